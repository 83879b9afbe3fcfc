/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * dm-thin-metadata.h - the pool metadata API: thin devices, their block
 * mappings, snapshots, data space, transactions, in dm-thin's on-disk
 * format (version 2), so thin-provisioning-tools and the kernel's
 * thin-pool read what we write and we read what they write.
 *
 * Two opaque types: struct tsp_pool_metadata (one pool's metadata device)
 * and struct tsp_thin_device (one thin device opened in it).
 *
 * Locking: every function takes the pool metadata lock (a rw_semaphore:
 * lookups share it, updates hold it exclusively); functions named __x
 * inside dm-thin-metadata.c assume it is held.  Every function may sleep,
 * except three that take no lock and never sleep: tsp_thin_dev_id() and
 * tsp_thin_fast_of(), which read what never changes, and the inline
 * tsp_thin_find_block_fast() (the map path's lookup; see "The mapping
 * cache" below).
 *
 * Return codes, for every function returning int: 0 on success;
 * -ENODATA for a virtual block that is not mapped, or a device id that
 * is not in use (as dm-thin, whose "delete" of a missing device lvm2
 * takes for done); -ENODEV for an open device deleted meanwhile; -EEXIST
 * for a device id in use; -EBUSY for an open device being
 * deleted, a metadata snapshot that exists, or a device still open at
 * close; -ENOSPC when out of data or metadata space; -EINVAL for bad
 * arguments; -EILSEQ for corrupt metadata; -EPERM when the metadata is
 * read only or failed; -ENOMEM; IO errors.  After any update fails the
 * metadata is in the failed state until tsp_pool_abort_metadata().
 */
#ifndef TSP_DM_THIN_METADATA_H
#define TSP_DM_THIN_METADATA_H

#include "persistent-data/transaction-manager.h"
#include "mapping-cache.h"

/* The largest device id dm-thin accepts: 24 bits. */
#define TSP_THIN_MAX_DEV_ID ((1ULL << 24) - 1)
/* Metadata beyond this many blocks (about 15.9 GiB) is not used. */
#define TSP_METADATA_MAX_BLOCKS TSP_TM_MAX_BLOCKS
/* Data block size limits, in 512-byte sectors (64 KiB to 1 GiB). */
#define TSP_DATA_BLOCK_SIZE_MIN_SECTORS 128
#define TSP_DATA_BLOCK_SIZE_MAX_SECTORS 2097152

typedef u64 tsp_thin_id;

struct tsp_pool_metadata;
struct tsp_thin_device;

/**
 * tsp_pool_metadata_open - open a pool's metadata, formatting if empty
 * @bdev: the metadata device
 * @data_block_size: data block size in sectors
 * @nr_data_blocks: the data device's size in data blocks (used when
 *	formatting; an existing pool keeps its size until resized)
 * @format_device: format if the superblock is all zeroes
 * @result: the opened metadata
 *
 * Returns 0, or -EILSEQ (bad checksum, magic or version), -EINVAL (data
 * block size differs from the one on disk), -ENOSPC (device too small),
 * -ENOMEM or an IO error, with a DMERR saying which.
 */
int __must_check tsp_pool_metadata_open(struct block_device *bdev,
					sector_t data_block_size,
					tsp_block_t nr_data_blocks,
					bool format_device,
					struct tsp_pool_metadata **result);
/* Commit (unless read only or failed) and free; -EBUSY if devices open. */
int tsp_pool_metadata_close(struct tsp_pool_metadata *pmd);

int __must_check tsp_pool_create_thin(struct tsp_pool_metadata *pmd,
				      tsp_thin_id dev);
/* @origin must be quiesced by the caller (suspended) as with dm-thin. */
int __must_check tsp_pool_create_snap(struct tsp_pool_metadata *pmd,
				      tsp_thin_id dev, tsp_thin_id origin);
int __must_check tsp_pool_delete_thin_device(struct tsp_pool_metadata *pmd,
					     tsp_thin_id dev);

int __must_check tsp_pool_commit_metadata(struct tsp_pool_metadata *pmd);
int __must_check tsp_pool_commit_metadata_hold_freed(struct tsp_pool_metadata *pmd);
void tsp_pool_release_held_blocks(struct tsp_pool_metadata *pmd);
/* Drop every change since the last commit; leaves the failed state. */
int __must_check tsp_pool_abort_metadata(struct tsp_pool_metadata *pmd);
/*
 * After a failed update: abort, set needs_check and make the metadata
 * read only, with no other update in between.  Nothing to do on read
 * only metadata, unless an update failed since the last abort.
 */
int __must_check tsp_pool_metadata_fail(struct tsp_pool_metadata *pmd);
bool tsp_pool_metadata_needs_abort(struct tsp_pool_metadata *pmd);

/* Compare and swap: -EINVAL if @current_id is not the stored one. */
int __must_check tsp_pool_set_metadata_transaction_id(struct tsp_pool_metadata *pmd,
						      u64 current_id, u64 new_id);
int __must_check tsp_pool_get_metadata_transaction_id(struct tsp_pool_metadata *pmd,
						      u64 *result);

/* Metadata snapshot for thin_dump -m on a live pool (commits first). */
int __must_check tsp_pool_reserve_metadata_snap(struct tsp_pool_metadata *pmd);
int __must_check tsp_pool_release_metadata_snap(struct tsp_pool_metadata *pmd);
/* The held root's location, 0 if none. */
int __must_check tsp_pool_get_metadata_snap(struct tsp_pool_metadata *pmd,
					    tsp_block_t *result);

int __must_check tsp_pool_open_thin_device(struct tsp_pool_metadata *pmd,
					   tsp_thin_id dev,
					   struct tsp_thin_device **td);
void tsp_pool_close_thin_device(struct tsp_thin_device *td);
tsp_thin_id tsp_thin_dev_id(struct tsp_thin_device *td);

/**
 * struct tsp_thin_lookup_result - where a virtual block lives
 * @block: the data block
 * @shared: the block may be shared with a snapshot (write must copy)
 */
struct tsp_thin_lookup_result {
	tsp_block_t block;
	bool shared;
};

/*
 * Returns 0, -ENODATA, -EPERM (a failed update awaits its abort) or a read
 * error.  Caches what it finds in the mapping cache (as does
 * tsp_thin_find_mapped_range()).
 */
int __must_check tsp_thin_find_block(struct tsp_thin_device *td,
				     tsp_block_t virt,
				     struct tsp_thin_lookup_result *result);

/*
 * The mapping cache.
 *
 * The pool metadata owns a mapping cache (mapping-cache.h) of
 * (device, virtual block) -> (data block, time), filled by
 * tsp_thin_find_block() and tsp_thin_find_mapped_range() and kept up to
 * date by every update, so that the map path can look a block up without
 * any lock: tsp_thin_find_block_fast().  Its default budget is
 * TSP_MC_DEFAULT_BUDGET bytes.
 *
 * What a hit promises.  The cache is only ever a subset of the metadata
 * as of the moment.  Every function that removes or changes a mapping
 * (tsp_thin_remove_block(), tsp_thin_remove_range(), tsp_thin_insert_block()
 * over a mapped block, tsp_pool_delete_thin_device(),
 * tsp_pool_abort_metadata(), and any update that fails and so puts the
 * metadata in the failed state, which empties the cache) changes the
 * cache under the metadata lock held for writing, before it returns.
 * Fills happen under the lock held for reading, between the btree lookup
 * and the unlock, so a fill cannot put back a mapping that a concurrent
 * update removed: the update waits for the lock.  Therefore:
 *
 *   - a fast lookup that starts after such a function returned never
 *     returns the old mapping;
 *   - a fast lookup that was already running (an RCU reader that began
 *     before the cache was changed) may still return it: it may have
 *     read the bucket before the change, or still be on a table that
 *     growing replaced, which is freed only after an RCU grace period.
 *
 * Hence the caller's contract (DESIGN.md section 4, deferred free): an
 * unmapped data block may be reused only after every IO remapped through
 * a lookup that may have seen the old mapping has completed.  If the
 * target does the lookup and enters its IO epoch inside one RCU
 * read-side critical section, it suffices to wait, after the unmapping
 * call returned, for a grace period (synchronize_rcu(): every lookup that
 * may have seen the old mapping has then entered the epoch) and then for
 * the epoch to drain, before the freed blocks can be handed out again.
 *
 * Snapshots.  tsp_pool_create_snap() requires the origin to be quiesced
 * (suspended); it moves the origin's snapshotted_time forward, so after
 * it every cached mapping of the origin older than the snapshot is
 * reported shared, without walking the cache.
 */

/**
 * struct tsp_thin_fast - what tsp_thin_find_block_fast() reads of an open
 *	thin device, without any lock
 * @cache: where the pool keeps its RCU pointer to the mapping cache
 *	(read with rcu_dereference(*@cache): the cache is replaced when
 *	its budget changes)
 * @id: the device's id (@cache and @id are set before the device is
 *	visible, and never change)
 * @snapshotted_time: the time of the device's last snapshot
 * @mapped_end: no virtual block at or past it is mapped: inserts raise
 *	it, removals leave it (an upper bound, not the highest mapping);
 *	U64_MAX when unknown.  Read from the tree when the device comes
 *	into core and on abort.  A lookup past it needs no walk: a device
 *	filled in ascending order finds each new block unmapped for free.
 *
 * Part of struct tsp_thin_device and written only by dm-thin-metadata.c,
 * under the metadata lock (with WRITE_ONCE() for @snapshotted_time and
 * @mapped_end); public only so that the map path's lookup can be inline.
 * A stale @mapped_end costs a lookup a miss, nothing more.
 */
struct tsp_thin_fast {
	struct tsp_mapping_cache __rcu **cache;
	tsp_thin_id id;
	u32 snapshotted_time;
	tsp_block_t mapped_end;
};

const struct tsp_thin_fast *tsp_thin_fast_of(struct tsp_thin_device *td);

/**
 * tsp_thin_find_block_fast - where a virtual block is mapped, if cached
 * @fast: what tsp_thin_fast_of() gave for an open thin device; the
 *	caller keeps the device open until this returns
 * @virt: virtual block
 * @result: out, as tsp_thin_find_block() would give it: @shared is the
 *	device's snapshotted_time > the mapping's time
 *
 * Context: map path, inside the caller's rcu_read_lock().  Never sleeps;
 * takes no lock (not the metadata lock either) and does no atomic
 * read-modify-write.  Inline: the map path calls it for every IO.
 *
 * Return: 0 on a hit, or -EWOULDBLOCK on a miss (not cached, or not
 * mapped at all: the caller defers to a worker that calls
 * tsp_thin_find_block()).  A failed pool's cache is empty, so it misses.
 */
static __always_inline int __must_check
tsp_thin_find_block_fast(const struct tsp_thin_fast *fast, tsp_block_t virt,
			 struct tsp_thin_lookup_result *result)
{
	struct tsp_mc_mapping m;

	/* Nothing is mapped there: spare the cache a lookup bound to miss. */
	if (virt >= READ_ONCE(fast->mapped_end) ||
	    !tsp_mc_lookup(rcu_dereference(*fast->cache), fast->id, virt, &m))
		return -EWOULDBLOCK;
	result->block = m.block;
	result->shared = READ_ONCE(fast->snapshotted_time) > m.time;
	return 0;
}

/* The mapping cache's counters; returns 0.  May sleep. */
int tsp_pool_cache_stats(struct tsp_pool_metadata *pmd,
			 struct tsp_mc_stats *stats);

/*
 * Replace the mapping cache with an empty one of @budget bytes (0: cache
 * nothing), freeing the old one after an RCU grace period; fast lookups
 * may run meanwhile.  Returns 0 or -ENOMEM.  May sleep.
 */
int __must_check tsp_pool_metadata_set_cache_budget(struct tsp_pool_metadata *pmd,
						    u64 budget);

/**
 * tsp_thin_find_mapped_range - the first run of mapped blocks in a range
 * @td: thin device
 * @begin: first virtual block of the range
 * @end: one past its last
 * @thin_begin: out, first virtual block of the run
 * @thin_end: out, one past its last
 * @pool_begin: out, the data block @thin_begin maps to
 * @maybe_shared: out, whether the run may be shared
 *
 * A run is consecutive virtual blocks mapped to consecutive data blocks
 * with the same sharing.  Returns -ENODATA if nothing in the range is
 * mapped.
 */
int __must_check tsp_thin_find_mapped_range(struct tsp_thin_device *td,
					    tsp_block_t begin, tsp_block_t end,
					    tsp_block_t *thin_begin,
					    tsp_block_t *thin_end,
					    tsp_block_t *pool_begin,
					    bool *maybe_shared);

/* Allocate a data block (reference count 1) for tsp_thin_insert_block(). */
int __must_check tsp_pool_alloc_data_block(struct tsp_pool_metadata *pmd,
					   tsp_block_t *result);
/* Give back an allocated block that will not be mapped after all. */
int __must_check tsp_pool_release_data_block(struct tsp_pool_metadata *pmd,
					     tsp_block_t b);
/* Map @virt to @data, taking over the allocation's reference. */
int __must_check tsp_thin_insert_block(struct tsp_thin_device *td,
				       tsp_block_t virt, tsp_block_t data);

/*
 * Look @virt up and, if it is unmapped, allocate and map it, in one
 * update; or -EEXIST (@virt is mapped, @result says where) or
 * -EWOULDBLOCK, having changed nothing, or another error, having failed
 * the metadata (see dm-thin-metadata.c).
 */
int __must_check tsp_thin_provision(struct tsp_thin_device *td,
				    tsp_block_t virt, tsp_block_t keep_free,
				    struct tsp_thin_lookup_result *result);
/*
 * Allocate and map in one walk, for the map path: waits for no IO and no
 * lock; 0, or -EEXIST or -EWOULDBLOCK, having changed nothing, or
 * another error, having failed the metadata.
 */
int __must_check tsp_thin_provision_nowait(struct tsp_thin_device *td,
					   tsp_block_t virt,
					   tsp_block_t keep_free,
					   tsp_block_t metadata_keep_free,
					   tsp_block_t *data);

/* One mapping of a batch for tsp_pool_insert_mappings(). */
struct tsp_new_mapping {
	struct list_head list;
	struct tsp_thin_device *td;
	tsp_block_t virt;
	tsp_block_t data;
};

/*
 * tsp_thin_insert_block() for each of @mappings in list order, in one
 * update: the metadata lock is taken once for the whole batch.  Stops at
 * the first failure; *@nr_inserted says how many were inserted.
 */
int __must_check tsp_pool_insert_mappings(struct tsp_pool_metadata *pmd,
					  struct list_head *mappings,
					  unsigned int *nr_inserted);
int __must_check tsp_thin_remove_block(struct tsp_thin_device *td,
				       tsp_block_t virt);
/* Unmap [@begin, @end); not an error if nothing was mapped. */
int __must_check tsp_thin_remove_range(struct tsp_thin_device *td,
				       tsp_block_t begin, tsp_block_t end);

int __must_check tsp_thin_get_mapped_count(struct tsp_thin_device *td,
					   tsp_block_t *result);
/* -ENODATA when nothing is mapped. */
int __must_check tsp_thin_get_highest_mapped_block(struct tsp_thin_device *td,
						   tsp_block_t *result);
bool tsp_thin_changed_this_transaction(struct tsp_thin_device *td);
bool tsp_thin_aborted_changes(struct tsp_thin_device *td);
bool tsp_pool_changed_this_transaction(struct tsp_pool_metadata *pmd);

int __must_check tsp_pool_get_data_block_count(struct tsp_pool_metadata *pmd,
					       tsp_block_t *result);
int __must_check tsp_pool_get_free_block_count(struct tsp_pool_metadata *pmd,
					       tsp_block_t *result);
int __must_check tsp_pool_get_waiting_block_count(struct tsp_pool_metadata *pmd,
						  tsp_block_t *result);
/* Free blocks less those held for a passdown: see dm-thin-metadata.c. */
int __must_check tsp_pool_get_allocatable_block_count(struct tsp_pool_metadata *pmd,
						      bool freed_held,
						      tsp_block_t *result);
int __must_check tsp_pool_get_data_block_refcount(struct tsp_pool_metadata *pmd,
						  tsp_block_t b, u32 *result);
int __must_check tsp_pool_get_metadata_dev_size(struct tsp_pool_metadata *pmd,
						tsp_block_t *result);

/**
 * struct tsp_pool_space - a pool's free space, as one look saw it
 * @data_free: free data blocks
 * @metadata_blocks: blocks of the metadata device
 * @metadata_free: free metadata blocks
 */
struct tsp_pool_space {
	tsp_block_t data_free;
	tsp_block_t metadata_blocks;
	tsp_block_t metadata_free;
};

int __must_check tsp_pool_get_space(struct tsp_pool_metadata *pmd,
				    struct tsp_pool_space *space);
/* Grow the data space map; -EINVAL to shrink. */
int __must_check tsp_pool_resize_data_dev(struct tsp_pool_metadata *pmd,
					  tsp_block_t new_count);
/* Grow the metadata space map to @new_count blocks. */
int __must_check tsp_pool_resize_metadata_dev(struct tsp_pool_metadata *pmd,
					      tsp_block_t new_count);

/* Refuse every further update (read-only pool mode). */
void tsp_pool_metadata_read_only(struct tsp_pool_metadata *pmd);
void tsp_pool_metadata_read_write(struct tsp_pool_metadata *pmd);
/* Set the needs_check flag in the superblock and commit it. */
int __must_check tsp_pool_metadata_set_needs_check(struct tsp_pool_metadata *pmd);
bool tsp_pool_metadata_needs_check(struct tsp_pool_metadata *pmd);

/*
 * For tools (restore, dump, check): the superblock's fields, device
 * details, and mappings with their times.
 */
struct tsp_pool_info {
	u8 uuid[16];
	u32 flags;
	u32 version;
	u32 time;
	u64 transaction_id;
	u64 metadata_snap;
	u32 data_block_size;
	tsp_block_t nr_data_blocks;
	tsp_block_t nr_metadata_blocks;
};

struct tsp_thin_details {
	u64 mapped_blocks;
	u64 transaction_id;
	u32 creation_time;
	u32 snapshotted_time;
};

int __must_check tsp_pool_get_info(struct tsp_pool_metadata *pmd,
				   struct tsp_pool_info *info);
/* Restore only: set the superblock's time, transaction id and flags. */
int __must_check tsp_pool_restore_superblock(struct tsp_pool_metadata *pmd,
					     u32 time, u64 transaction_id,
					     u32 flags);
/* Restore only: create an empty device with the given details. */
int __must_check tsp_pool_restore_thin(struct tsp_pool_metadata *pmd,
				       tsp_thin_id dev,
				       const struct tsp_thin_details *details);
/* Restore only: map @virt to @data at @time, adding a reference to @data. */
int __must_check tsp_thin_restore_block(struct tsp_thin_device *td,
					tsp_block_t virt, tsp_block_t data,
					u32 time);

/* Devices in id order; a non-zero return from @fn stops the walk. */
int __must_check tsp_pool_walk_devices(struct tsp_pool_metadata *pmd,
				       int (*fn)(void *context, tsp_thin_id dev,
						 const struct tsp_thin_details *d),
				       void *context);
/* Mappings in virtual block order. */
int __must_check tsp_thin_walk_mappings(struct tsp_thin_device *td,
					int (*fn)(void *context, tsp_block_t virt,
						  tsp_block_t data, u32 time),
					void *context);

/**
 * tsp_pool_check - verify the whole committed metadata
 * @pmd: freshly opened metadata (no uncommitted changes)
 *
 * Checks every tree's structure and every reference count in both space
 * maps against the references actually found, including those of a held
 * metadata snapshot.  Returns 0 or -EILSEQ with DMERRs saying what is
 * wrong.  Userspace tools only: it allocates per-block counters.
 */
int __must_check tsp_pool_check(struct tsp_pool_metadata *pmd);

#endif /* TSP_DM_THIN_METADATA_H */
