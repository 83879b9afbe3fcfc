// SPDX-License-Identifier: GPL-2.0-only
/*
 * test-btree.c - persistent-data/btree.h against an in-memory model, on a
 * real transaction manager over a temporary file.
 *
 * Model: a universe of U key slots, slot i holding key key_of(i) (a
 * stride apart, with slot U-1 holding U64_MAX), each either absent or
 * mapped to a value id.  A value is the id plus a pattern derived from
 * it, so a value moved to the wrong place or torn is seen.  The value
 * types' inc/dec callbacks count references per id in refs[]; the tree
 * must keep refs[] equal to the references its distinct leaves hold.
 *
 * After every batch of operations verify() checks, for every live tree:
 *   - a walk gives exactly the model, in order;
 *   - tsp_btree_check() passes, and counting its node_fn calls over all
 *     live trees, plus the superblock and the metadata space map's own
 *     blocks, gives tsp_tm_ref() of every metadata block exactly;
 *   - the value references found in distinct leaves equal refs[];
 *   - the trees as of the last commit still read back as committed
 *     (nothing the committed superblock reaches was overwritten), and no
 *     block in use at the last commit that was freed since is in use
 *     again.
 *
 * Density: ascending and descending inserts must leave the leaves full
 * (all but the last few), random ones at least two thirds full.
 *
 * Error paths: allocation failure injection (tsp_user_fail_alloc_after),
 * inc/dec callbacks failing on demand, IO failing at every point of a
 * batch and its commit (user/bufio.c crash simulation), and running out
 * of metadata space.  After each failure the transaction is dropped by
 * reopening from the last committed superblock, which must read back
 * intact; nothing may leak and no block may stay locked.
 *
 * Usage: test-btree [seed]; the seed (also $TSP_SEED) is printed first.
 * TSP_TEST_QUICK=1 uses smaller trees.  Exit status 0 pass, 1 fail.
 *
 * Locking: single threaded.
 */
#define DM_MSG_PREFIX "btree-test"
#include "persistent-data/btree.h"
#include "persistent-data/space-map-format.h"

#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Failure reporting and randomness                                    */
/* ------------------------------------------------------------------ */

static u64 seed;
static const char *phase = "setup";

