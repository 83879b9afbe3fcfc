// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-thin-metadata.c - a pool's metadata in dm-thin's on-disk format.
 *
 * Glossary:
 *   superblock     block 0: roots of everything below, the transaction id,
 *                  the snapshot time, the held root
 *   mapping tree   two levels: dev id -> root of the device's tree of
 *                  virtual block -> (data block << 24 | time)
 *   details tree   dev id -> mapped blocks, transaction id, creation and
 *                  snapshotted times
 *   time           a counter bumped by every snapshot; a mapping made
 *                  before its device's snapshotted_time may be shared
 *   held root      a copy of the superblock whose trees are kept alive
 *                  for thin_dump -m on a live pool (metadata snapshot)
 *
 * A snapshot shares the origin's whole mapping tree by adding a reference
 * to its root; the btree copies nodes as either side is written.
 *
 * Mapping cache: the pool owns one (mapping-cache.h) that the map path
 * reads under RCU alone, through tsp_thin_find_block_fast().  It is kept a
 * subset of the metadata:
 *
 *   fill        tsp_thin_find_block() and tsp_thin_find_mapped_range()
 *               cache what the btree returned, under @root_lock held for
 *               reading, before releasing it: an update that would make
 *               the mapping stale waits for the lock, and then fixes the
 *               cache itself
 *   update      insert (and restore) caches the new mapping or drops the
 *               old one; remove and remove_range drop the blocks; deleting
 *               a device drops all of its blocks; all under @root_lock
 *               held for writing, before the function returns
 *   clear       on abort, and whenever an update fails (the in-core
 *               metadata is then in doubt until the abort)
 *
 * A device's snapshotted_time and mapped_end (struct tsp_thin_fast) are
 * read by the map path without the lock, so they are written with
 * WRITE_ONCE() once the device is visible.
 *
 * Locking: @root_lock, a rw_semaphore, protects everything in struct
 * tsp_pool_metadata and struct tsp_thin_device, except that @cache is
 * also read under RCU (swapped with rcu_assign_pointer() under the lock
 * held for writing, freed after a grace period) and a device's
 * snapshotted_time and mapped_end are also read with READ_ONCE().
 * Public functions but tsp_thin_dev_id() and tsp_thin_fast_of() take it
 * (shared for lookups, exclusive for updates) and call a __name() helper
 * that asserts it is held.  A provision leaves its device's
 * btree cursor kept, its leaf write locked till the next provision
 * (readers may share it): anything else that takes @root_lock for
 * writing parks it first (lock_for_update()).  Every function may
 * sleep but those two.  The map path's lookup, tsp_thin_find_block_fast(),
 * is inline in dm-thin-metadata.h and takes no lock.
 */
#define DM_MSG_PREFIX "thin-scalable metadata"

#include "dm-thin-metadata.h"
#include "mapping-cache.h"
#include "persistent-data/btree.h"
#include "persistent-data/space-map.h"

#define THIN_SUPERBLOCK_MAGIC 27022010
#define THIN_SUPERBLOCK_LOCATION 0
#define THIN_VERSION 2
#define THIN_MIN_VERSION 1
#define SUPERBLOCK_CSUM_XOR 160774
#define THIN_METADATA_CACHE_BLOCKS 64
#define THIN_NEEDS_CHECK_FLAG 1
#define TIME_BITS 24
#define NO_MAPPED_END U64_MAX	/* tsp_thin_fast.mapped_end unknown */

struct thin_disk_superblock {
	__le32 csum;
	__le32 flags;
	__le64 blocknr;
	u8 uuid[16];
	__le64 magic;
	__le32 version;
	__le32 time;
	__le64 trans_id;
	__le64 held_root;
	u8 data_space_map_root[TSP_SM_ROOT_SIZE];
	u8 metadata_space_map_root[TSP_SM_ROOT_SIZE];
	__le64 data_mapping_root;
	__le64 device_details_root;
	__le32 data_block_size;		/* sectors */
	__le32 metadata_block_size;	/* sectors */
	__le64 metadata_nr_blocks;
	__le32 compat_flags;
	__le32 compat_ro_flags;
	__le32 incompat_flags;
} __packed;

struct disk_device_details {
	__le64 mapped_blocks;
	__le64 transaction_id;
	__le32 creation_time;
	__le32 snapshotted_time;
} __packed;

struct tsp_pool_metadata {
	struct block_device *bdev;
	struct tsp_block_manager *bm;
	struct tsp_tm *tm;
	struct tsp_data_sm *data_sm;

	struct tsp_btree_info tl_info;		/* dev -> mapping tree root */
	struct tsp_btree_info tl_set_info;	/* the same, to move a root */
	struct tsp_btree_info bl_info;		/* virt -> mapping */
	struct tsp_btree_info details_info;	/* dev -> details */

	struct rw_semaphore root_lock;
	struct tsp_mapping_cache __rcu *cache;	/* never NULL once open */
	u8 uuid[16];
	u32 version;
	u32 flags;
	u32 time;
	u64 trans_id;
	tsp_block_t root;
	tsp_block_t details_root;
	tsp_block_t held_root;
	u32 data_block_size;
	u32 compat_flags, compat_ro_flags, incompat_flags;

	struct tsp_thin_device *devices;	/* opened or changed */
	/*
	 * The device whose cursor may be kept (its leaf write locked: see
	 * struct tsp_thin_device), or NULL: parked by anything that takes
	 * @root_lock for writing but a provision (lock_for_update()).
	 */
	struct tsp_thin_device *kept;
	/*
	 * Bumped by every change that may move a device's mapping tree
	 * root other than that device's own mapping updates, and by every
	 * commit and abort: it makes the roots open devices remember
	 * (struct tsp_thin_device) stale, and releases their cursors.
	 */
	u64 roots_gen;
	bool changed;		/* anything since the last commit */
	bool fail_io;		/* an update failed: abort before more */
	bool read_only;
};

struct tsp_thin_device {
	struct tsp_thin_device *next;
	struct tsp_pool_metadata *pmd;
	/* What the map path's lookup reads without the lock. */
	struct tsp_thin_fast fast;
	int open_count;
	bool changed;
	bool aborted_with_changes;	/* until its last opener closes it */
	u64 mapped_blocks;
	u64 transaction_id;
	u32 creation_time;

	/*
	 * The device's mapping tree root as the top-level tree holds it,
	 * valid while @root_gen equals pmd->roots_gen.  Set only by updates
	 * (under @root_lock held for writing), once they have shadowed the
	 * top-level path to the root in this transaction: while it is
	 * valid, lookups and updates skip the top-level tree.
	 */
	tsp_block_t root;
	u64 root_gen;

	/*
	 * At the leaf of the last block provisioned, so that the next one
	 * of a device written in order goes straight into it.  Kept (the
	 * leaf write locked, readers may share it) from one provision to
	 * the next, for one device at a time (@pmd->kept); parked, else.
	 * Valid only while @root is and only provisions change the tree:
	 * __device_root_for_update() releases it for any other change.
	 */
	struct tsp_btree_cursor cursor;
};

/*----------------------------------------------------------------
 * Superblock validator
 *--------------------------------------------------------------*/
static void sb_prepare_for_write(const struct tsp_block_validator *v,
				 struct tsp_block *b, size_t block_size)
{
	struct thin_disk_superblock *sb = tsp_block_data(b);

	sb->blocknr = cpu_to_le64(tsp_block_location(b));
	sb->csum = cpu_to_le32(tsp_bm_checksum(&sb->flags,
					       block_size - sizeof(__le32),
					       SUPERBLOCK_CSUM_XOR));
}

static int sb_check(const struct tsp_block_validator *v, struct tsp_block *b,
		    size_t block_size)
{
	struct thin_disk_superblock *sb = tsp_block_data(b);
	u32 csum;

	if (le64_to_cpu(sb->blocknr) != tsp_block_location(b)) {
		DMERR("superblock at %llu claims to be at %llu",
		      (unsigned long long)tsp_block_location(b),
		      (unsigned long long)le64_to_cpu(sb->blocknr));
		return -EILSEQ;
	}
	if (le64_to_cpu(sb->magic) != THIN_SUPERBLOCK_MAGIC) {
		DMERR("superblock has bad magic %llu",
		      (unsigned long long)le64_to_cpu(sb->magic));
		return -EILSEQ;
	}
	csum = tsp_bm_checksum(&sb->flags, block_size - sizeof(__le32),
			       SUPERBLOCK_CSUM_XOR);
	if (csum != le32_to_cpu(sb->csum)) {
		DMERR("superblock has a bad checksum");
		return -EILSEQ;
	}
	return 0;
}

static const struct tsp_block_validator sb_validator = {
	.name = "superblock",
	.prepare_for_write = sb_prepare_for_write,
	.check = sb_check,
};

/*----------------------------------------------------------------
 * Value types
 *--------------------------------------------------------------*/
static u64 pack_mapping(tsp_block_t data, u32 time)
{
	return (data << TIME_BITS) | time;
}

static void unpack_mapping(u64 v, tsp_block_t *data, u32 *time)
{
	*data = v >> TIME_BITS;
	*time = v & ((1 << TIME_BITS) - 1);
}

static int data_block_inc(void *context, const void *value)
{
	struct tsp_pool_metadata *pmd = context;
	tsp_block_t b;
	__le64 v;
	u32 t;

	memcpy(&v, value, sizeof(v));
	unpack_mapping(le64_to_cpu(v), &b, &t);
	return tsp_data_sm_inc(pmd->data_sm, b);
}

static int data_block_dec(void *context, const void *value)
{
	struct tsp_pool_metadata *pmd = context;
	tsp_block_t b;
	__le64 v;
	u32 t;

	memcpy(&v, value, sizeof(v));
	unpack_mapping(le64_to_cpu(v), &b, &t);
	return tsp_data_sm_dec(pmd->data_sm, b);
}

static int subtree_inc(void *context, const void *value)
{
	struct tsp_pool_metadata *pmd = context;
	__le64 v;

	memcpy(&v, value, sizeof(v));
	return tsp_tm_inc(pmd->tm, le64_to_cpu(v));
}

static int subtree_dec(void *context, const void *value)
{
	struct tsp_pool_metadata *pmd = context;
	__le64 v;

	memcpy(&v, value, sizeof(v));
	return tsp_btree_del(&pmd->bl_info, le64_to_cpu(v));
}

static void setup_btree_infos(struct tsp_pool_metadata *pmd)
{
	pmd->bl_info.tm = pmd->tm;
	pmd->bl_info.vt.context = pmd;
	pmd->bl_info.vt.size = sizeof(__le64);
	pmd->bl_info.vt.inc = data_block_inc;
	pmd->bl_info.vt.dec = data_block_dec;

	pmd->tl_info.tm = pmd->tm;
	pmd->tl_info.vt.context = pmd;
	pmd->tl_info.vt.size = sizeof(__le64);
	pmd->tl_info.vt.inc = subtree_inc;
	pmd->tl_info.vt.dec = subtree_dec;

	/*
	 * Moving a device's root: shadowing the old root already moved the
	 * top-level tree's reference to the new one, so overwriting must
	 * not drop another.
	 */
	pmd->tl_set_info = pmd->tl_info;
	pmd->tl_set_info.vt.dec = NULL;

	pmd->details_info.tm = pmd->tm;
	pmd->details_info.vt.size = sizeof(struct disk_device_details);
}

