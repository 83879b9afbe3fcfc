// SPDX-License-Identifier: GPL-2.0-only
/*
 * test-corrupt.c - bad metadata is refused cleanly: opening and checking
 * (tsp_pool_metadata_open() + tsp_pool_check()) a damaged image either
 * fails with an error code, or, when the damage hit bytes nobody reads,
 * succeeds and thin_check agrees the image is fine.  Never a crash, an
 * assertion, a hang, a leak or a sanitizer report; and never a write to
 * the device (nothing was changed, so closing must not write).
 *
 * The fixture is built at test time (build_fixture(); no image is kept
 * in the tree): devices with internal btree nodes, snapshots of
 * snapshots (data blocks with three references and more, so both space
 * maps have overflow entries), mappings in both bitmaps of a data space
 * map of 20000 blocks, an empty device, a held metadata snapshot with
 * changes made after it.  An independent walk of the raw image
 * (img_walk() in helpers.h) finds every block in use, its kind, and
 * checks the metadata space map's counts.
 *
 * Groups:
 *   - every block in use: a random bit flipped, zeroed, swapped with a
 *     block of the same kind and with one of another kind (the checksum
 *     or the location check must catch all of these);
 *   - the same with the checksum and location recomputed, so that the
 *     structure checks behind them are exercised: random bit flips,
 *     swaps of same-kind and other-kind blocks;
 *   - targeted structural damage, resealed, that must be refused:
 *     entry counts, key order, cycles, pointers beyond the device or to
 *     blocks of another kind, value sizes, space map counts, index
 *     entries, superblock roots and sizes, device details, shared
 *     nodes outside the key range of one of their parents, and three
 *     "DAG bombs" (every entry of every internal node pointing at the
 *     same child: linear in blocks, exponential in paths), which must be
 *     refused in bounded time;
 *   - the superblock's own fields: magic, version, block sizes, feature
 *     flags; truncated images, a device too small to format, a missing
 *     path, an all-zero device opened without format.
 *
 * Whenever a damaged image opens (the check may still refuse it), it is
 * also used, as the kernel would use it without a full check: lookups,
 * maps, unmaps, snapshot, delete, metadata snapshot, commits, aborting
 * after each failure (workload()).  Errors are expected there; crashes,
 * hangs and leaks are not.
 *
 * Each case runs in a child with a time limit; stderr goes to a log that
 * is shown when the case fails.  Environment: TSP_SEED=n changes the
 * random choices (the seed is printed); TSP_VERBOSE=1 lists the damaged
 * images accepted, and those refused although thin_check accepts them
 * (thin_check 0.9.0 does not check data block reference counts);
 * TSP_KEEP_SCRATCH=1 keeps the images.
 */
#define DM_MSG_PREFIX "test-corrupt"
#include "tests/unit/helpers.h"

#define META_BLOCKS 1024		/* 4 MiB of metadata */
#define NR_DATA 20000			/* two data space map bitmaps */
#define CASE_TIMEOUT 20
#define BOMB_TIMEOUT 5

static char fixture_path[300], work_path[300], log_path[300], tool_log[300];
static u8 *pristine;
static size_t pristine_len;
static struct img_map map;		/* the pristine image's walk */
static u64 *in_use;			/* blocks in use, ascending */
static u64 nr_in_use;

/* Counters for the summary. */
static unsigned long nr_cases, nr_refused, nr_accepted, nr_stricter;
static bool verbose;			/* TSP_VERBOSE=1 */

/* ------------------------------------------------------------------ */
/* The fixture                                                         */
/* ------------------------------------------------------------------ */

/* Map @n blocks of @dev from @virt to chosen data blocks @data + i * @step. */
static int restore_blocks(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			  tsp_block_t virt, tsp_block_t data, tsp_block_t step,
			  unsigned int n)
{
	struct tsp_thin_device *td;
	unsigned int i;
	int r;

	r = tsp_pool_open_thin_device(pmd, dev, &td);
	if (r)
		return r;
	for (i = 0; !r && i < n; i++)
		r = tsp_thin_restore_block(td, virt + i, data + i * step, 0);
	tsp_pool_close_thin_device(td);
	return r;
}

static int build_fixture(void)
{
	struct live_counts live = live_now();
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	int r;

	r = make_zero_file(fixture_path, (u64)META_BLOCKS * MD_BLOCK);
	if (!r)
		r = pool_open(fixture_path, NR_DATA, true, &bdev, &pmd);
	if (r)
		return r;
	r = tsp_pool_create_thin(pmd, 1);
	if (!r)
		r = tsp_pool_create_thin(pmd, 2);
	if (!r)
		r = tsp_pool_create_thin(pmd, 7);	/* stays empty */
	if (!r)
		r = map_blocks(pmd, 1, 0, 1, 1500);
	if (!r)
		r = map_blocks(pmd, 2, 0, 2, 700);
	/* Mappings into the second data bitmap (blocks 16320 and up). */
	if (!r)
		r = restore_blocks(pmd, 2, 5000, 16320, 37, 90);
	if (!r)
		r = restore_blocks(pmd, 1, 9000, NR_DATA - 1, 0, 1);
	if (!r)
		r = tsp_pool_set_metadata_transaction_id(pmd, 0, 1);
	/* Snapshots of snapshots: blocks with 3 and 4 references. */
	if (!r)
		r = tsp_pool_create_snap(pmd, 3, 1);
	if (!r)
		r = tsp_pool_create_snap(pmd, 4, 3);
	if (!r)
		r = map_blocks(pmd, 1, 3, 50, 30);
	if (!r)
		r = map_blocks(pmd, 4, 7, 70, 20);
	if (!r)
		r = tsp_pool_create_snap(pmd, 5, 4);
	if (!r)
		r = tsp_pool_commit_metadata(pmd);
	/* A held metadata snapshot, and changes after it. */
	if (!r)
		r = tsp_pool_reserve_metadata_snap(pmd);
	if (!r)
		r = tsp_pool_create_thin(pmd, 6);
	if (!r)
		r = map_blocks(pmd, 6, 0, 1, 100);
	if (!r)
		r = map_blocks(pmd, 2, 1, 20, 35);
	if (!r)
		r = tsp_pool_set_metadata_transaction_id(pmd, 1, 2);
	if (!r)
		r = tsp_pool_commit_metadata(pmd);
	if (pool_close(bdev, pmd) && !r)
		r = -EIO;
	if (!r && !live_same(live, live_now()))
		r = -ENOTRECOVERABLE;
	return r;
}

/* The number of entries in the leaves of the tree of kind @tree. */
static u64 tree_entries(enum tree_kind tree)
{
	u64 b, n = 0;

	for (b = 0; b < map.nr_blocks; b++)
		if (map.b[b].kind == BK_NODE && map.b[b].tree == tree &&
		    map.b[b].leaf)
			n += node_nr(pristine + b * MD_BLOCK);
	return n;
}

static bool tree_has_internal(enum tree_kind tree)
{
	u64 b;

	for (b = 0; b < map.nr_blocks; b++)
		if (map.b[b].kind == BK_NODE && map.b[b].tree == tree &&
		    !map.b[b].leaf)
			return true;
	return false;
}

/* ------------------------------------------------------------------ */
/* Running a case                                                      */
/* ------------------------------------------------------------------ */

struct open_arg {
	const char *path;
	bool format;
	sector_t data_block_size;	/* passed to open; 0: the one on disk */
	tsp_block_t nr_data;
	bool workload;			/* use the pool after the check */
};

struct open_res {
	int bdev_errno;		/* tsp_bdev_open() failed with this */
	int open_r;
	int check_r;
	int close_r;
	bool leaked;
};

/*
 * What a pool does with metadata it opened (the kernel does not run the
 * whole check first): look devices up, map, unmap, snapshot, delete,
 * reserve and release a metadata snapshot, commit.  Errors are expected
 * on damaged metadata; after one the transaction is aborted and the
 * next step tried.  Only a crash, a hang or a leak is wrong.
 */
#define MAX_WORK_DEVS 8

static int collect_dev(void *context, tsp_thin_id dev,
		       const struct tsp_thin_details *d)
{
	tsp_thin_id *ids = context;

	if (ids[0] < MAX_WORK_DEVS)
		ids[++ids[0]] = dev;
	return 0;
}

/* Any result will do here (lookups on damaged metadata). */
static void any_result(int r)
{
}

/*
 * After a step, what the pool does: abort an update that failed half way.
 * One that failed without leaving the metadata waiting for its abort must
 * have been refused, changing nothing.
 */
static void work_step(struct tsp_pool_metadata *pmd, int r)
{
	if (tsp_pool_metadata_needs_abort(pmd)) {
		CHECK(r);
		any_result(tsp_pool_abort_metadata(pmd));
	} else if (r && r != -ENOSPC &&
		   !CHECK(r == -ENODATA || r == -EEXIST || r == -ENODEV ||
			  r == -EBUSY || r == -EINVAL)) {
		printf("  an update failed with %d and wants no abort\n", r);
	}
}

