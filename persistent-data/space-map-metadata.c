// SPDX-License-Identifier: GPL-2.0-only
/*
 * space-map-metadata.c - reference counts of metadata blocks, in memory
 * between commits, in dm-thin's on-disk layout at each commit.
 *
 * State per block: its count, and whether it was in use at the last
 * commit.  A block may be allocated only if both are zero: a block freed
 * in this transaction may still be reachable from the committed
 * superblock.  A block in use now but not at the last commit was written
 * in this transaction, so the transaction manager may overwrite it.
 *
 * Commit, in two phases so that writing the counts never changes them:
 *  1. allocate: rebuild the overflow btree if any count of 3 or more
 *     changed, give the index block and every bitmap whose 2-bit counts
 *     changed a location not visible to the committed superblock (this
 *     changes counts, so repeat until no bitmap needs a new location);
 *  2. write: fill every bitmap written in this transaction and the index
 *     block from the counts.
 *
 * Locking: none; the caller serialises.
 */
#define DM_MSG_PREFIX "thin-scalable metadata"

#include "space-map-metadata.h"
#include "space-map-format.h"
#include "btree.h"

#define MAX_BLOCKS ((tsp_block_t)TSP_MAX_METADATA_BITMAPS * TSP_ENTRIES_PER_BITMAP)

struct tsp_metadata_sm {
	tsp_block_t nr_blocks;
	u32 *counts;
	u8 *committed;		/* in use at the last commit */
	u8 dirty[TSP_MAX_METADATA_BITMAPS];	/* 2-bit counts changed */
	/*
	 * Per bitmap, a count went from or to zero since its index entry
	 * was counted (recount) or since committed[] was brought up to date
	 * for it (uncommitted): only such bitmaps are scanned at commit.
	 */
	u8 recount[TSP_MAX_METADATA_BITMAPS];
	u8 uncommitted[TSP_MAX_METADATA_BITMAPS];
	struct tsp_index_entry entries[TSP_MAX_METADATA_BITMAPS];
	tsp_block_t bitmap_locs[TSP_MAX_METADATA_BITMAPS];	/* 0: none yet */
	tsp_block_t index_loc;		/* 0: none yet */
	tsp_block_t ref_count_root;	/* 0: none yet */
	bool overflow_dirty;	/* a count >= 3 changed */
	tsp_block_t nr_allocated;	/* blocks with a count */
	tsp_block_t nr_freed;	/* no count now, but in use at the last commit */
	tsp_block_t alloc_hint;
};

static u32 nr_bitmaps(tsp_block_t nr_blocks)
{
	return (u32)DIV_ROUND_UP(nr_blocks, TSP_ENTRIES_PER_BITMAP);
}

static tsp_block_t bitmap_first(u32 i)
{
	return (tsp_block_t)i * TSP_ENTRIES_PER_BITMAP;
}

static u32 bitmap_entries(struct tsp_metadata_sm *sm, u32 i)
{
	return (u32)min_t(tsp_block_t, TSP_ENTRIES_PER_BITMAP,
			  sm->nr_blocks - bitmap_first(i));
}

static int alloc_arrays(struct tsp_metadata_sm *sm, tsp_block_t nr_blocks)
{
	u32 *counts;
	u8 *committed;

	if (nr_blocks > MAX_BLOCKS)
		return -EINVAL;

	counts = kvcalloc(nr_blocks, sizeof(*counts), GFP_KERNEL);
	committed = kvzalloc(nr_blocks, GFP_KERNEL);
	if (!counts || !committed) {
		kvfree(counts);
		kvfree(committed);
		return -ENOMEM;
	}
	if (sm->counts) {
		memcpy(counts, sm->counts, sm->nr_blocks * sizeof(*counts));
		memcpy(committed, sm->committed, sm->nr_blocks);
		kvfree(sm->counts);
		kvfree(sm->committed);
	}
	sm->counts = counts;
	sm->committed = committed;
	sm->nr_blocks = nr_blocks;
	memset(sm->recount, 1, sizeof(sm->recount));
	memset(sm->uncommitted, 1, sizeof(sm->uncommitted));
	return 0;
}

/**
 * tsp_msm_create - an empty metadata space map for a new pool
 * @nr_blocks: metadata blocks (at most 255 bitmaps' worth)
 *
 * Returns the space map or NULL when out of memory or too large.
 */
struct tsp_metadata_sm *tsp_msm_create(tsp_block_t nr_blocks)
{
	struct tsp_metadata_sm *sm;