/*----------------------------------------------------------------
 * Locking
 *--------------------------------------------------------------*/
/*
 * Take @root_lock for writing, for anything but a provision: the kept
 * cursor (see struct tsp_btree_cursor) is parked, so that the update may
 * lock its leaf, change or share its tree, or commit.
 */
static void lock_for_update(struct tsp_pool_metadata *pmd)
{
	down_write(&pmd->root_lock);
	if (pmd->kept) {
		tsp_btree_cursor_park(&pmd->kept->cursor);
		pmd->kept = NULL;
	}
}

/*----------------------------------------------------------------
 * The mapping cache
 *--------------------------------------------------------------*/
/* The cache, for a holder of @root_lock (either way). */
static struct tsp_mapping_cache *__cache(struct tsp_pool_metadata *pmd)
{
	lockdep_assert_held(&pmd->root_lock);
	return rcu_dereference_protected(pmd->cache,
					 lockdep_is_held(&pmd->root_lock));
}

/* The in-core metadata is in doubt: keep nothing derived from it. */
static void __fail_io(struct tsp_pool_metadata *pmd)
{
	pmd->roots_gen++;
	pmd->fail_io = true;
	tsp_mc_clear(__cache(pmd));
}

/* No more changes: the block manager writes nothing from now on. */
static void __set_read_only(struct tsp_pool_metadata *pmd)
{
	pmd->read_only = true;
	if (pmd->data_sm)
		tsp_data_sm_unlock(pmd->data_sm);
	tsp_bm_set_read_only(pmd->bm);
}

/*----------------------------------------------------------------
 * Open, format, commit, abort
 *--------------------------------------------------------------*/
static int superblock_all_zeroes(struct tsp_block_manager *bm, bool *result)
{
	struct tsp_block *b;
	const u8 *data;
	size_t i;
	int r;

	r = tsp_bm_read_lock(bm, THIN_SUPERBLOCK_LOCATION, NULL, &b);
	if (r)
		return r;
	data = tsp_block_data(b);
	*result = true;
	for (i = 0; i < TSP_METADATA_BLOCK_SIZE; i++) {
		if (data[i]) {
			*result = false;
			break;
		}
	}
	tsp_bm_unlock(b);
	tsp_bm_forget(bm, THIN_SUPERBLOCK_LOCATION);
	return 0;
}

static void destroy_persistent_objects(struct tsp_pool_metadata *pmd)
{
	if (pmd->data_sm)
		tsp_data_sm_destroy(pmd->data_sm);
	if (pmd->tm)
		tsp_tm_destroy(pmd->tm);
	pmd->data_sm = NULL;
	pmd->tm = NULL;
}

static int __commit_transaction(struct tsp_pool_metadata *pmd);

static int format_metadata(struct tsp_pool_metadata *pmd,
			   tsp_block_t nr_data_blocks)
{
	int r;

	r = tsp_tm_create(pmd->bm, THIN_SUPERBLOCK_LOCATION, &pmd->tm);
	if (r)
		return r;
	setup_btree_infos(pmd);

	r = tsp_data_sm_create(pmd->tm, nr_data_blocks, &pmd->data_sm);
	if (!r)
		r = tsp_btree_empty(&pmd->tl_info, &pmd->root);
	if (!r)
		r = tsp_btree_empty(&pmd->details_info, &pmd->details_root);
	if (r) {
		DMERR("could not format metadata: %d", r);
		return r;
	}

	pmd->version = THIN_VERSION;
	pmd->changed = true;
	return __commit_transaction(pmd);
}

static int read_superblock(struct tsp_pool_metadata *pmd, u32 data_block_size)
{
	struct thin_disk_superblock *sb;
	struct tsp_block *b;
	int r;

	r = tsp_bm_read_lock(pmd->bm, THIN_SUPERBLOCK_LOCATION, &sb_validator, &b);
	if (r) {
		DMERR("could not read the superblock: %d", r);
		return r;
	}
	sb = tsp_block_data(b);

	pmd->version = le32_to_cpu(sb->version);
	pmd->incompat_flags = le32_to_cpu(sb->incompat_flags);
	pmd->compat_flags = le32_to_cpu(sb->compat_flags);
	pmd->compat_ro_flags = le32_to_cpu(sb->compat_ro_flags);
	pmd->data_block_size = le32_to_cpu(sb->data_block_size);
	if (pmd->version < THIN_MIN_VERSION || pmd->version > THIN_VERSION) {
		DMERR("metadata version %u is not supported (%u to %u)",
		      pmd->version, THIN_MIN_VERSION, THIN_VERSION);
		r = -EILSEQ;
	} else if (pmd->incompat_flags) {
		DMERR("metadata has incompatible features 0x%x", pmd->incompat_flags);
		r = -EINVAL;
	} else if (pmd->compat_ro_flags && !bdev_read_only(pmd->bdev)) {
		DMERR("metadata has read-only features 0x%x, on a writable device",
		      pmd->compat_ro_flags);
		r = -EINVAL;
	} else if (le32_to_cpu(sb->metadata_block_size) != TSP_METADATA_BLOCK_SECTORS) {
		DMERR("metadata block size %u sectors is not supported",
		      le32_to_cpu(sb->metadata_block_size));
		r = -EILSEQ;
	} else if (pmd->data_block_size < TSP_DATA_BLOCK_SIZE_MIN_SECTORS ||
		   pmd->data_block_size > TSP_DATA_BLOCK_SIZE_MAX_SECTORS ||
		   pmd->data_block_size % TSP_DATA_BLOCK_SIZE_MIN_SECTORS) {
		DMERR("metadata has a bad data block size %u", pmd->data_block_size);
		r = -EILSEQ;
	} else if (le32_to_cpu(sb->time) >= (1u << TIME_BITS)) {
		DMERR("metadata has a bad time %u: more than %u bits",
		      le32_to_cpu(sb->time), TIME_BITS);
		r = -EILSEQ;
	} else if (data_block_size && data_block_size != pmd->data_block_size) {
		DMERR("data block size %u does not match %u in the metadata",
		      data_block_size, pmd->data_block_size);
		r = -EINVAL;
	}
	if (r)
		goto out;

	memcpy(pmd->uuid, sb->uuid, sizeof(pmd->uuid));
	pmd->flags = le32_to_cpu(sb->flags);
	pmd->time = le32_to_cpu(sb->time);
	pmd->trans_id = le64_to_cpu(sb->trans_id);
	pmd->root = le64_to_cpu(sb->data_mapping_root);
	pmd->details_root = le64_to_cpu(sb->device_details_root);
	pmd->held_root = le64_to_cpu(sb->held_root);

	r = tsp_tm_open(pmd->bm, THIN_SUPERBLOCK_LOCATION,
			sb->metadata_space_map_root, &pmd->tm);
	if (r) {
		DMERR("could not open the metadata space map: %d", r);
		goto out;
	}
	setup_btree_infos(pmd);
	r = tsp_data_sm_open(pmd->tm, sb->data_space_map_root, &pmd->data_sm);
	if (r)
		DMERR("could not open the data space map: %d", r);
out:
	tsp_bm_unlock(b);
	return r;
}

/**
 * tsp_pool_metadata_open - see dm-thin-metadata.h
 * @bdev: metadata device
 * @data_block_size: sectors per data block; 0 takes the one on disk
 * @nr_data_blocks: data blocks, for a format
 * @format_device: format an all-zero superblock
 * @result: out
 */
int tsp_pool_metadata_open(struct block_device *bdev, sector_t data_block_size,
			   tsp_block_t nr_data_blocks, bool format_device,
			   struct tsp_pool_metadata **result)
{
	struct tsp_mapping_cache *mc;
	struct tsp_pool_metadata *pmd;
	bool zeroes;
	int r;

	pmd = kzalloc(sizeof(*pmd), GFP_KERNEL);
	if (!pmd)
		return -ENOMEM;
	init_rwsem(&pmd->root_lock);
	pmd->roots_gen = 1;	/* devices start at 0: unknown */
	pmd->bdev = bdev;
	pmd->data_block_size = data_block_size;

	pmd->bm = tsp_bm_create(bdev, THIN_METADATA_CACHE_BLOCKS);
	if (IS_ERR(pmd->bm)) {
		r = PTR_ERR(pmd->bm);
		DMERR("could not create the block manager: %d", r);
		kfree(pmd);
		return r;
	}

	r = superblock_all_zeroes(pmd->bm, &zeroes);
	if (r) {
		DMERR("could not read the superblock: %d", r);
	} else if (zeroes && !format_device) {
		DMERR("no metadata on the device (superblock is all zeroes)");
		r = -ENODATA;
	} else if (zeroes) {
		if (data_block_size < TSP_DATA_BLOCK_SIZE_MIN_SECTORS ||
		    data_block_size > TSP_DATA_BLOCK_SIZE_MAX_SECTORS ||
		    data_block_size % TSP_DATA_BLOCK_SIZE_MIN_SECTORS) {
			DMERR("bad data block size %llu sectors",
			      (unsigned long long)data_block_size);
			r = -EINVAL;
		} else {
			lock_for_update(pmd);
			r = format_metadata(pmd, nr_data_blocks);
			up_write(&pmd->root_lock);
		}
	} else {
		r = read_superblock(pmd, data_block_size);
	}

	/* Last: only metadata that opened pays for the bucket array. */
	if (!r) {
		r = tsp_mc_create(TSP_MC_DEFAULT_BUDGET, &mc);
		if (r)
			DMERR("could not create the mapping cache: %d", r);
		else
			RCU_INIT_POINTER(pmd->cache, mc);
	}

	if (r) {
		destroy_persistent_objects(pmd);
		tsp_bm_destroy(pmd->bm);
		kfree(pmd);
		return r;
	}

	*result = pmd;
	return 0;
}

static void details_unpack(const struct disk_device_details *disk,
			   struct tsp_thin_details *d)
{
	d->mapped_blocks = le64_to_cpu(disk->mapped_blocks);
	d->transaction_id = le64_to_cpu(disk->transaction_id);
	d->creation_time = le32_to_cpu(disk->creation_time);
	d->snapshotted_time = le32_to_cpu(disk->snapshotted_time);
}

static int write_changed_details(struct tsp_pool_metadata *pmd)
{
	struct tsp_thin_device *td;
	struct disk_device_details disk;
	int r;

	for (td = pmd->devices; td; td = td->next) {
		if (!td->changed)
			continue;
		disk.mapped_blocks = cpu_to_le64(td->mapped_blocks);
		disk.transaction_id = cpu_to_le64(td->transaction_id);
		disk.creation_time = cpu_to_le32(td->creation_time);
		disk.snapshotted_time = cpu_to_le32(td->fast.snapshotted_time);
		r = tsp_btree_insert(&pmd->details_info, pmd->details_root,
				     td->fast.id, &disk, &pmd->details_root, NULL);
		if (r)
			return r;
	}
	return 0;
}

/*
 * The transaction is committed: no device has changes pending, and closed
 * ones leave core.  Not before: an abort after a commit that failed marks
 * the devices whose changes it drops (aborted_with_changes).
 */
static void devices_committed(struct tsp_pool_metadata *pmd)
{
	struct tsp_thin_device *td, **link;

	for (link = &pmd->devices; (td = *link);) {
		td->changed = false;
		if (!td->open_count) {
			*link = td->next;
			kfree(td);
		} else {
			link = &td->next;
		}
	}
}

