/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * transaction-manager.h - copy-on-write of metadata blocks and two-phase
 * commit.
 *
 * A transaction never overwrites a block that the last committed
 * superblock can reach: tsp_tm_shadow_block() copies such a block to a
 * free location first.  A block allocated or shadowed in the current
 * transaction, and referenced once, is written in place.  Blocks freed in
 * the current transaction are not reused until it commits.  Commit writes
 * every dirty block, flushes, then writes the superblock and flushes
 * again, so a crash leaves either the old or the new transaction.
 *
 * The transaction manager owns the metadata space map (reference counts
 * of metadata blocks).
 *
 * Locking: none; the caller serialises every call (the pool metadata lock).
 * Every function may sleep.
 */
#ifndef TSP_TRANSACTION_MANAGER_H
#define TSP_TRANSACTION_MANAGER_H

#include "block-manager.h"

struct tsp_tm;
struct tsp_metadata_sm;

/*
 * The metadata space map has one index block of 255 bitmaps of 16320
 * entries: metadata beyond this many blocks (about 15.9 GiB) is unused.
 */
#define TSP_TM_MAX_BLOCKS (255ULL * 16320)

/* Bytes of the space map root kept in the superblock. */
#define TSP_SM_ROOT_SIZE 128

/**
 * tsp_tm_create - a transaction manager over a freshly formatted device
 * @bm: the block manager; every block of it is free except @sb_location
 * @sb_location: where the superblock lives (never shadowed)
 * @result: the new transaction manager
 *
 * Returns 0, -ENOMEM, or -ENOSPC if the device is too small.
 */
int __must_check tsp_tm_create(struct tsp_block_manager *bm,
			       tsp_block_t sb_location, struct tsp_tm **result);

/**
 * tsp_tm_open - a transaction manager over existing metadata
 * @bm: the block manager
 * @sb_location: where the superblock lives
 * @sm_root: the metadata space map root as stored in the superblock
 * @result: the new transaction manager
 *
 * Reads and checks the whole metadata space map.  Returns 0, -ENOMEM,
 * -EILSEQ for a corrupt space map, or an IO error.
 */
int __must_check tsp_tm_open(struct tsp_block_manager *bm,
			     tsp_block_t sb_location,
			     const void *sm_root, struct tsp_tm **result);
void tsp_tm_destroy(struct tsp_tm *tm);

struct tsp_block_manager *tsp_tm_bm(struct tsp_tm *tm);

/**
 * tsp_tm_pre_commit - write the metadata space map and every dirty block
 * @tm: the transaction manager
 * @sm_root: out, TSP_SM_ROOT_SIZE bytes to copy into the superblock
 *
 * Call with the superblock not locked; then write the superblock and
 * call tsp_tm_commit().
 */
int __must_check tsp_tm_pre_commit(struct tsp_tm *tm, void *sm_root);

/**
 * tsp_tm_commit - make the superblock written since pre_commit durable
 * @tm: the transaction manager
 * @superblock: the write locked superblock; unlocked by this call
 *
 * Afterwards blocks freed in the transaction become allocatable.
 */
int __must_check tsp_tm_commit(struct tsp_tm *tm, struct tsp_block *superblock);

void tsp_tm_set_nowait(struct tsp_tm *tm, bool nowait);
void tsp_tm_prepare_new_blocks(struct tsp_tm *tm);

/*
 * Allocate a block (reference count 1) and write lock it, zeroed.  In
 * no-wait mode -EWOULDBLOCK unless the block was prepared.
 */
int __must_check tsp_tm_new_block(struct tsp_tm *tm,
				  const struct tsp_block_validator *v,
				  struct tsp_block **result);

/**
 * tsp_tm_shadow_block - write lock a block, copying it first if needed
 * @tm: the transaction manager
 * @orig: the block the caller's parent references
 * @v: validator
 * @result: the writable block; its location may differ from @orig
 * @inc_children: out, true when @orig was shared: the caller now holds a
 *	private copy and must increment the reference count of everything
 *	the copy references
 *
 * The reference the parent held on @orig moves to the copy.
 */
int __must_check tsp_tm_shadow_block(struct tsp_tm *tm, tsp_block_t orig,
				     const struct tsp_block_validator *v,
				     struct tsp_block **result,
				     bool *inc_children);

/**
 * tsp_tm_relock_shadow - write lock a block this transaction shadowed, in place
 * @tm: the transaction manager
 * @b: a block allocated or copied in this transaction, referenced once
 * @v: validator
 * @result: out, @b write locked
 *
 * For a caller that remembers where a shadow it made is: it never copies.
 *
 * Return: 0; -ESTALE if @b is shared or was not written in this
 * transaction (nothing is locked); or the lock's error (-EWOULDBLOCK in
 * no-wait mode when @b is not cached).
 */
int __must_check tsp_tm_relock_shadow(struct tsp_tm *tm, tsp_block_t b,
				      const struct tsp_block_validator *v,
				      struct tsp_block **result);

int __must_check tsp_tm_read_lock(struct tsp_tm *tm, tsp_block_t b,
				  const struct tsp_block_validator *v,
				  struct tsp_block **result);
void tsp_tm_unlock(struct tsp_tm *tm, struct tsp_block *b);

/* Reference counts of metadata blocks. */
int __must_check tsp_tm_inc(struct tsp_tm *tm, tsp_block_t b);
/* Returns 0 or -EINVAL (count already zero: corrupt metadata). */
int __must_check tsp_tm_dec(struct tsp_tm *tm, tsp_block_t b);
int __must_check tsp_tm_ref(struct tsp_tm *tm, tsp_block_t b, u32 *count);

/* Metadata space usage, in blocks. */
tsp_block_t tsp_tm_nr_blocks(struct tsp_tm *tm);
tsp_block_t tsp_tm_nr_free(struct tsp_tm *tm);
/* Grow the metadata space map to @nr_blocks (never shrinks). */
int __must_check tsp_tm_extend(struct tsp_tm *tm, tsp_block_t nr_blocks);

/*
 * For checkers: call @fn for every block the metadata space map occupies
 * (index, bitmaps, overflow btree nodes), as tsp_btree_check()'s node_fn.
 */
int __must_check tsp_tm_walk_sm_blocks(struct tsp_tm *tm,
				       int (*fn)(void *context, tsp_block_t b),
				       void *context);

#endif /* TSP_TRANSACTION_MANAGER_H */