	BUILD_BUG_ON(MAX_BLOCKS != TSP_TM_MAX_BLOCKS);
	BUILD_BUG_ON(sizeof(struct tsp_disk_metadata_index) > TSP_METADATA_BLOCK_SIZE);
	BUILD_BUG_ON(sizeof(struct tsp_disk_sm_root) > TSP_SM_ROOT_SIZE);
	BUILD_BUG_ON(sizeof(struct tsp_disk_index_entry) != 16);

	sm = kzalloc(sizeof(*sm), GFP_KERNEL);
	if (!sm)
		return NULL;
	if (alloc_arrays(sm, nr_blocks)) {
		kfree(sm);
		return NULL;
	}
	memset(sm->dirty, 1, sizeof(sm->dirty));
	sm->overflow_dirty = true;
	return sm;
}

void tsp_msm_destroy(struct tsp_metadata_sm *sm)
{
	kvfree(sm->counts);
	kvfree(sm->committed);
	kfree(sm);
}

tsp_block_t tsp_msm_nr_blocks(struct tsp_metadata_sm *sm)
{
	return sm->nr_blocks;
}

/* Blocks that can be allocated now. */
tsp_block_t tsp_msm_nr_free(struct tsp_metadata_sm *sm)
{
	return sm->nr_blocks - sm->nr_allocated - sm->nr_freed;
}

u32 tsp_msm_count(struct tsp_metadata_sm *sm, tsp_block_t b)
{
	return b < sm->nr_blocks ? sm->counts[b] : 0;
}

bool tsp_msm_is_new(struct tsp_metadata_sm *sm, tsp_block_t b)
{
	return b < sm->nr_blocks && !sm->committed[b] && sm->counts[b];
}

static void set_count(struct tsp_metadata_sm *sm, tsp_block_t b, u32 count)
{
	u32 old = sm->counts[b];
	u32 i = b / TSP_ENTRIES_PER_BITMAP;

	if (min(old, 3u) != min(count, 3u))
		sm->dirty[b / TSP_ENTRIES_PER_BITMAP] = 1;
	if (old != count && (old >= 3 || count >= 3))
		sm->overflow_dirty = true;
	if (!old != !count) {
		sm->recount[i] = 1;
		sm->uncommitted[i] = 1;
	}
	if (!old && count) {
		sm->nr_allocated++;
		sm->nr_freed -= sm->committed[b];
	} else if (old && !count) {
		sm->nr_allocated--;
		sm->nr_freed += sm->committed[b];
	}
	sm->counts[b] = count;
}

static int check_block(struct tsp_metadata_sm *sm, tsp_block_t b)
{
	if (b < sm->nr_blocks)
		return 0;
	DMERR("metadata block %llu is beyond the metadata space map (%llu blocks)",
	      (unsigned long long)b, (unsigned long long)sm->nr_blocks);
	return -EILSEQ;
}

int tsp_msm_inc(struct tsp_metadata_sm *sm, tsp_block_t b)
{
	int r = check_block(sm, b);

	if (r)
		return r;
	if (sm->counts[b] == U32_MAX)
		return -EOVERFLOW;
	set_count(sm, b, sm->counts[b] + 1);
	return 0;
}

int tsp_msm_dec(struct tsp_metadata_sm *sm, tsp_block_t b)
{
	int r = check_block(sm, b);

	if (r)
		return r;
	if (!sm->counts[b]) {
		DMERR("metadata block %llu is freed more often than referenced",
		      (unsigned long long)b);
		return -EILSEQ;
	}
	set_count(sm, b, sm->counts[b] - 1);
	return 0;
}

/**
 * tsp_msm_peek_new_blocks - the blocks the next allocations will hand out
 * @sm: space map
 * @blocks: out, @nr of them at most
 * @nr: how many to look for
 *
 * The first free blocks from where the last allocation left off, in the
 * order allocations take them (tsp_msm_take()), if nothing is freed
 * meanwhile.  Changes nothing.  Returns how many were found: 0 when the
 * space map is full.
 */
unsigned int tsp_msm_peek_new_blocks(struct tsp_metadata_sm *sm,
				     tsp_block_t *blocks, unsigned int nr)
{
	tsp_block_t i, candidate;
	unsigned int found = 0;

	for (i = 0; i < sm->nr_blocks && found < nr; i++) {
		candidate = (sm->alloc_hint + i) % sm->nr_blocks;
		if (!sm->counts[candidate] && !sm->committed[candidate])
			blocks[found++] = candidate;
	}
	return found;
}

