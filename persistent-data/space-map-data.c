// SPDX-License-Identifier: GPL-2.0-only
/*
 * space-map-data.c - reference counts of data blocks, kept on disk in
 * dm-thin's layout and updated through the transaction manager.
 *
 * Bitmap blocks are shadowed like any metadata block when a count
 * changes.  The index entries (where each bitmap is, how many entries
 * are free) are cached in memory, written to the index btree at commit.
 * Every block freed in this transaction is remembered in memory, and
 * allocation skips it until the commit: the committed metadata may still
 * map it (reusing it would let a crash expose new data through the old
 * mapping), or an IO still use it (the pool lets such IO finish before
 * it commits).  That covers every block the last commit had in use and
 * this transaction freed, and also one allocated and freed since.
 *
 * The caller may hold the blocks freed so far back from allocation past
 * the commit, until it releases them (tsp_data_sm_hold_freed()): the pool
 * discards them on the data device after the commit that frees them, and
 * none may be reused before the discard is done.  Held blocks come in two
 * generations, so that those of a discard in flight can be released
 * while later ones, waiting for it, stay held.
 *
 * An index entry's nr_free counts, as dm-thin's does, every free entry
 * of its bitmap block, also those past the end of the device: dm-thin
 * gives a new bitmap all its entries as free, and when it grows the
 * device it leaves the count of the last bitmap as it is.  Counting
 * only the entries within the device (as thin_restore does) would hide
 * blocks from dm-thin once it grows a pool of ours.
 *
 * So an entry read from disk may count fewer free entries than its
 * bitmap has: one written by thin_restore and then grown by dm-thin
 * does.  Taking one off such a count for every block that goes in use
 * would wrap it below zero, and the next open would refuse the map; and
 * a count of zero would hide the bitmap's free blocks from allocation.
 * Hence a bitmap's count is taken from the bitmap itself (recounted)
 * the first time the bitmap changes after the map is opened, and,
 * before allocation gives up, for every bitmap whose count says it is
 * full; from then on it is exact.  A count we wrote, or recounted, is
 * exact; one read from disk is trusted only as an allocation hint.
 *
 * The bitmap changed last stays write locked between changes (@locked),
 * so that allocating blocks one after another locks and shadows it once,
 * not once per block.  The map reads that bitmap from the block it keeps
 * rather than lock it again, and unlocks it (tsp_data_sm_unlock()) before
 * anything else may write or drop the blocks it locked: at commit, before
 * the metadata goes read only, at destroy.
 *
 * Locking: none; the caller serialises.  Readers that share the caller's
 * lock (tsp_data_sm_get_count()) may run together: they only read.
 */
#define DM_MSG_PREFIX "thin-scalable metadata"

#include "space-map.h"
#include "space-map-format.h"
#include "btree.h"

struct tsp_data_sm {
	struct tsp_tm *tm;
	struct tsp_btree_info index_info;	/* bitmap nr -> index entry */
	struct tsp_btree_info ref_info;		/* block -> count (>= 3) */
	tsp_block_t nr_blocks;
	tsp_block_t nr_allocated;
	tsp_block_t index_root;
	tsp_block_t ref_root;
	u64 nr_bitmaps;
	struct tsp_index_entry *index;
	u8 *dirty;				/* index entry changed */
	u64 **freed;	/* per bitmap, NULL or a bit per entry freed now */
	/*
	 * The same, for entries held past their commit: held[0] is released
	 * first; holds join held[1].
	 */
	u64 **held[2];
	u8 *counted;				/* nr_free known exact */
	/*
	 * Where allocation searches first: below it in its bitmap every
	 * block was in use or freed in this transaction when allocation
	 * passed it, and none of them can be allocated before the commit.
	 * Reset at commit.
	 */
	tsp_block_t alloc_cursor;
	/*
	 * Blocks [run_begin, run_end) could be allocated when allocation
	 * last searched a bitmap (see allocatable()): they are handed out in
	 * order without searching again.  Emptied at commit (so freed
	 * blocks get reused), and by any other change that uses one.
	 */
	tsp_block_t run_begin, run_end;
	/* Bitmap @locked_index, write locked since its last change; or NULL. */
	struct tsp_block *locked;
	u64 locked_index;
};

/* How far one search looks past the free block it finds. */
#define FREE_RUN_MAX 1024
#define FREED_WORDS DIV_ROUND_UP(TSP_ENTRIES_PER_BITMAP, 64)

static void forget_free_run(struct tsp_data_sm *sm)
{
	sm->run_begin = 0;
	sm->run_end = 0;
}

