// SPDX-License-Identifier: GPL-2.0-only
/*
 * test-space-map.c - the data space map (persistent-data/space-map.h)
 * against a model: one u32 count per data block.
 *
 * The map spans more than two bitmaps (16320 entries each).  Random
 * inc/dec/new_block, with a set of hot blocks whose counts go back and
 * forth across 2 <-> 3 (where a count moves between the bitmap and the
 * overflow btree) and a few very large counts.  verify() compares every
 * count, the free count, each index entry against its bitmap
 * (tsp_data_sm_check_index), and the metadata blocks the map occupies with
 * the metadata space map's counts exactly.  Also: blocks freed in a
 * transaction are not handed out before the commit, nor those held at a
 * commit (tsp_data_sm_hold_freed) before they are released, across an
 * extend too; -ENOSPC when full;
 * dec of a free block and blocks beyond the end are errors; extend keeps
 * the counts; commit and reopen from the root (tsp_data_sm_open) give the
 * same counts, and dropping a transaction gives the committed ones;
 * allocation failures in create, open and extend fail cleanly; an index
 * entry counting fewer free entries than its bitmap has (as dm-thin
 * growing a pool restored by thin_restore leaves it) neither wraps below
 * zero nor hides free blocks from allocation; a root whose count of
 * blocks in use disagrees with the bitmaps is refused, not wrapped.
 *
 * Usage: test-space-map [seed]; the seed (also $TSP_SEED) is printed.
 * Exit status 0 pass, 1 fail.
 *
 * Locking: single threaded.
 */
#define DM_MSG_PREFIX "space-map-test"
#include "persistent-data/space-map.h"
#include "persistent-data/space-map-format.h"
#include "persistent-data/btree.h"

#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <time.h>
#include <unistd.h>

#define ENTRIES_PER_BITMAP 16320

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
/* Metadata device, superblock, commit, reopen                         */
/* ------------------------------------------------------------------ */

#define SB_LOCATION 0
#define SB_MAGIC 0x7473736d	/* "tssm" */
#define SB_CSUM_XOR 8675309

struct test_sb {
	__le32 csum;
	__le32 magic;
	__le64 blocknr;
	u8 data_sm_root[TSP_SM_ROOT_SIZE];
	u8 meta_sm_root[TSP_SM_ROOT_SIZE];
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

struct ctx {
	struct block_device *bdev;
	struct tsp_block_manager *bm;
	struct tsp_tm *tm;
	struct tsp_data_sm *sm;
	tsp_block_t nr_meta;

	tsp_block_t nr_data;	/* model */
	u32 *count;
	tsp_block_t c_nr_data;	/* as committed */
	u32 *c_count;
	u32 *meta_refs;		/* scratch for verify() */
};

static long allocs_base, bufio_base;

static struct block_device *temp_bdev(tsp_block_t nr_blocks)
{
	const char *dir = getenv("TMPDIR");
	struct block_device *bdev;
	char path[4096];
	int fd;