static int __commit_transaction(struct tsp_pool_metadata *pmd)
{
	u8 data_root[TSP_SM_ROOT_SIZE], meta_root[TSP_SM_ROOT_SIZE];
	struct thin_disk_superblock *sb;
	struct tsp_block *b;
	int r;

	lockdep_assert_held(&pmd->root_lock);

	/* Whatever happens, the next transaction shadows afresh. */
	pmd->roots_gen++;
	r = write_changed_details(pmd);
	if (!r)
		r = tsp_data_sm_commit(pmd->data_sm, data_root);
	if (!r)
		r = tsp_tm_pre_commit(pmd->tm, meta_root);
	if (!r)
		r = tsp_bm_write_lock_zero(pmd->bm, THIN_SUPERBLOCK_LOCATION,
					   &sb_validator, &b);
	if (r)
		return r;

	sb = tsp_block_data(b);
	memcpy(sb->uuid, pmd->uuid, sizeof(sb->uuid));
	sb->flags = cpu_to_le32(pmd->flags);
	sb->magic = cpu_to_le64(THIN_SUPERBLOCK_MAGIC);
	sb->version = cpu_to_le32(pmd->version);
	sb->time = cpu_to_le32(pmd->time);
	sb->trans_id = cpu_to_le64(pmd->trans_id);
	sb->held_root = cpu_to_le64(pmd->held_root);
	memcpy(sb->data_space_map_root, data_root, TSP_SM_ROOT_SIZE);
	memcpy(sb->metadata_space_map_root, meta_root, TSP_SM_ROOT_SIZE);
	sb->data_mapping_root = cpu_to_le64(pmd->root);
	sb->device_details_root = cpu_to_le64(pmd->details_root);
	sb->data_block_size = cpu_to_le32(pmd->data_block_size);
	sb->metadata_block_size = cpu_to_le32(TSP_METADATA_BLOCK_SECTORS);
	sb->metadata_nr_blocks = cpu_to_le64(tsp_tm_nr_blocks(pmd->tm));
	sb->compat_flags = cpu_to_le32(pmd->compat_flags);
	sb->compat_ro_flags = cpu_to_le32(pmd->compat_ro_flags);
	sb->incompat_flags = cpu_to_le32(pmd->incompat_flags);

	r = tsp_tm_commit(pmd->tm, b);
	if (!r) {
		devices_committed(pmd);
		pmd->changed = false;
	}
	return r;
}

/*
 * Every update but a provision in no-wait mode goes through here: refuse
 * if read only or failed.  Where no-wait mode allocated a metadata block
 * (to split a node), or wanted one, the next few are made ready for it.
 */
static int begin_update(struct tsp_pool_metadata *pmd)
{
	lock_for_update(pmd);
	if (pmd->fail_io || pmd->read_only) {
		up_write(&pmd->root_lock);
		return -EPERM;
	}
	tsp_tm_prepare_new_blocks(pmd->tm);
	return 0;
}

/* A failed update leaves the transaction half done: fail until abort. */
static int end_update(struct tsp_pool_metadata *pmd, int r)
{
	if (r && r != -ENODATA && r != -EEXIST && r != -ENODEV &&
	    r != -EBUSY && r != -EINVAL)
		__fail_io(pmd);
	else if (!r)
		pmd->changed = true;
	up_write(&pmd->root_lock);
	return r;
}

static int commit_metadata(struct tsp_pool_metadata *pmd, bool hold_freed)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	if (pmd->changed) {
		if (hold_freed)
			tsp_data_sm_hold_freed(pmd->data_sm);
		r = __commit_transaction(pmd);
	}
	if (r)
		__fail_io(pmd);
	up_write(&pmd->root_lock);
	return r;
}

int tsp_pool_commit_metadata(struct tsp_pool_metadata *pmd)
{
	return commit_metadata(pmd, false);
}

/**
 * tsp_pool_commit_metadata_hold_freed - commit, holding back freed blocks
 * @pmd: pool metadata
 *
 * As tsp_pool_commit_metadata(), but the data blocks this transaction
 * freed are not handed out again until the second
 * tsp_pool_release_held_blocks() from now, in this transaction or a later
 * one: the pool discards them on the data device in between, once the
 * commit has made them free for good (no abort maps them again) and
 * before any can hold new data.  An abort releases them.
 *
 * Context: may sleep (takes @root_lock for writing).
 *
 * Return: 0; -EPERM if the metadata is read only or failed; or the
 * commit's error, after which the metadata fails until aborted.
 */
int tsp_pool_commit_metadata_hold_freed(struct tsp_pool_metadata *pmd)
{
	return commit_metadata(pmd, true);
}

/**
 * tsp_pool_release_held_blocks - release the older held blocks
 * @pmd: pool metadata
 *
 * The blocks tsp_pool_commit_metadata_hold_freed() holds come in two
 * generations: those it held since the last release (the newer), and
 * those it held before (the older).  The older are handed out again, and
 * the newer become the older: so the pool releases the blocks of a batch
 * of discards when they are done, while those held for the next batch
 * stay held.
 *
 * Context: may sleep (takes @root_lock for writing).
 */
void tsp_pool_release_held_blocks(struct tsp_pool_metadata *pmd)
{
	lock_for_update(pmd);
	if (pmd->data_sm)
		tsp_data_sm_release_held(pmd->data_sm);
	up_write(&pmd->root_lock);
}

static int __device_root(struct tsp_thin_device *td, tsp_block_t *root);

/* The mapped_end of a device whose highest mapping is @virt. */
static tsp_block_t mapped_end_past(tsp_block_t virt)
{
	return virt < NO_MAPPED_END ? virt + 1 : NO_MAPPED_END;
}

/*
 * Set @td->fast.mapped_end from its mapping tree: one past its highest
 * key.  Unknown if the tree cannot be read: its lookups then fail
 * themselves.
 */
static void __read_mapped_end(struct tsp_thin_device *td)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	tsp_block_t root;
	u64 key;
	int r;

	r = __device_root(td, &root);
	if (!r)
		r = tsp_btree_find_highest_key(&pmd->bl_info, root, &key);
	if (r == -ENODATA)
		WRITE_ONCE(td->fast.mapped_end, 0);
	else if (r)
		WRITE_ONCE(td->fast.mapped_end, NO_MAPPED_END);
	else
		WRITE_ONCE(td->fast.mapped_end, mapped_end_past(key));
}

/* tsp_pool_abort_metadata(), with @root_lock held for writing. */
static int __abort(struct tsp_pool_metadata *pmd)
{
	struct tsp_thin_device *td, **link;
	struct disk_device_details disk;
	struct tsp_data_sm *old_data_sm;
	struct tsp_thin_details d;
	struct tsp_tm *old_tm;
	int r;

	lockdep_assert_held_write(&pmd->root_lock);
	old_tm = pmd->tm;
	old_data_sm = pmd->data_sm;
	pmd->tm = NULL;
	pmd->data_sm = NULL;
	__fail_io(pmd);
	/*
	 * From the disk: after a failed commit the cache may still hold the
	 * superblock whose write failed, of the transaction dropped here.
	 */
	tsp_bm_forget(pmd->bm, THIN_SUPERBLOCK_LOCATION);
	r = read_superblock(pmd, pmd->data_block_size);
	if (r) {
		/* Stay failed, on the old objects, so getters still work. */
		destroy_persistent_objects(pmd);
		pmd->tm = old_tm;
		pmd->data_sm = old_data_sm;
		setup_btree_infos(pmd);
		goto out;
	}
	tsp_data_sm_destroy(old_data_sm);
	tsp_tm_destroy(old_tm);

	for (link = &pmd->devices; (td = *link);) {
		if (!td->open_count) {
			*link = td->next;
			kfree(td);
			continue;
		}
		td->aborted_with_changes |= td->changed;
		td->changed = false;
		memset(&d, 0, sizeof(d));
		r = tsp_btree_lookup(&pmd->details_info, pmd->details_root,
				     td->fast.id, &disk);
		if (!r)
			details_unpack(&disk, &d);
		else if (r != -ENODATA)
			goto out;
		td->mapped_blocks = d.mapped_blocks;
		td->transaction_id = d.transaction_id;
		td->creation_time = d.creation_time;
		WRITE_ONCE(td->fast.snapshotted_time, d.snapshotted_time);
		if (r == -ENODATA)
			/* Its creation was aborted: lookups must find it gone. */
			WRITE_ONCE(td->fast.mapped_end, NO_MAPPED_END);
		else
			__read_mapped_end(td);
		link = &td->next;
	}
	r = 0;
	pmd->fail_io = false;
	pmd->changed = false;
out:
	return r;
}

/**
 * tsp_pool_abort_metadata - drop every uncommitted change
 * @pmd: pool metadata
 *
 * Rereads the last committed superblock.  Open devices keep their
 * handles, with their details as committed.  The mapping cache is
 * emptied first.  Returns 0, or the error from rereading (the metadata
 * stays failed, and may be aborted again).
 */
int tsp_pool_abort_metadata(struct tsp_pool_metadata *pmd)
{
	int r;

	lock_for_update(pmd);
	r = pmd->read_only ? -EPERM : __abort(pmd);
	up_write(&pmd->root_lock);
	return r;
}

/**
 * tsp_pool_metadata_fail - give up after a failed update
 * @pmd: pool metadata
 *
 * Aborts the transaction, sets the needs_check flag (committing it) and
 * makes the metadata read only, in one hold of @root_lock: an update
 * from another thread cannot slip in between and be committed with the
 * flag, on top of the aborted transaction's allocations.  Does nothing
 * if the metadata is read only already and no update failed since the
 * last abort (another failure got here first).  Metadata made read only
 * between the failure and this call (by the pool's read-only mode) is
 * aborted all the same, and keeps the flag in core, as read only
 * metadata writes nothing: the pool does not go back to write mode.
 *
 * Context: may sleep.
 *
 * Return: 0, or the error of the abort or of the commit (the metadata is
 * then left failed, and read only).
 */
int tsp_pool_metadata_fail(struct tsp_pool_metadata *pmd)
{
	int r = 0;

	lock_for_update(pmd);
	if (!pmd->read_only || pmd->fail_io) {
		r = __abort(pmd);
		if (!r) {
			pmd->flags |= THIN_NEEDS_CHECK_FLAG;
			if (!pmd->read_only)
				r = __commit_transaction(pmd);
			if (r)
				__fail_io(pmd);
		}
		__set_read_only(pmd);
	}
	up_write(&pmd->root_lock);
	return r;
}

/**
 * tsp_pool_metadata_needs_abort - whether a failed update awaits its abort
 * @pmd: pool metadata
 *
 * An update that fails half way (other than by refusing: a device that
 * exists, or is open, say) leaves the in-core metadata in doubt, and
 * every update and lookup is refused from then on.  For a caller whose
 * update failed, to tell such a failure, which wants
 * tsp_pool_metadata_fail(), from a refusal that changed nothing.
 *
 * Context: may sleep (takes @root_lock for reading).
 *
 * Return: true if an update (or a commit) failed and no abort has
 * succeeded since.
 */
bool tsp_pool_metadata_needs_abort(struct tsp_pool_metadata *pmd)
{
	bool r;

	down_read(&pmd->root_lock);
	r = pmd->fail_io;
	up_read(&pmd->root_lock);
	return r;
}

/**
 * tsp_pool_metadata_close - commit and free
 * @pmd: pool metadata
 *
 * Returns -EBUSY (and frees nothing) while a thin device is open;
 * otherwise frees everything and returns the commit's result.
 */