static u64 nr_bitmaps(tsp_block_t nr_blocks)
{
	return nr_blocks / TSP_ENTRIES_PER_BITMAP +
	       !!(nr_blocks % TSP_ENTRIES_PER_BITMAP);
}

/* Each bitmap takes a metadata block: more bitmaps than those cannot be. */
static bool too_many_blocks(struct tsp_tm *tm, tsp_block_t nr_blocks)
{
	return nr_bitmaps(nr_blocks) > tsp_bm_nr_blocks(tsp_tm_bm(tm));
}

static u32 bitmap_entries(tsp_block_t nr_blocks, u64 i)
{
	return (u32)min_t(tsp_block_t, TSP_ENTRIES_PER_BITMAP,
			  nr_blocks - i * TSP_ENTRIES_PER_BITMAP);
}

static struct tsp_data_sm *sm_alloc(struct tsp_tm *tm)
{
	struct tsp_data_sm *sm = kzalloc(sizeof(*sm), GFP_KERNEL);

	if (!sm)
		return NULL;
	sm->tm = tm;
	sm->index_info.tm = tm;
	sm->index_info.vt.size = sizeof(struct tsp_disk_index_entry);
	sm->ref_info.tm = tm;
	sm->ref_info.vt.size = sizeof(__le32);
	return sm;
}

/* The block the map keeps write locked, if it is bitmap @i; else NULL. */
static struct tsp_block *kept_bitmap(struct tsp_data_sm *sm, u64 i)
{
	return sm->locked_index == i ? sm->locked : NULL;
}

/*
 * Bitmap @i for reading: the block the map keeps locked if it is that
 * bitmap (read locking it would find it write locked), else read locked.
 * Release it with put_bitmap().
 */
static int get_bitmap(struct tsp_data_sm *sm, u64 i, struct tsp_block **blk)
{
	*blk = kept_bitmap(sm, i);
	if (*blk)
		return 0;
	return tsp_tm_read_lock(sm->tm, sm->index[i].blocknr,
				&tsp_bitmap_validator, blk);
}

static void put_bitmap(struct tsp_data_sm *sm, struct tsp_block *blk)
{
	if (blk != sm->locked)
		tsp_tm_unlock(sm->tm, blk);
}

/**
 * tsp_data_sm_unlock - unlock the bitmap the map keeps write locked
 * @sm: space map
 *
 * Before the blocks written in the transaction are flushed or may no
 * longer be written (read only); the next change locks it again.
 */
void tsp_data_sm_unlock(struct tsp_data_sm *sm)
{
	if (sm->locked) {
		tsp_tm_unlock(sm->tm, sm->locked);
		sm->locked = NULL;
	}
}

/* Set bitmap @i's nr_free to the free entries of its bitmap block @data. */
static void count_free_from(struct tsp_data_sm *sm, u64 i, void *data)
{
	u32 first_free, nr_free;

	nr_free = tsp_bitmap_count_free(data, TSP_ENTRIES_PER_BITMAP,
					&first_free);
	if (sm->index[i].nr_free != nr_free) {
		sm->index[i].nr_free = nr_free;
		sm->dirty[i] = 1;
	}
	sm->counted[i] = 1;
}

/* Set bitmap @i's nr_free to the free entries in its bitmap block. */
static int recount_free(struct tsp_data_sm *sm, u64 i)
{
	struct tsp_block *blk;
	int r;

	r = get_bitmap(sm, i, &blk);
	if (r)
		return r;
	count_free_from(sm, i, tsp_block_data(blk));
	put_bitmap(sm, blk);
	return 0;
}

/* Resize the in-core index arrays to @nr entries, keeping what is there. */
static int resize_index(struct tsp_data_sm *sm, u64 nr)
{
	struct tsp_index_entry *index;
	u8 *dirty, *counted;
	u64 **freed, **held0, **held1;

	index = kvcalloc(nr, sizeof(*index), GFP_KERNEL);
	dirty = kvzalloc(nr, GFP_KERNEL);
	counted = kvzalloc(nr, GFP_KERNEL);
	freed = kvcalloc(nr, sizeof(*freed), GFP_KERNEL);
	held0 = kvcalloc(nr, sizeof(*held0), GFP_KERNEL);
	held1 = kvcalloc(nr, sizeof(*held1), GFP_KERNEL);
	if (!index || !dirty || !counted || !freed || !held0 || !held1) {
		kvfree(index);
		kvfree(dirty);
		kvfree(counted);
		kvfree(freed);
		kvfree(held0);
		kvfree(held1);
		return -ENOMEM;
	}
	if (sm->index) {
		memcpy(index, sm->index, sm->nr_bitmaps * sizeof(*index));
		memcpy(dirty, sm->dirty, sm->nr_bitmaps);
		memcpy(counted, sm->counted, sm->nr_bitmaps);
		memcpy(freed, sm->freed, sm->nr_bitmaps * sizeof(*freed));
		memcpy(held0, sm->held[0], sm->nr_bitmaps * sizeof(*held0));
		memcpy(held1, sm->held[1], sm->nr_bitmaps * sizeof(*held1));
		kvfree(sm->index);
		kvfree(sm->dirty);
		kvfree(sm->counted);
		kvfree(sm->freed);
		kvfree(sm->held[0]);
		kvfree(sm->held[1]);
	}
	sm->index = index;
	sm->dirty = dirty;
	sm->counted = counted;
	sm->freed = freed;
	sm->held[0] = held0;
	sm->held[1] = held1;
	sm->nr_bitmaps = nr;
	return 0;
}