	snprintf(path, sizeof(path), "%s/tsp-sm-XXXXXX", dir ? dir : "/tmp");
	fd = mkstemp(path);
	CHECK(fd >= 0);
	CHECK(!ftruncate(fd, (off_t)(nr_blocks * TSP_METADATA_BLOCK_SIZE)));
	close(fd);
	bdev = tsp_bdev_open(path, false);
	unlink(path);
	CHECK(bdev);
	return bdev;
}

static void model_resize(struct ctx *c, tsp_block_t nr)
{
	c->count = realloc(c->count, nr * sizeof(u32));
	c->c_count = realloc(c->c_count, nr * sizeof(u32));
	CHECK(c->count && c->c_count);
	if (nr > c->nr_data) {
		memset(c->count + c->nr_data, 0, (nr - c->nr_data) * sizeof(u32));
		memset(c->c_count + c->nr_data, 0, (nr - c->nr_data) * sizeof(u32));
	}
	c->nr_data = nr;
}

static int try_commit(struct ctx *c)
{
	u8 data_root[TSP_SM_ROOT_SIZE], meta_root[TSP_SM_ROOT_SIZE];
	struct tsp_block *b;
	struct test_sb *sb;
	int r;

	r = tsp_data_sm_commit(c->sm, data_root);
	if (!r)
		r = tsp_tm_pre_commit(c->tm, meta_root);
	if (!r)
		r = tsp_bm_write_lock_zero(c->bm, SB_LOCATION, &sb_validator, &b);
	if (r)
		return r;
	sb = tsp_block_data(b);
	sb->magic = cpu_to_le32(SB_MAGIC);
	memcpy(sb->data_sm_root, data_root, TSP_SM_ROOT_SIZE);
	memcpy(sb->meta_sm_root, meta_root, TSP_SM_ROOT_SIZE);
	return tsp_tm_commit(c->tm, b);
}

static void commit(struct ctx *c)
{
	CHECK_R(try_commit(c), 0);
	c->c_nr_data = c->nr_data;
	memcpy(c->c_count, c->count, c->nr_data * sizeof(u32));
}

static void close_all(struct ctx *c)
{
	if (c->sm)
		tsp_data_sm_destroy(c->sm);
	if (c->tm)
		tsp_tm_destroy(c->tm);
	if (c->bm)
		tsp_bm_destroy(c->bm);
	c->sm = NULL;
	c->tm = NULL;
	c->bm = NULL;
}

/* Open everything on the committed superblock. */
static int try_open(struct ctx *c)
{
	struct tsp_block *b;
	struct test_sb *sb;
	int r;

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
	r = tsp_tm_open(c->bm, SB_LOCATION, sb->meta_sm_root, &c->tm);
	if (!r)
		r = tsp_data_sm_open(c->tm, sb->data_sm_root, &c->sm);
	tsp_bm_unlock(b);
	if (r)
		goto bad;
	return 0;
bad:
	close_all(c);
	return r;
}

/* Drop the transaction: back to the committed counts. */
static void reopen(struct ctx *c)
{
	close_all(c);
	CHECK_R(try_open(c), 0);
	model_resize(c, c->c_nr_data);
	memcpy(c->count, c->c_count, c->nr_data * sizeof(u32));
}

static struct ctx *ctx_create(tsp_block_t nr_meta, tsp_block_t nr_data)
{
	struct ctx *c = calloc(1, sizeof(*c));