int tsp_pool_metadata_close(struct tsp_pool_metadata *pmd)
{
	struct tsp_thin_device *td;
	int r = 0;

	lock_for_update(pmd);
	for (td = pmd->devices; td; td = td->next) {
		if (td->open_count) {
			up_write(&pmd->root_lock);
			DMERR("cannot close metadata: thin device %llu is open",
			      (unsigned long long)td->fast.id);
			return -EBUSY;
		}
	}
	if (!pmd->fail_io && !pmd->read_only && pmd->changed) {
		r = __commit_transaction(pmd);
		if (r)
			DMERR("could not commit metadata on close: %d", r);
	}
	while ((td = pmd->devices)) {
		pmd->devices = td->next;
		kfree(td);
	}
	up_write(&pmd->root_lock);

	destroy_persistent_objects(pmd);
	tsp_bm_destroy(pmd->bm);
	/* No device is open, so no fast lookup can be running. */
	tsp_mc_destroy(rcu_dereference_protected(pmd->cache, true));
	kfree(pmd);
	return r;
}

/*----------------------------------------------------------------
 * Thin devices
 *--------------------------------------------------------------*/
static struct tsp_thin_device *find_open(struct tsp_pool_metadata *pmd,
					 tsp_thin_id dev)
{
	struct tsp_thin_device *td;

	for (td = pmd->devices; td; td = td->next)
		if (td->fast.id == dev)
			return td;
	return NULL;
}

/* Get the in-core device, reading its details; -ENODATA if none. */
static int __open_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			 struct tsp_thin_device **result)
{
	struct disk_device_details disk;
	struct tsp_thin_details d;
	struct tsp_thin_device *td = find_open(pmd, dev);
	int r;

	lockdep_assert_held(&pmd->root_lock);
	if (td) {
		td->open_count++;
		*result = td;
		return 0;
	}

	r = tsp_btree_lookup(&pmd->details_info, pmd->details_root, dev, &disk);
	if (r)
		return r;
	details_unpack(&disk, &d);

	td = kzalloc(sizeof(*td), GFP_KERNEL);
	if (!td)
		return -ENOMEM;
	td->pmd = pmd;
	td->fast.cache = &pmd->cache;
	td->fast.id = dev;
	td->cursor = TSP_BTREE_CURSOR(&pmd->bl_info);
	td->open_count = 1;
	td->mapped_blocks = d.mapped_blocks;
	td->transaction_id = d.transaction_id;
	td->creation_time = d.creation_time;
	td->fast.snapshotted_time = d.snapshotted_time;
	__read_mapped_end(td);
	td->next = pmd->devices;
	pmd->devices = td;
	*result = td;
	return 0;
}

/* Drop @td from the in-core list and free it. */
static void __forget_device(struct tsp_pool_metadata *pmd,
			    struct tsp_thin_device *td)
{
	struct tsp_thin_device **link;

	for (link = &pmd->devices; *link; link = &(*link)->next) {
		if (*link == td) {
			*link = td->next;
			kfree(td);
			return;
		}
	}
}

/* Closed and unchanged, a device need not stay in core until commit. */
static void __close_device(struct tsp_thin_device *td)
{
	if (--td->open_count)
		return;
	td->aborted_with_changes = false;	/* the next opener lost nothing */
	if (!td->changed)
		__forget_device(td->pmd, td);
}

/*
 * Add a device with the given details and mapping tree root, whose
 * mappings are all below @mapped_end.
 */
static int __add_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			tsp_block_t tree_root, const struct tsp_thin_details *d,
			tsp_block_t mapped_end)
{
	struct tsp_thin_device *td;
	__le64 value = cpu_to_le64(tree_root);
	int r;

	/* A snapshot shares its origin's root: it must be shadowed again. */
	pmd->roots_gen++;
	r = tsp_btree_insert(&pmd->tl_info, pmd->root, dev, &value,
			     &pmd->root, NULL);
	if (r)
		return r;

	td = kzalloc(sizeof(*td), GFP_KERNEL);
	if (!td)
		return -ENOMEM;
	td->pmd = pmd;
	td->fast.cache = &pmd->cache;
	td->fast.id = dev;
	td->cursor = TSP_BTREE_CURSOR(&pmd->bl_info);
	td->changed = true;
	td->mapped_blocks = d->mapped_blocks;
	td->transaction_id = d->transaction_id;
	td->creation_time = d->creation_time;
	td->fast.snapshotted_time = d->snapshotted_time;
	td->fast.mapped_end = mapped_end;
	td->next = pmd->devices;
	pmd->devices = td;
	return 0;
}

static int __check_new_id(struct tsp_pool_metadata *pmd, tsp_thin_id dev)
{
	int r;

	if (dev > TSP_THIN_MAX_DEV_ID) {
		DMERR("device id %llu is too large (max %llu)",
		      (unsigned long long)dev, TSP_THIN_MAX_DEV_ID);
		return -EINVAL;
	}
	/* The top-level tree is up to date; details wait for the commit. */
	r = tsp_btree_lookup(&pmd->tl_info, pmd->root, dev, NULL);
	if (!r) {
		DMERR("device id %llu is already in use", (unsigned long long)dev);
		return -EEXIST;
	}
	if (r != -ENODATA)
		return r;
	/* A handle from before an abort that undid the device's creation. */
	if (find_open(pmd, dev)) {
		DMERR("device id %llu is still open from before an abort",
		      (unsigned long long)dev);
		return -EBUSY;
	}
	return 0;
}

static int __create_thin(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			 const struct tsp_thin_details *d)
{
	tsp_block_t tree_root;
	int r;

	r = __check_new_id(pmd, dev);
	if (!r)
		r = tsp_btree_empty(&pmd->bl_info, &tree_root);
	if (!r)
		r = __add_device(pmd, dev, tree_root, d, 0);
	return r;
}

int tsp_pool_create_thin(struct tsp_pool_metadata *pmd, tsp_thin_id dev)
{
	struct tsp_thin_details d = { 0 };
	int r = begin_update(pmd);

	if (r)
		return r;
	d.transaction_id = pmd->trans_id;
	d.creation_time = pmd->time;
	d.snapshotted_time = pmd->time;
	return end_update(pmd, __create_thin(pmd, dev, &d));
}

static int __create_snap(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			 tsp_thin_id origin)
{
	struct tsp_thin_details d = { 0 };
	struct tsp_thin_device *otd;
	tsp_block_t origin_root;
	__le64 value;
	int r;

	r = __check_new_id(pmd, dev);
	if (r)
		return r;
	r = tsp_btree_lookup(&pmd->tl_info, pmd->root, origin, &value);
	if (r == -ENODATA) {
		DMERR("snapshot origin %llu does not exist",
		      (unsigned long long)origin);
		return -ENODATA;
	}
	if (r)
		return r;
	if (pmd->time >= (1u << TIME_BITS) - 1) {
		DMERR("too many snapshots: the 24-bit time is used up");
		return -EINVAL;
	}

	r = __open_device(pmd, origin, &otd);
	if (r)
		return r;

	/* The snapshot shares the origin's tree: one more reference. */
	origin_root = le64_to_cpu(value);
	r = tsp_tm_inc(pmd->tm, origin_root);
	if (r)
		goto out;

	pmd->time++;
	/* Every cached mapping of the origin is now seen as shared. */
	WRITE_ONCE(otd->fast.snapshotted_time, pmd->time);
	otd->changed = true;
	d.mapped_blocks = otd->mapped_blocks;
	d.transaction_id = pmd->trans_id;
	d.creation_time = pmd->time;
	d.snapshotted_time = pmd->time;
	r = __add_device(pmd, dev, origin_root, &d, otd->fast.mapped_end);
out:
	__close_device(otd);
	return r;
}

int tsp_pool_create_snap(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			 tsp_thin_id origin)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	return end_update(pmd, __create_snap(pmd, dev, origin));
}

static int __delete_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev)
{
	struct tsp_thin_device *td;
	int r;

	pmd->roots_gen++;
	td = find_open(pmd, dev);
	if (td && td->open_count) {
		DMERR("cannot delete thin device %llu: it is open",
		      (unsigned long long)dev);
		return -EBUSY;
	}

	r = tsp_btree_lookup(&pmd->tl_info, pmd->root, dev, NULL);
	if (r == -ENODATA) {
		DMERR("thin device %llu does not exist", (unsigned long long)dev);
		return -ENODATA;
	}
	if (!r)
		r = tsp_btree_remove(&pmd->tl_info, pmd->root, dev, &pmd->root);
	if (!r) {
		/* Absent if the device was created in this transaction. */
		r = tsp_btree_remove(&pmd->details_info, pmd->details_root, dev,
				     &pmd->details_root);
		if (r == -ENODATA)
			r = 0;
	}
	if (r)
		return r;

	tsp_mc_invalidate_dev(__cache(pmd), dev);
	if (td)
		__forget_device(pmd, td);
	return 0;
}

int tsp_pool_delete_thin_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	return end_update(pmd, __delete_device(pmd, dev));
}

int tsp_pool_set_metadata_transaction_id(struct tsp_pool_metadata *pmd,
					 u64 current_id, u64 new_id)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	if (pmd->trans_id != current_id) {
		DMERR("mismatched transaction id: %llu, expected %llu",
		      (unsigned long long)current_id,
		      (unsigned long long)pmd->trans_id);
		r = -EINVAL;
	} else {
		pmd->trans_id = new_id;
	}
	return end_update(pmd, r);
}

int tsp_pool_get_metadata_transaction_id(struct tsp_pool_metadata *pmd,
					 u64 *result)
{
	down_read(&pmd->root_lock);
	*result = pmd->trans_id;
	up_read(&pmd->root_lock);
	return 0;
}

/*----------------------------------------------------------------
 * Metadata snapshots
 *--------------------------------------------------------------*/
static int __reserve_metadata_snap(struct tsp_pool_metadata *pmd)
{
	struct thin_disk_superblock *copy;
	struct tsp_block *b;
	int r;

	/* Every root becomes reachable from the snapshot: shadow again. */
	pmd->roots_gen++;
	if (pmd->held_root) {
		DMERR("pool metadata snapshot already exists: release it first");
		return -EBUSY;
	}

	/* The copy must name committed trees: commit what is pending. */
	r = __commit_transaction(pmd);
	if (r)
		return r;

	r = tsp_tm_new_block(pmd->tm, &sb_validator, &b);
	if (r)
		return r;
	copy = tsp_block_data(b);
	memcpy(copy->uuid, pmd->uuid, sizeof(copy->uuid));
	copy->magic = cpu_to_le64(THIN_SUPERBLOCK_MAGIC);
	copy->version = cpu_to_le32(pmd->version);
	copy->time = cpu_to_le32(pmd->time);
	copy->trans_id = cpu_to_le64(pmd->trans_id);
	copy->data_mapping_root = cpu_to_le64(pmd->root);
	copy->device_details_root = cpu_to_le64(pmd->details_root);
	copy->data_block_size = cpu_to_le32(pmd->data_block_size);
	copy->metadata_block_size = cpu_to_le32(TSP_METADATA_BLOCK_SECTORS);
	copy->metadata_nr_blocks = cpu_to_le64(tsp_tm_nr_blocks(pmd->tm));
	pmd->held_root = tsp_block_location(b);
	tsp_tm_unlock(pmd->tm, b);

	r = tsp_tm_inc(pmd->tm, pmd->root);
	if (!r)
		r = tsp_tm_inc(pmd->tm, pmd->details_root);
	if (!r)
		r = __commit_transaction(pmd);
	return r;
}

