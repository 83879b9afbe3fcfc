/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * space-map.h - reference counts of data blocks, dm-thin's on-disk data
 * space map: 2-bit counts in bitmap blocks, found through an index btree,
 * with counts of 3 and more in an overflow btree.
 *
 * A block freed in the current transaction is not handed out again until
 * the transaction commits (the committed metadata may still map it, or an
 * IO still use it).
 *
 * Locking: none; the caller serialises.  Every function may sleep.  The
 * map keeps the bitmap it changed last write locked between calls: the
 * caller unlocks it (tsp_data_sm_unlock(), or the commit) before the
 * block manager flushes, goes read only or forgets blocks.
 * Return codes: 0; -ENOSPC when no block can be allocated (or, for
 * extend, the metadata device cannot hold the bitmaps); -EINVAL for a
 * block beyond the end or a shrink; -EILSEQ for corrupt metadata,
 * including a count that would go below zero; -ENOMEM; IO errors.
 */
#ifndef TSP_SPACE_MAP_H
#define TSP_SPACE_MAP_H

#include "transaction-manager.h"

struct tsp_data_sm;

/* Create an empty space map of @nr_blocks blocks. */
int __must_check tsp_data_sm_create(struct tsp_tm *tm, tsp_block_t nr_blocks,
				    struct tsp_data_sm **result);
/* Open the space map whose root (TSP_SM_ROOT_SIZE bytes) is @root. */
int __must_check tsp_data_sm_open(struct tsp_tm *tm, const void *root,
				  struct tsp_data_sm **result);
void tsp_data_sm_destroy(struct tsp_data_sm *sm);

tsp_block_t tsp_data_sm_nr_blocks(struct tsp_data_sm *sm);
tsp_block_t tsp_data_sm_nr_free(struct tsp_data_sm *sm);
tsp_block_t tsp_data_sm_nr_waiting(struct tsp_data_sm *sm);
tsp_block_t tsp_data_sm_nr_held(struct tsp_data_sm *sm);
int __must_check tsp_data_sm_get_count(struct tsp_data_sm *sm, tsp_block_t b,
				       u32 *count);
int __must_check tsp_data_sm_inc(struct tsp_data_sm *sm, tsp_block_t b);
int __must_check tsp_data_sm_dec(struct tsp_data_sm *sm, tsp_block_t b);
/* Allocate a free block: its count becomes 1. */
int __must_check tsp_data_sm_new_block(struct tsp_data_sm *sm, tsp_block_t *b);
/* The same in two steps, see space-map-data.c. */
int __must_check tsp_data_sm_reserve(struct tsp_data_sm *sm, tsp_block_t *b);
int __must_check tsp_data_sm_alloc_reserved(struct tsp_data_sm *sm,
					    tsp_block_t b);
/* Grow to @nr_blocks; -EINVAL to shrink. */
int __must_check tsp_data_sm_extend(struct tsp_data_sm *sm,
				    tsp_block_t nr_blocks);
/* Write what changed; fills @root (TSP_SM_ROOT_SIZE bytes). */
int __must_check tsp_data_sm_commit(struct tsp_data_sm *sm, void *root);
void tsp_data_sm_hold_freed(struct tsp_data_sm *sm);
/* Unlock the bitmap kept locked between changes, see space-map-data.c. */
void tsp_data_sm_unlock(struct tsp_data_sm *sm);
void tsp_data_sm_release_held(struct tsp_data_sm *sm);

/*
 * For checkers: call @fn for every metadata block the space map occupies
 * (index btree, bitmaps, overflow btree), as tsp_btree_check()'s node_fn.
 */
int __must_check tsp_data_sm_walk_own_blocks(struct tsp_data_sm *sm,
					     int (*fn)(void *context, tsp_block_t b),
					     void *context);

/*
 * For checkers: compare each bitmap's index entry (nr_free,
 * none_free_before) with the bitmap.  Reads every bitmap.
 */
int __must_check tsp_data_sm_check_index(struct tsp_data_sm *sm);

#endif /* TSP_SPACE_MAP_H */