static void work_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev)
{
	struct tsp_thin_lookup_result lookup;
	struct tsp_thin_device *td;
	tsp_block_t b, e, p, data;
	bool shared;
	int r;

	if (tsp_pool_open_thin_device(pmd, dev, &td))
		return;
	any_result(tsp_thin_find_block(td, 0, &lookup));
	any_result(tsp_thin_find_block(td, 5001, &lookup));
	any_result(tsp_thin_find_mapped_range(td, 0, 3000, &b, &e, &p, &shared));
	any_result(tsp_thin_get_mapped_count(td, &b));
	any_result(tsp_thin_get_highest_mapped_block(td, &b));
	r = tsp_pool_alloc_data_block(pmd, &data);
	if (!r)
		r = tsp_thin_insert_block(td, 200000 + dev, data);
	work_step(pmd, r);
	r = tsp_pool_alloc_data_block(pmd, &data);
	if (!r)
		r = tsp_thin_insert_block(td, 3, data);	/* often a remap */
	work_step(pmd, r);
	work_step(pmd, tsp_thin_remove_block(td, 6));
	work_step(pmd, tsp_thin_remove_range(td, 10, 40));
	tsp_pool_close_thin_device(td);
}

static void workload(struct tsp_pool_metadata *pmd)
{
	tsp_thin_id ids[MAX_WORK_DEVS + 1] = { 0 };
	tsp_block_t held;
	u64 i;

	any_result(tsp_pool_walk_devices(pmd, collect_dev, ids));
	for (i = 1; i <= ids[0]; i++)
		work_device(pmd, ids[i]);
	if (ids[0]) {
		work_step(pmd, tsp_pool_create_snap(pmd, 100, ids[1]));
		work_step(pmd, tsp_pool_delete_thin_device(pmd, ids[ids[0]]));
	}
	if (!tsp_pool_get_metadata_snap(pmd, &held) && held)
		work_step(pmd, tsp_pool_release_metadata_snap(pmd));
	work_step(pmd, tsp_pool_commit_metadata(pmd));
	work_step(pmd, tsp_pool_reserve_metadata_snap(pmd));
	work_step(pmd, tsp_pool_create_thin(pmd, 101));
	work_step(pmd, tsp_pool_commit_metadata(pmd));
}

static void open_case(void *argp, void *resp)
{
	const struct open_arg *a = argp;
	struct open_res *res = resp;
	struct live_counts live = live_now();
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;

	memset(res, 0, sizeof(*res));
	bdev = tsp_bdev_open(a->path, false);
	if (!bdev) {
		res->bdev_errno = errno;
		res->leaked = !live_same(live, live_now());
		return;
	}
	res->open_r = tsp_pool_metadata_open(bdev, a->data_block_size,
					     a->nr_data, a->format, &pmd);
	if (!res->open_r) {
		res->check_r = tsp_pool_check(pmd);
		if (a->workload)
			workload(pmd);
		res->close_r = tsp_pool_metadata_close(pmd);
	}
	tsp_bdev_close(bdev);
	res->leaked = !live_same(live, live_now());
}

/*
 * Open and check @a in a child.  Returns true if the child ran to the
 * end without leaking; reports a failure otherwise.
 */
static bool run_open(const char *what, const struct open_arg *a,
		     struct open_res *res, unsigned int timeout)
{
	char how[128];
	int r;

	nr_cases++;
	r = run_child(open_case, (void *)a, res, sizeof(*res), timeout,
		      log_path, how, sizeof(how));
	if (r) {
		fail("%s: the case %s", what, how);
		show_log_tail(log_path, 12);
		return false;
	}
	if (res->leaked) {
		fail("%s: allocations leaked", what);
		show_log_tail(log_path, 12);
		return false;
	}
	return true;
}

static bool accepted(const struct open_res *res)
{
	return !res->bdev_errno && !res->open_r && !res->check_r;
}

enum expect {
	MUST_REFUSE,		/* open or tsp_pool_check must fail */
	REFUSE_OR_VALID,	/* or both we and thin_check accept it */
};

/*
 * Judge a case on the image in work_path: see enum expect.  With
 * TSP_VERBOSE, @strict_info also asks thin_check about images we refuse,
 * to list where we are stricter than thin_check (information only, and
 * slow: one thin_check each).
 */
static void judge(const char *what, const struct open_res *res,
		  enum expect e, bool strict_info)
{
	if (!accepted(res)) {
		nr_refused++;
		if (res->close_r)
			fail("%s: closing after a successful open failed: %d",
			     what, res->close_r);
		if (strict_info && verbose && !thin_check(work_path, NULL)) {
			nr_stricter++;
			printf("  info: refused (%d, %d) but thin_check accepts: %s\n",
			       res->open_r, res->check_r, what);
			show_log_tail(log_path, 3);
		}
		return;
	}
	nr_accepted++;
	if (verbose)
		printf("  info: accepted: %s\n", what);
	if (res->close_r)
		fail("%s: close failed: %d", what, res->close_r);
	if (e == MUST_REFUSE) {
		fail("%s: accepted", what);
		return;
	}
	if (thin_check(work_path, tool_log)) {
		fail("%s: accepted by tsp_pool_check() but not by thin_check", what);
		show_log_tail(tool_log, 6);
	}
}

/* A damaged version of the pristine image: up to a few changed blocks. */
#define MAX_PATCHES 8

struct damage {
	unsigned int n;
	u64 block[MAX_PATCHES];
	u8 data[MAX_PATCHES][MD_BLOCK];
};

/* Start from the pristine contents of @b; returns the copy to change. */
static u8 *damage_block(struct damage *d, u64 b)
{
	unsigned int i;

	for (i = 0; i < d->n; i++)
		if (d->block[i] == b)
			return d->data[i];
	if (d->n == MAX_PATCHES)
		abort();
	d->block[d->n] = b;
	memcpy(d->data[d->n], pristine + b * MD_BLOCK, MD_BLOCK);
	return d->data[d->n++];
}

static void damage_init(struct damage *d)
{
	d->n = 0;
}

/* Make the work image pristine + @d. */
static int apply_damage(const struct damage *d)
{
	unsigned int i;
	int r = 0;

	for (i = 0; !r && i < d->n; i++)
		r = patch_file(work_path, d->block[i] * MD_BLOCK, d->data[i],
			       MD_BLOCK);
	return r;
}

/* Check the work image is still pristine + @d, then make it pristine. */
static u8 *readback;
static size_t readback_cap;

static void undo_damage(const char *what, const struct damage *d)
{
	ssize_t len = reread_file(work_path, &readback, &readback_cap);
	u8 *now = readback;
	unsigned int i;
	u64 b;

	if (len != (ssize_t)pristine_len) {
		fail("%s: cannot read the image back", what);
		write_file(work_path, pristine, pristine_len);
		return;
	}
	for (i = 0; i < d->n; i++) {
		if (memcmp(now + d->block[i] * MD_BLOCK, d->data[i], MD_BLOCK))
			fail("%s: block %llu was written by open/check/close",
			     what, (unsigned long long)d->block[i]);
		memcpy(now + d->block[i] * MD_BLOCK,
		       pristine + d->block[i] * MD_BLOCK, MD_BLOCK);
	}
	if (memcmp(now, pristine, pristine_len)) {
		for (b = 0; b < pristine_len / MD_BLOCK; b++)
			if (memcmp(now + b * MD_BLOCK, pristine + b * MD_BLOCK,
				   MD_BLOCK))
				break;
		fail("%s: open/check/close wrote to block %llu", what,
		     (unsigned long long)b);
		write_file(work_path, pristine, pristine_len);
	} else {
		for (i = 0; i < d->n; i++)
			patch_file(work_path, d->block[i] * MD_BLOCK,
				   pristine + d->block[i] * MD_BLOCK, MD_BLOCK);
	}
}

static unsigned long nr_workloads;

/*
 * Run a case on the pristine image with @d applied; if it opens, also
 * run the workload on it (in a second child: it writes to the image).
 */
static void try_damage(const char *what, const struct damage *d, enum expect e,
		       bool strict_info, unsigned int timeout)
{
	struct open_arg a = { .path = work_path };
	struct open_res res;
	char what2[256];
	bool opened;

	if (apply_damage(d)) {
		fail("%s: cannot write the image", what);
		return;
	}
	opened = false;
	if (run_open(what, &a, &res, timeout)) {
		judge(what, &res, e, strict_info);
		opened = !res.bdev_errno && !res.open_r;
	}
	undo_damage(what, d);
	if (!opened || apply_damage(d))
		return;

	snprintf(what2, sizeof(what2), "%s, then used", what);
	a.workload = true;
	nr_workloads++;
	run_open(what2, &a, &res, timeout);
	write_file(work_path, pristine, pristine_len);
}