int tsp_pool_reserve_metadata_snap(struct tsp_pool_metadata *pmd)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	return end_update(pmd, __reserve_metadata_snap(pmd));
}

static int __release_metadata_snap(struct tsp_pool_metadata *pmd)
{
	struct thin_disk_superblock *copy;
	tsp_block_t mapping_root, details_root, held = pmd->held_root;
	struct tsp_block *b;
	int r;

	pmd->roots_gen++;
	if (!held) {
		DMERR("no pool metadata snapshot to release");
		return -EINVAL;
	}

	r = tsp_tm_read_lock(pmd->tm, held, &sb_validator, &b);
	if (r)
		return r;
	copy = tsp_block_data(b);
	mapping_root = le64_to_cpu(copy->data_mapping_root);
	details_root = le64_to_cpu(copy->device_details_root);
	tsp_tm_unlock(pmd->tm, b);

	r = tsp_btree_del(&pmd->tl_info, mapping_root);
	if (!r)
		r = tsp_btree_del(&pmd->details_info, details_root);
	if (!r)
		r = tsp_tm_dec(pmd->tm, held);
	if (!r)
		pmd->held_root = 0;
	return r;
}

int tsp_pool_release_metadata_snap(struct tsp_pool_metadata *pmd)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	return end_update(pmd, __release_metadata_snap(pmd));
}

int tsp_pool_get_metadata_snap(struct tsp_pool_metadata *pmd,
			       tsp_block_t *result)
{
	down_read(&pmd->root_lock);
	*result = pmd->held_root;
	up_read(&pmd->root_lock);
	return 0;
}

/*----------------------------------------------------------------
 * Opening thin devices and their mappings
 *--------------------------------------------------------------*/
int tsp_pool_open_thin_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			      struct tsp_thin_device **td)
{
	int r;

	lock_for_update(pmd);
	r = pmd->fail_io ? -EPERM : __open_device(pmd, dev, td);
	up_write(&pmd->root_lock);
	return r;
}

void tsp_pool_close_thin_device(struct tsp_thin_device *td)
{
	struct tsp_pool_metadata *pmd = td->pmd;

	lock_for_update(pmd);
	__close_device(td);
	up_write(&pmd->root_lock);
}

tsp_thin_id tsp_thin_dev_id(struct tsp_thin_device *td)
{
	return td->fast.id;
}

/* @td's remembered root, if it is still valid. */
static bool __cached_root(struct tsp_thin_device *td, tsp_block_t *root)
{
	if (td->root_gen != td->pmd->roots_gen)
		return false;
	*root = td->root;
	return true;
}

/* The root of @td's mapping tree. */
static int __device_root(struct tsp_thin_device *td, tsp_block_t *root)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	__le64 value;
	int r;

	if (__cached_root(td, root))
		return 0;
	r = tsp_btree_lookup(&pmd->tl_info, pmd->root, td->fast.id, &value);
	if (r == -ENODATA) {
		/* Deleted, or its creation was aborted, while open. */
		DMERR("thin device %llu no longer exists",
		      (unsigned long long)td->fast.id);
		return -ENODEV;
	}
	if (!r)
		*root = le64_to_cpu(value);
	return r;
}

/*
 * The root of @td's mapping tree, for changing it.  The top-level path
 * to the device is shadowed first: if it is shared (with a held metadata
 * snapshot) the copy adds a reference to the device's root, so shadowing
 * the root afterwards sees it as shared and copies what it points to too.
 * Shadowing bottom-up instead would take over the root's children
 * without their gaining the references the shared parent still holds.
 * Any change but a provision (@provision: an insert through @td's
 * cursor) releases the cursor, as does a root no longer valid.
 */
static int __device_root_for_update(struct tsp_thin_device *td,
				    tsp_block_t *root, bool provision)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	__le64 value;
	int r;

	lockdep_assert_held_write(&pmd->root_lock);
	if (__cached_root(td, root)) {
		if (!provision)
			tsp_btree_cursor_release(&td->cursor);
		return 0;
	}
	tsp_btree_cursor_release(&td->cursor);
	r = __device_root(td, root);
	if (r)
		return r;
	value = cpu_to_le64(*root);
	r = tsp_btree_insert(&pmd->tl_set_info, pmd->root, td->fast.id, &value,
			     &pmd->root, NULL);
	if (r)
		return r;
	td->root = *root;
	td->root_gen = pmd->roots_gen;
	return 0;
}

/* Record that @td's mapping tree root moved from @old to @root. */
static int __set_device_root(struct tsp_thin_device *td, tsp_block_t old,
			     tsp_block_t root)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	__le64 value = cpu_to_le64(root);
	int r;

	if (root == old)
		return 0;
	r = tsp_btree_insert(&pmd->tl_set_info, pmd->root, td->fast.id, &value,
			     &pmd->root, NULL);
	if (!r)
		td->root = root;
	return r;
}

/*
 * The data block and time of @virt's mapping @value, which IO is to be
 * sent to: a block beyond the data space map is corrupt metadata, never
 * remapped to.
 */
static int __unpack_mapping_for_io(struct tsp_thin_device *td, tsp_block_t virt,
				   __le64 value, tsp_block_t *data, u32 *time)
{
	tsp_block_t nr_blocks = tsp_data_sm_nr_blocks(td->pmd->data_sm);

	unpack_mapping(le64_to_cpu(value), data, time);
	if (*data >= nr_blocks) {
		DMERR_LIMIT("thin device %llu: block %llu maps to data block %llu, of %llu",
			    (unsigned long long)td->fast.id, (unsigned long long)virt,
			    (unsigned long long)*data, (unsigned long long)nr_blocks);
		return -EILSEQ;
	}
	return 0;
}

static int __find_block(struct tsp_thin_device *td, tsp_block_t virt,
			tsp_block_t root, struct tsp_thin_lookup_result *result,
			u32 *time)
{
	__le64 value;
	int r;

	r = tsp_btree_lookup(&td->pmd->bl_info, root, virt, &value);
	if (!r)
		r = __unpack_mapping_for_io(td, virt, value, &result->block, time);
	if (r)
		return r;
	result->shared = td->fast.snapshotted_time > *time;
	return 0;
}

/*
 * Where @virt of @td is mapped, under @root_lock; known unmapped without
 * a walk past the device's highest mapping.  A mapping found is cached.
 */
static int __lookup_block(struct tsp_thin_device *td, tsp_block_t virt,
			  struct tsp_thin_lookup_result *result)
{
	tsp_block_t root;
	u32 time;
	int r;

	if (virt >= td->fast.mapped_end && td->fast.mapped_end != NO_MAPPED_END)
		return -ENODATA;
	r = __device_root(td, &root);
	if (!r)
		r = __find_block(td, virt, root, result, &time);
	if (!r)
		tsp_mc_insert(__cache(td->pmd), td->fast.id, virt, result->block, time);
	return r;
}

/**
 * tsp_thin_find_block - where a virtual block is mapped
 * @td: thin device
 * @virt: virtual block
 * @result: out
 *
 * Context: may sleep (reads metadata).
 *
 * Return: 0; -ENODATA if unmapped; -EPERM if an update failed and awaits
 * its abort; or the error of reading the metadata.
 */
int tsp_thin_find_block(struct tsp_thin_device *td, tsp_block_t virt,
			struct tsp_thin_lookup_result *result)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	int r;

	down_read(&pmd->root_lock);
	r = pmd->fail_io ? -EPERM : __lookup_block(td, virt, result);
	up_read(&pmd->root_lock);
	return r;
}

/**
 * tsp_thin_fast_of - what the map path's lookup of @td reads
 * @td: an open thin device
 *
 * Context: any.
 *
 * Return: the part of @td that tsp_thin_find_block_fast() reads, valid
 * until @td is closed.
 */
const struct tsp_thin_fast *tsp_thin_fast_of(struct tsp_thin_device *td)
{
	return &td->fast;
}

/**
 * tsp_pool_cache_stats - the mapping cache's counters
 * @pmd: pool metadata
 * @stats: out
 *
 * Context: may sleep (takes @root_lock for reading).
 *
 * Return: 0.
 */
int tsp_pool_cache_stats(struct tsp_pool_metadata *pmd,
			 struct tsp_mc_stats *stats)
{
	down_read(&pmd->root_lock);
	tsp_mc_get_stats(__cache(pmd), stats);
	up_read(&pmd->root_lock);
	return 0;
}

/**
 * tsp_pool_metadata_set_cache_budget - replace the mapping cache
 * @pmd: pool metadata
 * @budget: bytes the new cache may use (0: cache nothing)
 *
 * The new cache starts empty (counters too); the old one is freed after
 * an RCU grace period, so fast lookups may run throughout.  Context: may
 * sleep.
 *
 * Return: 0, or -ENOMEM (the old cache stays).
 */
int tsp_pool_metadata_set_cache_budget(struct tsp_pool_metadata *pmd,
				       u64 budget)
{
	struct tsp_mapping_cache *mc, *old;
	int r;

	r = tsp_mc_create(budget, &mc);
	if (r)
		return r;
	lock_for_update(pmd);
	old = __cache(pmd);
	rcu_assign_pointer(pmd->cache, mc);
	up_write(&pmd->root_lock);
	synchronize_rcu();
	tsp_mc_destroy(old);
	return 0;
}

int tsp_thin_find_mapped_range(struct tsp_thin_device *td, tsp_block_t begin,
			       tsp_block_t end, tsp_block_t *thin_begin,
			       tsp_block_t *thin_end, tsp_block_t *pool_begin,
			       bool *maybe_shared)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	struct tsp_thin_lookup_result lookup;
	tsp_block_t root, b;
	__le64 value;
	u64 key;
	u32 time;
	int r;

	down_read(&pmd->root_lock);
	r = pmd->fail_io ? -EPERM : __device_root(td, &root);
	if (!r)
		r = tsp_btree_lookup_next(&pmd->bl_info, root, begin, &key, &value);
	if (!r && key >= end)
		r = -ENODATA;
	if (!r)
		r = __unpack_mapping_for_io(td, key, value, pool_begin, &time);
	if (r)
		goto out;

	*thin_begin = key;
	*maybe_shared = td->fast.snapshotted_time > time;
	tsp_mc_insert(__cache(pmd), td->fast.id, key, *pool_begin, time);
	for (b = key + 1; b < end; b++) {
		r = __find_block(td, b, root, &lookup, &time);
		if (r == -ENODATA)
			break;
		if (r)
			goto out;
		tsp_mc_insert(__cache(pmd), td->fast.id, b, lookup.block, time);
		if (lookup.block != *pool_begin + (b - key) ||
		    lookup.shared != *maybe_shared)
			break;
	}
	*thin_end = b;
	r = 0;
out:
	up_read(&pmd->root_lock);
	return r;
}

int tsp_pool_alloc_data_block(struct tsp_pool_metadata *pmd,
			      tsp_block_t *result)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	r = tsp_data_sm_new_block(pmd->data_sm, result);
	if (r == -ENOSPC) {
		/* Nothing changed: the pool decides what out of space means. */
		up_write(&pmd->root_lock);
		return r;
	}
	return end_update(pmd, r);
}