/**
 * tsp_msm_take - allocate a metadata block
 * @sm: space map
 * @b: the first block tsp_msm_peek_new_blocks() returned, with nothing
 *	allocated or freed since
 *
 * Its count is now 1.
 */
void tsp_msm_take(struct tsp_metadata_sm *sm, tsp_block_t b)
{
	set_count(sm, b, 1);
	sm->alloc_hint = b + 1;
}

/* Grow to @nr_blocks; the new bitmaps are written at the next commit. */
int tsp_msm_extend(struct tsp_metadata_sm *sm, tsp_block_t nr_blocks)
{
	u32 first_new = nr_bitmaps(sm->nr_blocks);
	u32 i;
	int r;

	if (nr_blocks <= sm->nr_blocks)
		return 0;
	r = alloc_arrays(sm, nr_blocks);
	if (r)
		return r;
	for (i = first_new ? first_new - 1 : 0; i < nr_bitmaps(nr_blocks); i++)
		sm->dirty[i] = 1;
	return 0;
}

static struct tsp_btree_info overflow_info(struct tsp_tm *tm)
{
	struct tsp_btree_info info = {
		.tm = tm,
		.vt = { .size = sizeof(__le32) },
	};

	return info;
}

/* Load the counts of 3 and more from the overflow btree. */
static int load_overflow(void *context, u64 key, void *value)
{
	struct tsp_metadata_sm *sm = context;
	__le32 v;
	u32 count;

	memcpy(&v, value, sizeof(v));
	count = le32_to_cpu(v);
	if (key >= sm->nr_blocks || sm->counts[key] != 3 || count < 3) {
		DMERR("metadata space map overflow entry for block %llu is inconsistent",
		      (unsigned long long)key);
		return -EILSEQ;
	}
	sm->counts[key] = count;
	sm->committed[key] = 1;	/* has its entry; see tsp_msm_open() */
	return 0;
}

static int load_bitmap(struct tsp_metadata_sm *sm, struct tsp_tm *tm, u32 i,
		       const struct tsp_disk_index_entry *disk)
{
	tsp_block_t first = bitmap_first(i);
	u32 nr = bitmap_entries(sm, i);
	struct tsp_index_entry ie;
	struct tsp_block *blk;
	u32 j;
	int r;

	tsp_index_entry_unpack(disk, &ie);
	r = tsp_tm_read_lock(tm, ie.blocknr, &tsp_bitmap_validator, &blk);
	if (r)
		return r;
	for (j = 0; j < nr; j++)
		sm->counts[first + j] = tsp_bitmap_get(tsp_block_data(blk), j);
	tsp_tm_unlock(tm, blk);
	sm->bitmap_locs[i] = ie.blocknr;
	return 0;
}

/*
 * The map's own blocks, its index and bitmaps, must be in use in it: one
 * without a count could be handed out as a new block, and overwritten
 * while the committed map still needs it.
 */
static int check_own_blocks(struct tsp_metadata_sm *sm)
{
	u32 i, n = nr_bitmaps(sm->nr_blocks);
	tsp_block_t b;

	for (i = 0; i <= n; i++) {
		b = i < n ? sm->bitmap_locs[i] : sm->index_loc;
		if (b >= sm->nr_blocks || !sm->counts[b]) {
			DMERR("metadata space map: its %s block %llu is not in use in it",
			      i < n ? "bitmap" : "index", (unsigned long long)b);
			return -EILSEQ;
		}
	}
	return 0;
}

/**
 * tsp_msm_open - read the metadata space map of an existing pool
 * @tm: transaction manager (its space map is not needed to read)
 * @root: the root from the superblock
 * @result: the space map
 *
 * Returns 0, -EILSEQ for inconsistent space map blocks, -ENOMEM or an IO
 * error.
 */
int tsp_msm_open(struct tsp_tm *tm, const void *root,
		 struct tsp_metadata_sm **result)
{
	struct tsp_disk_sm_root disk_root;
	struct tsp_btree_info info = overflow_info(tm);
	struct tsp_disk_metadata_index *mi;
	struct tsp_metadata_sm *sm;
	struct tsp_block *blk;
	tsp_block_t b, nr_blocks, overflowed = 0;
	u32 i;
	int r;

	memcpy(&disk_root, root, sizeof(disk_root));
	nr_blocks = le64_to_cpu(disk_root.nr_blocks);
	if (!nr_blocks || nr_blocks > MAX_BLOCKS ||
	    nr_blocks > tsp_bm_nr_blocks(tsp_tm_bm(tm))) {
		DMERR("metadata space map claims %llu blocks; the device has %llu",
		      (unsigned long long)nr_blocks,
		      (unsigned long long)tsp_bm_nr_blocks(tsp_tm_bm(tm)));
		return -EILSEQ;
	}

