// SPDX-License-Identifier: GPL-2.0-only
/*
 * transaction-manager.c - shadowing and two-phase commit of metadata.
 *
 * Rule: a block that the last committed superblock can reach is never
 * written.  Whether a block can be reached is answered by the metadata
 * space map: a block in use now but not at the last commit was allocated
 * in this transaction.  Such a block, if referenced once, is modified in
 * place; anything else is copied to a new block first (shadowed).
 *
 * Commit: the metadata space map writes itself (allocating its own new
 * blocks first), every dirty block is written and the device flushed;
 * then the caller fills in the superblock, which we write and flush.
 *
 * No-wait mode (tsp_tm_set_nowait()), for updates made where metadata
 * IO cannot be waited for: only blocks in the cache are locked, only
 * blocks already written in this transaction are shadowed (in place), and
 * a new block is allocated only if its buffer was prepared in the cache
 * beforehand (tsp_tm_prepare_new_blocks()); anything else fails with
 * -EWOULDBLOCK before it changes anything.  (A btree insert refused on
 * its way down may have split a node above: a change complete in itself,
 * which maps nothing new.)
 *
 * Locking: none; the caller serialises every call.
 */
#define DM_MSG_PREFIX "thin-scalable metadata"

#include "transaction-manager.h"
#include "space-map-metadata.h"

/* Fewer blocks than this cannot hold even an empty pool. */
#define MIN_METADATA_BLOCKS 16

struct tsp_tm {
	struct tsp_block_manager *bm;
	struct tsp_metadata_sm *sm;
	tsp_block_t sb_location;
	bool nowait;
	/* No-wait mode allocated or wanted a block since the last prepare. */
	bool prepare;
};

/* New blocks no-wait mode may allocate between two prepares. */
#define PREPARED_BLOCKS 16

static tsp_block_t usable_blocks(struct tsp_block_manager *bm)
{
	return min_t(tsp_block_t, tsp_bm_nr_blocks(bm),
		     (tsp_block_t)TSP_TM_MAX_BLOCKS);
}

/**
 * tsp_tm_create - see transaction-manager.h
 * @bm: block manager
 * @sb_location: the superblock's block
 * @result: out
 */
int tsp_tm_create(struct tsp_block_manager *bm, tsp_block_t sb_location,
		  struct tsp_tm **result)
{
	struct tsp_tm *tm;
	int r;

	if (usable_blocks(bm) < MIN_METADATA_BLOCKS) {
		DMERR("metadata device too small: %llu blocks",
		      (unsigned long long)tsp_bm_nr_blocks(bm));
		return -ENOSPC;
	}

	tm = kzalloc(sizeof(*tm), GFP_KERNEL);
	if (!tm)
		return -ENOMEM;
	tm->bm = bm;
	tm->sb_location = sb_location;
	tm->sm = tsp_msm_create(usable_blocks(bm));
	if (!tm->sm) {
		kfree(tm);
		return -ENOMEM;
	}
	r = tsp_msm_inc(tm->sm, sb_location);
	if (r) {
		tsp_tm_destroy(tm);
		return r;
	}

	*result = tm;
	return 0;
}

/**
 * tsp_tm_open - see transaction-manager.h
 * @bm: block manager
 * @sb_location: the superblock's block
 * @sm_root: the metadata space map root from the superblock
 * @result: out
 */
int tsp_tm_open(struct tsp_block_manager *bm, tsp_block_t sb_location,
		const void *sm_root, struct tsp_tm **result)
{
	struct tsp_tm *tm;
	int r;

	tm = kzalloc(sizeof(*tm), GFP_KERNEL);
	if (!tm)
		return -ENOMEM;
	tm->bm = bm;
	tm->sb_location = sb_location;

	r = tsp_msm_open(tm, sm_root, &tm->sm);
	if (r) {
		kfree(tm);
		return r;
	}
	if (!tsp_msm_count(tm->sm, sb_location)) {
		DMERR("metadata space map does not account for the superblock");
		tsp_tm_destroy(tm);
		return -EILSEQ;
	}

	*result = tm;
	return 0;
}