/* Empty a set of entries (sm->freed or one of sm->held). */
static void forget_entries(struct tsp_data_sm *sm, u64 **set)
{
	u64 i;

	for (i = 0; i < sm->nr_bitmaps; i++) {
		kfree(set[i]);
		set[i] = NULL;
	}
}

/* Remember that entry @pos of bitmap @i was freed in this transaction. */
static int mark_freed(struct tsp_data_sm *sm, u64 i, u32 pos)
{
	if (!sm->freed[i]) {
		sm->freed[i] = kcalloc(FREED_WORDS, sizeof(u64), GFP_NOIO);
		if (!sm->freed[i])
			return -ENOMEM;
	}
	sm->freed[i][pos / 64] |= 1ULL << (pos % 64);
	return 0;
}

static bool in_set(u64 **set, u64 i, u32 pos)
{
	return set[i] && (set[i][pos / 64] >> (pos % 64)) & 1;
}

/* The number of entries in a set (sm->freed or one of sm->held). */
static tsp_block_t count_entries(struct tsp_data_sm *sm, u64 **set)
{
	tsp_block_t n = 0;
	u64 i;
	u32 w;

	for (i = 0; i < sm->nr_bitmaps; i++)
		for (w = 0; set[i] && w < FREED_WORDS; w++)
			n += hweight64(set[i][w]);
	return n;
}

void tsp_data_sm_destroy(struct tsp_data_sm *sm)
{
	tsp_data_sm_unlock(sm);
	if (sm->index) {
		forget_entries(sm, sm->freed);
		forget_entries(sm, sm->held[0]);
		forget_entries(sm, sm->held[1]);
	}
	kvfree(sm->index);
	kvfree(sm->dirty);
	kvfree(sm->counted);
	kvfree(sm->freed);
	kvfree(sm->held[0]);
	kvfree(sm->held[1]);
	kfree(sm);
}

/**
 * tsp_data_sm_hold_freed - keep the blocks freed so far from allocation
 * @sm: space map
 *
 * The blocks freed in this transaction stay out of allocation past its
 * commit, in the newer generation of held blocks, with those held there
 * since the last tsp_data_sm_release_held().  Allocates nothing.
 */
void tsp_data_sm_hold_freed(struct tsp_data_sm *sm)
{
	u64 **held = sm->held[1];
	u64 i;
	u32 w;

	for (i = 0; i < sm->nr_bitmaps; i++) {
		if (!sm->freed[i])
			continue;
		if (!held[i]) {
			held[i] = sm->freed[i];
		} else {
			for (w = 0; w < FREED_WORDS; w++)
				held[i][w] |= sm->freed[i][w];
			kfree(sm->freed[i]);
		}
		sm->freed[i] = NULL;
	}
}

/**
 * tsp_data_sm_release_held - let allocation have the older held blocks
 * @sm: space map
 *
 * The older generation of held blocks is free for allocation again; the
 * newer becomes the older, and holds start a new one.  Those freed in
 * this transaction since the last hold still wait for its commit.
 * Allocation searches from the start again, as after a commit, to reuse
 * the released blocks first.
 */
void tsp_data_sm_release_held(struct tsp_data_sm *sm)
{
	u64 **released = sm->held[0];

	forget_entries(sm, released);
	sm->held[0] = sm->held[1];
	sm->held[1] = released;
	sm->alloc_cursor = 0;
	forget_free_run(sm);
}

/**
 * tsp_data_sm_extend - grow the space map
 * @sm: space map
 * @nr_blocks: the new number of data blocks
 *
 * New bitmaps are allocated now; their index entries are written at the
 * next commit.  Returns 0, -EINVAL to shrink, -ENOMEM or -ENOSPC; after
 * an error the transaction must be aborted.
 */
