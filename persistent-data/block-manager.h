/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * block-manager.h - fixed size metadata blocks over dm-bufio, each read
 * checked by a validator (checksum, location, magic) and each write
 * prepared by it.
 *
 * Blocks written since the last flush stay held in a small pin table, so
 * that writing one again skips dm-bufio's lookup (see block-manager.c).
 *
 * Locking: the block manager itself takes no lock beyond dm-bufio's.  A
 * block is write locked by at most one holder at a time, and write locks,
 * flush, forget and read only are called by one holder at a time with no
 * reader about; the metadata layer above guarantees that by holding its
 * own lock, for writing, over all of them.  A holder may keep a block
 * write locked beyond that (the data space map's last bitmap), if no one
 * reads it through the block manager meanwhile, or if it marks the block
 * kept (tsp_bm_keep(), a btree cursor's leaf), which readers may share;
 * either way it is unlocked before a flush, forget or read only.  Every
 * function may sleep.
 */
#ifndef TSP_BLOCK_MANAGER_H
#define TSP_BLOCK_MANAGER_H

#include "compat.h"

#define TSP_METADATA_BLOCK_SIZE 4096
#define TSP_SECTOR_SHIFT 9
#define TSP_METADATA_BLOCK_SECTORS (TSP_METADATA_BLOCK_SIZE >> TSP_SECTOR_SHIFT)

typedef u64 tsp_block_t;

struct tsp_block_manager;
struct tsp_block;	/* a locked block */

/**
 * struct tsp_block_validator - how one kind of block is checked and sealed
 * @name: kind of block, for error messages
 * @prepare_for_write: fill in checksum and location just before the block
 *	is written; must not fail or sleep
 * @check: verify a block just read; returns 0 or a negative errno
 *	(-EILSEQ for a bad checksum or location)
 */
struct tsp_block_validator {
	const char *name;
	void (*prepare_for_write)(const struct tsp_block_validator *v,
				  struct tsp_block *b, size_t block_size);
	int (*check)(const struct tsp_block_validator *v,
		     struct tsp_block *b, size_t block_size);
};

struct tsp_block_manager *tsp_bm_create(struct block_device *bdev,
					unsigned int max_held);
void tsp_bm_destroy(struct tsp_block_manager *bm);

tsp_block_t tsp_bm_nr_blocks(struct tsp_block_manager *bm);

int __must_check tsp_bm_read_lock(struct tsp_block_manager *bm, tsp_block_t b,
				  const struct tsp_block_validator *v,
				  struct tsp_block **result);
int __must_check tsp_bm_write_lock(struct tsp_block_manager *bm, tsp_block_t b,
				   const struct tsp_block_validator *v,
				   struct tsp_block **result);
int __must_check tsp_bm_write_lock_zero(struct tsp_block_manager *bm,
					tsp_block_t b,
					const struct tsp_block_validator *v,
					struct tsp_block **result);
int __must_check tsp_bm_lock_cached(struct tsp_block_manager *bm,
				    tsp_block_t b,
				    const struct tsp_block_validator *v,
				    bool write, struct tsp_block **result);
int __must_check tsp_bm_write_lock_zero_cached(struct tsp_block_manager *bm,
					       tsp_block_t b,
					       const struct tsp_block_validator *v,
					       struct tsp_block **result);
int tsp_bm_prepare_zero(struct tsp_block_manager *bm, tsp_block_t b);
void tsp_bm_unlock(struct tsp_block *b);
void tsp_bm_keep(struct tsp_block *b);
void tsp_bm_unkeep(struct tsp_block *b);

int __must_check tsp_bm_flush(struct tsp_block_manager *bm);
void tsp_bm_forget(struct tsp_block_manager *bm, tsp_block_t b);
void tsp_bm_set_read_only(struct tsp_block_manager *bm);
void tsp_bm_set_read_write(struct tsp_block_manager *bm);

tsp_block_t tsp_block_location(struct tsp_block *b);
void *tsp_block_data(struct tsp_block *b);

u32 tsp_bm_checksum(const void *data, size_t len, u32 init_xor);

#endif /* TSP_BLOCK_MANAGER_H */