/**
 * tsp_pool_release_data_block - give back a block that was never mapped
 * @pmd: pool metadata
 * @b: a block from tsp_pool_alloc_data_block() of this or an earlier
 *	transaction (since the last abort), not mapped by anyone
 *
 * Its reference count drops to zero; like any block freed in this
 * transaction it is handed out again only after the commit.
 *
 * Context: may sleep (takes @root_lock for writing).
 *
 * Return: 0, -EPERM if the metadata is read only or failed, or the space
 * map's error (the transaction then fails until aborted).
 */
int tsp_pool_release_data_block(struct tsp_pool_metadata *pmd, tsp_block_t b)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	return end_update(pmd, tsp_data_sm_dec(pmd->data_sm, b));
}

/* Keep @td's cursor till the next provision, parking the one kept so far. */
static void __keep_cursor(struct tsp_thin_device *td)
{
	struct tsp_pool_metadata *pmd = td->pmd;

	if (pmd->kept && pmd->kept != td)
		tsp_btree_cursor_park(&pmd->kept->cursor);
	tsp_btree_cursor_keep(&td->cursor);
	pmd->kept = td;
}

/*
 * Map @virt of @td to @data at @time.  If @virt is mapped already: with
 * @overwrite the old mapping is replaced (and its block dec'ed), without
 * it nothing changes and -EEXIST is returned.  An overwriting insert goes
 * through @cursor, which a batch keeps from one insert to the next, if
 * not NULL; one that must not overwrite (a provision) goes through
 * @td's own cursor, kept between provisions.
 */
static int __insert_block(struct tsp_thin_device *td, tsp_block_t virt,
			  tsp_block_t data, u32 time, bool overwrite,
			  struct tsp_btree_cursor *cursor)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	__le64 value = cpu_to_le64(pack_mapping(data, time));
	tsp_block_t old, root;
	bool inserted = true;
	int r;

	if (data >= tsp_data_sm_nr_blocks(pmd->data_sm)) {
		DMERR("data block %llu is beyond the data device",
		      (unsigned long long)data);
		return -EINVAL;
	}
	r = __device_root_for_update(td, &old, !overwrite);
	if (r)
		return r;
	if (overwrite && cursor) {
		r = tsp_btree_insert_at(cursor, old, virt, &value, &root,
					&inserted);
	} else if (overwrite) {
		r = tsp_btree_insert(&pmd->bl_info, old, virt, &value, &root,
				     &inserted);
	} else {
		r = tsp_btree_insert_new_at(&td->cursor, old, virt, &value,
					    &root);
		if (!r || r == -EEXIST)
			__keep_cursor(td);
		else
			tsp_btree_cursor_release(&td->cursor);
	}
	/* On -EEXIST too: the way down may have moved the root. */
	if (!r || r == -EEXIST)
		r = __set_device_root(td, old, root) ?: r;
	if (r)
		return r;

	tsp_mc_insert(__cache(pmd), td->fast.id, virt, data, time);
	td->changed = true;
	if (inserted)
		td->mapped_blocks++;
	WRITE_ONCE(td->fast.mapped_end,
		   max(td->fast.mapped_end, mapped_end_past(virt)));
	return 0;
}

int tsp_thin_insert_block(struct tsp_thin_device *td, tsp_block_t virt,
			  tsp_block_t data)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	int r = begin_update(pmd);

	if (r)
		return r;
	return end_update(pmd, __insert_block(td, virt, data, pmd->time, true,
						 NULL));
}

/* Allocating a data block would leave more than @keep_free free. */
static bool __may_allocate(struct tsp_pool_metadata *pmd, tsp_block_t keep_free)
{
	tsp_block_t nr_free = tsp_data_sm_nr_free(pmd->data_sm);

	return nr_free > keep_free && nr_free - keep_free > 1;
}

/*
 * Allocate a data block and map @virt to it, unless @virt is mapped
 * (-EEXIST), or no more than @keep_free blocks would be left free, or
 * no more than @metadata_keep_free metadata blocks are free
 * (-EWOULDBLOCK; also when the space map would have to recount, which
 * tsp_pool_alloc_data_block() does), in at most one walk of the mapping
 * tree;
 * for the transaction manager's no-wait mode only.  The block is only
 * reserved while the mapping is inserted, so that an insert refused for
 * want of IO, or because @virt is mapped, leaves the space map as it was.
 * The reserve locks the block's bitmap, so allocating it after the insert
 * cannot be refused: no-wait mode copies no shared node, whose copy
 * would take references to data blocks, maybe counted in another bitmap.
 */
static int __provision_nowait(struct tsp_thin_device *td, tsp_block_t virt,
			      tsp_block_t keep_free,
			      tsp_block_t metadata_keep_free, tsp_block_t *data)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	int r;

	if (!__may_allocate(pmd, keep_free) ||
	    tsp_tm_nr_free(pmd->tm) <= metadata_keep_free)
		return -EWOULDBLOCK;
	r = tsp_data_sm_reserve(pmd->data_sm, data);
	if (r)
		return r == -ENOSPC ? -EWOULDBLOCK : r;
	r = __insert_block(td, virt, *data, pmd->time, false, NULL);
	if (r)
		return r;
	/* Mapped now: a refusal here must fail the update, not undo it. */
	r = tsp_data_sm_alloc_reserved(pmd->data_sm, *data);
	if (WARN_ON_ONCE(r))
		return r == -EWOULDBLOCK ? -EILSEQ : r;
	return 0;
}

/* End an update that tried to provision: a refusal changed nothing. */
static int end_provision(struct tsp_pool_metadata *pmd, int r)
{
	if (r == -EWOULDBLOCK || r == -EEXIST) {
		up_write(&pmd->root_lock);
		return r;
	}
	return end_update(pmd, r);
}

/**
 * tsp_thin_provision - where a virtual block is mapped, mapping it if it is not
 * @td: thin device
 * @virt: virtual block
 * @keep_free: do not map @virt if no more than this many data blocks
 *	would be left free (the pool's low water mark:
 *	tsp_pool_alloc_data_block() is the way past it)
 * @result: out: on success the new data block (reference count 1, not
 *	shared); on -EEXIST, the mapping found, as from tsp_thin_find_block()
 *
 * What tsp_thin_find_block(), tsp_pool_alloc_data_block() and
 * tsp_thin_insert_block() do for a block found unmapped, under one
 * acquisition of @root_lock.
 *
 * Context: may sleep (takes @root_lock for writing, may read metadata).
 *
 * Return: 0 if @virt was mapped here; -EEXIST if it was mapped already;
 * -EWOULDBLOCK if @keep_free stood in the way, no block is free until
 * the next commit, the metadata is read only or failed, or the lookup
 * failed (nothing changed in these cases: the caller's way on is
 * tsp_thin_find_block() and tsp_pool_alloc_data_block(), which report
 * what stood in the way); or the error of the allocation or the insert,
 * which fails the metadata as any update's would.
 */
int tsp_thin_provision(struct tsp_thin_device *td, tsp_block_t virt,
		       tsp_block_t keep_free,
		       struct tsp_thin_lookup_result *result)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	int r;

	if (begin_update(pmd))
		return -EWOULDBLOCK;
	r = __lookup_block(td, virt, result);
	if (r != -ENODATA) {
		up_write(&pmd->root_lock);
		return r ? -EWOULDBLOCK : -EEXIST;
	}

	result->shared = false;
	r = __may_allocate(pmd, keep_free) ?
	    tsp_data_sm_new_block(pmd->data_sm, &result->block) : -ENOSPC;
	if (r == -ENOSPC)
		r = -EWOULDBLOCK;
	if (!r) {
		r = __insert_block(td, virt, result->block, pmd->time,
				   false, NULL);
		/* Found unmapped a moment ago: the tree contradicts itself. */
		if (r == -EEXIST)
			r = -EILSEQ;
	}
	return end_provision(pmd, r);
}

/**
 * tsp_thin_provision_nowait - map an unmapped block, where IO cannot be waited for
 * @td: thin device
 * @virt: virtual block
 * @keep_free: as for tsp_thin_provision()
 * @metadata_keep_free: do not map @virt if no more than this many
 *	metadata blocks are free (the pool's metadata reserve: a split may
 *	take some)
 * @data: out, on success only: the data block @virt is now mapped to
 *	(reference count 1)
 *
 * Maps @virt in at most one walk of the mapping tree (none when @virt
 * goes into the leaf of @td's last provision), for the map path: a bio
 * that metadata IO issued there would not start before the map function
 * returned.  It takes @root_lock only if no one holds it, and runs the
 * transaction manager in no-wait mode: the update is refused if it needs
 * a block that is not cached, a block copied (the first change to a node
 * or bitmap after a commit), a new block beyond those the last blocking
 * update prepared (for a split), or a search of the space map's bitmaps
 * beyond the cache.
 *
 * Context: may sleep (dm-bufio's lock), but waits for no IO and no holder
 * of @root_lock.
 *
 * Return: 0; -EEXIST if @virt is mapped; -EWOULDBLOCK if @keep_free or
 * @metadata_keep_free stood in the way, the update was refused (@virt may be mapped: the way to its
 * leaf is not known without the update's walk), @root_lock was held or
 * the metadata is read only or failed (no mapping changed in these cases;
 * a node on the way may have been split);
 * or another error, which fails the metadata as any update's would.
 */
int tsp_thin_provision_nowait(struct tsp_thin_device *td, tsp_block_t virt,
			      tsp_block_t keep_free,
			      tsp_block_t metadata_keep_free, tsp_block_t *data)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	int r;

	if (!down_write_trylock(&pmd->root_lock))
		return -EWOULDBLOCK;
	if (pmd->fail_io || pmd->read_only) {
		up_write(&pmd->root_lock);
		return -EWOULDBLOCK;
	}

	tsp_tm_set_nowait(pmd->tm, true);
	r = __provision_nowait(td, virt, keep_free, metadata_keep_free, data);
	tsp_tm_set_nowait(pmd->tm, false);
	return end_provision(pmd, r);
}

/**
 * tsp_pool_insert_mappings - map a batch of blocks in one update
 * @pmd: pool metadata
 * @mappings: struct tsp_new_mapping entries, linked by ->list; each
 *	one's @td belongs to @pmd
 * @nr_inserted: out: how many mappings, from the head of the list, were
 *	inserted
 *
 * Does what tsp_thin_insert_block() does for each mapping, in list order,
 * under one acquisition of @root_lock, so that a worker finishing many
 * provisions takes the lock once; consecutive mappings of nearby blocks
 * of one device go into their leaf with one walk down the tree (a btree
 * cursor), not one walk each.  Stops at the first failure, which
 * fails the metadata as tsp_thin_insert_block()'s would.
 *
 * Context: may sleep.
 *
 * Return: 0, or the error of the first mapping not inserted.
 */
int tsp_pool_insert_mappings(struct tsp_pool_metadata *pmd,
			     struct list_head *mappings,
			     unsigned int *nr_inserted)
{
	struct tsp_btree_cursor cursor = TSP_BTREE_CURSOR(&pmd->bl_info);
	struct tsp_new_mapping *m;
	int r;

	*nr_inserted = 0;
	if (list_empty(mappings))
		return 0;
	r = begin_update(pmd);
	if (r)
		return r;
	list_for_each_entry(m, mappings, list) {
		r = __insert_block(m->td, m->virt, m->data, pmd->time, true,
				   &cursor);
		if (r)
			break;
		++*nr_inserted;
	}
	tsp_btree_cursor_release(&cursor);
	if (*nr_inserted)
		pmd->changed = true;
	return end_update(pmd, r);
}