int tsp_data_sm_extend(struct tsp_data_sm *sm, tsp_block_t nr_blocks)
{
	u64 i, old_nr = sm->nr_bitmaps;
	struct tsp_block *blk;
	int r;

	if (nr_blocks < sm->nr_blocks)
		return -EINVAL;
	if (nr_blocks == sm->nr_blocks)
		return 0;
	if (too_many_blocks(sm->tm, nr_blocks))
		return -ENOSPC;

	r = resize_index(sm, nr_bitmaps(nr_blocks));
	if (r)
		return r;

	if (old_nr) {
		/*
		 * The last old bitmap gains entries, all free.  Count them
		 * again rather than add: written by dm-thin, its nr_free
		 * holds them already; by thin_restore, it does not.
		 */
		r = recount_free(sm, old_nr - 1);
		if (r)
			return r;
	}
	for (i = old_nr; i < sm->nr_bitmaps; i++) {
		r = tsp_tm_new_block(sm->tm, &tsp_bitmap_validator, &blk);
		if (r)
			return r;
		sm->index[i].blocknr = tsp_block_location(blk);
		sm->index[i].nr_free = TSP_ENTRIES_PER_BITMAP;
		sm->index[i].none_free_before = 0;
		sm->dirty[i] = 1;
		sm->counted[i] = 1;
		tsp_tm_unlock(sm->tm, blk);
	}
	sm->nr_blocks = nr_blocks;
	return 0;
}

/**
 * tsp_data_sm_create - see space-map.h
 * @tm: transaction manager
 * @nr_blocks: data blocks
 * @result: out
 */
int tsp_data_sm_create(struct tsp_tm *tm, tsp_block_t nr_blocks,
		       struct tsp_data_sm **result)
{
	struct tsp_data_sm *sm = sm_alloc(tm);
	int r;

	if (!sm)
		return -ENOMEM;
	r = tsp_btree_empty(&sm->index_info, &sm->index_root);
	if (!r)
		r = tsp_btree_empty(&sm->ref_info, &sm->ref_root);
	if (!r)
		r = tsp_data_sm_extend(sm, nr_blocks);
	if (r) {
		tsp_data_sm_destroy(sm);
		return r;
	}
	*result = sm;
	return 0;
}

static int load_index_entry(void *context, u64 key, void *value)
{
	struct tsp_data_sm *sm = context;
	struct tsp_index_entry *ie;

	if (key >= sm->nr_bitmaps || sm->index[key].blocknr) {
		DMERR("data space map index has a bad or repeated entry %llu",
		      (unsigned long long)key);
		return -EILSEQ;
	}
	ie = &sm->index[key];
	tsp_index_entry_unpack(value, ie);
	if (!ie->blocknr || ie->nr_free > TSP_ENTRIES_PER_BITMAP ||
	    ie->none_free_before > TSP_ENTRIES_PER_BITMAP) {
		DMERR("data space map index entry %llu is corrupt",
		      (unsigned long long)key);
		return -EILSEQ;
	}
	return 0;
}

/**
 * tsp_data_sm_open - see space-map.h
 * @tm: transaction manager
 * @root: the root from the superblock
 * @result: out
 */
int tsp_data_sm_open(struct tsp_tm *tm, const void *root,
		     struct tsp_data_sm **result)
{
	struct tsp_disk_sm_root disk_root;
	struct tsp_data_sm *sm = sm_alloc(tm);
	u64 i;
	int r;

	if (!sm)
		return -ENOMEM;
	memcpy(&disk_root, root, sizeof(disk_root));
	sm->nr_blocks = le64_to_cpu(disk_root.nr_blocks);
	sm->nr_allocated = le64_to_cpu(disk_root.nr_allocated);
	sm->index_root = le64_to_cpu(disk_root.bitmap_root);
	sm->ref_root = le64_to_cpu(disk_root.ref_count_root);
	if (sm->nr_allocated > sm->nr_blocks || too_many_blocks(tm, sm->nr_blocks)) {
		DMERR("data space map root is corrupt (%llu of %llu blocks allocated)",
		      (unsigned long long)sm->nr_allocated,
		      (unsigned long long)sm->nr_blocks);
		r = -EILSEQ;
		goto bad;
	}

	r = resize_index(sm, nr_bitmaps(sm->nr_blocks));
	if (!r)
		r = tsp_btree_walk(&sm->index_info, sm->index_root,
				   load_index_entry, sm);
	for (i = 0; !r && i < sm->nr_bitmaps; i++) {
		if (!sm->index[i].blocknr) {
			DMERR("data space map index lacks bitmap %llu",
			      (unsigned long long)i);
			r = -EILSEQ;
		}
	}
	if (r)
		goto bad;

	*result = sm;
	return 0;
bad:
	tsp_data_sm_destroy(sm);
	return r;
}

