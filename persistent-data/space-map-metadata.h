/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * space-map-metadata.h - reference counts of metadata blocks; internal to
 * the transaction manager.
 *
 * The counts live in memory (4 bytes a block: at most about 16 MiB for
 * the largest metadata device dm-thin's format allows) and are written to
 * dm-thin's on-disk layout (bitmaps, one index block, overflow btree) at
 * commit.  Keeping them in memory means allocating a metadata block never
 * recurses into the space map's own blocks; only the commit allocates
 * blocks for the space map itself, and it does that before it writes the
 * counts out.
 *
 * Locking: none; the transaction manager's caller serialises.
 */
#ifndef TSP_SPACE_MAP_METADATA_H
#define TSP_SPACE_MAP_METADATA_H

#include "transaction-manager.h"

struct tsp_metadata_sm;

struct tsp_metadata_sm *tsp_msm_create(tsp_block_t nr_blocks);
int __must_check tsp_msm_open(struct tsp_tm *tm, const void *root,
			      struct tsp_metadata_sm **result);
void tsp_msm_destroy(struct tsp_metadata_sm *sm);

tsp_block_t tsp_msm_nr_blocks(struct tsp_metadata_sm *sm);
tsp_block_t tsp_msm_nr_free(struct tsp_metadata_sm *sm);
u32 tsp_msm_count(struct tsp_metadata_sm *sm, tsp_block_t b);
/* True if @b was allocated after the last commit (so may be overwritten). */
bool tsp_msm_is_new(struct tsp_metadata_sm *sm, tsp_block_t b);
int __must_check tsp_msm_inc(struct tsp_metadata_sm *sm, tsp_block_t b);
int __must_check tsp_msm_dec(struct tsp_metadata_sm *sm, tsp_block_t b);
unsigned int tsp_msm_peek_new_blocks(struct tsp_metadata_sm *sm,
				     tsp_block_t *blocks, unsigned int nr);
void tsp_msm_take(struct tsp_metadata_sm *sm, tsp_block_t b);
int __must_check tsp_msm_extend(struct tsp_metadata_sm *sm, tsp_block_t nr_blocks);

/* Write the counts out through @tm; fills the TSP_SM_ROOT_SIZE root. */
int __must_check tsp_msm_commit(struct tsp_metadata_sm *sm, struct tsp_tm *tm,
				void *root);
/* The commit is durable: what was freed may now be reused. */
void tsp_msm_committed(struct tsp_metadata_sm *sm);

/* Call @fn for every block the space map itself occupies. */
int __must_check tsp_msm_walk_own_blocks(struct tsp_metadata_sm *sm,
					 struct tsp_tm *tm,
					 int (*fn)(void *context, tsp_block_t b),
					 void *context);

#endif /* TSP_SPACE_MAP_METADATA_H */