/* ------------------------------------------------------------------ */
/* Helpers to damage blocks                                            */
/* ------------------------------------------------------------------ */

static u32 salt_of(enum blk_kind k)
{
	switch (k) {
	case BK_SUPERBLOCK:
	case BK_SNAP_SUPERBLOCK:
		return SALT_SUPERBLOCK;
	case BK_META_INDEX:
		return SALT_INDEX;
	case BK_META_BITMAP:
	case BK_DATA_BITMAP:
		return SALT_BITMAP;
	default:
		return SALT_NODE;
	}
}

/* Make block copy @p valid at @b as a block of kind @k (location, csum). */
static void seal_as(u8 *p, u64 b, enum blk_kind k)
{
	put_le64(p, 8, b);
	reseal(p, salt_of(k));
}

static const char *kind_name(u64 b)
{
	static char buf[96];
	const struct img_block *ib = &map.b[b];

	if (ib->kind != BK_NODE)
		return blk_kind_names[ib->kind];
	snprintf(buf, sizeof(buf), "%s %s", tree_kind_names[ib->tree],
		 ib->leaf ? "leaf" : "internal node");
	return buf;
}

/* A random in-use block other than @not of kind @k (any if @same false). */
static u64 pick_block(u64 not, bool same, enum blk_kind k, enum tree_kind t)
{
	u64 i, start = rng() % nr_in_use, b;

	for (i = 0; i < nr_in_use; i++) {
		b = in_use[(start + i) % nr_in_use];
		if (b == not)
			continue;
		if (same && map.b[b].kind == k &&
		    (k != BK_NODE || map.b[b].tree == t))
			return b;
		if (!same && map.b[b].kind != k)
			return b;
	}
	/* No other block of that tree: any node will do. */
	for (i = 0; i < nr_in_use; i++) {
		b = in_use[(start + i) % nr_in_use];
		if (b != not && map.b[b].kind == k)
			return b;
	}
	return not;
}

/*
 * The first node of @tree, leaf or internal, with at least @min_entries,
 * reachable from the superblock (@from 1) or only from the held copy
 * (@from 2); ~0 if none.
 */
static u64 find_node_from(enum tree_kind tree, bool leaf, u32 min_entries,
			  u8 from)
{
	u64 i, b;

	for (i = 0; i < nr_in_use; i++) {
		b = in_use[i];
		if (map.b[b].kind == BK_NODE && map.b[b].tree == tree &&
		    map.b[b].from == from &&
		    map.b[b].leaf == leaf &&
		    node_nr(pristine + b * MD_BLOCK) >= min_entries)
			return b;
	}
	return ~0ull;
}

static u64 find_node(enum tree_kind tree, bool leaf, u32 min_entries)
{
	u64 b = find_node_from(tree, leaf, min_entries, 1);

	return b != ~0ull ? b : find_node_from(tree, leaf, min_entries, 3);
}

static u64 find_kind(enum blk_kind k)
{
	u64 i;

	for (i = 0; i < nr_in_use; i++)
		if (map.b[in_use[i]].kind == k)
			return in_use[i];
	return ~0ull;
}

/* A block nobody uses (for crafted nodes), the @n-th from the end. */
static u64 free_block(unsigned int n)
{
	u64 b;

	for (b = map.sm_nr_blocks; b-- > 1;)
		if (!map.b[b].refs && !n--)
			return b;
	abort();
}

/* ------------------------------------------------------------------ */
/* Every block in use                                                  */
/* ------------------------------------------------------------------ */

/*
 * A random byte offset in the part of block @b that means something
 * (header fields, keys and values in use, counts of existing blocks,
 * index entries in use), never its checksum or location.
 */
static unsigned int used_offset(u64 b)
{
	const u8 *p = pristine + b * MD_BLOCK;
	unsigned int nr, len, off;
	u64 entries;

	switch (map.b[b].kind) {
	case BK_NODE:
		/* nr_entries, max_entries, value_size; keys; values. */
		nr = node_nr(p);
		len = 12 + 8 * nr + nr * node_vsize(p);
		off = rng() % len;
		if (off < 12)
			return NODE_NR_ENTRIES + off;
		off -= 12;
		if (off < 8 * nr)
			return NODE_KEYS + off;
		return node_value_off(p, 0) + off - 8 * nr;
	case BK_META_INDEX:
		len = 16 * ((map.sm_nr_blocks + BITMAP_ENTRIES - 1) /
			    BITMAP_ENTRIES);
		return INDEX_ENTRIES_OFF + rng() % len;
	case BK_META_BITMAP:
	case BK_DATA_BITMAP:
		entries = map.b[b].kind == BK_META_BITMAP ? map.sm_nr_blocks :
			  map.data_nr_blocks;
		if (entries > BITMAP_ENTRIES)
			entries = BITMAP_ENTRIES;	/* near enough */
		return 16 + rng() % ((entries + 3) / 4);
	default:
		/* Superblock fields after the location, up to the flags. */
		return 16 + rng() % (SB_INCOMPAT + 4 - 16);
	}
}

static void test_every_block(bool resealed)
{
	int f0 = failures;
	unsigned long c0 = nr_cases, a0 = nr_accepted, s0 = nr_stricter;
	struct damage *d = malloc(sizeof(*d));
	char what[192];
	u64 i, b, other;
	unsigned int j, bit;
	u8 *p;

	for (i = 0; i < nr_in_use; i++) {
		b = in_use[i];

		/*
		 * Random bit flips: raw, one anywhere; resealed, three
		 * anywhere but the checksum and location (they may hit
		 * bytes nobody reads) and three in the bytes in use.
		 */
		for (j = 0; j < (resealed ? 6 : 1); j++) {
			damage_init(d);
			p = damage_block(d, b);
			if (j >= 3) {
				bit = used_offset(b) * 8 + rng() % 8;
			} else {
				do {
					bit = rng() % (MD_BLOCK * 8);
				} while (resealed && (bit / 8 < 4 ||
						      (bit / 8 >= 8 && bit / 8 < 16)));
			}
			p[bit / 8] ^= 1 << (bit % 8);
			if (resealed)
				reseal(p, salt_of(map.b[b].kind));
			snprintf(what, sizeof(what), "%s %llu (%s): bit %u flipped%s",
				 resealed ? "resealed" : "raw",
				 (unsigned long long)b, kind_name(b), bit,
				 resealed ? ", resealed" : "");
			try_damage(what, d, resealed ? REFUSE_OR_VALID : MUST_REFUSE,
				   resealed && j < 3, CASE_TIMEOUT);
		}

		if (!resealed) {
			damage_init(d);
			memset(damage_block(d, b), 0, MD_BLOCK);
			snprintf(what, sizeof(what), "block %llu (%s) zeroed",
				 (unsigned long long)b, kind_name(b));
			try_damage(what, d, MUST_REFUSE, false, CASE_TIMEOUT);
		}

		/* Swapped with a block of the same kind, then of another. */
		for (j = 0; j < 2; j++) {
			other = pick_block(b, !j, map.b[b].kind, map.b[b].tree);
			if (other == b)
				continue;
			damage_init(d);
			memcpy(damage_block(d, b), pristine + other * MD_BLOCK,
			       MD_BLOCK);
			memcpy(damage_block(d, other), pristine + b * MD_BLOCK,
			       MD_BLOCK);
			if (resealed) {
				seal_as(damage_block(d, b), b, map.b[b].kind);
				seal_as(damage_block(d, other), other,
					map.b[other].kind);
			}
			snprintf(what, sizeof(what),
				 "%s swap of %llu (%s) with %llu (%s)",
				 resealed ? "resealed" : "raw",
				 (unsigned long long)b, kind_name(b),
				 (unsigned long long)other,
				 j ? "another kind" : "the same kind");
			/*
			 * Resealed same-kind swaps can be valid metadata
			 * (two leaves whose keys and counts fit either way).
			 */
			try_damage(what, d, resealed && !j ? REFUSE_OR_VALID :
				   MUST_REFUSE, false, CASE_TIMEOUT);
		}
	}
	free(d);
	if (resealed && verbose)
		printf("  info: %lu refused although thin_check accepts them\n",
		       nr_stricter - s0);
	if (resealed)
		report(f0, "corrupt: every block in use, resealed: 3 random bit flips "
		       "anywhere, 3 in the bytes in use, swaps with same and "
		       "other kinds (%lu cases, %lu valid and accepted by "
		       "thin_check too)", nr_cases - c0, nr_accepted - a0);
	else
		report(f0, "corrupt: every block in use (%llu): random bit flip, zeroed, "
		       "swaps with same and other kinds (%lu cases)",
		       (unsigned long long)nr_in_use, nr_cases - c0);
}