tsp_block_t tsp_data_sm_nr_blocks(struct tsp_data_sm *sm)
{
	return sm->nr_blocks;
}

tsp_block_t tsp_data_sm_nr_free(struct tsp_data_sm *sm)
{
	return sm->nr_blocks - sm->nr_allocated;
}

/**
 * tsp_data_sm_nr_waiting - free blocks that cannot be allocated yet
 * @sm: space map
 *
 * Counts the blocks freed in this transaction, which wait for its commit,
 * and those held past their commit (both generations), which wait for
 * tsp_data_sm_release_held().  tsp_data_sm_nr_free() counts them as free.
 * Walks the sets of them: for reports, not for the IO path.
 *
 * Return: the number of such blocks.
 */
tsp_block_t tsp_data_sm_nr_waiting(struct tsp_data_sm *sm)
{
	return count_entries(sm, sm->freed) + tsp_data_sm_nr_held(sm);
}

/**
 * tsp_data_sm_nr_held - free blocks held past their commit
 * @sm: space map
 *
 * Counts both generations; tsp_data_sm_nr_free() counts them as free.
 * Walks the sets of them: not for the IO path.
 *
 * Return: the number of such blocks.
 */
tsp_block_t tsp_data_sm_nr_held(struct tsp_data_sm *sm)
{
	return count_entries(sm, sm->held[0]) + count_entries(sm, sm->held[1]);
}

/*
 * Every block number the space map is given comes from the metadata (a
 * mapping) or from its own allocator: one past the end is corruption,
 * and an error that fails the transaction.
 */
static int check_block(struct tsp_data_sm *sm, tsp_block_t b)
{
	if (b < sm->nr_blocks)
		return 0;
	DMERR("data block %llu is beyond the end of the data device (%llu blocks)",
	      (unsigned long long)b, (unsigned long long)sm->nr_blocks);
	return -EILSEQ;
}

/* The 2-bit entry of @b in its bitmap. */
static int bitmap_entry(struct tsp_data_sm *sm, tsp_block_t b,
			unsigned int *entry)
{
	struct tsp_block *blk;
	int r;

	r = get_bitmap(sm, b / TSP_ENTRIES_PER_BITMAP, &blk);
	if (r)
		return r;
	*entry = tsp_bitmap_get(tsp_block_data(blk), b % TSP_ENTRIES_PER_BITMAP);
	put_bitmap(sm, blk);
	return 0;
}

/**
 * tsp_data_sm_get_count - a data block's reference count
 * @sm: space map
 * @b: data block
 * @count: out
 */
int tsp_data_sm_get_count(struct tsp_data_sm *sm, tsp_block_t b, u32 *count)
{
	unsigned int entry;
	__le32 v;
	int r;

	r = check_block(sm, b);
	if (!r)
		r = bitmap_entry(sm, b, &entry);
	if (r)
		return r;
	if (entry < 3) {
		*count = entry;
		return 0;
	}

	r = tsp_btree_lookup(&sm->ref_info, sm->ref_root, b, &v);
	if (r == -ENODATA) {
		DMERR("data block %llu has no overflow reference count",
		      (unsigned long long)b);
		return -EILSEQ;
	}
	if (r)
		return r;
	*count = le32_to_cpu(v);
	if (*count < 3) {
		/* A count below 3 lives in the bitmap alone. */
		DMERR("data block %llu has an overflow reference count of %u",
		      (unsigned long long)b, *count);
		return -EILSEQ;
	}
	return 0;
}

/*
 * Bitmap @i for changing entries: shadowed, with its index entry
 * following it, and kept write locked (see the top of this file) in
 * place of the one kept so far.  The first change after open recounts
 * its free entries, so nr_free is exact before it is changed by one.
 */
static int lock_bitmap(struct tsp_data_sm *sm, u64 i, struct tsp_block **blk)
{
	struct tsp_index_entry *ie = &sm->index[i];
	bool inc;
	int r;

	*blk = kept_bitmap(sm, i);
	if (*blk)
		return 0;
	tsp_data_sm_unlock(sm);
	r = tsp_tm_shadow_block(sm->tm, ie->blocknr, &tsp_bitmap_validator,
				blk, &inc);
	if (r)
		return r;
	if (ie->blocknr != tsp_block_location(*blk)) {
		ie->blocknr = tsp_block_location(*blk);
		sm->dirty[i] = 1;
	}
	if (!sm->counted[i])
		count_free_from(sm, i, tsp_block_data(*blk));
	sm->locked = *blk;
	sm->locked_index = i;
	return 0;
}