static int __remove_range(struct tsp_thin_device *td, tsp_block_t begin,
			  tsp_block_t end)
{
	tsp_block_t old, root;
	u64 nr;
	int r;

	r = __device_root_for_update(td, &old, false);
	if (!r)
		r = tsp_btree_remove_range(&td->pmd->bl_info, old, begin, end,
					   &root, &nr);
	if (!r)
		r = __set_device_root(td, old, root);
	/* Nothing was mapped, so nothing was cached, unless it failed. */
	if (r || nr)
		tsp_mc_invalidate_range(__cache(td->pmd), td->fast.id, begin, end);
	if (r)
		return r;
	if (nr) {
		td->mapped_blocks -= min(nr, td->mapped_blocks);
		td->changed = true;
	}
	return 0;
}

int tsp_thin_remove_block(struct tsp_thin_device *td, tsp_block_t virt)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	tsp_block_t old, root;
	int r = begin_update(pmd);

	if (r)
		return r;
	r = __device_root_for_update(td, &old, false);
	if (!r)
		r = tsp_btree_remove(&pmd->bl_info, old, virt, &root);
	if (!r)
		r = __set_device_root(td, old, root);
	tsp_mc_invalidate(__cache(pmd), td->fast.id, virt);
	if (!r) {
		if (td->mapped_blocks)
			td->mapped_blocks--;
		td->changed = true;
	}
	return end_update(pmd, r);
}

int tsp_thin_remove_range(struct tsp_thin_device *td, tsp_block_t begin,
			  tsp_block_t end)
{
	int r = begin_update(td->pmd);

	if (r)
		return r;
	return end_update(td->pmd, __remove_range(td, begin, end));
}

int tsp_thin_get_mapped_count(struct tsp_thin_device *td, tsp_block_t *result)
{
	down_read(&td->pmd->root_lock);
	*result = td->mapped_blocks;
	up_read(&td->pmd->root_lock);
	return 0;
}

int tsp_thin_get_highest_mapped_block(struct tsp_thin_device *td,
				      tsp_block_t *result)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	tsp_block_t root;
	u64 key;
	int r;

	down_read(&pmd->root_lock);
	r = pmd->fail_io ? -EPERM : __device_root(td, &root);
	if (!r)
		r = tsp_btree_find_highest_key(&pmd->bl_info, root, &key);
	if (!r)
		*result = key;
	up_read(&pmd->root_lock);
	return r;
}

bool tsp_thin_changed_this_transaction(struct tsp_thin_device *td)
{
	bool r;

	down_read(&td->pmd->root_lock);
	r = td->changed;
	up_read(&td->pmd->root_lock);
	return r;
}

/**
 * tsp_thin_aborted_changes - whether an abort dropped changes to @td
 * @td: an open thin device
 *
 * Writes to @td that completed before the abort may be lost: a flush
 * cannot make them durable.  Stays true until @td's last opener closes
 * it.
 *
 * Context: may sleep (takes @root_lock for reading).
 */
bool tsp_thin_aborted_changes(struct tsp_thin_device *td)
{
	bool r;

	down_read(&td->pmd->root_lock);
	r = td->aborted_with_changes;
	up_read(&td->pmd->root_lock);
	return r;
}

bool tsp_pool_changed_this_transaction(struct tsp_pool_metadata *pmd)
{
	bool r;

	down_read(&pmd->root_lock);
	r = pmd->changed;
	up_read(&pmd->root_lock);
	return r;
}

/*----------------------------------------------------------------
 * Space
 *--------------------------------------------------------------*/
int tsp_pool_get_data_block_count(struct tsp_pool_metadata *pmd,
				  tsp_block_t *result)
{
	down_read(&pmd->root_lock);
	*result = tsp_data_sm_nr_blocks(pmd->data_sm);
	up_read(&pmd->root_lock);
	return 0;
}

int tsp_pool_get_free_block_count(struct tsp_pool_metadata *pmd,
				  tsp_block_t *result)
{
	down_read(&pmd->root_lock);
	*result = tsp_data_sm_nr_free(pmd->data_sm);
	up_read(&pmd->root_lock);
	return 0;
}

/**
 * tsp_pool_get_waiting_block_count - freed blocks not yet allocatable
 * @pmd: pool metadata
 * @result: out: blocks freed in this transaction (by a discard, a delete
 *	or a break of sharing), which wait for its commit (and the pool's
 *	IO grace period before it), and blocks held past their commit for a
 *	discard's passdown.  The free block count includes them.
 *
 * Context: may sleep (takes @root_lock for reading).
 *
 * Return: 0.
 */
int tsp_pool_get_waiting_block_count(struct tsp_pool_metadata *pmd,
				     tsp_block_t *result)
{
	down_read(&pmd->root_lock);
	*result = tsp_data_sm_nr_waiting(pmd->data_sm);
	up_read(&pmd->root_lock);
	return 0;
}

/**
 * tsp_pool_get_allocatable_block_count - free blocks allocation may have
 * @pmd: pool metadata
 * @freed_held: the blocks freed in this transaction will be held at its
 *	commit (tsp_pool_commit_metadata_hold_freed()): do not count them
 * @result: out: the free blocks less those held past their commit for a
 *	discard's passdown; those freed in this transaction count unless
 *	@freed_held, as they will be allocatable after its commit.
 *
 * Context: may sleep (takes @root_lock for reading).  Walks the held
 * blocks: not for the IO path.
 *
 * Return: 0.
 */
int tsp_pool_get_allocatable_block_count(struct tsp_pool_metadata *pmd,
					 bool freed_held, tsp_block_t *result)
{
	tsp_block_t nr_free, nr_held;

	down_read(&pmd->root_lock);
	nr_free = tsp_data_sm_nr_free(pmd->data_sm);
	nr_held = freed_held ? tsp_data_sm_nr_waiting(pmd->data_sm) :
			       tsp_data_sm_nr_held(pmd->data_sm);
	up_read(&pmd->root_lock);
	/* Not below zero on a corrupt count of blocks in use. */
	*result = nr_free > nr_held ? nr_free - nr_held : 0;
	return 0;
}

int tsp_pool_get_data_block_refcount(struct tsp_pool_metadata *pmd,
				     tsp_block_t b, u32 *result)
{
	int r;

	down_read(&pmd->root_lock);
	r = pmd->fail_io ? -EPERM : tsp_data_sm_get_count(pmd->data_sm, b, result);
	up_read(&pmd->root_lock);
	return r;
}

int tsp_pool_get_metadata_dev_size(struct tsp_pool_metadata *pmd,
				   tsp_block_t *result)
{
	down_read(&pmd->root_lock);
	*result = tsp_tm_nr_blocks(pmd->tm);
	up_read(&pmd->root_lock);
	return 0;
}

/**
 * tsp_pool_get_space - the free data and metadata blocks, in one look
 * @pmd: pool metadata
 * @space: out
 *
 * Context: may sleep (takes @root_lock for reading).  Return: 0.
 */
int tsp_pool_get_space(struct tsp_pool_metadata *pmd,
		       struct tsp_pool_space *space)
{
	down_read(&pmd->root_lock);
	space->data_free = tsp_data_sm_nr_free(pmd->data_sm);
	space->metadata_blocks = tsp_tm_nr_blocks(pmd->tm);
	space->metadata_free = tsp_tm_nr_free(pmd->tm);
	up_read(&pmd->root_lock);
	return 0;
}

int tsp_pool_resize_data_dev(struct tsp_pool_metadata *pmd,
			     tsp_block_t new_count)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	if (new_count < tsp_data_sm_nr_blocks(pmd->data_sm)) {
		DMERR("cannot shrink the data device from %llu to %llu blocks",
		      (unsigned long long)tsp_data_sm_nr_blocks(pmd->data_sm),
		      (unsigned long long)new_count);
		r = -EINVAL;
	} else {
		r = tsp_data_sm_extend(pmd->data_sm, new_count);
	}
	return end_update(pmd, r);
}

int tsp_pool_resize_metadata_dev(struct tsp_pool_metadata *pmd,
				 tsp_block_t new_count)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	if (new_count < tsp_tm_nr_blocks(pmd->tm)) {
		DMERR("cannot shrink the metadata device from %llu to %llu blocks",
		      (unsigned long long)tsp_tm_nr_blocks(pmd->tm),
		      (unsigned long long)new_count);
		r = -EINVAL;
	} else {
		r = tsp_tm_extend(pmd->tm, new_count);
	}
	return end_update(pmd, r);
}

void tsp_pool_metadata_read_only(struct tsp_pool_metadata *pmd)
{
	lock_for_update(pmd);
	__set_read_only(pmd);
	up_write(&pmd->root_lock);
}

/*
 * Undo tsp_pool_metadata_read_only().  The caller knows the in-core
 * metadata is sound: read-only was asked for, no operation failed.
 */
void tsp_pool_metadata_read_write(struct tsp_pool_metadata *pmd)
{
	lock_for_update(pmd);
	pmd->read_only = false;
	tsp_bm_set_read_write(pmd->bm);
	up_write(&pmd->root_lock);
}

int tsp_pool_metadata_set_needs_check(struct tsp_pool_metadata *pmd)
{
	int r;

	lock_for_update(pmd);
	pmd->flags |= THIN_NEEDS_CHECK_FLAG;
	if (pmd->fail_io || pmd->read_only) {
		r = -EPERM;
	} else {
		r = __commit_transaction(pmd);
		if (r)
			__fail_io(pmd);	/* as tsp_pool_commit_metadata() */
	}
	up_write(&pmd->root_lock);
	return r;
}

bool tsp_pool_metadata_needs_check(struct tsp_pool_metadata *pmd)
{
	bool r;

	down_read(&pmd->root_lock);
	r = pmd->flags & THIN_NEEDS_CHECK_FLAG;
	up_read(&pmd->root_lock);
	return r;
}

/*----------------------------------------------------------------
 * Tools: restore, dump
 *--------------------------------------------------------------*/
int tsp_pool_get_info(struct tsp_pool_metadata *pmd, struct tsp_pool_info *info)
{
	down_read(&pmd->root_lock);
	memcpy(info->uuid, pmd->uuid, sizeof(info->uuid));
	info->flags = pmd->flags;
	info->version = pmd->version;
	info->time = pmd->time;
	info->transaction_id = pmd->trans_id;
	info->metadata_snap = pmd->held_root;
	info->data_block_size = pmd->data_block_size;
	info->nr_data_blocks = tsp_data_sm_nr_blocks(pmd->data_sm);
	info->nr_metadata_blocks = tsp_tm_nr_blocks(pmd->tm);
	up_read(&pmd->root_lock);
	return 0;
}

int tsp_pool_restore_superblock(struct tsp_pool_metadata *pmd, u32 time,
				u64 transaction_id, u32 flags)
{
	int r = begin_update(pmd);

	if (r)
		return r;
	if (time >= (1u << TIME_BITS)) {
		DMERR("time %u does not fit in 24 bits", time);
		r = -EINVAL;
	} else {
		pmd->time = time;
		pmd->trans_id = transaction_id;
		pmd->flags = flags;
	}
	return end_update(pmd, r);
}