/* ------------------------------------------------------------------ */
/* Targeted structural damage, resealed                                */
/* ------------------------------------------------------------------ */

/* One node-header or node-content change on node @b, resealed. */
enum node_damage {
	ND_TOO_MANY,		/* nr_entries = max_entries + 1 */
	ND_MAX_NOT_3,		/* max_entries not a multiple of 3 */
	ND_MAX_TOO_BIG,		/* max_entries beyond the block */
	ND_FLAGS_0,
	ND_FLAGS_3,
	ND_VALUE_SIZE,		/* value_size doubled (max_entries kept) */
	ND_VALUE_SIZE_SHRUNK,	/* value_size 4 or 16 with a fitting max */
	ND_KEYS_SWAPPED,	/* two keys out of order */
	ND_KEY_DUPLICATED,
	ND_CHILD_SELF,		/* internal: a child is the node itself */
	ND_CHILD_ROOT,		/* internal: a child is an ancestor (the root) */
	ND_CHILD_BEYOND,	/* internal: a child beyond the device */
	ND_CHILD_HUGE,		/* internal: a child at 2^63 */
	ND_CHILD_BITMAP,	/* internal: a child is a bitmap */
	ND_CHILD_SUPERBLOCK,	/* internal: a child is block 0 */
	ND_CHILD_SIBLING,	/* internal: two entries, same child */
	ND_EMPTY,		/* nr_entries 0 */
	ND_UNDERFULL,		/* fewer than a third of max_entries */
	NR_NODE_DAMAGE,
};

static const char *const node_damage_names[NR_NODE_DAMAGE] = {
	"nr_entries > max_entries", "max_entries not a multiple of 3",
	"max_entries beyond the block", "flags 0", "flags 3",
	"value_size doubled", "value_size changed to fit",
	"keys out of order", "a duplicated key", "child pointer to itself",
	"child pointer to the root (cycle)", "child pointer beyond the device",
	"child pointer 2^63", "child pointer to a bitmap",
	"child pointer to the superblock", "two entries, same child",
	"no entries", "fewer than a third full",
};

/* Does damage @nd apply to node @b (and must it be refused)? */
static bool node_damage_applies(u64 b, enum node_damage nd)
{
	const u8 *n = pristine + b * MD_BLOCK;
	bool leaf = map.b[b].leaf;
	u32 nr = node_nr(n);

	switch (nd) {
	case ND_KEYS_SWAPPED:
	case ND_KEY_DUPLICATED:
	case ND_CHILD_SIBLING:
		return nr >= 2 && (nd != ND_CHILD_SIBLING || !leaf);
	case ND_CHILD_SELF:
	case ND_CHILD_ROOT:
	case ND_CHILD_BEYOND:
	case ND_CHILD_HUGE:
	case ND_CHILD_BITMAP:
	case ND_CHILD_SUPERBLOCK:
		return !leaf && nr;
	case ND_EMPTY:
		/* An empty leaf is a valid (empty) tree at the root. */
		return nr && (!leaf || map.b[b].depth);
	case ND_UNDERFULL:
		return map.b[b].depth && nr > 1;
	default:
		return true;
	}
}

static void apply_node_damage(u8 *n, u64 b, enum node_damage nd, u64 root)
{
	u32 nr = node_nr(n), max = node_max(n), vs = node_vsize(n);
	u64 k;

	switch (nd) {
	case ND_TOO_MANY:
		put_le32(n, NODE_NR_ENTRIES, max + 1);
		break;
	case ND_MAX_NOT_3:
		put_le32(n, NODE_MAX_ENTRIES, max - 1);
		break;
	case ND_MAX_TOO_BIG:
		put_le32(n, NODE_MAX_ENTRIES, max * 4 + 3);
		break;
	case ND_FLAGS_0:
		put_le32(n, NODE_FLAGS, 0);
		break;
	case ND_FLAGS_3:
		put_le32(n, NODE_FLAGS, 3);
		break;
	case ND_VALUE_SIZE:
		put_le32(n, NODE_VALUE_SIZE, vs * 2);
		break;
	case ND_VALUE_SIZE_SHRUNK:
		vs = vs == 4 ? 16 : 4;
		put_le32(n, NODE_VALUE_SIZE, vs);
		put_le32(n, NODE_MAX_ENTRIES, ((MD_BLOCK - 32) / (8 + vs)) / 3 * 3);
		break;
	case ND_KEYS_SWAPPED:
		k = node_key(n, 0);
		put_le64(n, NODE_KEYS, node_key(n, 1));
		put_le64(n, NODE_KEYS + 8, k);
		break;
	case ND_KEY_DUPLICATED:
		put_le64(n, NODE_KEYS + 8 * (nr - 1), node_key(n, nr - 2));
		break;
	case ND_CHILD_SELF:
		put_le64(n, node_value_off(n, nr - 1), b);
		break;
	case ND_CHILD_ROOT:
		put_le64(n, node_value_off(n, nr - 1), root);
		break;
	case ND_CHILD_BEYOND:
		put_le64(n, node_value_off(n, nr - 1), META_BLOCKS + 5);
		break;
	case ND_CHILD_HUGE:
		put_le64(n, node_value_off(n, nr - 1), 1ull << 63);
		break;
	case ND_CHILD_BITMAP:
		put_le64(n, node_value_off(n, nr - 1), find_kind(BK_DATA_BITMAP));
		break;
	case ND_CHILD_SUPERBLOCK:
		put_le64(n, node_value_off(n, nr - 1), 0);
		break;
	case ND_CHILD_SIBLING:
		put_le64(n, node_value_off(n, 1), get_le64(n, node_value_off(n, 0)));
		break;
	case ND_EMPTY:
		put_le32(n, NODE_NR_ENTRIES, 0);
		break;
	case ND_UNDERFULL:
		put_le32(n, NODE_NR_ENTRIES, max / 3 - 1 < nr ? max / 3 - 1 : 1);
		break;
	default:
		break;
	}
	reseal(n, SALT_NODE);
}

/* The root of the tree holding node @b (the node with depth 0 above it). */
static u64 root_of(u64 b)
{
	u64 i, c;

	for (i = 0; map.b[b].depth && i < nr_in_use; i++) {
		c = in_use[i];
		if (map.b[c].kind != BK_NODE || map.b[c].leaf ||
		    map.b[c].tree != map.b[b].tree ||
		    map.b[c].depth != map.b[b].depth - 1)
			continue;
		for (u32 j = 0; j < node_nr(pristine + c * MD_BLOCK); j++)
			if (get_le64(pristine + c * MD_BLOCK,
				     node_value_off(pristine + c * MD_BLOCK, j)) == b)
				return root_of(c);
	}
	return b;
}

static void test_node_damage(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;
	struct damage *d = malloc(sizeof(*d));
	char what[192];
	enum tree_kind t;
	enum node_damage nd;
	unsigned int leaf;
	u64 b;

	for (t = TK_TOP; t < NR_TREE_KINDS; t++) {
		for (leaf = 0; leaf < 2; leaf++) {
			b = find_node(t, leaf, 2);
			if (b == ~0ull)
				b = find_node(t, leaf, 0);
			if (b == ~0ull)
				continue;
			for (nd = 0; nd < NR_NODE_DAMAGE; nd++) {
				if (!node_damage_applies(b, nd))
					continue;
				damage_init(d);
				apply_node_damage(damage_block(d, b), b, nd,
						  root_of(b));
				snprintf(what, sizeof(what), "%s %llu: %s",
					 kind_name(b), (unsigned long long)b,
					 node_damage_names[nd]);
				try_damage(what, d, MUST_REFUSE, false,
					   CASE_TIMEOUT);
			}
		}
	}
	free(d);
	report(f0, "corrupt: btree nodes of every tree, resealed: entry counts, "
	       "sizes, flags, key order, cycles, bad child pointers (%lu cases)",
	       nr_cases - c0);
}

/*
 * A node reached through several parents (shared by snapshots, or with
 * the held copy) must fit the key range of each of them, not only of the
 * first one a checker happens to come through: otherwise lookups through
 * the other parents miss its keys.  For a few shared nodes, and each of
 * their parents in turn, move the parent's key for it above its keys.
 */