/* Set @b's 2-bit entry in its bitmap @blk, from lock_bitmap(). */
static void set_entry(struct tsp_data_sm *sm, struct tsp_block *blk,
		      tsp_block_t b, u32 count)
{
	tsp_bitmap_set(tsp_block_data(blk), b % TSP_ENTRIES_PER_BITMAP,
		       min(count, 3u));
	sm->dirty[b / TSP_ENTRIES_PER_BITMAP] = 1;
}

/* @b, free until now, is in use: count it in its index entry and the map. */
static void count_allocated(struct tsp_data_sm *sm, tsp_block_t b)
{
	struct tsp_index_entry *ie = &sm->index[b / TSP_ENTRIES_PER_BITMAP];
	u32 pos = b % TSP_ENTRIES_PER_BITMAP;

	if (b >= sm->run_begin && b < sm->run_end)
		forget_free_run(sm);
	ie->nr_free--;
	if (pos == ie->none_free_before)
		ie->none_free_before = pos + 1;
	sm->nr_allocated++;
}

/*
 * The root's count of blocks in use, read from disk, must neither pass
 * the map's size (@allocating) nor go below zero as blocks are counted
 * in and out: either means it disagrees with the bitmaps.
 */
static int check_nr_allocated(struct tsp_data_sm *sm, bool allocating)
{
	if (allocating ? sm->nr_allocated < sm->nr_blocks : sm->nr_allocated)
		return 0;
	DMERR("data space map root is corrupt: %llu of %llu blocks in use while %s one",
	      (unsigned long long)sm->nr_allocated,
	      (unsigned long long)sm->nr_blocks,
	      allocating ? "allocating" : "freeing");
	return -EILSEQ;
}

/* Change @b's count from @old to @count in bitmap, index and overflow. */
static int set_count(struct tsp_data_sm *sm, tsp_block_t b, u32 old, u32 count)
{
	u64 i = b / TSP_ENTRIES_PER_BITMAP;
	struct tsp_index_entry *ie = &sm->index[i];
	u32 pos = b % TSP_ENTRIES_PER_BITMAP;
	struct tsp_block *blk;
	int r;

	if (!old != !count) {
		r = check_nr_allocated(sm, count);
		if (r)
			return r;
	}
	if (old && !count) {
		r = mark_freed(sm, i, pos);
		if (r)
			return r;
	}
	if (min(old, 3u) != min(count, 3u)) {
		r = lock_bitmap(sm, i, &blk);
		if (r)
			return r;
		set_entry(sm, blk, b, count);
	}

	if (!old && count) {
		count_allocated(sm, b);
	} else if (old && !count) {
		ie->nr_free++;
		ie->none_free_before = min(ie->none_free_before, pos);
		sm->nr_allocated--;
	}

	if (count >= 3) {
		__le32 v = cpu_to_le32(count);

		return tsp_btree_insert(&sm->ref_info, sm->ref_root, b, &v,
					&sm->ref_root, NULL);
	}
	if (old >= 3)
		return tsp_btree_remove(&sm->ref_info, sm->ref_root, b,
					&sm->ref_root);
	return 0;
}

int tsp_data_sm_inc(struct tsp_data_sm *sm, tsp_block_t b)
{
	u32 old;
	int r = tsp_data_sm_get_count(sm, b, &old);

	if (r)
		return r;
	if (old == U32_MAX)
		return -EOVERFLOW;
	return set_count(sm, b, old, old + 1);
}

int tsp_data_sm_dec(struct tsp_data_sm *sm, tsp_block_t b)
{
	u32 old;
	int r = tsp_data_sm_get_count(sm, b, &old);

	if (r)
		return r;
	if (!old) {
		DMERR("data block %llu is freed more often than referenced",
		      (unsigned long long)b);
		return -EILSEQ;
	}
	return set_count(sm, b, old, old - 1);
}

/*
 * Entry @j of bitmap @i, whose block is @bitmap, is free, not freed now
 * and not held.
 */
static bool allocatable(struct tsp_data_sm *sm, u64 i, struct tsp_block *bitmap,
			u32 j)
{
	return !tsp_bitmap_get(tsp_block_data(bitmap), j) &&
	       !in_set(sm->freed, i, j) && !in_set(sm->held[0], i, j) &&
	       !in_set(sm->held[1], i, j);
}

/*
 * Set the free run to the first blocks of bitmap @i from @start that can
 * be allocated (see allocatable()); -ENOSPC if there are none.
 */