void tsp_tm_destroy(struct tsp_tm *tm)
{
	if (tm->sm)
		tsp_msm_destroy(tm->sm);
	kfree(tm);
}

struct tsp_block_manager *tsp_tm_bm(struct tsp_tm *tm)
{
	return tm->bm;
}

int tsp_tm_pre_commit(struct tsp_tm *tm, void *sm_root)
{
	int r = tsp_msm_commit(tm->sm, tm, sm_root);

	return r ? r : tsp_bm_flush(tm->bm);
}

int tsp_tm_commit(struct tsp_tm *tm, struct tsp_block *superblock)
{
	int r;

	if (WARN_ON(tsp_block_location(superblock) != tm->sb_location)) {
		tsp_bm_unlock(superblock);
		return -EINVAL;
	}

	tsp_bm_unlock(superblock);
	r = tsp_bm_flush(tm->bm);
	if (!r)
		tsp_msm_committed(tm->sm);
	return r;
}

/**
 * tsp_tm_set_nowait - enter or leave no-wait mode
 * @tm: transaction manager
 * @nowait: true to enter
 *
 * See "No-wait mode" above.  The caller leaves it before it unlocks the
 * transaction for others.
 */
void tsp_tm_set_nowait(struct tsp_tm *tm, bool nowait)
{
	tm->nowait = nowait;
}

/* Lock @b for reading or writing, from the cache alone in no-wait mode. */
static int tm_lock(struct tsp_tm *tm, tsp_block_t b,
		   const struct tsp_block_validator *v, bool write,
		   struct tsp_block **result)
{
	if (tm->nowait)
		return tsp_bm_lock_cached(tm->bm, b, v, write, result);
	if (write)
		return tsp_bm_write_lock(tm->bm, b, v, result);
	return tsp_bm_read_lock(tm->bm, b, v, result);
}

int tsp_tm_new_block(struct tsp_tm *tm, const struct tsp_block_validator *v,
		     struct tsp_block **result)
{
	tsp_block_t b;
	int r;

	if (tm->nowait)
		tm->prepare = true;
	/* The block is allocated only once it is locked: nothing to undo. */
	if (!tsp_msm_peek_new_blocks(tm->sm, &b, 1))
		return tm->nowait ? -EWOULDBLOCK : -ENOSPC;
	if (tm->nowait)
		r = tsp_bm_write_lock_zero_cached(tm->bm, b, v, result);
	else
		r = tsp_bm_write_lock_zero(tm->bm, b, v, result);
	if (!r)
		tsp_msm_take(tm->sm, b);
	return r;
}

/**
 * tsp_tm_prepare_new_blocks - let no-wait mode allocate new blocks
 * @tm: transaction manager, not in no-wait mode
 *
 * If no-wait mode allocated a block, or wanted one, since the last call:
 * puts the buffers of the next blocks the metadata space map will hand
 * out in the cache, so that no-wait mode may allocate them (as long as
 * nothing else allocates them first and dm-bufio keeps them).  Errors
 * only mean later refusals, and are not reported.  Context: may sleep
 * and wait for IO.
 */
void tsp_tm_prepare_new_blocks(struct tsp_tm *tm)
{
	tsp_block_t blocks[PREPARED_BLOCKS];
	unsigned int i, nr;

	if (!tm->prepare || WARN_ON_ONCE(tm->nowait))
		return;
	tm->prepare = false;
	nr = tsp_msm_peek_new_blocks(tm->sm, blocks, ARRAY_SIZE(blocks));
	for (i = 0; i < nr; i++)
		if (tsp_bm_prepare_zero(tm->bm, blocks[i]))
			break;
}

/*
 * @b, whose reference count is @count, was allocated or copied in this
 * transaction and nothing else references it: it is written in place.
 */
static bool private_shadow(struct tsp_tm *tm, tsp_block_t b, u32 count)
{
	return count == 1 && tsp_msm_is_new(tm->sm, b);
}