static void __attribute__((noreturn, format(printf, 3, 4)))
fail(const char *file, int line, const char *fmt, ...)
{
	va_list ap;

	fflush(stdout);
	fprintf(stderr, "FAIL %s:%d (phase %s, seed %" PRIu64 "): ", file, line,
		phase, seed);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

#define CHECK(c)							\
	do {								\
		if (!(c))						\
			fail(__FILE__, __LINE__, "%s", #c);		\
	} while (0)

#define CHECK_R(expr, want)						\
	do {								\
		int __r = (expr), __w = (want);				\
		if (__r != __w)						\
			fail(__FILE__, __LINE__, "%s = %d, expected %d", \
			     #expr, __r, __w);				\
	} while (0)

static u64 rng;

/* splitmix64: small, fast and good enough to drive a model test. */
static u64 rnd(void)
{
	u64 z = (rng += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static u64 rnd_below(u64 n)
{
	return n ? rnd() % n : 0;
}

static bool chance(unsigned int percent)
{
	return rnd_below(100) < percent;
}

/* ------------------------------------------------------------------ */
/* Keys and the model                                                  */
/* ------------------------------------------------------------------ */

#define U (1u << 17)		/* key slots */
#define NV 1024u		/* value ids */
#define MAX_VSIZE 40

static u64 key_stride = 1;

static u64 key_of(u32 i)
{
	return i == U - 1 ? U64_MAX : (u64)i * key_stride;
}

/* The first slot whose key is >= @key. */
static u32 slot_ceil(u64 key)
{
	u64 i = key / key_stride + !!(key % key_stride);

	return i > U - 1 ? U - 1 : (u32)i;
}

struct model {
	u64 bits[U / 64];	/* slot present */
	u32 val[U];		/* value id of a present slot */
	u32 count;
};

static bool model_has(const struct model *m, u32 i)
{
	return m->bits[i / 64] >> (i % 64) & 1;
}

static void model_set(struct model *m, u32 i, u32 id)
{
	if (!model_has(m, i))
		m->count++;
	m->bits[i / 64] |= 1ULL << (i % 64);
	m->val[i] = id;
}

static void model_clear(struct model *m, u32 i)
{
	if (model_has(m, i))
		m->count--;
	m->bits[i / 64] &= ~(1ULL << (i % 64));
}

/* The first present slot >= @i, or U if none. */
static u32 model_next(const struct model *m, u32 i)
{
	u32 w = i / 64;
	u64 bits;

	if (i >= U)
		return U;
	bits = m->bits[w] & (~0ULL << (i % 64));
	for (;;) {
		if (bits)
			return w * 64 + __builtin_ctzll(bits);
		if (++w == U / 64)
			return U;
		bits = m->bits[w];
	}
}

/* The last present slot, or U if none. */
static u32 model_last(const struct model *m)
{
	u32 w;

	for (w = U / 64; w--;)
		if (m->bits[w])
			return w * 64 + 63 - __builtin_clzll(m->bits[w]);
	return U;
}

/* A random present slot (U if none). */
static u32 model_pick(const struct model *m)
{
	u32 i;

	if (!m->count)
		return U;
	i = model_next(m, (u32)rnd_below(U));
	return i == U ? model_next(m, 0) : i;
}

/* ------------------------------------------------------------------ */
/* Value types                                                         */
/* ------------------------------------------------------------------ */

struct vt_ctx {
	long refs[NV];		/* references held on each id */
	long fail_after;	/* callbacks left before one fails; -1 never */
	u32 size;
	bool counted;		/* has inc/dec callbacks */
};

static void make_value(void *buf, u32 id, u32 size)
{
	u8 *p = buf;
	u32 j;

	if (size == 4) {
		__le32 v = cpu_to_le32(id);

		memcpy(p, &v, 4);
		return;
	}
	{
		__le64 v = cpu_to_le64(id);

		memcpy(p, &v, 8);
	}
	for (j = 8; j < size; j++)
		p[j] = (u8)(id * 131 + j);
}

/* The id of a value, or -1 if the value is malformed. */
static long value_id(const void *buf, u32 size)
{
	u8 expect[MAX_VSIZE];
	u64 id;

	if (size == 4) {
		__le32 v;

		memcpy(&v, buf, 4);
		id = le32_to_cpu(v);
	} else {
		__le64 v;

		memcpy(&v, buf, 8);
		id = le64_to_cpu(v);
	}
	if (id >= NV)
		return -1;
	make_value(expect, (u32)id, size);
	return memcmp(expect, buf, size) ? -1 : (long)id;
}

static int vt_fail_now(struct vt_ctx *vc)
{
	if (vc->fail_after < 0)
		return 0;
	if (!vc->fail_after)
		return -EIO;
	vc->fail_after--;
	return 0;
}

static int vt_inc(void *context, const void *value)
{
	struct vt_ctx *vc = context;
	long id = value_id(value, vc->size);

	if (id < 0)
		fail(__FILE__, __LINE__, "inc of a malformed value");
	if (vt_fail_now(vc))
		return -EIO;
	vc->refs[id]++;
	return 0;
}

static int vt_dec(void *context, const void *value)
{
	struct vt_ctx *vc = context;
	long id = value_id(value, vc->size);

	if (id < 0)
		fail(__FILE__, __LINE__, "dec of a malformed value");
	if (vt_fail_now(vc))
		return -EIO;
	if (--vc->refs[id] < 0)
		fail(__FILE__, __LINE__, "value %ld dec'ed below zero", id);
	return 0;
}

/* ------------------------------------------------------------------ */
/* The metadata device, the test's superblock, commit and reopen       */
/* ------------------------------------------------------------------ */

#define SB_LOCATION 0
#define SB_MAGIC 0x74737062	/* "tspb" */
#define SB_CSUM_XOR 5318008
#define MAX_TREES 4

struct test_sb {
	__le32 csum;
	__le32 magic;
	__le64 blocknr;
	__le64 roots[MAX_TREES];	/* 0: no tree */
	u8 sm_root[TSP_SM_ROOT_SIZE];
} __packed;

static void sb_prepare(const struct tsp_block_validator *v,
		       struct tsp_block *b, size_t block_size)
{
	struct test_sb *sb = tsp_block_data(b);

	sb->blocknr = cpu_to_le64(tsp_block_location(b));
	sb->csum = cpu_to_le32(tsp_bm_checksum(&sb->magic, block_size - 4,
					       SB_CSUM_XOR));
}

static int sb_check(const struct tsp_block_validator *v, struct tsp_block *b,
		    size_t block_size)
{
	struct test_sb *sb = tsp_block_data(b);

	if (le32_to_cpu(sb->magic) != SB_MAGIC ||
	    le64_to_cpu(sb->blocknr) != tsp_block_location(b) ||
	    le32_to_cpu(sb->csum) != tsp_bm_checksum(&sb->magic, block_size - 4,
						     SB_CSUM_XOR))
		return -EILSEQ;
	return 0;
}

static const struct tsp_block_validator sb_validator = {
	.name = "test superblock",
	.prepare_for_write = sb_prepare,
	.check = sb_check,
};

struct tree {
	bool live;
	tsp_block_t root;
	struct model m;
	/* As of the last commit. */
	bool c_live;
	tsp_block_t c_root;
	struct model cm;
};

struct ctx {
	struct block_device *bdev;
	struct tsp_block_manager *bm;
	struct tsp_tm *tm;
	tsp_block_t nr_blocks;
	struct tsp_btree_info info;
	struct vt_ctx vc;
	struct tree t[MAX_TREES];
	long c_refs[NV];	/* refs[] at the last commit */
	u8 *c_used;		/* metadata block in use at the last commit */
	u8 *freed;		/* ... and freed since */
	u32 *counts;		/* scratch for verify() */
	long found[NV];
	u64 nr_verify;
};

static long allocs_base, bufio_base;

/*
 * A sparse temporary file of @nr_blocks metadata blocks, opened and
 * unlinked at once: the open device keeps it until tsp_bdev_close().
 */
static struct block_device *temp_bdev(tsp_block_t nr_blocks)
{
	const char *dir = getenv("TMPDIR");
	struct block_device *bdev;
	char path[4096];
	int fd;

	snprintf(path, sizeof(path), "%s/tsp-btree-XXXXXX", dir ? dir : "/tmp");
	fd = mkstemp(path);
	CHECK(fd >= 0);
	CHECK(!ftruncate(fd, (off_t)(nr_blocks * TSP_METADATA_BLOCK_SIZE)));
	close(fd);
	bdev = tsp_bdev_open(path, false);
	unlink(path);
	CHECK(bdev);
	return bdev;
}

/*
 * Write the superblock for the current roots: the second phase of a
 * commit.  Returns the first error.
 */
static int try_commit(struct ctx *c)
{
	u8 sm_root[TSP_SM_ROOT_SIZE];
	struct tsp_block *b;
	struct test_sb *sb;
	int i, r;

	r = tsp_tm_pre_commit(c->tm, sm_root);
	if (r)
		return r;
	r = tsp_bm_write_lock_zero(c->bm, SB_LOCATION, &sb_validator, &b);
	if (r)
		return r;
	sb = tsp_block_data(b);
	sb->magic = cpu_to_le32(SB_MAGIC);
	for (i = 0; i < MAX_TREES; i++)
		sb->roots[i] = cpu_to_le64(c->t[i].live ? c->t[i].root : 0);
	memcpy(sb->sm_root, sm_root, sizeof(sm_root));
	return tsp_tm_commit(c->tm, b);
}

/* What is in use now is what the committed superblock reaches. */
static void committed(struct ctx *c)
{
	tsp_block_t b;
	u32 count;
	int i;

	for (i = 0; i < MAX_TREES; i++) {
		struct tree *t = &c->t[i];

		t->c_live = t->live;
		t->c_root = t->root;
		if (t->live)
			t->cm = t->m;
	}
	memcpy(c->c_refs, c->vc.refs, sizeof(c->c_refs));
	for (b = 0; b < c->nr_blocks; b++) {
		CHECK_R(tsp_tm_ref(c->tm, b, &count), 0);
		c->c_used[b] = !!count;
		c->freed[b] = 0;
	}
}

/*
 * The committed metadata space map index agrees with its bitmaps: each
 * entry's free count and first free entry (the commit counts them again
 * only for bitmaps whose counts went from or to zero).
 */
static void check_sm_index(struct ctx *c)
{
	struct tsp_disk_sm_root root;
	struct tsp_index_entry ie;
	struct tsp_block *b, *ib;
	u64 nr_blocks;
	u32 i, j, nr, nr_free, first_free;

	CHECK_R(tsp_bm_read_lock(c->bm, SB_LOCATION, &sb_validator, &b), 0);
	memcpy(&root, ((struct test_sb *)tsp_block_data(b))->sm_root, sizeof(root));
	tsp_bm_unlock(b);
	nr_blocks = le64_to_cpu(root.nr_blocks);
	CHECK_R(tsp_bm_read_lock(c->bm, le64_to_cpu(root.bitmap_root),
				 &tsp_index_validator, &ib), 0);
	for (i = 0; (u64)i * TSP_ENTRIES_PER_BITMAP < nr_blocks; i++) {
		struct tsp_disk_metadata_index *mi = tsp_block_data(ib);

		tsp_index_entry_unpack(&mi->index[i], &ie);
		nr = min_t(u64, TSP_ENTRIES_PER_BITMAP,
			   nr_blocks - (u64)i * TSP_ENTRIES_PER_BITMAP);
		CHECK_R(tsp_bm_read_lock(c->bm, ie.blocknr, &tsp_bitmap_validator, &b), 0);
		nr_free = 0;
		first_free = nr;
		for (j = 0; j < nr; j++) {
			if (!tsp_bitmap_get(tsp_block_data(b), j)) {
				nr_free++;
				first_free = min(first_free, j);
			}
		}
		tsp_bm_unlock(b);
		CHECK(ie.nr_free == nr_free);
		CHECK(ie.none_free_before == first_free);
	}
	tsp_bm_unlock(ib);
}

static void commit(struct ctx *c)
{
	CHECK_R(try_commit(c), 0);
	committed(c);
	check_sm_index(c);
}

/* Open the block manager and transaction manager on the committed state. */
static int try_open(struct ctx *c)
{
	struct tsp_block *b;
	struct test_sb *sb;
	int i, r;

	c->bm = tsp_bm_create(c->bdev, 16);
	if (IS_ERR(c->bm)) {
		r = PTR_ERR(c->bm);
		c->bm = NULL;
		return r;
	}
	r = tsp_bm_read_lock(c->bm, SB_LOCATION, &sb_validator, &b);
	if (r)
		goto bad;
	sb = tsp_block_data(b);
	r = tsp_tm_open(c->bm, SB_LOCATION, sb->sm_root, &c->tm);
	for (i = 0; i < MAX_TREES; i++) {
		c->t[i].root = le64_to_cpu(sb->roots[i]);
		c->t[i].live = !!c->t[i].root;
	}
	tsp_bm_unlock(b);
	if (r)
		goto bad;
	c->info.tm = c->tm;
	return 0;
bad:
	tsp_bm_destroy(c->bm);
	c->bm = NULL;
	c->tm = NULL;
	return r;
}

static void close_managers(struct ctx *c)
{
	if (c->tm)
		tsp_tm_destroy(c->tm);
	if (c->bm)
		tsp_bm_destroy(c->bm);
	c->tm = NULL;
	c->bm = NULL;
}

/*
 * Drop the transaction: reopen from the committed superblock and put the
 * models and references back as they were committed.
 */
static void reopen(struct ctx *c)
{
	int i;

	close_managers(c);
	CHECK_R(try_open(c), 0);
	for (i = 0; i < MAX_TREES; i++) {
		struct tree *t = &c->t[i];

		CHECK(t->live == t->c_live);
		CHECK(!t->live || t->root == t->c_root);
		if (t->live)
			t->m = t->cm;
	}
	memcpy(c->vc.refs, c->c_refs, sizeof(c->c_refs));
	memset(c->freed, 0, c->nr_blocks);
}

/* ------------------------------------------------------------------ */
/* The block manager's pins                                            */
/* ------------------------------------------------------------------ */

/* Write lock @b (zeroed if @zero) as a test superblock stamped @stamp. */
static void pin_write(struct tsp_block_manager *bm, tsp_block_t b, bool zero,
		      u32 stamp)
{
	struct tsp_block *blk;
	struct test_sb *sb;

	if (zero)
		CHECK_R(tsp_bm_write_lock_zero(bm, b, &sb_validator, &blk), 0);
	else
		CHECK_R(tsp_bm_write_lock(bm, b, &sb_validator, &blk), 0);
	sb = tsp_block_data(blk);
	sb->magic = cpu_to_le32(SB_MAGIC);
	sb->roots[0] = cpu_to_le64(stamp);
	tsp_bm_unlock(blk);
}

/*
 * A written block stays held (pinned) until a flush, forget, read only or
 * destroy, or until another block takes its slot; a write lock of a
 * pinned block adds no hold; no hold leaks or is dropped twice, whatever
 * the order; and what was written through a pin reaches the device.
 * Blocks 100, 116 and 132 share a slot (16 slots).
 */
static void test_pins(void)
{
	struct block_device *bdev = temp_bdev(512);
	struct tsp_block_manager *bm = tsp_bm_create(bdev, 16);
	long h0 = tsp_bufio_holds();
	struct tsp_block *rd, *wr, *other;

	CHECK(!IS_ERR(bm));
	pin_write(bm, 100, true, 1);
	CHECK(tsp_bufio_holds() == h0 + 1);
	pin_write(bm, 100, false, 2);
	CHECK(tsp_bufio_holds() == h0 + 1);

	/* A reader has its own hold; the pin's goes when 116 takes the slot. */
	CHECK_R(tsp_bm_read_lock(bm, 100, &sb_validator, &rd), 0);
	CHECK(tsp_bufio_holds() == h0 + 2);
	pin_write(bm, 116, true, 3);
	CHECK(tsp_bufio_holds() == h0 + 2);
	tsp_bm_unlock(rd);
	CHECK(tsp_bufio_holds() == h0 + 1);

	/* A write locked pin keeps its slot: 132 is locked without a pin. */
	CHECK_R(tsp_bm_write_lock(bm, 116, &sb_validator, &wr), 0);
	CHECK(tsp_bufio_holds() == h0 + 1);
	CHECK_R(tsp_bm_write_lock_zero(bm, 132, &sb_validator, &other), 0);
	CHECK(tsp_bufio_holds() == h0 + 2);
	tsp_bm_unlock(other);
	tsp_bm_unlock(wr);
	CHECK(tsp_bufio_holds() == h0 + 1);

	/* Forget drops the pin; so do a flush and read only. */
	tsp_bm_forget(bm, 116);
	CHECK(tsp_bufio_holds() == h0);
	pin_write(bm, 200, true, 4);
	pin_write(bm, 201, true, 5);
	CHECK(tsp_bufio_holds() == h0 + 2);
	CHECK_R(tsp_bm_flush(bm), 0);
	CHECK(tsp_bufio_holds() == h0);
	pin_write(bm, 200, false, 6);
	tsp_bm_set_read_only(bm);
	CHECK(tsp_bufio_holds() == h0);
	tsp_bm_set_read_write(bm);

	/* A block write locked already is refused to anyone else. */
	pin_write(bm, 300, true, 7);
	CHECK_R(tsp_bm_write_lock(bm, 300, &sb_validator, &wr), 0);
	CHECK_R(tsp_bm_write_lock(bm, 300, &sb_validator, &other), -EILSEQ);
	CHECK_R(tsp_bm_read_lock(bm, 300, &sb_validator, &other), -EILSEQ);
	CHECK(tsp_bufio_holds() == h0 + 1);
	tsp_bm_unlock(wr);
	CHECK(tsp_bufio_holds() == h0 + 1);

	/* A pinned block read as another kind stays pinned. */
	CHECK_R(tsp_bm_read_lock(bm, 300, &tsp_bitmap_validator, &rd), -EILSEQ);
	CHECK(tsp_bufio_holds() == h0 + 1);

	/* A pinned block asked for as another kind is refused and unpinned. */
	CHECK_R(tsp_bm_write_lock(bm, 300, &tsp_bitmap_validator, &wr), -EILSEQ);
	CHECK(tsp_bufio_holds() == h0);

	/* The last writes through pins, after a flush, are on the device. */
	pin_write(bm, 100, false, 8);
	pin_write(bm, 100, false, 9);
	CHECK_R(tsp_bm_flush(bm), 0);
	pin_write(bm, 201, false, 10);

	/* A flush is refused while a pinned block is write locked... */
	CHECK_R(tsp_bm_write_lock(bm, 201, &sb_validator, &wr), 0);
	CHECK_R(tsp_bm_flush(bm), -EDEADLK);
	/* ...or kept... */
	tsp_bm_keep(wr);
	CHECK_R(tsp_bm_flush(bm), -EDEADLK);
	tsp_bm_unkeep(wr);
	tsp_bm_unlock(wr);
	CHECK(tsp_bufio_holds() == h0 + 1);
	/* ...or one without a pin, its slot taken by a write locked one. */
	CHECK_R(tsp_bm_write_lock(bm, 201, &sb_validator, &wr), 0);
	CHECK_R(tsp_bm_write_lock_zero(bm, 217, &sb_validator, &other), 0);
	CHECK(tsp_bufio_holds() == h0 + 2);
	tsp_bm_unlock(wr);
	CHECK_R(tsp_bm_flush(bm), -EDEADLK);
	tsp_bm_unlock(other);
	CHECK(tsp_bufio_holds() == h0 + 1);
	tsp_bm_destroy(bm);
	CHECK(tsp_bufio_holds() == h0);

	bm = tsp_bm_create(bdev, 16);
	CHECK(!IS_ERR(bm));
	CHECK_R(tsp_bm_read_lock(bm, 100, &sb_validator, &rd), 0);
	CHECK(le64_to_cpu(((struct test_sb *)tsp_block_data(rd))->roots[0]) == 9);
	tsp_bm_unlock(rd);
	CHECK_R(tsp_bm_read_lock(bm, 200, &sb_validator, &rd), 0);
	CHECK(le64_to_cpu(((struct test_sb *)tsp_block_data(rd))->roots[0]) == 6);
	tsp_bm_unlock(rd);
	CHECK_R(tsp_bm_read_lock(bm, 201, &sb_validator, &rd), 0);
	CHECK(le64_to_cpu(((struct test_sb *)tsp_block_data(rd))->roots[0]) == 10);
	tsp_bm_unlock(rd);
	tsp_bm_destroy(bm);
	tsp_bdev_close(bdev);
	CHECK(tsp_bufio_holds() == h0);
}

/* A fresh device with a transaction manager, committed once (no trees). */
static struct ctx *ctx_create(tsp_block_t nr_blocks, u32 vsize, bool counted)
{
	struct ctx *c = calloc(1, sizeof(*c));

	CHECK(c);
	c->nr_blocks = nr_blocks;
	c->c_used = calloc(nr_blocks, 1);
	c->freed = calloc(nr_blocks, 1);
	c->counts = calloc(nr_blocks, sizeof(u32));
	CHECK(c->c_used && c->freed && c->counts);
	c->bdev = temp_bdev(nr_blocks);
	c->bm = tsp_bm_create(c->bdev, 16);
	CHECK(!IS_ERR(c->bm));
	CHECK_R(tsp_tm_create(c->bm, SB_LOCATION, &c->tm), 0);

	c->vc.size = vsize;
	c->vc.counted = counted;
	c->vc.fail_after = -1;
	c->info.tm = c->tm;
	c->info.vt.context = &c->vc;
	c->info.vt.size = vsize;
	c->info.vt.inc = counted ? vt_inc : NULL;
	c->info.vt.dec = counted ? vt_dec : NULL;
	commit(c);
	return c;
}

static void ctx_destroy(struct ctx *c)
{
	close_managers(c);
	tsp_bdev_close(c->bdev);
	free(c->c_used);
	free(c->freed);
	free(c->counts);
	free(c);
	CHECK(tsp_user_live_allocs() == allocs_base);
	CHECK(tsp_bufio_live_allocs() == bufio_base);
}

/* ------------------------------------------------------------------ */
/* Verification                                                        */
/* ------------------------------------------------------------------ */

struct walk_ctx {
	struct ctx *c;
	const struct model *m;
	u32 next;	/* the slot the next key must be */
	u32 seen;
};

static int walk_fn(void *context, u64 key, void *value)
{
	struct walk_ctx *w = context;
	u32 i = w->next;

	if (i == U || key != key_of(i))
		fail(__FILE__, __LINE__, "walk: key %" PRIu64 ", expected %" PRIu64,
		     key, i == U ? 0 : key_of(i));
	if (value_id(value, w->c->vc.size) != (long)w->m->val[i])
		fail(__FILE__, __LINE__, "walk: key %" PRIu64 " has value %ld, expected %u",
		     key, value_id(value, w->c->vc.size), w->m->val[i]);
	w->seen++;
	w->next = model_next(w->m, i + 1);
	return 0;
}

static void check_walk(struct ctx *c, tsp_block_t root, const struct model *m)
{
	struct walk_ctx w = { .c = c, .m = m, .next = model_next(m, 0) };

	CHECK_R(tsp_btree_walk(&c->info, root, walk_fn, &w), 0);
	CHECK(w.next == U);
	CHECK(w.seen == m->count);
}

static int count_node(void *context, tsp_block_t b)
{
	struct ctx *c = context;

	if (b >= c->nr_blocks)
		fail(__FILE__, __LINE__, "reference to block %llu beyond the device",
		     (unsigned long long)b);
	return c->counts[b]++ ? 1 : 0;
}

static int count_value(void *context, u64 key, void *value)
{
	struct ctx *c = context;
	long id = value_id(value, c->vc.size);

	if (id < 0)
		fail(__FILE__, __LINE__, "malformed value at key %" PRIu64, key);
	c->found[id]++;
	return 0;
}

static void verify(struct ctx *c)
{
	tsp_block_t b;
	u32 count;
	int i;

	c->nr_verify++;
	memset(c->counts, 0, c->nr_blocks * sizeof(u32));
	memset(c->found, 0, sizeof(c->found));

	for (i = 0; i < MAX_TREES; i++) {
		struct tree *t = &c->t[i];

		if (!t->live)
			continue;
		check_walk(c, t->root, &t->m);
		CHECK_R(tsp_btree_check(&c->info, t->root, count_node,
					count_value, c), 0);
	}
	count_node(c, SB_LOCATION);
	CHECK_R(tsp_tm_walk_sm_blocks(c->tm, count_node, c), 0);

	for (b = 0; b < c->nr_blocks; b++) {
		CHECK_R(tsp_tm_ref(c->tm, b, &count), 0);
		if (count != c->counts[b])
			fail(__FILE__, __LINE__,
			     "metadata block %llu: count %u, %u references",
			     (unsigned long long)b, count, c->counts[b]);
		if (c->c_used[b] && !count)
			c->freed[b] = 1;
		if (c->freed[b] && count)
			fail(__FILE__, __LINE__,
			     "block %llu, freed in this transaction, is in use again",
			     (unsigned long long)b);
	}
	if (c->vc.counted)
		for (i = 0; i < (int)NV; i++)
			if (c->found[i] != c->vc.refs[i])
				fail(__FILE__, __LINE__,
				     "value %d: %ld references counted, %ld in leaves",
				     i, c->vc.refs[i], c->found[i]);

	/* The committed trees are untouched by this transaction. */
	for (i = 0; i < MAX_TREES; i++) {
		struct tree *t = &c->t[i];

		if (!t->c_live)
			continue;
		check_walk(c, t->c_root, &t->cm);
		CHECK_R(tsp_btree_check(&c->info, t->c_root, NULL, NULL, NULL), 0);
	}
}

/* Every block in use is the superblock or the space map's. */
static void check_all_freed(struct ctx *c)
{
	tsp_block_t b, used = 0;
	int i;

	for (i = 0; i < MAX_TREES; i++)
		CHECK(!c->t[i].live);
	verify(c);
	for (b = 0; b < c->nr_blocks; b++)
		used += !!c->counts[b];
	for (i = 0; i < (int)NV; i++)
		CHECK(!c->vc.refs[i]);
	/*
	 * verify() matched every count with no tree live: what is left is
	 * the superblock, the space map's index, bitmaps and overflow leaf.
	 */
	CHECK(used <= 3 + DIV_ROUND_UP(c->nr_blocks, 16320));
}

/* Levels of a tree, from the on-disk node format (flags 1 = internal). */
/* Block number of child @i of internal node @b. */
static tsp_block_t node_child(struct ctx *c, tsp_block_t b, u32 i)
{
	struct tsp_block *blk;
	__le32 max;
	__le64 child;
	u8 *n;

	CHECK_R(tsp_tm_read_lock(c->tm, b, &tsp_btree_node_validator, &blk), 0);
	n = tsp_block_data(blk);
	memcpy(&max, n + 20, 4);
	memcpy(&child, n + 32 + 8 * (size_t)le32_to_cpu(max) + 8 * (size_t)i, 8);
	tsp_tm_unlock(c->tm, blk);
	return le64_to_cpu(child);
}

static int tree_depth(struct ctx *c, tsp_block_t root)
{
	struct tsp_block *blk;
	int depth = 0;
	__le32 flags;

	for (;;) {
		CHECK_R(tsp_tm_read_lock(c->tm, root, &tsp_btree_node_validator,
					 &blk), 0);
		memcpy(&flags, (u8 *)tsp_block_data(blk) + 4, 4);
		tsp_tm_unlock(c->tm, blk);
		depth++;
		if (le32_to_cpu(flags) != 1)
			return depth;
		root = node_child(c, root, 0);
	}
}

/* ------------------------------------------------------------------ */
/* Operations on tree and model                                        */
/* ------------------------------------------------------------------ */

/* tsp_btree_insert(), or with @cursor tsp_btree_insert_at(). */
static int op_insert_at(struct ctx *c, struct tsp_btree_cursor *cursor,
			struct tree *t, u32 i, u32 id)
{
	u8 v[MAX_VSIZE];
	tsp_block_t root;
	bool inserted;
	int r;

	make_value(v, id, c->vc.size);
	if (c->vc.counted)
		c->vc.refs[id]++;	/* the caller's reference, for the tree */
	if (cursor)
		r = tsp_btree_insert_at(cursor, t->root, key_of(i), v, &root,
					&inserted);
	else
		r = tsp_btree_insert(&c->info, t->root, key_of(i), v, &root,
				     &inserted);
	if (r)
		return r;
	CHECK(inserted == !model_has(&t->m, i));
	model_set(&t->m, i, id);
	t->root = root;
	return 0;
}

static int op_insert(struct ctx *c, struct tree *t, u32 i, u32 id)
{
	return op_insert_at(c, NULL, t, i, id);
}

/*
 * tsp_btree_insert_new_at() through @cursor, or without one (NULL)
 * through a cursor of its own: inserts a new key, leaves a present one
 * alone.
 */
static int op_insert_new_at(struct ctx *c, struct tsp_btree_cursor *cursor,
			    struct tree *t, u32 i, u32 id)
{
	struct tsp_btree_cursor once = TSP_BTREE_CURSOR(&c->info);
	u8 v[MAX_VSIZE];
	tsp_block_t root;
	int r;

	make_value(v, id, c->vc.size);
	if (c->vc.counted)
		c->vc.refs[id]++;	/* the caller's reference, for the tree */
	r = tsp_btree_insert_new_at(cursor ?: &once, t->root, key_of(i), v,
				    &root);
	tsp_btree_cursor_release(&once);
	if (r && r != -EEXIST)
		return r;
	/* Set on -EEXIST too: the way down may have moved the root. */
	t->root = root;
	CHECK((r == -EEXIST) == model_has(&t->m, i));
	if (r == -EEXIST) {
		if (c->vc.counted)
			c->vc.refs[id]--;	/* still the caller's */
		return 0;
	}
	model_set(&t->m, i, id);
	return 0;
}

static int op_insert_new(struct ctx *c, struct tree *t, u32 i, u32 id)
{
	return op_insert_new_at(c, NULL, t, i, id);
}

static int op_remove(struct ctx *c, struct tree *t, u32 i)
{
	tsp_block_t root = 0;
	int r;

	r = tsp_btree_remove(&c->info, t->root, key_of(i), &root);
	if (!model_has(&t->m, i)) {
		if (r == -ENODATA)
			return 0;
		if (!r)
			fail(__FILE__, __LINE__, "removed absent key %" PRIu64,
			     key_of(i));
		return r;
	}
	if (r)
		return r;
	model_clear(&t->m, i);
	t->root = root;
	return 0;
}

/* Remove [@begin, @end) in key space. */
static int op_remove_range(struct ctx *c, struct tree *t, u64 begin, u64 end)
{
	u64 nr_removed = ~0ULL, expect = 0;
	tsp_block_t root;
	u32 i;
	int r;

	r = tsp_btree_remove_range(&c->info, t->root, begin, end, &root,
				   &nr_removed);
	if (r)
		return r;
	for (i = model_next(&t->m, slot_ceil(begin));
	     begin < end && i < U && key_of(i) < end;
	     i = model_next(&t->m, i + 1)) {
		model_clear(&t->m, i);
		expect++;
	}
	CHECK(nr_removed == expect);
	t->root = root;
	return 0;
}

static int op_lookup(struct ctx *c, struct tree *t, u64 key)
{
	u8 v[MAX_VSIZE];
	u32 i = slot_ceil(key);
	bool present = key_of(i) == key && model_has(&t->m, i);
	int r;

	r = tsp_btree_lookup(&c->info, t->root, key, v);
	if (!present && r == -ENODATA)
		return 0;
	if (r)
		return r;
	CHECK(present);
	CHECK(value_id(v, c->vc.size) == (long)t->m.val[i]);
	/* Presence only. */
	CHECK_R(tsp_btree_lookup(&c->info, t->root, key, NULL), 0);
	return 0;
}

static int op_lookup_next(struct ctx *c, struct tree *t, u64 key)
{
	u32 i = model_next(&t->m, slot_ceil(key));
	u8 v[MAX_VSIZE];
	u64 found = 0;
	int r;

	r = tsp_btree_lookup_next(&c->info, t->root, key, &found, v);
	if (i == U && r == -ENODATA)
		return 0;
	if (r)
		return r;
	if (i == U || found != key_of(i))
		fail(__FILE__, __LINE__, "lookup_next(%" PRIu64 ") = %" PRIu64
		     ", expected %" PRIu64, key, found, i == U ? 0 : key_of(i));
	CHECK(value_id(v, c->vc.size) == (long)t->m.val[i]);
	return 0;
}

static int op_highest(struct ctx *c, struct tree *t)
{
	u32 i = model_last(&t->m);
	u64 key = 0;
	int r;

	r = tsp_btree_find_highest_key(&c->info, t->root, &key);
	if (i == U && r == -ENODATA)
		return 0;
	if (r)
		return r;
	CHECK(i != U && key == key_of(i));
	return 0;
}

/* A key near slot @i: on it, or (with a stride) just before or after. */
static u64 key_near(u32 i)
{
	u64 k = key_of(i);

	if (key_stride > 1 && i < U - 1 && chance(20))
		return chance(50) && k ? k - 1 : k + 1;
	return k;
}

/* One random operation; returns the library's error, 0 if as expected. */
static int random_op(struct ctx *c, struct tree *t, u32 slots)
{
	u32 p = (u32)rnd_below(100), i, j;

	if (p < 35) {			/* insert, mostly new keys */
		i = (u32)rnd_below(slots);
		if (chance(2))
			i = chance(50) ? 0 : U - 1;
		if (chance(30))
			return op_insert_new(c, t, i, (u32)rnd_below(NV));
		return op_insert(c, t, i, (u32)rnd_below(NV));
	}
	if (p < 50) {			/* overwrite, half with the same value */
		i = model_pick(&t->m);
		if (i == U)
			return 0;
		return op_insert(c, t, i, chance(50) ? t->m.val[i] :
				 (u32)rnd_below(NV));
	}
	if (p < 75) {			/* remove, sometimes an absent key */
		i = chance(80) ? model_pick(&t->m) : (u32)rnd_below(slots);
		return op_remove(c, t, i == U ? 0 : i);
	}
	if (p < 78) {			/* remove a range */
		i = (u32)rnd_below(slots);
		j = i + (u32)rnd_below(chance(10) ? 5000 : 50);
		if (chance(5))
			swap(i, j);	/* empty range */
		return op_remove_range(c, t, key_near(i), key_near(min(j, U - 1)));
	}
	if (p < 90)
		return op_lookup(c, t, chance(70) && t->m.count ?
				 key_near(model_pick(&t->m)) :
				 key_near((u32)rnd_below(U)));
	if (p < 98)
		return op_lookup_next(c, t, chance(3) ? U64_MAX :
				      key_near((u32)rnd_below(slots)));
	return op_highest(c, t);
}

static void new_tree(struct ctx *c, struct tree *t)
{
	memset(&t->m, 0, sizeof(t->m));
	CHECK_R(tsp_btree_empty(&c->info, &t->root), 0);
	t->live = true;
}

static void del_tree(struct ctx *c, struct tree *t)
{
	CHECK_R(tsp_btree_del(&c->info, t->root), 0);
	t->live = false;
}

/* A snapshot: @dst shares @src's root, one more reference to it. */
static void snap_tree(struct ctx *c, struct tree *dst, struct tree *src)
{
	CHECK_R(tsp_tm_inc(c->tm, src->root), 0);
	dst->root = src->root;
	dst->m = src->m;
	dst->live = true;
}

/* ------------------------------------------------------------------ */
/* Tests                                                               */
/* ------------------------------------------------------------------ */

static bool quick;

struct vt_config {
	const char *name;
	u32 size;
	bool counted;
};

static const struct vt_config vts[] = {
	{ "u64 counted", 8, true },
	{ "24-byte counted", 24, true },
	{ "le32 plain", 4, false },
};

enum order { SEQUENTIAL, REVERSE, RANDOM };
static const char * const order_names[] = { "sequential", "reverse", "random" };

/* A permutation of 0..n-1. */
static u32 *permutation(u32 n)
{
	u32 *p = malloc(n * sizeof(*p)), i;

	CHECK(p);
	for (i = 0; i < n; i++)
		p[i] = i;
	for (i = n; i > 1; i--) {
		u32 j = (u32)rnd_below(i);

		swap(p[i - 1], p[j]);
	}
	return p;
}

/*
 * Fill one tree in @order, run random operations on it, empty it, delete
 * it; verify after each batch, commit every other batch, reopen now and
 * then.
 */
static void test_single(const struct vt_config *vt, enum order order,
			u64 stride)
{
	u32 n = quick ? 8000 : vt->size == 8 ? 80000 : vt->size == 4 ? 100000 : 40000;
	u32 batch = n / 12, nr_ops = quick ? 20000 : 60000;
	struct ctx *c = ctx_create(16384, vt->size, vt->counted);
	struct tree *t = &c->t[0];
	u32 *perm = permutation(n), k, slot;
	u64 nr_verify;
	char name[128];

	snprintf(name, sizeof(name), "single %s %s stride %" PRIu64, vt->name,
		 order_names[order], stride);
	phase = name;
	key_stride = stride;

	new_tree(c, t);
	verify(c);
	for (k = 0; k < n; k++) {
		slot = order == SEQUENTIAL ? k : order == REVERSE ? n - 1 - k :
		       perm[k];
		CHECK_R(op_insert(c, t, slot, (u32)rnd_below(NV)), 0);
		if ((k + 1) % batch == 0) {
			verify(c);
			if ((k / batch) % 2)
				commit(c);
		}
	}
	verify(c);
	CHECK(t->m.count == n);
	if (!quick)
		CHECK(tree_depth(c, t->root) >= 3);
	commit(c);

	for (k = 0; k < nr_ops; k++) {
		CHECK_R(random_op(c, t, n + n / 4), 0);
		if ((k + 1) % 5000 == 0) {
			verify(c);
			if (chance(50))
				commit(c);
			if (chance(20)) {
				/* Drop the transaction, or reopen after a commit. */
				if (chance(50))
					commit(c);
				reopen(c);
				verify(c);
			}
		}
	}
	verify(c);

	/* Empty it: ranges and single removes, in random order. */
	free(perm);
	perm = permutation(U);
	for (k = 0; t->m.count; k++) {
		slot = perm[k % U];
		if (chance(5))
			CHECK_R(op_remove_range(c, t, key_of(slot),
						key_of(min(slot + 200, U - 1))), 0);
		else
			CHECK_R(op_remove(c, t, slot), 0);
		if (k % 7000 == 0)
			verify(c);
	}
	verify(c);
	CHECK_R(op_highest(c, t), 0);
	CHECK_R(op_lookup_next(c, t, 0), 0);
	del_tree(c, t);
	check_all_freed(c);
	commit(c);
	reopen(c);
	check_all_freed(c);

	free(perm);
	nr_verify = c->nr_verify;
	ctx_destroy(c);
	printf("ok   %s (%" PRIu64 " verifications)\n", name, nr_verify);
}

struct leaf_count {
	struct ctx *c;
	u32 leaves;
	u32 max_entries;	/* of the last leaf seen */
};

/* tsp_btree_check()'s node_fn: count leaves, from the node header. */
static int count_leaf(void *context, tsp_block_t b)
{
	struct leaf_count *lc = context;
	struct tsp_block *blk;
	__le32 flags, max;
	u8 *n;

	CHECK_R(tsp_tm_read_lock(lc->c->tm, b, &tsp_btree_node_validator, &blk), 0);
	n = tsp_block_data(blk);
	memcpy(&flags, n + 4, 4);
	memcpy(&max, n + 20, 4);
	tsp_tm_unlock(lc->c->tm, blk);
	if (le32_to_cpu(flags) == 2) {
		lc->leaves++;
		lc->max_entries = le32_to_cpu(max);
	}
	return 0;
}

/*
 * Density: @n keys inserted in @order fill their leaves.  Ascending and
 * descending inserts must pack the leaves (all full but the last few;
 * splitting full leaves in half and never filling them again would take
 * twice as many), random inserts must fill them at least 2/3 on average.
 */
static void test_density(const struct vt_config *vt, enum order order)
{
	u32 n = quick ? 20000 : 100000, k, slot, full_leaves;
	struct ctx *c = ctx_create(16384, vt->size, vt->counted);
	struct leaf_count lc = { .c = c };
	struct tree *t = &c->t[0];
	u32 *perm = permutation(n);
	char name[128];

	snprintf(name, sizeof(name), "density %s %s", vt->name,
		 order_names[order]);
	phase = name;
	key_stride = 1;

	new_tree(c, t);
	for (k = 0; k < n; k++) {
		slot = order == SEQUENTIAL ? k : order == REVERSE ? n - 1 - k :
		       perm[k];
		CHECK_R(op_insert(c, t, slot, (u32)rnd_below(NV)), 0);
		if ((k + 1) % 10000 == 0)
			commit(c);
	}
	verify(c);
	CHECK_R(tsp_btree_check(&c->info, t->root, count_leaf, NULL, &lc), 0);
	full_leaves = DIV_ROUND_UP(n, lc.max_entries);
	if (order == RANDOM)
		CHECK(lc.leaves * 2 <= full_leaves * 3);
	else
		CHECK(lc.leaves <= full_leaves + 2);

	del_tree(c, t);
	commit(c);
	free(perm);
	ctx_destroy(c);
	printf("ok   %s (%u keys in %u leaves of %u: %.1f per leaf)\n", name,
	       n, lc.leaves, lc.max_entries, (double)n / lc.leaves);
}

/* A run of nearby key slots: how many, how far apart, which way. */
struct key_run {
	u32 len, step;
	bool down;
};

/* Start a run, maybe in another of three trees (*@ti) or elsewhere. */
static void start_run(struct key_run *run, unsigned int *ti, u32 *slot)
{
	if (chance(30))
		*ti = (unsigned int)rnd_below(3);
	if (chance(20))
		*slot = (u32)rnd_below(U);
	run->len = 1 + (u32)rnd_below(300);
	run->step = 1 + (u32)rnd_below(3);
	run->down = chance(25);
}

static u32 run_next(const struct key_run *run, u32 slot)
{
	return run->down ? (slot + U - run->step) % U : (slot + run->step) % U;
}

/* Sometimes remove a range of up to 600 keys from one of three trees. */
static void maybe_remove_range(struct ctx *c, struct tsp_btree_cursor *cursors)
{
	unsigned int o = (unsigned int)rnd_below(3);
	u32 j;

	if (!chance(20))
		return;
	/* The tree's cursor is released first, as for any other update. */
	if (cursors)
		tsp_btree_cursor_release(&cursors[o]);
	j = (u32)rnd_below(U - 1);
	CHECK_R(op_remove_range(c, &c->t[o], key_of(j),
				key_of(min(j + 1 + (u32)rnd_below(600), U - 1))), 0);
}

/*
 * Through @cursor: slots @mid, @mid - 2, ..., then @mid + 2, ...; @len
 * each way.
 */
static void insert_around(struct ctx *c, struct tsp_btree_cursor *cursor,
			  struct tree *t, u32 mid, u32 len)
{
	u32 j;

	for (j = 0; j < len && 2 * j <= mid; j++)
		CHECK_R(op_insert_at(c, cursor, t, mid - 2 * j,
				     (u32)rnd_below(NV)), 0);
	for (j = 1; j < len && mid + 2 * j < U - 1; j++)
		CHECK_R(op_insert_at(c, cursor, t, mid + 2 * j,
				     (u32)rnd_below(NV)), 0);
}

/*
 * Inserts through a cursor (tsp_btree_insert_at()):
 * - ascending keys pack leaves as plain inserts do;
 * - descending keys below a deep tree's lowest one, where the cursor
 *   holds the leftmost leaf and every key lowers the separators above;
 * - short runs up and down from the middle of full leaves (odd slots
 *   between even ones), where leaves are split or share with siblings;
 * - runs of nearby keys, up or down, with jumps, into a tree, its
 *   snapshot and a third tree, switching trees within a run, inserting
 *   into the other trees plainly while the cursor holds a leaf, and
 *   removing ranges between runs (so separators fall below their
 *   child's first key): the cursor meets other roots, full and shared
 *   leaves, the edges of its range and the top key (U64_MAX, never
 *   within a range).
 * The trees must hold what the model says, with every reference counted.
 */
static void test_cursor(const struct vt_config *vt)
{
	u32 n = quick ? 20000 : 80000, nr_runs = quick ? 300 : 1500;
	struct ctx *c = ctx_create(16384, vt->size, vt->counted);
	struct tsp_btree_cursor cursor = TSP_BTREE_CURSOR(&c->info);
	struct leaf_count lc = { .c = c };
	struct tree *t = c->t;
	struct key_run run;
	u32 k, j, slot = 0;
	unsigned int ti = 0;
	char name[128];

	snprintf(name, sizeof(name), "cursor %s", vt->name);
	phase = name;
	key_stride = 1;

	new_tree(c, &t[0]);
	for (k = 0; k < n; k++) {
		CHECK_R(op_insert_at(c, &cursor, &t[0], n / 4 + k, k % NV), 0);
		if ((k + 1) % 10000 == 0) {
			tsp_btree_cursor_release(&cursor);
			commit(c);
		}
	}
	tsp_btree_cursor_release(&cursor);
	verify(c);
	CHECK_R(tsp_btree_check(&c->info, t[0].root, count_leaf, NULL, &lc), 0);
	CHECK(lc.leaves <= DIV_ROUND_UP(n, lc.max_entries) + 2);
	/* A walk per leaf and per commit; the rest straight into the leaf. */
	CHECK(cursor.hits >= n - 2 * lc.leaves - n / 10000);
	commit(c);

	for (k = n / 4; k-- > 0;)
		CHECK_R(op_insert_at(c, &cursor, &t[0], k, k % NV), 0);
	tsp_btree_cursor_release(&cursor);
	verify(c);

	new_tree(c, &t[1]);
	for (k = 0; k < n; k += 2)
		CHECK_R(op_insert(c, &t[1], k, k % NV), 0);
	commit(c);
	for (k = 0; k < n / 24; k++)
		insert_around(c, &cursor, &t[1], 2 * (u32)rnd_below(n / 2) + 1, 6);
	tsp_btree_cursor_release(&cursor);
	verify(c);
	del_tree(c, &t[1]);
	commit(c);

	snap_tree(c, &t[1], &t[0]);
	new_tree(c, &t[2]);
	for (k = 0; k < nr_runs; k++) {
		start_run(&run, &ti, &slot);
		for (j = 0; j < run.len; j++) {
			if (chance(1))
				slot = U - 1;
			CHECK_R(op_insert_at(c, &cursor, &t[ti], slot,
					     (u32)rnd_below(NV)), 0);
			slot = run_next(&run, slot);
			/* Not the cursor's tree, t[ti]. */
			if (chance(2))
				CHECK_R(op_insert(c, &t[(ti + 1) % 3],
						  (u32)rnd_below(U),
						  (u32)rnd_below(NV)), 0);
			if (chance(2))
				ti = (unsigned int)rnd_below(3);
		}
		tsp_btree_cursor_release(&cursor);
		maybe_remove_range(c, NULL);
		if (k % 50 == 0)
			verify(c);
		if (k % 200 == 0)
			commit(c);
	}
	verify(c);
	for (k = 0; k < 3; k++)
		del_tree(c, &t[k]);
	check_all_freed(c);
	commit(c);

	ctx_destroy(c);
	printf("ok   %s (%u keys in %u leaves of %u, then %u runs)\n", name,
	       n, lc.leaves, lc.max_entries, nr_runs);
}

static void release_cursors(struct tsp_btree_cursor *cursors, unsigned int nr)
{
	while (nr--)
		tsp_btree_cursor_release(&cursors[nr]);
}

/*
 * Parked (tsp_btree_cursor_park()) and kept (tsp_btree_cursor_keep())
 * cursors, one per tree, as the metadata keeps one per thin device: runs
 * of nearby keys, up or down, with jumps, into a half full tree, its
 * snapshot and a third tree, each key through its tree's cursor
 * (tsp_btree_insert_new_at(); some are present already), the cursor
 * parked or kept after every insert.  Meanwhile lookups in any tree (of
 * a kept leaf too), and plain inserts and range removals in a tree whose
 * cursor is released first, as the rule for any change the cursor does
 * not make says.  Commits park or release the cursors first (a kept
 * leaf would miss the flush), but some stay parked: a cursor parked
 * across a commit finds its leaf committed, no longer writable in place,
 * and walks down instead.
 */
static void test_parked_cursor(const struct vt_config *vt)
{
	u32 n = quick ? 20000 : 60000, nr_runs = quick ? 400 : 2000;
	struct ctx *c = ctx_create(16384, vt->size, vt->counted);
	struct tsp_btree_cursor cursors[3];
	struct tree *t = c->t;
	struct key_run run;
	u32 k, j, slot = 0;
	unsigned int ti = 0, o;
	u64 hits = 0, nr_inserts = 0;
	char name[128];

	snprintf(name, sizeof(name), "parked and kept cursors %s", vt->name);
	phase = name;
	key_stride = 1;
	for (o = 0; o < ARRAY_SIZE(cursors); o++)
		cursors[o] = TSP_BTREE_CURSOR(&c->info);

	new_tree(c, &t[0]);
	for (k = 0; k < n; k++)
		CHECK_R(op_insert(c, &t[0], (u32)rnd_below(U), k % NV), 0);
	commit(c);
	snap_tree(c, &t[1], &t[0]);
	new_tree(c, &t[2]);

	for (k = 0; k < nr_runs; k++) {
		start_run(&run, &ti, &slot);
		for (j = 0; j < run.len; j++) {
			CHECK_R(op_insert_new_at(c, &cursors[ti], &t[ti], slot,
						 (u32)rnd_below(NV)), 0);
			if (chance(50)) {
				tsp_btree_cursor_keep(&cursors[ti]);
				/* A reader of the kept leaf itself. */
				if (chance(10))
					CHECK_R(op_lookup(c, &t[ti], key_of(slot)), 0);
			} else {
				tsp_btree_cursor_park(&cursors[ti]);
			}
			nr_inserts++;
			slot = run_next(&run, slot);
			if (chance(5))
				CHECK_R(op_lookup(c, &t[rnd_below(3)],
						  key_of((u32)rnd_below(U))), 0);
			if (chance(2)) {
				o = (ti + 1 + (unsigned int)rnd_below(2)) % 3;
				tsp_btree_cursor_release(&cursors[o]);
				CHECK_R(op_insert(c, &t[o], (u32)rnd_below(U),
						  (u32)rnd_below(NV)), 0);
			}
			if (chance(2))
				ti = (unsigned int)rnd_below(3);
		}
		maybe_remove_range(c, cursors);
		if (k % 50 == 0)
			verify(c);
		if (k % 100 == 0) {
			if (chance(50))
				release_cursors(cursors, ARRAY_SIZE(cursors));
			for (o = 0; o < ARRAY_SIZE(cursors); o++)
				tsp_btree_cursor_park(&cursors[o]);
			commit(c);
		}
	}
	release_cursors(cursors, ARRAY_SIZE(cursors));
	verify(c);
	for (k = 0; k < 3; k++)
		del_tree(c, &t[k]);
	check_all_freed(c);
	commit(c);

	/* Most inserts of a run went straight into the cursor's leaf. */
	for (o = 0; o < ARRAY_SIZE(cursors); o++)
		hits += cursors[o].hits;
	CHECK(hits > nr_inserts / 2);
	ctx_destroy(c);
	printf("ok   %s (%u runs, %llu of %llu inserts into a parked or kept leaf)\n",
	       name, nr_runs, (unsigned long long)hits,
	       (unsigned long long)nr_inserts);
}

/*
 * Snapshots: trees sharing nodes, each changed on its own, deleted in
 * turn; counts of 3 and more so the metadata space map's overflow tree
 * is written and read back.
 */
static void test_shared(const struct vt_config *vt)
{
	u32 n = quick ? 6000 : 30000, slots = n + n / 4, k;
	struct ctx *c = ctx_create(16384, vt->size, vt->counted);
	struct tree *t = c->t;
	int round, i;
	char name[128];

	snprintf(name, sizeof(name), "shared %s", vt->name);
	phase = name;
	key_stride = 3;

	new_tree(c, &t[0]);
	for (k = 0; k < n; k++)
		CHECK_R(op_insert(c, &t[0], (u32)rnd_below(slots),
				  (u32)rnd_below(NV)), 0);
	verify(c);
	commit(c);

	/* A snapshot of a committed tree, then both change. */
	snap_tree(c, &t[1], &t[0]);
	verify(c);
	/*
	 * A present key through tsp_btree_insert_new_at(): the shared path is
	 * copied on the way down, the new root kept, and nothing leaks.
	 */
	k = model_pick(&t[1].m);
	CHECK(k != U);
	{
		tsp_block_t shared_root = t[1].root;

		CHECK_R(op_insert_new(c, &t[1], k, 0), 0);
		CHECK(t[1].root != shared_root);
	}
	verify(c);
	for (k = 0; k < 4000; k++)
		CHECK_R(random_op(c, &t[k % 2], slots), 0);
	verify(c);

	/* A snapshot of an uncommitted tree, and of that. */
	snap_tree(c, &t[2], &t[1]);
	snap_tree(c, &t[3], &t[2]);
	verify(c);
	commit(c);
	reopen(c);
	verify(c);
	for (k = 0; k < 6000; k++) {
		CHECK_R(random_op(c, &t[rnd_below(4)], slots), 0);
		if (k % 1500 == 0)
			verify(c);
	}
	verify(c);
	commit(c);

	/* Delete them one by one, changing the others in between. */
	for (round = 0; round < 4; round++) {
		do
			i = (int)rnd_below(4);
		while (!t[i].live);
		del_tree(c, &t[i]);
		verify(c);
		for (k = 0; k < 2000; k++) {
			int j = (int)rnd_below(4);

			if (t[j].live)
				CHECK_R(random_op(c, &t[j], slots), 0);
		}
		verify(c);
		if (round % 2) {
			commit(c);
			reopen(c);
			verify(c);
		}
	}
	check_all_freed(c);

	/* The same root referenced five times: overflow counts, reopened. */
	new_tree(c, &t[0]);
	for (k = 0; k < 2000; k++)
		CHECK_R(op_insert(c, &t[0], k, k % NV), 0);
	for (i = 1; i < MAX_TREES; i++)
		snap_tree(c, &t[i], &t[0]);
	CHECK_R(tsp_tm_inc(c->tm, t[0].root), 0);
	CHECK_R(tsp_tm_dec(c->tm, t[0].root), 0);
	commit(c);
	reopen(c);
	verify(c);
	for (i = 0; i < MAX_TREES; i++) {
		CHECK_R(random_op(c, &t[i], 2000), 0);
		verify(c);
	}
	for (i = 0; i < MAX_TREES; i++)
		del_tree(c, &t[i]);
	commit(c);
	reopen(c);
	check_all_freed(c);

	ctx_destroy(c);
	printf("ok   %s\n", name);
}

/* Freed blocks stay unused until the commit, then become allocatable. */
static void test_reuse_after_commit(void)
{
	struct ctx *c = ctx_create(256, 8, true);
	struct tree *t = c->t;
	tsp_block_t free_before;
	u32 k;

	phase = "reuse after commit";
	key_stride = 1;
	new_tree(c, &t[0]);
	for (k = 0; k < 3000; k++)
		CHECK_R(op_insert(c, &t[0], k, k % NV), 0);
	commit(c);
	verify(c);

	/*
	 * Rewrite every key: every node is shadowed, the old ones freed but
	 * not allocatable; verify() checks none comes back.
	 */
	free_before = tsp_tm_nr_free(c->tm);
	for (k = 0; k < 3000; k++) {
		CHECK_R(op_insert(c, &t[0], k, (k + 1) % NV), 0);
		if (k % 500 == 0)
			verify(c);
	}
	verify(c);
	CHECK(tsp_tm_nr_free(c->tm) < free_before);
	commit(c);
	CHECK(tsp_tm_nr_free(c->tm) >= free_before - 2);
	verify(c);
	del_tree(c, &t[0]);
	commit(c);
	check_all_freed(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/* Allocation failures in create and open: clean errors, nothing leaked. */
static void test_alloc_failures(void)
{
	struct ctx *c;
	struct tsp_block_manager *bm;
	struct tsp_tm *tm;
	long n;
	int r, failures = 0;
	u32 k;

	phase = "allocation failures";
	key_stride = 1;

	/* tsp_bm_create + tsp_tm_create. */
	c = ctx_create(1024, 8, true);
	for (n = 0;; n++) {
		tsp_user_fail_alloc_after(n);
		bm = tsp_bm_create(c->bdev, 16);
		if (IS_ERR(bm)) {
			tsp_user_fail_alloc_after(-1);
			CHECK(PTR_ERR(bm) == -ENOMEM);
			failures++;
			continue;
		}
		r = tsp_tm_create(bm, SB_LOCATION, &tm);
		tsp_user_fail_alloc_after(-1);
		if (!r)
			tsp_tm_destroy(tm);
		tsp_bm_destroy(bm);
		if (!r)
			break;
		CHECK_R(r, -ENOMEM);
		failures++;
	}

	/* Reopen a committed tree: tsp_bm_create + tsp_tm_open. */
	new_tree(c, &c->t[0]);
	for (k = 0; k < 5000; k++)
		CHECK_R(op_insert(c, &c->t[0], k * 7 % 5003, k % NV), 0);
	commit(c);
	for (n = 0;; n++) {
		close_managers(c);
		tsp_user_fail_alloc_after(n);
		r = try_open(c);
		tsp_user_fail_alloc_after(-1);
		if (!r)
			break;
		CHECK_R(r, -ENOMEM);
		CHECK(!c->bm && !c->tm);
		failures++;
	}
	reopen(c);
	verify(c);

	/* Every btree operation, with each allocation failing in turn. */
	for (k = 0; k < 300; k++) {
		for (n = 0;; n++) {
			u64 save = rng;

			tsp_user_fail_alloc_after(n);
			r = random_op(c, &c->t[0], 6000);
			tsp_user_fail_alloc_after(-1);
			if (!r)
				break;
			CHECK_R(r, -ENOMEM);
			failures++;
			reopen(c);
			rng = save;
		}
	}
	verify(c);
	commit(c);
	del_tree(c, &c->t[0]);
	commit(c);
	ctx_destroy(c);
	printf("ok   %s (%d injected)\n", phase, failures);
}

/* inc/dec callbacks failing at each call in turn. */
static void test_callback_failures(void)
{
	struct ctx *c = ctx_create(1024, 8, true);
	struct tree *t = c->t;
	u64 batch_seed = rnd();
	long n;
	int r = 0, failed = 0;
	u32 k;

	phase = "callback failures";
	key_stride = 1;
	new_tree(c, &t[0]);
	for (k = 0; k < 3000; k++)
		CHECK_R(op_insert(c, &t[0], k, k % NV), 0);
	snap_tree(c, &t[1], &t[0]);
	commit(c);

	/* Every call of the first few hundred, then a sample. */
	for (n = 0;; n += n < 300 ? 1 : 1 + (long)rnd_below(20)) {
		u64 save = rng;

		rng = batch_seed;
		c->vc.fail_after = n;
		for (k = 0; k < 300 && !r; k++)
			r = random_op(c, &t[k % 2], 3500);
		if (!r)
			r = tsp_btree_del(&c->info, t[1].root);
		c->vc.fail_after = -1;
		rng = save;
		if (!r)
			break;
		CHECK_R(r, -EIO);
		failed++;
		r = 0;
		reopen(c);
		if (n % 50 == 0)
			verify(c);
	}
	t[1].live = false;
	verify(c);
	commit(c);
	del_tree(c, &t[0]);
	check_all_freed(c);
	ctx_destroy(c);
	printf("ok   %s (%d injected)\n", phase, failed);
}

/* Out of metadata space: -ENOSPC, and the committed tree survives. */
static void test_enospc(void)
{
	struct ctx *c = ctx_create(48, 8, true);
	struct tree *t = c->t;
	int r = 0, round;
	u32 k;

	phase = "out of metadata space";
	key_stride = 1;
	new_tree(c, &t[0]);
	for (k = 0; k < 2000; k++)
		CHECK_R(op_insert(c, &t[0], k, k % NV), 0);
	commit(c);
	for (round = 0; round < 3; round++) {
		for (k = 2000; !r; k++)
			r = op_insert(c, &t[0], k, k % NV);
		CHECK_R(r, -ENOSPC);
		CHECK(tsp_tm_nr_free(c->tm) == 0);
		r = 0;
		reopen(c);
		verify(c);
	}
	del_tree(c, &t[0]);
	commit(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/*
 * Corrupt metadata whose checksums are intact: a leaf whose sibling is
 * not shaped like it, an internal node (flags) or a leaf of half the
 * capacity.  Removals from the leaf that merge it with, or refill it from,
 * that sibling fail with -EILSEQ, without reading or writing past either
 * node (ASan).
 */
static void test_mixed_siblings(void)
{
	static const char * const names[] = { "flags", "capacity" };
	struct tsp_block *blk;
	unsigned int kind;
	__le32 *hdr;
	int r;
	u32 k;

	phase = "siblings of different shapes";
	key_stride = 1;
	for (kind = 0; kind < ARRAY_SIZE(names); kind++) {
		struct ctx *c = ctx_create(256, 8, false);
		struct tree *t = c->t;

		new_tree(c, &t[0]);
		/* Sequential: leaves packed full, 252 entries each. */
		for (k = 0; k < 600; k++)
			CHECK_R(op_insert(c, &t[0], k, k % NV), 0);
		commit(c);
		CHECK(tree_depth(c, t[0].root) == 2);

		/* Header: csum, flags, blocknr, nr_entries, max_entries, value_size. */
		CHECK_R(tsp_bm_write_lock(c->bm, node_child(c, t[0].root, 1),
					  &tsp_btree_node_validator, &blk), 0);
		hdr = tsp_block_data(blk);
		if (kind == 0) {
			hdr[1] = cpu_to_le32(1);	/* INTERNAL_NODE */
		} else {
			/* max_entries 126 and its first 126 entries */
			hdr[4] = cpu_to_le32(126);
			hdr[5] = cpu_to_le32(126);
			memmove((u8 *)hdr + 32 + 8 * 126, (u8 *)hdr + 32 + 8 * 252, 8 * 126);
		}
		tsp_bm_unlock(blk);

		r = 0;
		for (k = 0; k < 252 && !r; k++)
			r = op_remove(c, &t[0], k);
		if (r != -EILSEQ)
			fail(__FILE__, __LINE__, "%s: removal %u returned %d, not -EILSEQ",
			     names[kind], k, r);
		ctx_destroy(c);
	}
	printf("ok   %s\n", phase);
}

/*
 * A full leaf whose keys are out of order, which every check on reading
 * passes: an insert that evens it out with a sibling must not choose a
 * node that is still full, nor insert past its end.
 */
static void test_unordered_full_leaf(void)
{
	struct ctx *c = ctx_create(256, 8, false);
	struct tree *t = c->t;
	struct tsp_block *blk;
	__le32 *hdr;
	__le64 *keys;
	u32 k;

	phase = "a full leaf with keys out of order";
	key_stride = 1;
	new_tree(c, &t[0]);
	/* Leaves of keys 0 to 251, 252 to 377 and 378 to 599... */
	for (k = 0; k < 600; k++)
		CHECK_R(op_insert(c, &t[0], k, k % NV), 0);
	/* ... and of 96 keys, the last one. */
	for (k = 378; k < 504; k++)
		CHECK_R(op_remove(c, &t[0], k), 0);
	commit(c);
	CHECK(tree_depth(c, t[0].root) == 2);

	/*
	 * The middle leaf made full, its first key the largest, the others
	 * 253, 253, 254, 254, ...  Key 301 goes to it: its left sibling is
	 * full, so the right one takes all but its first 96 entries and is
	 * full then, and its first key, 300, sends 301 there.
	 */
	CHECK_R(tsp_bm_write_lock(c->bm, node_child(c, t[0].root, 1),
				  &tsp_btree_node_validator, &blk), 0);
	hdr = tsp_block_data(blk);
	hdr[4] = cpu_to_le32(252);	/* nr_entries, of max_entries 252 */
	keys = (__le64 *)(hdr + 8);
	keys[0] = cpu_to_le64(100000);
	for (k = 1; k < 252; k++)
		keys[k] = cpu_to_le64(253 + (k - 1) / 2);
	tsp_bm_unlock(blk);

	CHECK_R(op_insert(c, &t[0], 301, 0), -EILSEQ);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/* Copy of the committed superblock block, to roll a later commit back. */
static void save_superblock(struct ctx *c, u8 *copy)
{
	struct tsp_block *b;

	CHECK_R(tsp_bm_read_lock(c->bm, SB_LOCATION, &sb_validator, &b), 0);
	memcpy(copy, tsp_block_data(b), TSP_METADATA_BLOCK_SIZE);
	tsp_bm_unlock(b);
}

static void restore_superblock(struct ctx *c, const u8 *copy)
{
	struct tsp_block *b;

	CHECK_R(tsp_bm_write_lock_zero(c->bm, SB_LOCATION, &sb_validator, &b), 0);
	memcpy(tsp_block_data(b), copy, TSP_METADATA_BLOCK_SIZE);
	tsp_bm_unlock(b);
	CHECK_R(tsp_bm_flush(c->bm), 0);
}

/*
 * IO failing at every write or flush of a batch and its commit (reads
 * fail from then on too), with the device's volatile cache then lost,
 * kept or torn: the operations fail cleanly, and after reopening the
 * tree is exactly the committed one from before or after the batch.
 * When it is the one after, writing back the old superblock must give
 * the old tree again: the commit overwrote nothing the old one used.
 */
static void test_io_failures(void)
{
	static const enum tsp_crash_mode modes[] = {
		TSP_CRASH_DROP_VOLATILE, TSP_CRASH_KEEP_VOLATILE,
		TSP_CRASH_TEAR_LAST,
	};
	struct model *after = malloc(sizeof(*after));
	long after_refs[NV];
	u8 *sb0 = malloc(TSP_METADATA_BLOCK_SIZE);
	u32 nr_ops = quick ? 100 : 200, k;
	int r, batch, crashes = 0, old = 0, new = 0;
	struct tree *t;
	struct ctx *c;
	u64 batch_seed, ev, start;

	phase = "IO failures";
	key_stride = 5;
	CHECK(after && sb0);
	setenv("TSP_BUFIO_BUFFERS", "24", 1);
	c = ctx_create(1024, 8, true);
	t = c->t;
	new_tree(c, &t[0]);
	for (k = 0; k < 3000; k++)
		CHECK_R(op_insert(c, &t[0], k, k % NV), 0);
	commit(c);
	tsp_bdev_set_volatile(c->bdev, true);

	for (batch = 0; batch < 3; batch++) {
		/* What the batch leaves, from a run without failures, dropped. */
		batch_seed = rnd();
		rng = batch_seed;
		for (k = 0; k < nr_ops; k++)
			CHECK_R(random_op(c, &t[0], 3500), 0);
		*after = t[0].m;
		memcpy(after_refs, c->vc.refs, sizeof(after_refs));
		reopen(c);
		save_superblock(c, sb0);

		for (ev = 0;; ev++) {
			start = tsp_bdev_events(c->bdev);
			tsp_bdev_crash_at(c->bdev, start + ev);
			rng = batch_seed;
			r = 0;
			for (k = 0; k < nr_ops && !r; k++)
				r = random_op(c, &t[0], 3500);
			if (!r)
				r = try_commit(c);
			if (!r)
				break;
			CHECK_R(r, -EIO);
			CHECK(tsp_bdev_crashed(c->bdev));
			crashes++;

			close_managers(c);
			CHECK_R(tsp_bdev_crash_apply(c->bdev, modes[ev % 3]), 0);
			CHECK_R(try_open(c), 0);
			memset(c->freed, 0, c->nr_blocks);
			if (t[0].root == t[0].c_root) {
				old++;
				t[0].m = t[0].cm;
				memcpy(c->vc.refs, c->c_refs, sizeof(c->c_refs));
				verify(c);
				continue;
			}
			new++;
			t[0].m = *after;
			memcpy(c->vc.refs, after_refs, sizeof(after_refs));
			verify(c);
			/* Roll back to the old commit. */
			restore_superblock(c, sb0);
			reopen(c);
			committed(c);
			verify(c);
		}
		tsp_bdev_crash_at(c->bdev, ~0ULL);
		CHECK(!memcmp(&t[0].m, after, sizeof(*after)));
		committed(c);
		verify(c);
		reopen(c);
		verify(c);
	}
	del_tree(c, &t[0]);
	commit(c);
	tsp_bdev_set_volatile(c->bdev, false);
	ctx_destroy(c);
	unsetenv("TSP_BUFIO_BUFFERS");
	free(after);
	free(sb0);
	printf("ok   %s (%d crashes: %d left the old tree, %d the new)\n",
	       phase, crashes, old, new);
}

int main(int argc, char **argv)
{
	const char *s = argc > 1 ? argv[1] : getenv("TSP_SEED");
	unsigned int v, o;

	setenv("TSP_QUIET", "1", 0);
	setenv("TSP_BUFIO_NOSYNC", "1", 0);
	quick = getenv("TSP_TEST_QUICK") && !strcmp(getenv("TSP_TEST_QUICK"), "1");
	seed = s ? strtoull(s, NULL, 0) : (u64)time(NULL) ^ ((u64)getpid() << 32);
	printf("test-btree: seed %" PRIu64 " (rerun: test-btree %" PRIu64 ")\n",
	       seed, seed);
	fflush(stdout);
	rng = seed;
	allocs_base = tsp_user_live_allocs();
	bufio_base = tsp_bufio_live_allocs();

	test_pins();
	test_reuse_after_commit();
	test_alloc_failures();
	test_callback_failures();
	test_io_failures();
	test_enospc();
	test_mixed_siblings();
	test_unordered_full_leaf();
	for (v = 0; v < ARRAY_SIZE(vts); v++)
		for (o = SEQUENTIAL; o <= RANDOM; o++)
			test_density(&vts[v], o);
	for (v = 0; v < ARRAY_SIZE(vts); v++)
		test_cursor(&vts[v]);
	for (v = 0; v < ARRAY_SIZE(vts); v++)
		test_parked_cursor(&vts[v]);
	for (v = 0; v < ARRAY_SIZE(vts); v++)
		test_shared(&vts[v]);
	for (v = 0; v < ARRAY_SIZE(vts); v++)
		for (o = SEQUENTIAL; o <= RANDOM; o++)
			test_single(&vts[v], o, o == RANDOM ? 1ULL << 40 : 1 + v);

	CHECK(tsp_user_live_allocs() == allocs_base);
	CHECK(tsp_bufio_live_allocs() == bufio_base);
	printf("test-btree: all passed\n");
	return 0;
}