static int find_free_in(struct tsp_data_sm *sm, u64 i, u32 start)
{
	struct tsp_index_entry *ie = &sm->index[i];
	u32 j, k, nr = bitmap_entries(sm->nr_blocks, i);
	struct tsp_block *bitmap;
	int r;

	r = get_bitmap(sm, i, &bitmap);
	if (r)
		return r;

	r = -ENOSPC;
	for (j = max(ie->none_free_before, start); j < nr; j++) {
		if (!allocatable(sm, i, bitmap, j))
			continue;
		sm->run_begin = i * TSP_ENTRIES_PER_BITMAP + j;
		for (k = j + 1; k < nr && k - j < FREE_RUN_MAX; k++)
			if (!allocatable(sm, i, bitmap, k))
				break;
		sm->run_end = i * TSP_ENTRIES_PER_BITMAP + k;
		r = 0;
		break;
	}

	put_bitmap(sm, bitmap);
	return r;
}

/*
 * One pass over the bitmaps with free entries, from the cursor, that sets
 * the free run.
 */
static int find_free(struct tsp_data_sm *sm)
{
	u64 first = sm->nr_bitmaps ? sm->alloc_cursor / TSP_ENTRIES_PER_BITMAP : 0;
	u64 k, i;
	u32 start;
	int r;

	for (k = 0; k < sm->nr_bitmaps; k++) {
		i = (first + k) % sm->nr_bitmaps;
		if (!sm->index[i].nr_free)
			continue;
		start = k ? 0 : sm->alloc_cursor % TSP_ENTRIES_PER_BITMAP;
		r = find_free_in(sm, i, start);
		if (r != -ENOSPC)
			return r;
	}
	return -ENOSPC;
}

/*
 * Recount every bitmap whose count, as read from disk, says it is full.
 * Returns 1 if one of them has free entries after all, 0 if none has,
 * or an IO error.
 */
static int recount_full(struct tsp_data_sm *sm)
{
	int r, found = 0;
	u64 i;

	for (i = 0; i < sm->nr_bitmaps; i++) {
		if (sm->counted[i] || sm->index[i].nr_free)
			continue;
		r = recount_free(sm, i);
		if (r)
			return r;
		if (sm->index[i].nr_free)
			found = 1;
	}
	return found;
}

/**
 * tsp_data_sm_new_block - allocate a data block
 * @sm: space map
 * @b: out, a block whose count is now 1
 *
 * Returns 0 or -ENOSPC.  Cost: the next block of the free run; when the
 * run is empty, the index is scanned from where the last allocation
 * succeeded, reading the bitmaps that have free entries, for a new run.
 * Before -ENOSPC, the bitmaps said to be full whose counts were read
 * from disk are recounted, once after open.
 */
int tsp_data_sm_new_block(struct tsp_data_sm *sm, tsp_block_t *b)
{
	int r = tsp_data_sm_reserve(sm, b);

	if (r == -ENOSPC) {
		r = recount_full(sm);
		if (r > 0)
			r = tsp_data_sm_reserve(sm, b);
		else if (!r)
			r = -ENOSPC;
	}
	return r ?: tsp_data_sm_alloc_reserved(sm, *b);
}

/**
 * tsp_data_sm_reserve - the block the next allocation hands out
 * @sm: space map
 * @b: out, the block
 *
 * Changes nothing that matters if @b is not allocated: the caller may try
 * other updates (not of the data space map) before it decides to
 * allocate @b with tsp_data_sm_alloc_reserved().  @b's bitmap is locked
 * (shadowed) here, so that allocating it then cannot fail, also in the
 * transaction manager's no-wait mode, unless a change of another bitmap
 * came in between.
 *
 * Return: 0; -ENOSPC if no bitmap in the index has an allocatable entry
 * (counts read from disk are not recounted: tsp_data_sm_new_block() does
 * that); -EILSEQ if the root counts every block in use while a bitmap
 * has a free one; or the transaction manager's error (-EWOULDBLOCK in
 * no-wait mode).
 */
int tsp_data_sm_reserve(struct tsp_data_sm *sm, tsp_block_t *b)
{
	struct tsp_block *bitmap;
	int r = 0;

	if (sm->run_begin == sm->run_end)
		r = find_free(sm);
	if (!r)
		r = check_nr_allocated(sm, true);
	if (r)
		return r;
	*b = sm->run_begin;
	return lock_bitmap(sm, *b / TSP_ENTRIES_PER_BITMAP, &bitmap);
}

/**
 * tsp_data_sm_alloc_reserved - allocate the block tsp_data_sm_reserve() picked
 * @sm: space map
 * @b: the block; no other block was allocated since it was reserved
 *
 * Return: 0 (@b's count is 1), or lock_bitmap()'s error if a change of
 * another bitmap came in since the reserve.
 */