	sm = kzalloc(sizeof(*sm), GFP_KERNEL);
	if (!sm)
		return -ENOMEM;
	r = alloc_arrays(sm, nr_blocks);
	if (r)
		goto bad;
	sm->index_loc = le64_to_cpu(disk_root.bitmap_root);
	sm->ref_count_root = le64_to_cpu(disk_root.ref_count_root);

	r = tsp_tm_read_lock(tm, sm->index_loc, &tsp_index_validator, &blk);
	if (r)
		goto bad;
	mi = tsp_block_data(blk);
	for (i = 0; !r && i < nr_bitmaps(nr_blocks); i++)
		r = load_bitmap(sm, tm, i, &mi->index[i]);
	tsp_tm_unlock(tm, blk);
	if (r)
		goto bad;

	r = tsp_btree_walk(&info, sm->ref_count_root, load_overflow, sm);
	if (r)
		goto bad;

	for (b = 0; b < nr_blocks; b++) {
		overflowed += sm->counts[b] == 3 && !sm->committed[b];
		sm->committed[b] = !!sm->counts[b];
		sm->nr_allocated += !!sm->counts[b];
	}
	if (overflowed) {
		DMERR("metadata space map: %llu counts of 3 lack an overflow entry",
		      (unsigned long long)overflowed);
		r = -EILSEQ;
		goto bad;
	}
	r = check_own_blocks(sm);
	if (r)
		goto bad;

	*result = sm;
	return 0;
bad:
	tsp_msm_destroy(sm);
	return r;
}

/* Put the counts of 3 and more into a new overflow btree. */
static int rebuild_overflow(struct tsp_metadata_sm *sm, struct tsp_tm *tm)
{
	struct tsp_btree_info info = overflow_info(tm);
	tsp_block_t b, root;
	int r;

	if (sm->ref_count_root) {
		r = tsp_btree_del(&info, sm->ref_count_root);
		if (r)
			return r;
	}
	r = tsp_btree_empty(&info, &root);
	for (b = 0; !r && b < sm->nr_blocks; b++) {
		if (sm->counts[b] >= 3) {
			__le32 v = cpu_to_le32(sm->counts[b]);

			r = tsp_btree_insert(&info, root, b, &v, &root, NULL);
		}
	}
	sm->ref_count_root = root;
	return r;
}

/* Give a space map block a location the committed state cannot see. */
static int relocate(struct tsp_metadata_sm *sm, struct tsp_tm *tm,
		    tsp_block_t *loc, const struct tsp_block_validator *v)
{
	struct tsp_block *blk;
	bool inc;
	int r;

	if (*loc && tsp_msm_is_new(sm, *loc))
		return 0;
	if (*loc)
		r = tsp_tm_shadow_block(tm, *loc, v, &blk, &inc);
	else
		r = tsp_tm_new_block(tm, v, &blk);
	if (r)
		return r;
	*loc = tsp_block_location(blk);
	tsp_tm_unlock(tm, blk);
	return 0;
}

/*
 * The index entry of bitmap @i (below the number of bitmaps), as a commit
 * writes it, in @ie.  The free count and first free entry are counted
 * again only if a count in the bitmap went from or to zero since they
 * were last counted.
 */
static void index_entry(struct tsp_metadata_sm *sm, u32 i,
			struct tsp_index_entry *ie)
{
	struct tsp_index_entry *e = &sm->entries[i];
	u32 j, nr = bitmap_entries(sm, i);

	if (sm->recount[i]) {
		e->nr_free = 0;
		e->none_free_before = nr;
		for (j = 0; j < nr; j++) {
			if (!sm->counts[bitmap_first(i) + j]) {
				e->nr_free++;
				e->none_free_before = min(e->none_free_before, j);
			}
		}
		sm->recount[i] = 0;
	}
	e->blocknr = sm->bitmap_locs[i];
	*ie = *e;
}

static void pack_index_entry(struct tsp_metadata_sm *sm, u32 i,
			     struct tsp_disk_index_entry *disk)
{
	struct tsp_index_entry ie;

	index_entry(sm, i, &ie);
	tsp_index_entry_pack(&ie, disk);
}