static void test_shared_ranges(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;
	struct damage *d = malloc(sizeof(*d));
	unsigned int nr_children = 0;
	char what[192];
	u64 i, j, c, par;
	u32 e, nr;
	u8 *p;

	for (i = 0; i < nr_in_use && nr_children < 4; i++) {
		c = in_use[i];
		if (map.b[c].kind != BK_NODE || map.b[c].tree != TK_BOTTOM ||
		    map.b[c].refs < 2 || !map.b[c].depth)
			continue;
		nr_children++;
		for (j = 0; j < nr_in_use; j++) {
			par = in_use[j];
			if (map.b[par].kind != BK_NODE || map.b[par].leaf ||
			    map.b[par].tree != TK_BOTTOM)
				continue;
			p = pristine + par * MD_BLOCK;
			nr = node_nr(p);
			for (e = 0; e < nr; e++)
				if (get_le64(p, node_value_off(p, e)) == c)
					break;
			if (e == nr)
				continue;
			damage_init(d);
			p = damage_block(d, par);
			put_le64(p, NODE_KEYS + 8 * e, e + 1 < nr ?
				 node_key(p, e + 1) - 1 : node_key(p, e) + (1ull << 40));
			reseal(p, SALT_NODE);
			snprintf(what, sizeof(what),
				 "node %llu (%u references): parent %llu's key for it "
				 "above its keys", (unsigned long long)c,
				 map.b[c].refs, (unsigned long long)par);
			try_damage(what, d, MUST_REFUSE, false, CASE_TIMEOUT);
		}
	}
	CHECK(nr_children);
	free(d);
	report(f0, "corrupt: shared nodes out of the key range of one of their "
	       "parents, resealed (%lu cases)", nr_cases - c0);
}

/* Add @delta to nr_free of entry @entry of data space map index node @b. */
static void nr_free_add(struct damage *d, u64 b, unsigned int entry, int delta,
			const char *what, enum expect e)
{
	u8 *p;

	damage_init(d);
	p = damage_block(d, b);
	put_le32(p, node_value_off(p, entry) + 8,
		 get_le32(p, node_value_off(p, entry) + 8) + delta);
	reseal(p, SALT_NODE);
	try_damage(what, d, e, false, CASE_TIMEOUT);
}