int tsp_data_sm_alloc_reserved(struct tsp_data_sm *sm, tsp_block_t b)
{
	struct tsp_block *bitmap;
	int r = lock_bitmap(sm, b / TSP_ENTRIES_PER_BITMAP, &bitmap);

	if (r)
		return r;
	set_entry(sm, bitmap, b, 1);
	/* Past the run first: count_allocated() keeps the rest of it. */
	sm->run_begin = b + 1;
	sm->alloc_cursor = b + 1;
	count_allocated(sm, b);
	return 0;
}

/**
 * tsp_data_sm_commit - write the index entries that changed
 * @sm: space map
 * @root: out, TSP_SM_ROOT_SIZE bytes for the superblock
 */
int tsp_data_sm_commit(struct tsp_data_sm *sm, void *root)
{
	struct tsp_disk_sm_root disk_root;
	struct tsp_disk_index_entry disk;
	u64 i;
	int r;

	tsp_data_sm_unlock(sm);
	for (i = 0; i < sm->nr_bitmaps; i++) {
		if (!sm->dirty[i])
			continue;
		tsp_index_entry_pack(&sm->index[i], &disk);
		r = tsp_btree_insert(&sm->index_info, sm->index_root, i, &disk,
				     &sm->index_root, NULL);
		if (r)
			return r;
		sm->dirty[i] = 0;
	}
	sm->alloc_cursor = 0;
	forget_free_run(sm);
	forget_entries(sm, sm->freed);

	memset(root, 0, TSP_SM_ROOT_SIZE);
	disk_root.nr_blocks = cpu_to_le64(sm->nr_blocks);
	disk_root.nr_allocated = cpu_to_le64(sm->nr_allocated);
	disk_root.bitmap_root = cpu_to_le64(sm->index_root);
	disk_root.ref_count_root = cpu_to_le64(sm->ref_root);
	memcpy(root, &disk_root, sizeof(disk_root));
	return 0;
}

/**
 * tsp_data_sm_check_index - compare the index entries with the bitmaps
 * @sm: space map (as opened or committed)
 *
 * An entry's nr_free may count the entries past the end of the device
 * (dm-thin and we do) or not (thin_restore); it may also be lower than
 * the free entries in the device: dm-thin growing a pool leaves the
 * last bitmap's count alone, so a bitmap written by thin_restore and
 * then grown by dm-thin undercounts until we recount it (thin_check
 * 0.9.0 reads neither field).  It must not be higher than the free entries of the
 * whole bitmap block: no writer gets there, and counting frees on top
 * of it would soon make the entry one that cannot be opened.  Every
 * entry below none_free_before must be in use.
 *
 * Cost: reads every bitmap.  Returns 0, -EILSEQ with a DMERR for the
 * first bad entry, or an IO error.
 */
int tsp_data_sm_check_index(struct tsp_data_sm *sm)
{
	struct tsp_index_entry *ie;
	struct tsp_block *blk;
	u32 nr, nr_free, first_free;
	u64 i;
	int r;

	for (i = 0; i < sm->nr_bitmaps; i++) {
		ie = &sm->index[i];
		nr = bitmap_entries(sm->nr_blocks, i);
		r = get_bitmap(sm, i, &blk);
		if (r)
			return r;
		nr_free = tsp_bitmap_count_free(tsp_block_data(blk), nr,
						&first_free);
		put_bitmap(sm, blk);

		if (ie->nr_free > nr_free + (TSP_ENTRIES_PER_BITMAP - nr)) {
			DMERR("data space map bitmap %llu: index entry says %u entries are free, the bitmap has %u of %u",
			      (unsigned long long)i, ie->nr_free, nr_free, nr);
			return -EILSEQ;
		}
		if (ie->none_free_before > first_free) {
			DMERR("data space map bitmap %llu: index entry says none of the first %u entries is free, entry %u is",
			      (unsigned long long)i, ie->none_free_before,
			      first_free);
			return -EILSEQ;
		}
	}
	return 0;
}

/**
 * tsp_data_sm_walk_own_blocks - report the metadata blocks of the map
 * @sm: space map (as opened or committed)
 * @fn: called per reference, as tsp_btree_check()'s node_fn
 * @context: for @fn
 *
 * Also checks the structure of the index and overflow btrees.
 */
int tsp_data_sm_walk_own_blocks(struct tsp_data_sm *sm,
				int (*fn)(void *context, tsp_block_t b),
				void *context)
{
	u64 i;
	int r;

	r = tsp_btree_check(&sm->index_info, sm->index_root, fn, NULL, context);
	for (i = 0; r >= 0 && i < sm->nr_bitmaps; i++)
		r = fn(context, sm->index[i].blocknr);
	if (r < 0)
		return r;
	return tsp_btree_check(&sm->ref_info, sm->ref_root, fn, NULL, context);
}