int tsp_pool_restore_thin(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			  const struct tsp_thin_details *details)
{
	struct tsp_thin_details d = *details;
	int r = begin_update(pmd);

	if (r)
		return r;
	d.mapped_blocks = 0;	/* counted as mappings are restored */
	return end_update(pmd, __create_thin(pmd, dev, &d));
}

int tsp_thin_restore_block(struct tsp_thin_device *td, tsp_block_t virt,
			   tsp_block_t data, u32 time)
{
	struct tsp_pool_metadata *pmd = td->pmd;
	tsp_block_t root;
	int r = begin_update(pmd);

	if (r)
		return r;
	if (time >= (1u << TIME_BITS)) {
		DMERR("mapping time %u does not fit in 24 bits", time);
		r = -EINVAL;
		goto out;
	}
	r = __device_root(td, &root);
	if (!r) {
		r = tsp_btree_lookup(&pmd->bl_info, root, virt, NULL);
		if (!r) {
			DMERR("virtual block %llu of device %llu is mapped twice",
			      (unsigned long long)virt, (unsigned long long)td->fast.id);
			r = -EEXIST;
			goto out;
		}
	}
	if (r == -ENODATA && data < tsp_data_sm_nr_blocks(pmd->data_sm))
		r = tsp_data_sm_inc(pmd->data_sm, data);
	if (!r)
		r = __insert_block(td, virt, data, time, true, NULL);
out:
	return end_update(pmd, r);
}

struct walk_devices_args {
	int (*fn)(void *context, tsp_thin_id dev, const struct tsp_thin_details *d);
	void *context;
};

static int walk_device(void *context, u64 key, void *value)
{
	struct walk_devices_args *args = context;
	struct tsp_thin_details d;

	details_unpack(value, &d);
	return args->fn(args->context, key, &d);
}

/* Devices as committed or changed: commit first to see every change. */
int tsp_pool_walk_devices(struct tsp_pool_metadata *pmd,
			  int (*fn)(void *context, tsp_thin_id dev,
				    const struct tsp_thin_details *d),
			  void *context)
{
	struct walk_devices_args args = { fn, context };
	int r;

	down_read(&pmd->root_lock);
	r = tsp_btree_walk(&pmd->details_info, pmd->details_root, walk_device, &args);
	up_read(&pmd->root_lock);
	return r;
}

struct walk_mappings_args {
	int (*fn)(void *context, tsp_block_t virt, tsp_block_t data, u32 time);
	void *context;
};

static int walk_mapping(void *context, u64 key, void *value)
{
	struct walk_mappings_args *args = context;
	tsp_block_t data;
	__le64 v;
	u32 time;

	memcpy(&v, value, sizeof(v));
	unpack_mapping(le64_to_cpu(v), &data, &time);
	return args->fn(args->context, key, data, time);
}

int tsp_thin_walk_mappings(struct tsp_thin_device *td,
			   int (*fn)(void *context, tsp_block_t virt,
				     tsp_block_t data, u32 time),
			   void *context)
{
	struct walk_mappings_args args = { fn, context };
	struct tsp_pool_metadata *pmd = td->pmd;
	tsp_block_t root;
	int r;

	down_read(&pmd->root_lock);
	r = __device_root(td, &root);
	if (!r)
		r = tsp_btree_walk(&pmd->bl_info, root, walk_mapping, &args);
	up_read(&pmd->root_lock);
	return r;
}

/*----------------------------------------------------------------
 * Checker
 *--------------------------------------------------------------*/
#define MAX_REPORTED_MISMATCHES 10

struct check_ctx {
	struct tsp_pool_metadata *pmd;
	u32 *meta;		/* references found per metadata block */
	tsp_block_t nr_meta;
	u32 *data;		/* references found per data block */
	tsp_block_t nr_data;
	u64 nr_mappings;	/* of the device being counted */
};

/* node_fn for tsp_btree_check(): count, and descend the first time. */
static int count_metadata_ref(void *context, tsp_block_t b)
{
	struct check_ctx *ctx = context;

	if (b >= ctx->nr_meta) {
		DMERR("reference to metadata block %llu beyond the space map (%llu)",
		      (unsigned long long)b, (unsigned long long)ctx->nr_meta);
		return -EILSEQ;
	}
	return ctx->meta[b]++ ? 1 : 0;
}

static int count_data_ref(void *context, u64 key, void *value)
{
	struct check_ctx *ctx = context;
	tsp_block_t b;
	__le64 v;
	u32 time;

	memcpy(&v, value, sizeof(v));
	unpack_mapping(le64_to_cpu(v), &b, &time);
	if (b >= ctx->nr_data) {
		DMERR("virtual block %llu maps to data block %llu beyond the data device",
		      (unsigned long long)key, (unsigned long long)b);
		return -EILSEQ;
	}
	ctx->data[b]++;
	return 0;
}

static int check_subtree(void *context, u64 key, void *value)
{
	struct check_ctx *ctx = context;
	__le64 v;

	memcpy(&v, value, sizeof(v));
	return tsp_btree_check(&ctx->pmd->bl_info, le64_to_cpu(v),
			       count_metadata_ref, count_data_ref, ctx);
}

static int check_trees(struct check_ctx *ctx, tsp_block_t mapping_root,
		       tsp_block_t details_root)
{
	struct tsp_pool_metadata *pmd = ctx->pmd;
	int r;

	r = tsp_btree_check(&pmd->tl_info, mapping_root, count_metadata_ref,
			    check_subtree, ctx);
	if (!r)
		r = tsp_btree_check(&pmd->details_info, details_root,
				    count_metadata_ref, NULL, ctx);
	return r;
}

static int count_mapping(void *context, u64 key, void *value)
{
	struct check_ctx *ctx = context;

	ctx->nr_mappings++;
	return 0;
}

/* Every device has both details and a tree, with the right count. */
static int check_device(void *context, u64 key, void *value)
{
	struct check_ctx *ctx = context;
	struct tsp_pool_metadata *pmd = ctx->pmd;
	struct tsp_thin_details d;
	__le64 root;
	int r;

	details_unpack(value, &d);
	r = tsp_btree_lookup(&pmd->tl_info, pmd->root, key, &root);
	if (r == -ENODATA) {
		DMERR("device %llu has details but no mapping tree",
		      (unsigned long long)key);
		return -EILSEQ;
	}
	if (r)
		return r;

	ctx->nr_mappings = 0;
	r = tsp_btree_walk(&pmd->bl_info, le64_to_cpu(root), count_mapping, ctx);
	if (r)
		return r;
	if (ctx->nr_mappings != d.mapped_blocks) {
		DMERR("device %llu has %llu mappings but its details say %llu",
		      (unsigned long long)key, (unsigned long long)ctx->nr_mappings,
		      (unsigned long long)d.mapped_blocks);
		return -EILSEQ;
	}
	return 0;
}

static int check_has_details(void *context, u64 key, void *value)
{
	struct check_ctx *ctx = context;
	int r;

	r = tsp_btree_lookup(&ctx->pmd->details_info, ctx->pmd->details_root,
			     key, NULL);
	if (r == -ENODATA) {
		DMERR("device %llu has a mapping tree but no details",
		      (unsigned long long)key);
		return -EILSEQ;
	}
	return r;
}

static int check_held_root(struct check_ctx *ctx)
{
	struct tsp_pool_metadata *pmd = ctx->pmd;
	struct thin_disk_superblock *copy;
	tsp_block_t mapping_root, details_root;
	struct tsp_block *b;
	int r;

	r = count_metadata_ref(ctx, pmd->held_root);
	if (r)
		return r < 0 ? r : -EILSEQ;
	r = tsp_tm_read_lock(pmd->tm, pmd->held_root, &sb_validator, &b);
	if (r)
		return r;
	copy = tsp_block_data(b);
	mapping_root = le64_to_cpu(copy->data_mapping_root);
	details_root = le64_to_cpu(copy->device_details_root);
	tsp_tm_unlock(pmd->tm, b);
	return check_trees(ctx, mapping_root, details_root);
}

/* Compare the references found with both space maps' counts. */
static int compare_counts(struct check_ctx *ctx)
{
	struct tsp_pool_metadata *pmd = ctx->pmd;
	tsp_block_t b, mismatches = 0, in_use = 0;
	u32 count;
	int r;

	for (b = 0; b < ctx->nr_meta; b++) {
		r = tsp_tm_ref(pmd->tm, b, &count);
		if (r)
			return r;
		if (count != ctx->meta[b] && mismatches++ < MAX_REPORTED_MISMATCHES)
			DMERR("metadata block %llu: space map count %u, %u references",
			      (unsigned long long)b, count, ctx->meta[b]);
	}
	for (b = 0; b < ctx->nr_data; b++) {
		r = tsp_data_sm_get_count(pmd->data_sm, b, &count);
		if (r)
			return r;
		in_use += !!count;
		if (count != ctx->data[b] && mismatches++ < MAX_REPORTED_MISMATCHES)
			DMERR("data block %llu: space map count %u, %u references",
			      (unsigned long long)b, count, ctx->data[b]);
	}
	if (ctx->nr_data - in_use != tsp_data_sm_nr_free(pmd->data_sm)) {
		DMERR("data space map says %llu blocks are free, but %llu are",
		      (unsigned long long)tsp_data_sm_nr_free(pmd->data_sm),
		      (unsigned long long)(ctx->nr_data - in_use));
		mismatches++;
	}
	if (mismatches) {
		DMERR("%llu reference count mismatches", (unsigned long long)mismatches);
		return -EILSEQ;
	}
	return 0;
}

/**
 * tsp_pool_check - see dm-thin-metadata.h
 * @pmd: freshly opened pool metadata
 */
int tsp_pool_check(struct tsp_pool_metadata *pmd)
{
	struct check_ctx ctx = { .pmd = pmd };
	int r;

	down_read(&pmd->root_lock);
	if (pmd->changed) {
		r = -EBUSY;
		goto out;
	}
	ctx.nr_meta = tsp_tm_nr_blocks(pmd->tm);
	ctx.nr_data = tsp_data_sm_nr_blocks(pmd->data_sm);
	ctx.meta = kvcalloc(ctx.nr_meta, sizeof(u32), GFP_KERNEL);
	ctx.data = kvcalloc(max_t(tsp_block_t, ctx.nr_data, 1), sizeof(u32),
			    GFP_KERNEL);
	if (!ctx.meta || !ctx.data) {
		r = -ENOMEM;
		goto out;
	}

	r = count_metadata_ref(&ctx, THIN_SUPERBLOCK_LOCATION);
	if (!r)
		r = tsp_tm_walk_sm_blocks(pmd->tm, count_metadata_ref, &ctx);
	if (!r)
		r = tsp_data_sm_walk_own_blocks(pmd->data_sm, count_metadata_ref,
						&ctx);
	if (!r)
		r = check_trees(&ctx, pmd->root, pmd->details_root);
	if (!r && pmd->held_root)
		r = check_held_root(&ctx);
	if (!r)
		r = tsp_btree_walk(&pmd->details_info, pmd->details_root,
				   check_device, &ctx);
	if (!r)
		r = tsp_btree_walk(&pmd->tl_info, pmd->root, check_has_details,
				   &ctx);
	if (!r)
		r = compare_counts(&ctx);
	if (!r)
		r = tsp_data_sm_check_index(pmd->data_sm);
out:
	kvfree(ctx.meta);
	kvfree(ctx.data);
	up_read(&pmd->root_lock);
	return r;
}