static int write_bitmap(struct tsp_metadata_sm *sm, struct tsp_tm *tm, u32 i)
{
	struct tsp_block *blk;
	void *data;
	u32 j;
	int r;

	r = tsp_bm_write_lock(tsp_tm_bm(tm), sm->bitmap_locs[i],
			      &tsp_bitmap_validator, &blk);
	if (r)
		return r;
	data = tsp_block_data(blk);
	memset(tsp_bitmap_words(data), 0,
	       TSP_METADATA_BLOCK_SIZE - sizeof(struct tsp_disk_bitmap_header));
	for (j = 0; j < bitmap_entries(sm, i); j++)
		tsp_bitmap_set(data, j, min(sm->counts[bitmap_first(i) + j], 3u));
	tsp_bm_unlock(blk);
	return 0;
}

/**
 * tsp_msm_commit - write the space map for a commit
 * @sm: space map
 * @tm: transaction manager to allocate and write through
 * @root: out, TSP_SM_ROOT_SIZE bytes for the superblock
 *
 * Must be the last thing to allocate metadata blocks before the commit.
 */
int tsp_msm_commit(struct tsp_metadata_sm *sm, struct tsp_tm *tm, void *root)
{
	struct tsp_disk_sm_root disk_root;
	struct tsp_disk_metadata_index *mi;
	struct tsp_block *blk;
	u32 i, n = nr_bitmaps(sm->nr_blocks);
	bool again;
	int r;

	if (sm->overflow_dirty) {
		r = rebuild_overflow(sm, tm);
		if (r)
			return r;
		sm->overflow_dirty = false;
	}

	r = relocate(sm, tm, &sm->index_loc, &tsp_index_validator);
	if (r)
		return r;
	do {
		again = false;
		for (i = 0; i < n; i++) {
			if (!sm->dirty[i] ||
			    (sm->bitmap_locs[i] && tsp_msm_is_new(sm, sm->bitmap_locs[i])))
				continue;
			r = relocate(sm, tm, &sm->bitmap_locs[i], &tsp_bitmap_validator);
			if (r)
				return r;
			again = true;
		}
	} while (again);
	if (WARN_ON(sm->overflow_dirty))
		return -EINVAL;

	r = tsp_bm_write_lock(tsp_tm_bm(tm), sm->index_loc, &tsp_index_validator, &blk);
	if (r)
		return r;
	mi = tsp_block_data(blk);
	memset(mi->index, 0, sizeof(mi->index));
	for (i = 0; !r && i < n; i++) {
		if (tsp_msm_is_new(sm, sm->bitmap_locs[i]))
			r = write_bitmap(sm, tm, i);
		pack_index_entry(sm, i, &mi->index[i]);
		sm->dirty[i] = 0;
	}
	tsp_bm_unlock(blk);
	if (r)
		return r;

	memset(root, 0, TSP_SM_ROOT_SIZE);
	disk_root.nr_blocks = cpu_to_le64(sm->nr_blocks);
	disk_root.nr_allocated = cpu_to_le64(sm->nr_allocated);
	disk_root.bitmap_root = cpu_to_le64(sm->index_loc);
	disk_root.ref_count_root = cpu_to_le64(sm->ref_count_root);
	memcpy(root, &disk_root, sizeof(disk_root));
	return 0;
}

void tsp_msm_committed(struct tsp_metadata_sm *sm)
{
	tsp_block_t b;
	u32 i;

	for (i = 0; i < nr_bitmaps(sm->nr_blocks); i++) {
		if (!sm->uncommitted[i])
			continue;
		for (b = bitmap_first(i); b < bitmap_first(i) + bitmap_entries(sm, i); b++)
			sm->committed[b] = !!sm->counts[b];
		sm->uncommitted[i] = 0;
	}
	sm->nr_freed = 0;
}

/**
 * tsp_msm_walk_own_blocks - report the blocks holding the space map
 * @sm: space map (as last committed or opened)
 * @tm: transaction manager
 * @fn: called once per reference, as tsp_btree_check()'s node_fn
 * @context: for @fn
 *
 * Also checks the overflow btree's structure.
 */
int tsp_msm_walk_own_blocks(struct tsp_metadata_sm *sm, struct tsp_tm *tm,
			    int (*fn)(void *context, tsp_block_t b),
			    void *context)
{
	struct tsp_btree_info info = overflow_info(tm);
	u32 i;
	int r;

	r = fn(context, sm->index_loc);
	for (i = 0; r >= 0 && i < nr_bitmaps(sm->nr_blocks); i++)
		r = fn(context, sm->bitmap_locs[i]);
	if (r < 0)
		return r;
	return tsp_btree_check(&info, sm->ref_count_root, fn, NULL, context);
}