	CHECK(c);
	c->nr_meta = nr_meta;
	c->meta_refs = calloc(nr_meta, sizeof(u32));
	CHECK(c->meta_refs);
	c->bdev = temp_bdev(nr_meta);
	c->bm = tsp_bm_create(c->bdev, 16);
	CHECK(!IS_ERR(c->bm));
	CHECK_R(tsp_tm_create(c->bm, SB_LOCATION, &c->tm), 0);
	CHECK_R(tsp_data_sm_create(c->tm, nr_data, &c->sm), 0);
	model_resize(c, nr_data);
	commit(c);
	return c;
}

static void ctx_destroy(struct ctx *c)
{
	close_all(c);
	tsp_bdev_close(c->bdev);
	free(c->count);
	free(c->c_count);
	free(c->meta_refs);
	free(c);
	CHECK(tsp_user_live_allocs() == allocs_base);
	CHECK(tsp_bufio_live_allocs() == bufio_base);
}

/* ------------------------------------------------------------------ */
/* Verification                                                        */
/* ------------------------------------------------------------------ */

static int count_meta(void *context, tsp_block_t b)
{
	struct ctx *c = context;

	if (b >= c->nr_meta)
		fail(__FILE__, __LINE__, "metadata block %llu beyond the device",
		     (unsigned long long)b);
	return c->meta_refs[b]++ ? 1 : 0;
}

static void verify(struct ctx *c)
{
	tsp_block_t b, nr_free = 0;
	u32 count;

	CHECK(tsp_data_sm_nr_blocks(c->sm) == c->nr_data);
	for (b = 0; b < c->nr_data; b++) {
		CHECK_R(tsp_data_sm_get_count(c->sm, b, &count), 0);
		if (count != c->count[b])
			fail(__FILE__, __LINE__, "data block %llu: count %u, expected %u",
			     (unsigned long long)b, count, c->count[b]);
		nr_free += !count;
	}
	CHECK(tsp_data_sm_nr_free(c->sm) == nr_free);
	CHECK_R(tsp_data_sm_check_index(c->sm), 0);

	/* The metadata blocks the maps occupy, exactly. */
	memset(c->meta_refs, 0, c->nr_meta * sizeof(u32));
	count_meta(c, SB_LOCATION);
	CHECK_R(tsp_tm_walk_sm_blocks(c->tm, count_meta, c), 0);
	CHECK_R(tsp_data_sm_walk_own_blocks(c->sm, count_meta, c), 0);
	for (b = 0; b < c->nr_meta; b++) {
		CHECK_R(tsp_tm_ref(c->tm, b, &count), 0);
		if (count != c->meta_refs[b])
			fail(__FILE__, __LINE__,
			     "metadata block %llu: count %u, %u references",
			     (unsigned long long)b, count, c->meta_refs[b]);
	}
}

/* ------------------------------------------------------------------ */
/* Operations                                                          */
/* ------------------------------------------------------------------ */

static int op_inc(struct ctx *c, tsp_block_t b)
{
	int r = tsp_data_sm_inc(c->sm, b);

	if (!r)
		c->count[b]++;
	return r;
}

static int op_dec(struct ctx *c, tsp_block_t b)
{
	int r = tsp_data_sm_dec(c->sm, b);

	if (!r) {
		CHECK(c->count[b]);
		c->count[b]--;
	}
	return r;
}

static int op_new(struct ctx *c, tsp_block_t *result)
{
	tsp_block_t b = ~0ULL;
	int r = tsp_data_sm_new_block(c->sm, &b);

	if (r)
		return r;
	if (b >= c->nr_data)
		fail(__FILE__, __LINE__, "new_block gave %llu of %llu",
		     (unsigned long long)b, (unsigned long long)c->nr_data);
	if (c->count[b])
		fail(__FILE__, __LINE__, "new_block gave block %llu, count %u",
		     (unsigned long long)b, c->count[b]);
	if (b < c->c_nr_data && c->c_count[b])
		fail(__FILE__, __LINE__,
		     "new_block gave block %llu, freed in this transaction",
		     (unsigned long long)b);
	c->count[b] = 1;
	if (result)
		*result = b;
	return 0;
}

/* Allocate every free block; then allocation fails with -ENOSPC. */
static void fill(struct ctx *c)
{
	tsp_block_t b;

	while (tsp_data_sm_nr_free(c->sm))
		CHECK_R(op_new(c, &b), 0);
	CHECK_R(op_new(c, &b), -ENOSPC);
}

/* Blocks whose counts are driven back and forth around 3. */
#define NR_HOT 64

/* One random operation, which must succeed. */
static void random_op(struct ctx *c, const tsp_block_t *hot)
{
	u32 p = (u32)rnd_below(100);
	tsp_block_t b;

	if (p < 30) {
		b = hot[rnd_below(NR_HOT)];
		if (c->count[b] && chance(50))
			CHECK_R(op_dec(c, b), 0);
		else
			CHECK_R(op_inc(c, b), 0);
	} else if (p < 55) {
		/* -ENOSPC when the only free blocks were freed just now. */
		int r = op_new(c, NULL);

		CHECK(!r || r == -ENOSPC);
	} else if (p < 70) {
		b = rnd_below(c->nr_data);
		if (c->count[b])
			CHECK_R(op_inc(c, b), 0);
	} else {
		/* Dec a used block, found from a random start. */
		tsp_block_t i, start = rnd_below(c->nr_data);

		for (i = 0; i < 1000; i++) {
			b = (start + i) % c->nr_data;
			if (c->count[b]) {
				CHECK_R(op_dec(c, b), 0);
				break;
			}
		}
	}
}

/* ------------------------------------------------------------------ */
/* Tests                                                               */
/* ------------------------------------------------------------------ */

static void pick_hot(struct ctx *c, tsp_block_t *hot)
{
	int i;

	/* Spread over the bitmaps, including their first and last entries. */
	for (i = 0; i < NR_HOT; i++)
		hot[i] = i < 4 ? ((tsp_block_t)i * ENTRIES_PER_BITMAP - !!i) %
			 c->nr_data : rnd_below(c->nr_data);
	hot[NR_HOT - 1] = c->nr_data - 1;
}

static void test_model(void)
{
	tsp_block_t nr = 2 * ENTRIES_PER_BITMAP + 5000, hot[NR_HOT], b;
	struct ctx *c = ctx_create(4096, nr);
	u32 k, round;
	int r;

	phase = "model";
	verify(c);
	pick_hot(c, hot);

	/* Errors: beyond the end, and dec of a free block. */
	CHECK_R(tsp_data_sm_inc(c->sm, nr), -EILSEQ);
	CHECK_R(tsp_data_sm_dec(c->sm, nr + 12345), -EILSEQ);
	{
		u32 count;

		CHECK_R(tsp_data_sm_get_count(c->sm, nr, &count), -EILSEQ);
	}
	r = tsp_data_sm_dec(c->sm, 17);
	if (r != -EINVAL && r != -EILSEQ)
		fail(__FILE__, __LINE__, "dec of a free block: %d", r);
	verify(c);

	/* A few very large counts. */
	for (k = 0; k < 300; k++)
		CHECK_R(op_inc(c, hot[k % 3]), 0);

	for (round = 0; round < 12; round++) {
		for (k = 0; k < 6000; k++)
			random_op(c, hot);
		verify(c);
		switch (rnd_below(4)) {
		case 0:
			commit(c);
			break;
		case 1:
			commit(c);
			reopen(c);	/* reopened from the root */
			verify(c);
			break;
		case 2:
			reopen(c);	/* transaction dropped */
			verify(c);
			break;
		default:
			break;		/* carry on in the same transaction */
		}
	}

	/* Every hot count across 2 <-> 3 and back, committed each way. */
	for (k = 0; k < NR_HOT; k++) {
		b = hot[k];
		while (c->count[b] < 2)
			CHECK_R(op_inc(c, b), 0);
		while (c->count[b] > 2)
			CHECK_R(op_dec(c, b), 0);
	}
	commit(c);
	reopen(c);
	verify(c);
	for (k = 0; k < NR_HOT; k++)
		CHECK_R(op_inc(c, hot[k]), 0);	/* 2 -> 3 (or more) */
	commit(c);
	reopen(c);
	verify(c);
	for (k = 0; k < NR_HOT; k++)
		CHECK_R(op_dec(c, hot[k]), 0);	/* 3 -> 2 */
	verify(c);
	commit(c);
	reopen(c);
	verify(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/* Freed blocks wait for the commit; a full map gives -ENOSPC. */
static void test_full(void)
{
	tsp_block_t nr = 2 * ENTRIES_PER_BITMAP + 7, b, i, freed[100];
	struct ctx *c = ctx_create(1024, nr);

	phase = "full";
	for (i = 0; i < nr; i++)
		CHECK_R(op_new(c, NULL), 0);
	CHECK(tsp_data_sm_nr_free(c->sm) == 0);
	CHECK_R(op_new(c, &b), -ENOSPC);
	verify(c);
	commit(c);

	/* Free 100 blocks, some in each bitmap: not allocatable yet. */
	for (i = 0; i < 100; i++) {
		freed[i] = i < 3 ? i * ENTRIES_PER_BITMAP : rnd_below(nr);
		if (c->count[freed[i]])
			CHECK_R(op_dec(c, freed[i]), 0);
	}
	CHECK(tsp_data_sm_nr_free(c->sm) > 0);
	CHECK_R(op_new(c, &b), -ENOSPC);
	verify(c);
	commit(c);

	/* After the commit they are, and then the map is full again. */
	fill(c);
	verify(c);

	/* Still so after more frees; a reopen from the root agrees. */
	commit(c);
	CHECK_R(op_dec(c, 5), 0);
	CHECK_R(op_dec(c, nr - 1), 0);
	CHECK_R(op_new(c, &b), -ENOSPC);
	commit(c);
	reopen(c);
	verify(c);
	CHECK_R(op_new(c, &b), 0);
	CHECK(b == 5 || b == nr - 1);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/*
 * No block freed in a transaction comes back before the commit, not
 * even one allocated in it: an IO may still be using it.
 */
static void test_reuse_in_transaction(void)
{
	struct ctx *c = ctx_create(256, 10);
	tsp_block_t b, b2, i;

	phase = "reuse within a transaction";
	for (i = 0; i < 10; i++)
		CHECK_R(op_new(c, NULL), 0);
	commit(c);
	CHECK_R(op_dec(c, 3), 0);
	CHECK_R(op_dec(c, 7), 0);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 2);
	CHECK_R(op_new(c, &b), -ENOSPC);	/* freed this transaction */
	commit(c);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 0);
	CHECK_R(op_new(c, &b), 0);
	CHECK(b == 3 || b == 7);
	CHECK_R(op_dec(c, b), 0);		/* allocated and freed now */
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 1);
	CHECK_R(op_new(c, &b2), 0);		/* the other one */
	CHECK(b2 == 10 - b);
	CHECK_R(op_new(c, &b2), -ENOSPC);	/* not @b again */
	verify(c);
	commit(c);
	CHECK_R(op_new(c, &b2), 0);
	CHECK(b2 == b);
	verify(c);
	commit(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/*
 * Blocks freed before tsp_data_sm_hold_freed() stay out of allocation
 * past the commit, until released: the release after the one that
 * made them the older generation; those freed after it do not.
 */
static void test_hold_freed(void)
{
	struct ctx *c = ctx_create(256, 10);
	tsp_block_t b, i;

	phase = "held freed blocks";
	for (i = 0; i < 10; i++)
		CHECK_R(op_new(c, NULL), 0);
	commit(c);
	CHECK_R(op_dec(c, 3), 0);
	tsp_data_sm_hold_freed(c->sm);
	CHECK_R(op_dec(c, 7), 0);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 2);
	commit(c);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 1);
	CHECK_R(op_new(c, &b), 0);
	CHECK_R(b, 7);
	CHECK_R(op_new(c, &b), -ENOSPC);	/* 3 is held */

	/* Held across an extend, and released. */
	CHECK_R(tsp_data_sm_extend(c->sm, ENTRIES_PER_BITMAP + 10), 0);
	model_resize(c, ENTRIES_PER_BITMAP + 10);
	CHECK_R(op_new(c, &b), 0);
	CHECK_R(b, 10);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 1);
	tsp_data_sm_release_held(c->sm);	/* 3 is the older generation */
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 1);
	CHECK_R(op_new(c, &b), 0);
	CHECK_R(b, 11);
	tsp_data_sm_release_held(c->sm);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 0);
	CHECK_R(op_new(c, &b), 0);
	CHECK_R(b, 3);
	verify(c);
	commit(c);

	/*
	 * Two generations: 4, held and made the older, is released while 5,
	 * held since, stays held until the next release.
	 */
	CHECK_R(op_dec(c, 4), 0);
	tsp_data_sm_hold_freed(c->sm);
	commit(c);
	tsp_data_sm_release_held(c->sm);
	CHECK_R(op_dec(c, 5), 0);
	tsp_data_sm_hold_freed(c->sm);
	commit(c);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 2);
	tsp_data_sm_release_held(c->sm);
	CHECK(tsp_data_sm_nr_waiting(c->sm) == 1);
	CHECK_R(op_new(c, &b), 0);
	CHECK_R(b, 4);
	tsp_data_sm_release_held(c->sm);
	CHECK_R(op_new(c, &b), 0);
	CHECK_R(b, 5);
	verify(c);
	commit(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

static void test_extend(void)
{
	tsp_block_t sizes[] = { 100, 101, ENTRIES_PER_BITMAP - 1,
				ENTRIES_PER_BITMAP, ENTRIES_PER_BITMAP + 1,
				3 * ENTRIES_PER_BITMAP + 17, 5 * ENTRIES_PER_BITMAP };
	struct ctx *c = ctx_create(2048, 50);
	tsp_block_t hot[NR_HOT];
	unsigned int i;
	u32 k;

	phase = "extend";
	for (k = 0; k < 50; k++)
		CHECK_R(op_new(c, NULL), 0);
	for (k = 0; k < 20; k++)
		CHECK_R(op_inc(c, k % 5), 0);
	commit(c);

	for (i = 0; i < ARRAY_SIZE(sizes); i++) {
		CHECK_R(tsp_data_sm_extend(c->sm, sizes[i]), 0);
		model_resize(c, sizes[i]);
		CHECK_R(tsp_data_sm_extend(c->sm, sizes[i] - 1), -EINVAL);
		CHECK_R(tsp_data_sm_extend(c->sm, sizes[i]), 0);
		verify(c);
		pick_hot(c, hot);
		for (k = 0; k < 3000; k++)
			random_op(c, hot);
		/* The new blocks at the end are usable. */
		CHECK_R(op_inc(c, sizes[i] - 1), 0);
		verify(c);
		if (i % 2) {
			commit(c);
			reopen(c);
			verify(c);
		}
	}
	commit(c);

	/* An extend dropped with its transaction. */
	CHECK_R(tsp_data_sm_extend(c->sm, 6 * ENTRIES_PER_BITMAP), 0);
	reopen(c);
	CHECK(tsp_data_sm_nr_blocks(c->sm) == 5 * ENTRIES_PER_BITMAP);
	verify(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/*
 * Set bitmap @i's nr_free in the committed index, as a foreign writer
 * may have left it: patch its index btree entry (a single leaf here) in
 * place, the block manager resealing its checksum, and reopen.
 */
static u64 le_at(const u8 *p, unsigned int size)
{
	u64 v = 0;

	while (size--)
		v = v << 8 | p[size];
	return v;
}

static void set_index_nr_free(struct ctx *c, u64 i, u32 nr_free)
{
	struct tsp_disk_index_entry *ie;
	struct tsp_disk_sm_root root;
	struct tsp_block *b;
	u32 max, nr, k;
	u8 *n;

	close_all(c);
	c->bm = tsp_bm_create(c->bdev, 16);
	CHECK(!IS_ERR(c->bm));
	CHECK_R(tsp_bm_read_lock(c->bm, SB_LOCATION, &sb_validator, &b), 0);
	memcpy(&root, ((struct test_sb *)tsp_block_data(b))->data_sm_root,
	       sizeof(root));
	tsp_bm_unlock(b);

	CHECK_R(tsp_bm_write_lock(c->bm, le64_to_cpu(root.bitmap_root),
				  &tsp_btree_node_validator, &b), 0);
	/* Node header: flags at 4, nr_entries at 16, max_entries at 20. */
	n = tsp_block_data(b);
	CHECK(le_at(n + 4, 4) == 2);		/* a leaf */
	nr = (u32)le_at(n + 16, 4);
	max = (u32)le_at(n + 20, 4);
	for (k = 0; k < nr && le_at(n + 32 + 8 * k, 8) != i; k++)
		;
	CHECK(k < nr);
	ie = (struct tsp_disk_index_entry *)(n + 32 + 8 * max) + k;
	ie->nr_free = cpu_to_le32(nr_free);
	tsp_bm_unlock(b);
	CHECK_R(tsp_bm_flush(c->bm), 0);
	close_all(c);
	CHECK_R(try_open(c), 0);
}

/*
 * An index entry whose nr_free is below the free entries of its bitmap
 * (thin_restore counts only those within the device, and dm-thin leaves
 * the count of the last bitmap alone when it grows the device) must
 * neither wrap below zero as blocks of the bitmap go in use, which would
 * make the next open refuse the map, nor hide the bitmap's free blocks
 * from allocation.
 */
static void test_low_nr_free(void)
{
	tsp_block_t nr = ENTRIES_PER_BITMAP + 100, b;
	struct ctx *c = ctx_create(1024, nr);
	u32 k;

	phase = "index entry counting too few free entries";
	for (b = 0; b < ENTRIES_PER_BITMAP; b++)
		CHECK_R(op_inc(c, b), 0);
	commit(c);

	/* Restore-like increments of free blocks: five, with nr_free 2. */
	set_index_nr_free(c, 1, 2);
	verify(c);
	for (k = 0; k < 5; k++)
		CHECK_R(op_inc(c, ENTRIES_PER_BITMAP + 10 * k), 0);
	verify(c);
	commit(c);
	reopen(c);
	verify(c);

	/* Allocation finds the free blocks of a bitmap that says it has none. */
	set_index_nr_free(c, 1, 0);
	verify(c);
	fill(c);
	verify(c);
	commit(c);
	reopen(c);
	verify(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/* Write @nr_allocated into the committed root, and reopen. */
static void set_nr_allocated(struct ctx *c, tsp_block_t nr_allocated)
{
	struct tsp_disk_sm_root *root;
	struct tsp_block *b;

	close_all(c);
	c->bm = tsp_bm_create(c->bdev, 16);
	CHECK(!IS_ERR(c->bm));
	CHECK_R(tsp_bm_write_lock(c->bm, SB_LOCATION, &sb_validator, &b), 0);
	root = (void *)((struct test_sb *)tsp_block_data(b))->data_sm_root;
	root->nr_allocated = cpu_to_le64(nr_allocated);
	tsp_bm_unlock(b);
	CHECK_R(tsp_bm_flush(c->bm), 0);
	close_all(c);
	CHECK_R(try_open(c), 0);
}

/*
 * A root whose count of blocks in use disagrees with the bitmaps is
 * refused as corrupt when the count would go below zero or past the
 * map's size, and never wraps.
 */
static void test_bad_nr_allocated(void)
{
	struct ctx *c = ctx_create(256, 20);
	tsp_block_t b;
	u32 k;

	phase = "root's count of blocks in use is wrong";
	for (k = 0; k < 10; k++)
		CHECK_R(op_new(c, NULL), 0);
	commit(c);

	set_nr_allocated(c, 0);
	CHECK_R(op_inc(c, 3), 0);		/* 1 -> 2 counts nothing in */
	CHECK_R(op_dec(c, 3), 0);
	CHECK_R(op_dec(c, 3), -EILSEQ);		/* 1 -> 0 */
	CHECK(tsp_data_sm_nr_free(c->sm) == 20);

	set_nr_allocated(c, 20);
	CHECK_R(op_inc(c, 15), -EILSEQ);	/* 0 -> 1 */
	CHECK_R(tsp_data_sm_new_block(c->sm, &b), -EILSEQ);
	CHECK(tsp_data_sm_nr_free(c->sm) == 0);

	set_nr_allocated(c, 10);
	reopen(c);
	verify(c);
	ctx_destroy(c);
	printf("ok   %s\n", phase);
}

/* Allocation failures in create, open and extend. */
static void test_alloc_failures(void)
{
	struct ctx *c = ctx_create(1024, 1000);
	struct tsp_data_sm *sm;
	long n;
	int r, injected = 0;
	u32 k;

	phase = "allocation failures";
	for (k = 0; k < 500; k++)
		CHECK_R(op_new(c, NULL), 0);
	commit(c);

	for (n = 0;; n++) {
		tsp_user_fail_alloc_after(n);
		r = tsp_data_sm_create(c->tm, 3 * ENTRIES_PER_BITMAP, &sm);
		tsp_user_fail_alloc_after(-1);
		if (!r)
			break;
		CHECK_R(r, -ENOMEM);
		injected++;
	}
	tsp_data_sm_destroy(sm);
	reopen(c);	/* drop the blocks those creates took */

	for (n = 0;; n++) {
		close_all(c);
		tsp_user_fail_alloc_after(n);
		r = try_open(c);
		tsp_user_fail_alloc_after(-1);
		if (!r)
			break;
		CHECK_R(r, -ENOMEM);
		CHECK(!c->sm && !c->tm && !c->bm);
		injected++;
	}
	verify(c);

	for (n = 0;; n++) {
		tsp_user_fail_alloc_after(n);
		r = tsp_data_sm_extend(c->sm, 4 * ENTRIES_PER_BITMAP);
		tsp_user_fail_alloc_after(-1);
		if (!r)
			break;
		CHECK_R(r, -ENOMEM);
		injected++;
		reopen(c);	/* a failed extend needs an abort */
	}
	model_resize(c, 4 * ENTRIES_PER_BITMAP);
	verify(c);
	commit(c);
	reopen(c);
	verify(c);
	ctx_destroy(c);
	printf("ok   %s (%d injected)\n", phase, injected);
}

int main(int argc, char **argv)
{
	const char *s = argc > 1 ? argv[1] : getenv("TSP_SEED");

	setenv("TSP_QUIET", "1", 0);
	setenv("TSP_BUFIO_NOSYNC", "1", 0);
	setenv("TSP_BUFIO_BUFFERS", "64", 0);	/* evictions mid-transaction */
	seed = s ? strtoull(s, NULL, 0) : (u64)time(NULL) ^ ((u64)getpid() << 32);
	printf("test-space-map: seed %" PRIu64 " (rerun: test-space-map %" PRIu64 ")\n",
	       seed, seed);
	fflush(stdout);
	rng = seed;
	allocs_base = tsp_user_live_allocs();
	bufio_base = tsp_bufio_live_allocs();

	test_reuse_in_transaction();
	test_hold_freed();
	test_full();
	test_extend();
	test_low_nr_free();
	test_bad_nr_allocated();
	test_alloc_failures();
	test_model();

	CHECK(tsp_user_live_allocs() == allocs_base);
	CHECK(tsp_bufio_live_allocs() == bufio_base);
	printf("test-space-map: all passed\n");
	return 0;
}