/**
 * tsp_tm_shadow_block - see transaction-manager.h
 * @tm: transaction manager
 * @orig: the block
 * @v: its validator
 * @result: out, the writable block
 * @inc_children: out, whether the caller must add references for what
 *	the copy points to
 */
int tsp_tm_shadow_block(struct tsp_tm *tm, tsp_block_t orig,
			const struct tsp_block_validator *v,
			struct tsp_block **result, bool *inc_children)
{
	struct tsp_block *orig_blk;
	u32 count = tsp_msm_count(tm->sm, orig);
	int r;

	if (!count) {
		DMERR("%s block %llu is referenced but free in the space map",
		      v->name, (unsigned long long)orig);
		return -EILSEQ;
	}

	*inc_children = false;
	if (private_shadow(tm, orig, count))
		return tm_lock(tm, orig, v, true, result);
	if (tm->nowait)
		return -EWOULDBLOCK;

	r = tsp_bm_read_lock(tm->bm, orig, v, &orig_blk);
	if (r)
		return r;
	r = tsp_tm_new_block(tm, v, result);
	if (r) {
		tsp_bm_unlock(orig_blk);
		return r;
	}
	memcpy(tsp_block_data(*result), tsp_block_data(orig_blk),
	       TSP_METADATA_BLOCK_SIZE);
	tsp_bm_unlock(orig_blk);

	r = tsp_msm_dec(tm->sm, orig);
	if (r) {
		tsp_bm_unlock(*result);
		return r;
	}
	*inc_children = count > 1;
	return 0;
}

/**
 * tsp_tm_relock_shadow - see transaction-manager.h
 * @tm: transaction manager
 * @b: the block
 * @v: its validator
 * @result: out, @b write locked
 */
int tsp_tm_relock_shadow(struct tsp_tm *tm, tsp_block_t b,
			 const struct tsp_block_validator *v,
			 struct tsp_block **result)
{
	if (!private_shadow(tm, b, tsp_msm_count(tm->sm, b)))
		return -ESTALE;
	return tm_lock(tm, b, v, true, result);
}

int tsp_tm_read_lock(struct tsp_tm *tm, tsp_block_t b,
		     const struct tsp_block_validator *v,
		     struct tsp_block **result)
{
	return tm_lock(tm, b, v, false, result);
}

void tsp_tm_unlock(struct tsp_tm *tm, struct tsp_block *b)
{
	tsp_bm_unlock(b);
}

int tsp_tm_inc(struct tsp_tm *tm, tsp_block_t b)
{
	return tsp_msm_inc(tm->sm, b);
}

int tsp_tm_dec(struct tsp_tm *tm, tsp_block_t b)
{
	return tsp_msm_dec(tm->sm, b);
}

int tsp_tm_ref(struct tsp_tm *tm, tsp_block_t b, u32 *count)
{
	if (b >= tsp_msm_nr_blocks(tm->sm)) {
		DMERR("metadata block %llu is beyond the metadata space map",
		      (unsigned long long)b);
		return -EILSEQ;
	}
	*count = tsp_msm_count(tm->sm, b);
	return 0;
}

tsp_block_t tsp_tm_nr_blocks(struct tsp_tm *tm)
{
	return tsp_msm_nr_blocks(tm->sm);
}

tsp_block_t tsp_tm_nr_free(struct tsp_tm *tm)
{
	return tsp_msm_nr_free(tm->sm);
}

int tsp_tm_extend(struct tsp_tm *tm, tsp_block_t nr_blocks)
{
	if (nr_blocks > tsp_bm_nr_blocks(tm->bm))
		return -EINVAL;
	return tsp_msm_extend(tm->sm, min_t(tsp_block_t, nr_blocks,
					    TSP_TM_MAX_BLOCKS));
}

int tsp_tm_walk_sm_blocks(struct tsp_tm *tm,
			  int (*fn)(void *context, tsp_block_t b), void *context)
{
	return tsp_msm_walk_own_blocks(tm->sm, tm, fn, context);
}