/* Value damage in leaves: mappings, details, index entries. */
static void test_value_damage(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;
	struct damage *d = malloc(sizeof(*d));
	u64 b, v, other;
	u8 *p;

	/* A mapping to a data block beyond the pool. */
	b = find_node(TK_BOTTOM, true, 1);
	damage_init(d);
	p = damage_block(d, b);
	v = get_le64(p, node_value_off(p, 0));
	put_le64(p, node_value_off(p, 0), ((u64)NR_DATA << 24) | (v & 0xffffff));
	reseal(p, SALT_NODE);
	try_damage("mapping to data block nr_data", d, MUST_REFUSE, false,
		   CASE_TIMEOUT);

	damage_init(d);
	p = damage_block(d, b);
	put_le64(p, node_value_off(p, 0), ~0ull);
	reseal(p, SALT_NODE);
	try_damage("mapping to data block 2^40 - 1", d, MUST_REFUSE, false,
		   CASE_TIMEOUT);

	/* A mapping moved to another (free) data block: counts differ. */
	damage_init(d);
	p = damage_block(d, b);
	v = get_le64(p, node_value_off(p, 0));
	put_le64(p, node_value_off(p, 0), ((u64)(NR_DATA - 2) << 24) | (v & 0xffffff));
	reseal(p, SALT_NODE);
	try_damage("mapping moved to a free data block", d, MUST_REFUSE, false,
		   CASE_TIMEOUT);

	/* Device details: mapped_blocks off by one, for each leaf entry. */
	b = find_node(TK_DETAILS, true, 1);
	damage_init(d);
	p = damage_block(d, b);
	put_le64(p, node_value_off(p, 0), get_le64(p, node_value_off(p, 0)) + 1);
	reseal(p, SALT_NODE);
	try_damage("device details: mapped_blocks + 1", d, MUST_REFUSE, false,
		   CASE_TIMEOUT);

	/* The same in the held copy's details (not checked by us alone). */
	b = find_node_from(TK_DETAILS, true, 1, 2);
	if (b != ~0ull) {
		damage_init(d);
		p = damage_block(d, b);
		put_le64(p, node_value_off(p, 0),
			 get_le64(p, node_value_off(p, 0)) + 1);
		reseal(p, SALT_NODE);
		try_damage("held copy's device details: mapped_blocks + 1", d,
			   REFUSE_OR_VALID, false, CASE_TIMEOUT);
	}

	/* A device in the details tree only: its top-level entry renamed. */
	b = find_node(TK_TOP, true, 1);
	damage_init(d);
	p = damage_block(d, b);
	put_le64(p, NODE_KEYS + 8 * (node_nr(p) - 1),
		 node_key(p, node_nr(p) - 1) + 1000);
	reseal(p, SALT_NODE);
	try_damage("top-level tree: a device id renamed", d, MUST_REFUSE, false,
		   CASE_TIMEOUT);

	/* Two devices sharing one mapping tree, its count unchanged. */
	damage_init(d);
	p = damage_block(d, b);
	put_le64(p, node_value_off(p, 1), get_le64(p, node_value_off(p, 0)));
	reseal(p, SALT_NODE);
	try_damage("top-level tree: two devices, one mapping tree", d,
		   MUST_REFUSE, false, CASE_TIMEOUT);

	/* A device's mapping tree root pointing at the details tree. */
	damage_init(d);
	p = damage_block(d, b);
	put_le64(p, node_value_off(p, 0), get_le64(pristine, SB_DETAILS_ROOT));
	reseal(p, SALT_NODE);
	try_damage("top-level tree: a device's root is the details tree", d,
		   MUST_REFUSE, false, CASE_TIMEOUT);

	/*
	 * Data space map index entries: bitmap 0 is whole, bitmap 1 the
	 * last.  nr_free may be low (dm-thin growing a pool restored by
	 * thin_restore leaves it so), never above the free entries of the
	 * bitmap block; our writer counts them all, as dm-thin does.
	 */
	b = find_node(TK_DATA_INDEX, true, 2);
	if (CHECK(b != ~0ull)) {
		nr_free_add(d, b, 0, -1, "data index entry: nr_free - 1",
			    REFUSE_OR_VALID);
		nr_free_add(d, b, 0, 1, "data index entry: nr_free + 1",
			    MUST_REFUSE);
		nr_free_add(d, b, 1, 1, "last data index entry: nr_free + 1",
			    MUST_REFUSE);
		nr_free_add(d, b, 1, -(BITMAP_ENTRIES - (NR_DATA - BITMAP_ENTRIES)),
			    "last data index entry: nr_free without the entries "
			    "past the end (thin_restore's count)", REFUSE_OR_VALID);

		damage_init(d);
		p = damage_block(d, b);
		put_le32(p, node_value_off(p, 0) + 12, BITMAP_ENTRIES);
		reseal(p, SALT_NODE);
		try_damage("data index entry: none_free_before past a free entry",
			   d, MUST_REFUSE, false, CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		put_le32(p, node_value_off(p, 0) + 12, BITMAP_ENTRIES + 1);
		reseal(p, SALT_NODE);
		try_damage("data index entry: none_free_before > entries", d,
			   MUST_REFUSE, false, CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		put_le32(p, node_value_off(p, 0) + 8, BITMAP_ENTRIES + 1);
		reseal(p, SALT_NODE);
		try_damage("data index entry: nr_free > entries", d, MUST_REFUSE,
			   false, CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		other = get_le64(p, node_value_off(p, 1));
		put_le64(p, node_value_off(p, 0), other);
		reseal(p, SALT_NODE);
		try_damage("data index: two entries, one bitmap", d, MUST_REFUSE,
			   false, CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		put_le64(p, node_value_off(p, 0), find_kind(BK_META_BITMAP));
		reseal(p, SALT_NODE);
		try_damage("data index: entry points at the metadata bitmap", d,
			   MUST_REFUSE, false, CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		put_le64(p, NODE_KEYS + 8, 7);
		reseal(p, SALT_NODE);
		try_damage("data index: bitmap number beyond the map", d,
			   MUST_REFUSE, false, CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		put_le32(p, NODE_NR_ENTRIES, 1);
		reseal(p, SALT_NODE);
		try_damage("data index: the second bitmap missing", d,
			   MUST_REFUSE, false, CASE_TIMEOUT);
	}

	/* Metadata space map index entries. */
	b = find_kind(BK_META_INDEX);
	damage_init(d);
	p = damage_block(d, b);
	put_le64(p, INDEX_ENTRIES_OFF, find_kind(BK_DATA_BITMAP));
	seal_as(p, b, BK_META_INDEX);
	try_damage("metadata index: entry points at a data bitmap", d,
		   MUST_REFUSE, false, CASE_TIMEOUT);

	damage_init(d);
	p = damage_block(d, b);
	put_le64(p, INDEX_ENTRIES_OFF, META_BLOCKS + 1);
	seal_as(p, b, BK_META_INDEX);
	try_damage("metadata index: entry beyond the device", d, MUST_REFUSE,
		   false, CASE_TIMEOUT);

	/* Overflow entries: a count changed, an entry added. */
	b = find_node(TK_DATA_REF, true, 1);
	if (CHECK(b != ~0ull)) {
		damage_init(d);
		p = damage_block(d, b);
		put_le32(p, node_value_off(p, 0), get_le32(p, node_value_off(p, 0)) + 1);
		reseal(p, SALT_NODE);
		try_damage("data overflow: a count + 1", d, MUST_REFUSE, false,
			   CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		put_le32(p, node_value_off(p, 0), 2);
		reseal(p, SALT_NODE);
		try_damage("data overflow: a count of 2", d, MUST_REFUSE, false,
			   CASE_TIMEOUT);
	}
	b = find_node(TK_META_REF, true, 1);
	if (CHECK(b != ~0ull)) {
		damage_init(d);
		p = damage_block(d, b);
		put_le32(p, node_value_off(p, 0), get_le32(p, node_value_off(p, 0)) + 1);
		reseal(p, SALT_NODE);
		try_damage("metadata overflow: a count + 1", d, MUST_REFUSE, false,
			   CASE_TIMEOUT);

		damage_init(d);
		p = damage_block(d, b);
		put_le64(p, NODE_KEYS, META_BLOCKS * 2);
		reseal(p, SALT_NODE);
		try_damage("metadata overflow: entry for a block beyond the map", d,
			   MUST_REFUSE, false, CASE_TIMEOUT);
	}
	free(d);
	report(f0, "corrupt: values, resealed: mappings, device details, top-level "
	       "entries, index entries, overflow counts (%lu cases)",
	       nr_cases - c0);
}

/* Bitmap counts changed, resealed: reference counts no longer match. */
static void test_bitmap_counts(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;
	struct damage *d = malloc(sizeof(*d));
	static const struct {
		bool meta;
		unsigned int from, to;
	} cases[] = {
		{ false, 1, 2 }, { false, 1, 0 }, { false, 0, 1 }, { false, 2, 1 },
		{ false, 3, 2 }, { false, 1, 3 }, { true, 1, 2 }, { true, 1, 0 },
		{ true, 0, 1 }, { true, 2, 1 }, { true, 3, 2 }, { true, 1, 3 },
	};
	char what[160];
	unsigned int i, j, n;
	u64 b, i2;
	u8 *p;

	for (i = 0; i < ARRAY_SIZE(cases); i++) {
		/* The first bitmap of that kind with an entry of count @from. */
		b = ~0ull;
		for (i2 = 0; i2 < nr_in_use && b == ~0ull; i2++) {
			u64 c = in_use[i2];

			if (map.b[c].kind != (cases[i].meta ? BK_META_BITMAP :
					      BK_DATA_BITMAP))
				continue;
			n = cases[i].meta ? (unsigned int)map.sm_nr_blocks :
			    BITMAP_ENTRIES;
			for (j = 0; j < n && j < BITMAP_ENTRIES; j++) {
				if (bitmap_count(pristine + c * MD_BLOCK, j) ==
				    cases[i].from) {
					b = c;
					break;
				}
			}
		}
		if (b == ~0ull) {
			fail("no %s bitmap entry with count %u",
			     cases[i].meta ? "metadata" : "data", cases[i].from);
			continue;
		}
		damage_init(d);
		p = damage_block(d, b);
		bitmap_set_count(p, j, cases[i].to);
		seal_as(p, b, map.b[b].kind);
		snprintf(what, sizeof(what), "%s bitmap %llu: entry %u count %u -> %u",
			 cases[i].meta ? "metadata" : "data",
			 (unsigned long long)b, j, cases[i].from, cases[i].to);
		try_damage(what, d, MUST_REFUSE, false, CASE_TIMEOUT);
	}
	free(d);
	report(f0, "corrupt: space map bitmap counts changed, resealed (%lu cases)",
	       nr_cases - c0);
}

/* The superblock: roots pointing elsewhere, sizes, fields. */
static void test_superblock(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;
	struct damage *d = malloc(sizeof(*d));
	u64 top = get_le64(pristine, SB_MAPPING_ROOT);
	u64 details = get_le64(pristine, SB_DETAILS_ROOT);
	u64 dindex = get_le64(pristine, SB_DATA_SM_ROOT + SMR_BITMAP_ROOT);
	u64 dref = get_le64(pristine, SB_DATA_SM_ROOT + SMR_REF_COUNT_ROOT);
	u64 mindex = get_le64(pristine, SB_META_SM_ROOT + SMR_BITMAP_ROOT);
	u64 mref = get_le64(pristine, SB_META_SM_ROOT + SMR_REF_COUNT_ROOT);
	u64 held = get_le64(pristine, SB_HELD_ROOT);
	u64 leaf = find_node(TK_BOTTOM, true, 1);
	u64 dbitmap = find_kind(BK_DATA_BITMAP);
	const struct {
		const char *what;
		unsigned int off, size;
		u64 value;
		enum expect e;
	} cases[] = {
#define BAD(w, off, size, v) { w, off, size, v, MUST_REFUSE }
#define ANY(w, off, size, v) { w, off, size, v, REFUSE_OR_VALID }
#define DSM(f) (SB_DATA_SM_ROOT + (f))
#define MSM(f) (SB_META_SM_ROOT + (f))
		BAD("mapping root -> details root", SB_MAPPING_ROOT, 8, details),
		BAD("mapping root -> a bottom-level leaf", SB_MAPPING_ROOT, 8, leaf),
		BAD("mapping root -> a data bitmap", SB_MAPPING_ROOT, 8, dbitmap),
		BAD("mapping root -> the metadata index", SB_MAPPING_ROOT, 8, mindex),
		BAD("mapping root -> block 0", SB_MAPPING_ROOT, 8, 0),
		BAD("mapping root -> beyond the device", SB_MAPPING_ROOT, 8,
		    META_BLOCKS),
		BAD("mapping root -> 2^64 - 1", SB_MAPPING_ROOT, 8, ~0ull),
		BAD("details root -> mapping root", SB_DETAILS_ROOT, 8, top),
		BAD("details root -> data index root", SB_DETAILS_ROOT, 8, dindex),
		BAD("data index root -> data overflow root",
		    DSM(SMR_BITMAP_ROOT), 8, dref),
		BAD("data index root -> details root", DSM(SMR_BITMAP_ROOT), 8,
		    details),
		BAD("data overflow root -> metadata overflow root",
		    DSM(SMR_REF_COUNT_ROOT), 8, mref),
		BAD("data overflow root -> a free block", DSM(SMR_REF_COUNT_ROOT),
		    8, META_BLOCKS - 1),
		BAD("metadata index -> a btree node", MSM(SMR_BITMAP_ROOT), 8, top),
		BAD("metadata index -> a data bitmap", MSM(SMR_BITMAP_ROOT), 8,
		    dbitmap),
		BAD("metadata overflow root -> data overflow root",
		    MSM(SMR_REF_COUNT_ROOT), 8, dref),
		BAD("metadata overflow root -> a bitmap", MSM(SMR_REF_COUNT_ROOT),
		    8, dbitmap),
		BAD("held root -> a btree node", SB_HELD_ROOT, 8, top),
		BAD("held root -> beyond the device", SB_HELD_ROOT, 8,
		    META_BLOCKS * 3),
		BAD("held root dropped (its trees' counts remain)", SB_HELD_ROOT,
		    8, 0),
		BAD("data nr_blocks 0", DSM(SMR_NR_BLOCKS), 8, 0),
		BAD("data nr_blocks below the mapped blocks", DSM(SMR_NR_BLOCKS),
		    8, 16320),
		BAD("data nr_blocks one bitmap more", DSM(SMR_NR_BLOCKS), 8,
		    NR_DATA + 16320),
		BAD("data nr_blocks 2^60", DSM(SMR_NR_BLOCKS), 8, 1ull << 60),
		BAD("data nr_allocated + 1", DSM(SMR_NR_ALLOCATED), 8,
		    get_le64(pristine, DSM(SMR_NR_ALLOCATED)) + 1),
		BAD("data nr_allocated > nr_blocks", DSM(SMR_NR_ALLOCATED), 8,
		    NR_DATA + 1),
		BAD("metadata nr_blocks 0", MSM(SMR_NR_BLOCKS), 8, 0),
		BAD("metadata nr_blocks beyond the device", MSM(SMR_NR_BLOCKS), 8,
		    META_BLOCKS + 1),
		BAD("metadata nr_blocks below the blocks in use",
		    MSM(SMR_NR_BLOCKS), 8, 20),
		BAD("metadata nr_blocks 2^40", MSM(SMR_NR_BLOCKS), 8, 1ull << 40),
		/* Fields nobody may refuse: any value is metadata. */
		ANY("time + 1", SB_TIME, 4, get_le32(pristine, SB_TIME) + 1),
		ANY("transaction id 2^64 - 1", SB_TRANS_ID, 8, ~0ull),
		ANY("needs_check flag", SB_FLAGS, 4, 1),
		ANY("uuid", SB_UUID, 8, 0x0123456789abcdefull),
#undef BAD
#undef ANY
#undef DSM
#undef MSM
	};

	unsigned int i;
	u8 *p;

	CHECK(held);
	for (i = 0; i < ARRAY_SIZE(cases); i++) {
		damage_init(d);
		p = damage_block(d, 0);
		if (cases[i].size == 8)
			put_le64(p, cases[i].off, cases[i].value);
		else
			put_le32(p, cases[i].off, (u32)cases[i].value);
		seal_as(p, 0, BK_SUPERBLOCK);
		try_damage(cases[i].what, d, cases[i].e, false, CASE_TIMEOUT);
	}

	/* The held copy's roots. */
	damage_init(d);
	p = damage_block(d, held);
	put_le64(p, SB_MAPPING_ROOT, details);
	seal_as(p, held, BK_SNAP_SUPERBLOCK);
	try_damage("held copy: mapping root -> details root", d, MUST_REFUSE,
		   false, CASE_TIMEOUT);

	damage_init(d);
	p = damage_block(d, held);
	put_le64(p, SB_DETAILS_ROOT, META_BLOCKS + 7);
	seal_as(p, held, BK_SNAP_SUPERBLOCK);
	try_damage("held copy: details root beyond the device", d, MUST_REFUSE,
		   false, CASE_TIMEOUT);

	damage_init(d);
	p = damage_block(d, held);
	put_le64(p, SB_MAPPING_ROOT, top);
	seal_as(p, held, BK_SNAP_SUPERBLOCK);
	try_damage("held copy: mapping root -> the current one", d, MUST_REFUSE,
		   false, CASE_TIMEOUT);

	free(d);
	report(f0, "corrupt: superblock roots pointing elsewhere, space map sizes, "
	       "held copy, resealed (%lu cases)", nr_cases - c0);
}

/* ------------------------------------------------------------------ */
/* DAG bombs                                                           */
/* ------------------------------------------------------------------ */

/*
 * Craft a chain of @levels internal nodes in free blocks, every entry of
 * each pointing at the next, ending in one leaf with @leaf_entries
 * entries of @leaf_vsize bytes holding @leaf_value.  Keys are laid out so
 * that every node's keys fit the range its parent gives it: node at level
 * i has keys j * 100^(levels - i), the leaf 0..n-1.  Returns the root.
 */
static u64 craft_bomb(struct damage *d, unsigned int levels, u32 fanout,
		      u32 leaf_vsize, u32 leaf_entries, u64 leaf_value)
{
	u64 blocks[8], step = 1;
	unsigned int i, j;
	u8 *p;

	for (i = 0; i <= levels; i++)
		blocks[i] = free_block(i);
	for (i = 0; i < levels; i++)
		step *= 100;
	for (i = 0; i <= levels; i++, step /= 100) {
		bool leaf = i == levels;
		u32 vs = leaf ? leaf_vsize : 8;

		p = damage_block(d, blocks[i]);
		memset(p, 0, MD_BLOCK);
		put_le32(p, NODE_FLAGS, leaf ? NODE_LEAF : NODE_INTERNAL);
		put_le32(p, NODE_MAX_ENTRIES, ((MD_BLOCK - 32) / (8 + vs)) / 3 * 3);
		put_le32(p, NODE_VALUE_SIZE, vs);
		put_le32(p, NODE_NR_ENTRIES, leaf ? leaf_entries : fanout);
		for (j = 0; j < (leaf ? leaf_entries : fanout); j++) {
			put_le64(p, NODE_KEYS + 8 * j, leaf ? j : j * step);
			if (leaf)
				memcpy(p + node_value_off(p, j), &leaf_value, vs);
			else
				put_le64(p, node_value_off(p, j), blocks[i + 1]);
		}
		seal_as(p, blocks[i], BK_NODE);
	}
	return blocks[0];
}

static void test_bombs(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;
	struct damage *d = malloc(sizeof(*d));
	u64 root, b, v;
	u8 *p;

	/*
	 * The metadata space map's overflow tree, read at open: 5 levels
	 * of 252 entries over an empty leaf (key order is not its concern).
	 */
	damage_init(d);
	root = craft_bomb(d, 4, 252, 4, 0, 0);
	p = damage_block(d, 0);
	put_le64(p, SB_META_SM_ROOT + SMR_REF_COUNT_ROOT, root);
	seal_as(p, 0, BK_SUPERBLOCK);
	try_damage("metadata overflow tree: 252^4 paths to one empty leaf", d,
		   MUST_REFUSE, false, BOMB_TIMEOUT);

	/* The data space map's index tree, also read at open. */
	damage_init(d);
	root = craft_bomb(d, 4, 252, 16, 0, 0);
	p = damage_block(d, 0);
	put_le64(p, SB_DATA_SM_ROOT + SMR_BITMAP_ROOT, root);
	seal_as(p, 0, BK_SUPERBLOCK);
	try_damage("data index tree: 252^4 paths to one empty leaf", d,
		   MUST_REFUSE, false, BOMB_TIMEOUT);

	/*
	 * A device's mapping tree, with keys in range and nodes a third
	 * full, so the structure check passes node by node: 84^5 paths to
	 * a leaf of 84 mappings.
	 */
	damage_init(d);
	v = htole64((u64)1 << 24);
	root = craft_bomb(d, 5, 84, 8, 84, v);
	b = find_node(TK_TOP, true, 1);
	p = damage_block(d, b);
	put_le64(p, node_value_off(p, 0), root);
	reseal(p, SALT_NODE);
	try_damage("mapping tree: 84^5 paths through nodes a third full", d,
		   MUST_REFUSE, false, BOMB_TIMEOUT);
	free(d);
	report(f0, "corrupt: DAG bombs (every entry of every node pointing at the "
	       "same child) refused in bounded time (%lu cases)", nr_cases - c0);
}

/* ------------------------------------------------------------------ */
/* Superblock fields, sizes, paths                                     */
/* ------------------------------------------------------------------ */

/* Open a copy of the pristine image with superblock field(s) changed. */
static void try_sb_field(const char *what, unsigned int off, unsigned int size,
			 u64 value, bool seal, int want)
{
	struct damage *d = malloc(sizeof(*d));
	struct open_arg a = { .path = work_path };
	struct open_res res;
	u8 *p;

	damage_init(d);
	p = damage_block(d, 0);
	if (size == 8)
		put_le64(p, off, value);
	else
		put_le32(p, off, (u32)value);
	if (seal)
		reseal(p, SALT_SUPERBLOCK);
	if (apply_damage(d)) {
		fail("%s: cannot write the image", what);
	} else if (run_open(what, &a, &res, CASE_TIMEOUT)) {
		if (accepted(&res))
			fail("%s: accepted", what);
		else if (want && res.open_r != want)
			fail("%s: open returned %d, expected %d", what,
			     res.open_r, want);
		else
			nr_refused++;
	}
	undo_damage(what, d);
	free(d);
}

static void test_superblock_fields(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;

	try_sb_field("magic + 1, checksum stale", SB_MAGIC, 8, 27022011, false,
		     -EILSEQ);
	try_sb_field("magic + 1, resealed", SB_MAGIC, 8, 27022011, true, -EILSEQ);
	try_sb_field("magic 0, resealed", SB_MAGIC, 8, 0, true, -EILSEQ);
	try_sb_field("checksum + 1", SB_CSUM, 4, get_le32(pristine, SB_CSUM) + 1,
		     false, -EILSEQ);
	try_sb_field("blocknr 1, resealed", SB_BLOCKNR, 8, 1, true, -EILSEQ);
	try_sb_field("version 0", SB_VERSION, 4, 0, true, -EILSEQ);
	try_sb_field("version 3", SB_VERSION, 4, 3, true, -EILSEQ);
	try_sb_field("version 2^32 - 1", SB_VERSION, 4, ~0u, true, -EILSEQ);
	try_sb_field("data_block_size 0", SB_DATA_BLOCK_SIZE, 4, 0, true, 0);
	try_sb_field("data_block_size 127", SB_DATA_BLOCK_SIZE, 4, 127, true, 0);
	try_sb_field("data_block_size 129", SB_DATA_BLOCK_SIZE, 4, 129, true, 0);
	try_sb_field("data_block_size 2^31", SB_DATA_BLOCK_SIZE, 4, 1u << 31,
		     true, 0);
	try_sb_field("data_block_size 2^32 - 1", SB_DATA_BLOCK_SIZE, 4, ~0u,
		     true, 0);
	try_sb_field("metadata_block_size 0", SB_META_BLOCK_SIZE, 4, 0, true, 0);
	try_sb_field("metadata_block_size 16", SB_META_BLOCK_SIZE, 4, 16, true, 0);
	try_sb_field("metadata_block_size 7", SB_META_BLOCK_SIZE, 4, 7, true, 0);
	try_sb_field("incompat flag 1", SB_INCOMPAT, 4, 1, true, 0);
	try_sb_field("incompat flags ~0", SB_INCOMPAT, 4, ~0u, true, 0);
	try_sb_field("compat_ro flag 1", SB_COMPAT_RO, 4, 1, true, -EINVAL);

	/* A data block size other than the one on disk, asked for by open. */
	{
		struct open_arg a = { .path = work_path, .data_block_size = 256 };
		struct open_res res;

		if (run_open("open asking for data block size 256", &a, &res,
			     CASE_TIMEOUT)) {
			if (accepted(&res) || res.open_r != -EINVAL)
				fail("open asking for another data block size: %d, "
				     "expected %d", res.open_r, -EINVAL);
		}
	}
	report(f0, "corrupt: superblock magic, checksum, location, version, block "
	       "sizes, incompat and compat_ro flags (%lu cases)", nr_cases - c0);
}

static void try_file(const char *what, const void *img, size_t len,
		     const struct open_arg *a, int want, bool any_error)
{
	struct open_res res;

	if (img && write_file(work_path, img, len)) {
		fail("%s: cannot write the image", what);
		return;
	}
	if (!run_open(what, a, &res, CASE_TIMEOUT))
		return;
	if (want == 0 && !any_error) {
		if (!accepted(&res))
			fail("%s: refused (%d, %d, %d)", what, res.bdev_errno,
			     res.open_r, res.check_r);
		return;
	}
	if (accepted(&res)) {
		fail("%s: accepted", what);
		return;
	}
	nr_refused++;
	if (!any_error && res.open_r != want && -res.bdev_errno != want)
		fail("%s: got %d (bdev errno %d), expected %d", what, res.open_r,
		     res.bdev_errno, want);
}

static void test_files(void)
{
	int f0 = failures;
	unsigned long c0 = nr_cases;
	struct open_arg a = { .path = work_path };
	struct open_arg fmt = { .path = work_path, .format = true,
				.data_block_size = 128, .nr_data = 1000 };
	struct open_arg missing = { .path = "/nonexistent/tsp-no-such-image" };
	u64 highest = in_use[nr_in_use - 1];
	const size_t cuts[] = {
		0, 512, MD_BLOCK - 1, MD_BLOCK, 2 * MD_BLOCK, 16 * MD_BLOCK,
		highest * MD_BLOCK, highest * MD_BLOCK + 100,
		(highest + 1) * MD_BLOCK - 1, pristine_len / 2,
		pristine_len - MD_BLOCK, pristine_len - 1,
	};
	char what[128];
	u8 *zero = calloc(1, 64 * MD_BLOCK);
	unsigned int i;

	/* Truncated: every cut below the last block in use must fail. */
	for (i = 0; i < ARRAY_SIZE(cuts); i++) {
		snprintf(what, sizeof(what), "image cut to %zu bytes", cuts[i]);
		try_file(what, pristine, cuts[i], &a, 0,
			 cuts[i] < (highest + 1) * MD_BLOCK ||
			 cuts[i] < map.sm_nr_blocks * MD_BLOCK);
	}

	/* Empty and tiny devices. */
	try_file("all-zero image, no format", zero, 64 * MD_BLOCK, &a, -ENODATA,
		 false);
	try_file("all-zero image, format", zero, 64 * MD_BLOCK, &fmt, 0, false);
	try_file("8 KiB device, format", zero, 2 * MD_BLOCK, &fmt, -ENOSPC, false);
	try_file("60 KiB device, format", zero, 15 * MD_BLOCK, &fmt, -ENOSPC,
		 false);
	try_file("empty file, format", zero, 0, &fmt, 0, true);
	try_file("empty file, no format", zero, 0, &a, 0, true);
	try_file("missing path", NULL, 0, &missing, -ENOENT, false);
	{
		struct open_arg bad = fmt;

		bad.data_block_size = 100;
		try_file("format with data block size 100", zero, 64 * MD_BLOCK,
			 &bad, -EINVAL, false);
		bad.data_block_size = 0;
		try_file("format with data block size 0", zero, 64 * MD_BLOCK,
			 &bad, -EINVAL, false);
	}
	free(zero);
	write_file(work_path, pristine, pristine_len);
	report(f0, "corrupt: truncated images, all-zero, tiny and missing devices "
	       "(%lu cases)", nr_cases - c0);
}

/* ------------------------------------------------------------------ */

static int setup(void)
{
	struct open_arg a = { .path = fixture_path };
	struct open_res res;
	int f0 = failures, r;
	u64 b;

	alarm(120);	/* building in-process must not hang either */
	r = build_fixture();
	alarm(0);
	if (r) {
		fail("building the fixture: %d", r);
		return r;
	}
	pristine = read_file(fixture_path, &pristine_len);
	if (!pristine || write_file(work_path, pristine, pristine_len))
		return -EIO;
	if (thin_check(fixture_path, tool_log)) {
		fail("thin_check rejects the fixture");
		show_log_tail(tool_log, 10);
	}
	if (run_open("the fixture", &a, &res, CASE_TIMEOUT) && !accepted(&res))
		fail("the fixture does not open and check: %d %d", res.open_r,
		     res.check_r);
	if (img_walk(pristine, pristine_len, &map))
		fail("walking the fixture: %s", map.why);

	in_use = calloc(map.nr_blocks, sizeof(*in_use));
	for (b = 0; in_use && b < map.nr_blocks; b++)
		if (map.b[b].refs)
			in_use[nr_in_use++] = b;

	/* What the fixture must hold for the cases to mean anything. */
	if (!CHECK(map.data_nr_blocks > BITMAP_ENTRIES) ||
	    !CHECK(map.nr_shared_data > 0) ||
	    !CHECK(tree_entries(TK_DATA_REF) > 0) ||
	    !CHECK(tree_entries(TK_META_REF) > 0) ||
	    !CHECK(tree_has_internal(TK_BOTTOM)) ||
	    !CHECK(get_le64(pristine, SB_HELD_ROOT)) ||
	    !CHECK(find_kind(BK_META_INDEX) != ~0ull))
		fail("the fixture lacks something the cases need");
	report(f0, "corrupt: fixture: %llu blocks in use of %u, %llu data blocks "
	       "with 3+ references, %llu/%llu overflow entries (data/metadata)",
	       (unsigned long long)nr_in_use, META_BLOCKS,
	       (unsigned long long)map.nr_shared_data,
	       (unsigned long long)tree_entries(TK_DATA_REF),
	       (unsigned long long)tree_entries(TK_META_REF));
	return failures == f0 ? 0 : -EINVAL;
}

int main(void)
{
	double t0 = now_seconds();
	const char *seed = getenv("TSP_SEED");
	u64 s = seed ? strtoull(seed, NULL, 0) : 20261130;

	setvbuf(stdout, NULL, _IOLBF, 0);
	last_report = t0;
	verbose = getenv("TSP_VERBOSE") && *getenv("TSP_VERBOSE") == '1';
	setenv("TSP_BUFIO_NOSYNC", "1", 1);
	setenv("TSP_QUIET", "1", 1);
	if (!have_tools()) {
		printf("SKIP: thin_check (thin-provisioning-tools) is not installed\n");
		return 77;
	}
	if (make_scratch("corrupt")) {
		perror("mkdtemp");
		return 1;
	}
	scratch_path(fixture_path, sizeof(fixture_path), "fixture.img");
	scratch_path(work_path, sizeof(work_path), "work.img");
	scratch_path(log_path, sizeof(log_path), "case.log");
	scratch_path(tool_log, sizeof(tool_log), "tool.log");
	rng_seed(s);
	printf("seed %llu (TSP_SEED)\n", (unsigned long long)s);

	if (!setup()) {
		test_superblock_fields();
		test_files();
		write_file(work_path, pristine, pristine_len);
		test_every_block(false);
		test_every_block(true);
		test_node_damage();
		test_shared_ranges();
		test_value_damage();
		test_bitmap_counts();
		test_superblock();
		test_bombs();
	}

	img_free(&map);
	free(in_use);
	free(pristine);
	free(readback);
	rm_scratch();
	printf("%s: %d failure%s; %lu cases (%lu of them using a pool that "
	       "opened), %lu refused, %lu accepted, %.1fs\n",
	       failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s",
	       nr_cases, nr_workloads, nr_refused, nr_accepted,
	       now_seconds() - t0);
	return failures ? 1 : 0;
}
