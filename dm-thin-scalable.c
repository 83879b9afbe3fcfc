// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-thin-scalable.c - the thin-scal-pool and thin-scalable targets,
 * drop-in replacements for dm-thin's thin-pool and thin: the same table
 * lines, messages, status lines and on-disk metadata.
 *
 * The pool target is "thin-scal-pool", not "thin-scalable-pool": the
 * device-mapper ioctl interface carries target type names in 16 bytes
 * (DM_MAX_TYPE_NAME, with the terminating NUL), so 15 characters at most.
 *
 * Glossary:
 *   pool        one metadata device + one data device; shared by every
 *               table (reload) of the same pool mapped device
 *   thin        a virtual device mapped onto pool blocks (struct thin_c)
 *   block       a data block of sectors_per_block sectors
 *   job         the provisioning of one virtual block: copying into a new
 *               data block, or writing the bio's part of it with the rest
 *               zeroed, then inserting the mapping
 *   epoch       a per-CPU count of IOs remapped to data blocks, in two
 *               generations; see "Deferred free" below
 *
 * The IO path:
 *   - Fast path (in map): a read, or a write without FLUSH/FUA to a block
 *     the device owns alone, is looked up in the metadata layer's RCU
 *     mapping cache, enters the current epoch and is remapped.  No lock.
 *     A bio over several blocks mapped to consecutive data blocks stays
 *     one bio; dm core splits off whatever the fast path cannot take.
 *   - Provisioning in map: a plain write to an unmapped block of a pool
 *     that does not zero new blocks is provisioned right there when
 *     that needs no IO and no wait (provision_in_map()): allocated and
 *     mapped, then issued, as dm-thin's worker does without zeroing.
 *     A worker with a long list of deferred bios does the same for such
 *     a write deferred to it (map_before_write()).
 *   - Everything else goes to a worker (pool_workers of them, one by
 *     default, on an unbound workqueue), each owning the virtual blocks
 *     of the regions (REGION_BLOCKS blocks of one thin device) that hash
 *     to it, as dm-vdo's logical zones own theirs.  A bio goes on its
 *     owner's deferred list (an llist, pushed from any CPU) and the
 *     owner is kicked.  The owner serialises bios per block
 *     through its table of running jobs (the per-block lock table, one
 *     shard per worker, so no lock), provisions (the bio's data and the
 *     zeroes around it go to the new block in one write, or beside
 *     zeroing bios, unless zeroing is off), breaks sharing (copying
 *     with dm-kcopyd), unmaps discarded blocks (discards are cut at
 *     region ends in map), maps the blocks of finished jobs in
 *     batches, and commits.  The bios of a long batch
 *     are ended on the CPUs that mapped them, and in a long pass the
 *     first writes it maps before they are written are issued there
 *     (handover_min_batch).
 *     Workers run concurrently; the metadata lock orders their metadata
 *     changes.
 *
 * Deferred free: a data block unmapped by a discard, or whose last
 * mapping a broken share replaced, is freed in the current metadata
 * transaction, and the data space map does not hand out a block freed in
 * the current transaction.  A commit of a transaction that freed blocks
 * first waits for every IO that entered an epoch before the commit
 * started: an IO remapped through a stale cache entry finishes before its
 * block can be reused.  Blocks that discards freed are discarded on the
 * data device (passed down) once the metadata commit has succeeded, so
 * that no abort maps them again, while the metadata holds them back from
 * allocation until the discards are done; the commit does not wait for
 * them (queue_committed_passdowns()).
 *
 * Durability: before a commit the data device is flushed.  A FLUSH or FUA
 * bio that depends on uncommitted mappings is issued (or completed) only
 * after the commit covering them: a write is held until the worker's next
 * commit, a read waits for a commit right away (process_bio()).  The
 * waker also commits once a second when the metadata changed.
 *
 * Locking:
 *   pool_table_mutex   the list of pools, and pool->ref_count
 *   pool->mode_lock    a change of pool mode; low_water_triggered; the
 *                      no-space timeout (its deadline, and its change
 *                      of error_if_no_space); pool->ti being set or
 *                      cleared, and its table's events
 *   pool->commit_lock  (taken before mode_lock, never after it) a
 *                      commit, and the IO path's mapping changes
 *                      (discards, batches of new mappings), so that
 *                      none lands between a commit's data device flush
 *                      and its metadata commit; freed_this_transaction,
 *                      passdowns, passdowns_next, passdown_in_flight;
 *                      metadata_low_water_triggered.  Not
 *                      provision_in_map() or map_before_write(): their
 *                      bio is issued after the mapping exists, so no
 *                      completed write depends on a mapping a commit
 *                      could miss
 *   pool->lock         (irq-safe spinlock) pool->retry_list; the
 *                      pool's list of thin targets and its suspended
 *                      flag; each thin target's requeue_no_space
 *   worker->lock       (irq-safe spinlock) worker->completed_jobs
 *   worker->running    written by its work item only; read by those
 *                      adding to its lists, after a full barrier (see
 *                      wake_worker())
 *   worker->pass_lock  (mutex) held by each pass of its work item, and
 *                      taken with a trylock by provision_in_map(), which
 *                      looks at its job table
 *   worker-private     the worker's job table, spare_jobs,
 *                      flush_waiters, issue_after_commit and no_job:
 *                      only its work item touches them (the job table
 *                      also provision_in_map(), under pass_lock), and
 *                      a work item never runs twice at once
 *   worker->deferred   llist: pushed by anyone, emptied by the worker
 *   cpu_completions    per CPU llists: pushed by workers, emptied by the
 *                      CPU's work item
 *   metadata           dm-thin-metadata.c's own rw_semaphore
 *   fast path          RCU and per-CPU counters only
 */

#include <linux/module.h>
#include <linux/init.h>
#include <linux/device-mapper.h>
#include <linux/dm-kcopyd.h>
#include <linux/blkdev.h>
#include <linux/llist.h>
#include <linux/list.h>
#include <linux/hash.h>
#include <linux/workqueue.h>
#include <linux/rcupdate.h>
#include <linux/percpu.h>
#include <linux/slab.h>
#include <linux/sched.h>
#include <linux/delay.h>
#include <linux/refcount.h>
#include <linux/completion.h>
#include <linux/sizes.h>
#include <linux/version.h>

#include "dm-core-private.h"
#include "dm-thin-metadata.h"

#define DM_MSG_PREFIX "thin-scalable"

#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 5, 0)
#define OPEN_READ BLK_OPEN_READ
#define OPEN_READ_WRITE (BLK_OPEN_READ | BLK_OPEN_WRITE)
#else
#define OPEN_READ FMODE_READ
#define OPEN_READ_WRITE (FMODE_READ | FMODE_WRITE)
#endif

/*
 * A pool's own reference to one of its devices (see struct pool): it
 * keeps the block device alive and claims nothing.  The tables' opens
 * (dm_get_device()) hold the exclusive claims and the access modes.
 * bdev_ref_put() drops what bdev_ref_get() took, if it took anything.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 9, 0)
struct bdev_ref {
	struct file *file;
	struct block_device *bdev;
};

static int bdev_ref_get(struct bdev_ref *ref, dev_t dev)
{
	struct file *file;

	file = bdev_file_open_by_dev(dev, BLK_OPEN_READ, NULL, NULL);
	if (IS_ERR(file))
		return PTR_ERR(file);
	ref->file = file;
	ref->bdev = file_bdev(file);
	return 0;
}

static void bdev_ref_put(struct bdev_ref *ref)
{
	if (ref->file)
		bdev_fput(ref->file);
	ref->file = NULL;
	ref->bdev = NULL;
}
#elif LINUX_VERSION_CODE < KERNEL_VERSION(6, 5, 0)
struct bdev_ref {
	struct block_device *bdev;
};

static int bdev_ref_get(struct bdev_ref *ref, dev_t dev)
{
	struct block_device *bdev;

	bdev = blkdev_get_by_dev(dev, FMODE_READ, NULL);
	if (IS_ERR(bdev))
		return PTR_ERR(bdev);
	ref->bdev = bdev;
	return 0;
}

static void bdev_ref_put(struct bdev_ref *ref)
{
	if (ref->bdev)
		blkdev_put(ref->bdev, FMODE_READ);
	ref->bdev = NULL;
}
#else
#error "kernels 6.5 to 6.8 are not supported (struct bdev_ref)"
#endif

#define COMMIT_PERIOD HZ
#define JOB_HASH_BITS 8
#define JOB_SPARES 64		/* jobs a worker keeps for reuse */
/*
 * Virtual blocks of a thin device are dealt to workers in regions of
 * this many: a region's bios and jobs all belong to one worker.
 */
#define REGION_BLOCKS 128
/* Workers per pool at most (pool_workers). */
#define MAX_WORKERS 64
/*
 * Runs of freed blocks waiting to be passed down, at most: more, and the
 * discard that freed them commits, which passes them down
 * (process_discard()).  Committed runs waiting for the batch in flight,
 * at most MAX_PASSDOWNS_NEXT: past it, the new ones are not passed down
 * (a discard is a hint to the device), so that a device slow to discard
 * does not pile them up without end.
 */
#define MAX_PASSDOWNS 1024
#define MAX_PASSDOWNS_NEXT (16 * MAX_PASSDOWNS)
/* dm-thin's metadata low water mark: 4 MiB of metadata, or a quarter. */
#define METADATA_LOW_WATER_BLOCKS 1024ULL
/*
 * Metadata blocks kept back so that the operations in flight when the
 * pool runs out of metadata space can still finish and commit: a tenth of
 * the metadata device, 16 MiB at most.  Free counts in the status line
 * leave it out, as dm-thin's do.
 */
#define METADATA_RESERVE_MAX_BLOCKS 4096ULL

static unsigned int no_space_timeout_secs = 60;
module_param_named(no_space_timeout, no_space_timeout_secs, uint, 0644);
MODULE_PARM_DESC(no_space_timeout,
		 "Out of data space queue IO timeout in seconds (0: queue forever)");

/*
 * One worker by default: under emulation, with the metadata lock
 * ordering every worker's btree work, more workers lost to one at 2 and
 * 8 vCPUs (README, Performance).
 */
static unsigned int pool_workers = 1;
module_param(pool_workers, uint, 0644);
MODULE_PARM_DESC(pool_workers,
		 "Workers per pool, each owning part of the virtual blocks (0: one per CPU, at most 64); read when a pool is created");

/*
 * A worker ends the bios of a batch of provisions itself, unless at
 * least this many of them wrote their new blocks (first writes): then
 * each CPU that mapped some ends its own, so that the worker does not
 * wake every submitter one by one (an IPI each) while the rest of the
 * batch and the next pass wait.  At 8 vCPUs on 2 host cores that gained
 * about a quarter; with short batches (1 and 2 vCPUs) handing over lost
 * to ending them at once (README, Performance).  Likewise in a pass of
 * at least this many deferred bios, first writes that need no zeroing
 * are mapped before they are written and issued by the CPUs that mapped
 * them (map_before_write()).
 */
static unsigned int handover_min_batch = 64;
module_param(handover_min_batch, uint, 0644);
MODULE_PARM_DESC(handover_min_batch,
		 "Provisions completed together, or bios in a worker's pass, from which the worker hands their bios to their submitters' CPUs (0: never)");

static unsigned int cache_budget_mib = 64;
module_param_named(cache_budget_mib, cache_budget_mib, uint, 0644);
MODULE_PARM_DESC(cache_budget_mib,
		 "Mapping cache memory per pool in MiB, taken when a pool is created");

/*
 * Ordered by degradation, as dm-thin's.  Out of metadata space the pool
 * behaves as read-only (and says "ro"), but the metadata stays writable so
 * that the work in flight finishes and commits, into the reserve.
 */
enum pool_mode {
	PM_WRITE,
	PM_OUT_OF_DATA_SPACE,
	PM_OUT_OF_METADATA_SPACE,
	PM_READ_ONLY,
	PM_FAIL,
};

struct pool_features {
	enum pool_mode mode;
	bool zero_new_blocks;
	bool discard_enabled;
	bool discard_passdown;
	bool error_if_no_space;
};

struct epoch_counts {
	long count[2];
};

struct pool_stats {
	u64 fast;		/* remapped in map, no lock */
	u64 deferred;		/* handed to the worker */
	u64 provisioned_in_map;	/* provision_in_map() */
	u64 mapped_before_write; /* map_before_write() */
	u64 blocks_written_whole; /* write_with_zeroes() */
};

struct pool {
	struct list_head list;			/* pool_table */
	struct mapped_device *pool_md;
	int ref_count;				/* pool_table_mutex */
	/*
	 * The pool's devices, held from its creation to its destruction: a
	 * pool outlives its tables while thin devices hold it, and its
	 * metadata and IO path use the devices throughout.  Their table
	 * opens alone would leave a pool without a table with pointers to
	 * devices that may go, or be replaced under the same number.
	 */
	struct bdev_ref metadata_dev;
	struct bdev_ref data_dev;

	struct tsp_pool_metadata *pmd;
	struct dm_kcopyd_client *copier;
	struct bio_set zero_bios;		/* filling new blocks */
	/*
	 * The data device refused a WRITE ZEROES as one it cannot do (it
	 * may offer them and then refuse them): new blocks are zeroed by
	 * writing from then on.
	 */
	atomic_t write_zeroes_failed;
	struct workqueue_struct *wq;
	struct workqueue_struct *completion_wq;	/* per CPU, high priority */
	struct cpu_completions __percpu *completions;
	struct worker *workers;
	unsigned int nr_workers;
	struct delayed_work waker;
	struct delayed_work no_space_timeout;
	unsigned long no_space_deadline;	/* mode_lock: jiffies */

	/*
	 * Set when the pool target is resumed, cleared when it is destroyed,
	 * under mode_lock; read by the IO path.
	 */
	struct dm_target *ti;
	struct pool_features pf;
	bool table_error_if_no_space;		/* the table's, not the timeout's */
	u32 sectors_per_block;
	int sectors_per_block_shift;		/* -1 if not a power of 2 */
	tsp_block_t low_water_blocks;
	bool low_water_triggered;		/* mode_lock */
	bool metadata_low_water_triggered;
	/*
	 * The metadata reserve (metadata_reserve()) of the metadata device
	 * as of the last resume: a provision in map leaves it free, so that
	 * only the worker goes past it (and switches the pool's mode).
	 */
	tsp_block_t metadata_reserve_blocks;

	struct epoch_counts __percpu *epoch;
	unsigned int epoch_index;
	struct pool_stats __percpu *stats;
	atomic64_t commits;
	atomic_t aborts;	/* 2 per metadata_failed() call, refusals aside */

	/*
	 * Held over a commit and over the IO path's mapping changes, so
	 * that none lands between a commit's data device flush and its
	 * metadata commit, and a commit knows whether its transaction freed
	 * blocks.
	 */
	struct mutex commit_lock;
	bool freed_this_transaction;		/* commit_lock */
	/*
	 * Runs of data blocks that discards freed in this transaction, to
	 * be discarded on the data device (passed down) at its commit, after
	 * the IO grace period: until then an IO through a stale mapping may
	 * still read them.  Under commit_lock.
	 */
	struct list_head passdowns;
	unsigned int nr_passdowns;
	int passdowns_aborts;			/* pool->aborts at the first */
	/*
	 * Runs whose transaction is committed, waiting for the batch of
	 * passdowns in flight to be done: one batch is in flight at a time
	 * (see tsp_pool_release_held_blocks()).  Under commit_lock, and
	 * passdown_in_flight read by wait_for_passdowns().
	 */
	struct list_head passdowns_next;
	unsigned int nr_passdowns_next;
	bool passdown_in_flight;
	/*
	 * Goes up whenever blocks may have become allocatable: at each
	 * commit, and when a batch of passdowns releases its blocks.
	 */
	atomic64_t space_gen;
	/* Serialises mode changes (pf.mode is also read locklessly). */
	struct mutex mode_lock;

	spinlock_t lock;
	struct bio_list retry_list;		/* lock: out of space */
	/*
	 * The thin targets of this pool, suspended with it as dm-thin's
	 * are.  Under lock; none is added while the pool is suspended.
	 */
	struct list_head thins;
	bool suspended;				/* lock */
};

/*
 * A worker: the owner of the regions that hash to it (worker_for()).  It
 * alone processes their bios and jobs, so its job table needs no lock.
 */
struct worker {
	struct work_struct work;
	struct pool *pool;
	struct llist_head deferred;		/* bios for it, from any CPU */

	spinlock_t lock;
	struct list_head completed_jobs;	/* lock: IO done, to map */

	/*
	 * Set while the work item runs, up to its last look at its lists:
	 * work added meanwhile needs no kick (see wake_worker()).
	 */
	bool running;

	struct mutex pass_lock;			/* see "Locking" */

	/* Private to the work item. */
	struct hlist_head jobs[1 << JOB_HASH_BITS];
	/*
	 * Up to JOB_SPARES free jobs (linked by their hash node), the
	 * first place alloc_job() looks and the first place free_job()
	 * puts a job back: the slab only when they run out or overflow.
	 * The bios that find no job wait in @no_job for the next pass:
	 * only this worker's jobs empty its spares, and the end of each of
	 * them runs a pass (as dm-thin retries a bio that found its
	 * mapping pool empty).
	 */
	struct hlist_head spare_jobs;
	unsigned int nr_spare_jobs;
	struct bio_list no_job;
	struct bio_list flush_waiters;		/* complete after commit */
	struct bio_list issue_after_commit;	/* issue after commit */
	bool commit_requested;
	cpumask_var_t completions_to_kick;	/* hand_over_bio() */

	/* Written by the work item, read by stats. */
	u64 passes;
	u64 handed_over;
} ____cacheline_aligned_in_smp;

/*
 * Bios workers completed, to be ended on the CPU that mapped them, and
 * bios they remapped, to be issued there.
 */
struct cpu_completions {
	struct llist_head bios;
	struct llist_head issues;
	struct work_struct work;
};

/* One table's pool target. */
struct pool_c {
	struct dm_target *ti;
	struct pool *pool;
	struct dm_dev *data_dev;
	struct dm_dev *metadata_dev;
	tsp_block_t low_water_blocks;
	struct pool_features requested_pf;	/* as in the table line */
	struct pool_features adjusted_pf;	/* after the data device's limits */
};

struct thin_c {
	struct dm_target *ti;
	struct mapped_device *thin_md;
	struct pool *pool;
	struct dm_dev *pool_dev;
	tsp_thin_id dev_id;
	struct tsp_thin_device *td;
	const struct tsp_thin_fast *td_fast;	/* tsp_thin_fast_of(td) */

	/*
	 * External origin: a read-only device that unprovisioned blocks
	 * read from (zeroes past its end), copied into a block when it is
	 * first written.  Its size is taken on resume.
	 */
	struct dm_dev *origin_dev;
	sector_t origin_size;

	/*
	 * Being suspended with noflush: bios that would wait for data space
	 * go back to dm core instead, which holds them until the resume.
	 * Under pool->lock.
	 */
	bool requeue_no_space;

	struct list_head list;		/* pool->thins */
	/*
	 * The pool's while on its list, and one more while the pool's
	 * suspend or resume works on it; the destructor waits for the
	 * last to go.
	 */
	refcount_t refcount;
	struct completion can_destroy;
	bool suspended_by_pool;		/* pool->lock */
	struct list_head batch;		/* suspend_thins() */
};

/* Per bio, in the thin target's per-bio data. */
struct thin_bio {
	struct llist_node node;		/* deferred, or handed to a CPU */
	struct thin_c *tc;
	int epoch;			/* -1: not counted */
	int cpu;			/* that mapped it */
	bio_end_io_t *saved_end_io;	/* while a job owns the bio */
	void *saved_private;
};

/* A run of freed data blocks to discard on the data device. */
struct passdown {
	struct list_head list;
	tsp_block_t begin, end;
};

/* One batch of passdowns, in flight: sent, then done, on pool->wq. */
struct passdown_batch {
	struct pool *pool;
	struct list_head runs;		/* until sent */
	struct work_struct send_work;	/* send_passdowns() */
	struct work_struct done_work;	/* passdown_done() */
};

/* Zeroing around a bio takes two ranges of its block, the rest one. */
#define JOB_ZEROED_RANGES 2

struct job {
	struct hlist_node hash;
	struct list_head list;		/* its worker's completed_jobs */
	struct thin_c *tc;
	struct tsp_new_mapping mapping;	/* virtual block -> new data block */
	struct bio *bio;		/* issued once the mapping exists */
	bool bio_wrote_block;		/* @bio's data is in the block */
	bool breaks_sharing;		/* replaces a shared block's mapping */
	struct bio_list waiting;	/* later bios for the same block */
	atomic_t pending;		/* IOs filling the block */
	int err;			/* of the first IO that failed */
	/* The ranges zero_range() zeroed, to write if WRITE ZEROES failed. */
	struct zeroed_range {
		sector_t sector;
		sector_t nr;
	} zeroed[JOB_ZEROED_RANGES];
	unsigned int nr_zeroed;
	bool write_zeroes_failed;	/* one of its WRITE ZEROES did */
};

static DEFINE_MUTEX(pool_table_mutex);
static LIST_HEAD(pool_table);
static struct kmem_cache *job_cache;

/*
 * What writes of zeroes write: 64 KiB of zeroes, never written, so that
 * a block of the usual sizes takes one vector of them where the zero
 * page would take one per page (and a bio with many vectors, allocated
 * apart).
 */
#define ZEROES_ORDER get_order(SZ_64K)
#define ZEROES_SECTORS (SZ_64K >> SECTOR_SHIFT)
static struct page *zeroes;

/*----------------------------------------------------------------
 * Small helpers
 *--------------------------------------------------------------*/
static struct thin_bio *thin_bio(struct bio *bio)
{
	return dm_per_bio_data(bio, sizeof(struct thin_bio));
}

static tsp_block_t sector_block(struct pool *pool, sector_t s)
{
	if (pool->sectors_per_block_shift >= 0)
		return s >> pool->sectors_per_block_shift;
	return div_u64(s, pool->sectors_per_block);
}

static tsp_block_t bio_block(struct pool *pool, struct bio *bio)
{
	return sector_block(pool, bio->bi_iter.bi_sector);
}

static sector_t block_offset(struct pool *pool, sector_t s)
{
	if (pool->sectors_per_block_shift >= 0)
		return s & (pool->sectors_per_block - 1);
	return sector_div(s, pool->sectors_per_block);
}

/* Inline: the fast path calls it for every IO. */
static inline void remap(struct pool *pool, struct bio *bio,
			 tsp_block_t data_block)
{
	sector_t offset = block_offset(pool, bio->bi_iter.bi_sector);

	bio_set_dev(bio, pool->data_dev.bdev);
	bio->bi_iter.bi_sector = data_block * pool->sectors_per_block + offset;
}

static bool bio_covers_block(struct pool *pool, struct bio *bio)
{
	return !block_offset(pool, bio->bi_iter.bi_sector) &&
	       bio->bi_iter.bi_size == (pool->sectors_per_block << SECTOR_SHIFT);
}

/*
 * Whether @bio may complete only once the mappings it depends on are
 * committed: FLUSH or FUA (6.1 lets a FUA read through too).
 */
static bool bio_needs_commit(struct bio *bio)
{
	return op_is_flush(bio->bi_opf);
}

static enum pool_mode pool_mode(struct pool *pool)
{
	return READ_ONCE(pool->pf.mode);
}

/* No mapping may change: out of metadata space, read-only or failed. */
static bool pool_is_read_only(struct pool *pool)
{
	return pool_mode(pool) >= PM_OUT_OF_METADATA_SPACE;
}

/*
 * Whether @bio, if @virt is unmapped, may have its new block mapped
 * before it writes it, as dm-thin does for a pool that does not zero new
 * blocks: a plain write (no FLUSH or FUA, which would wait for a commit)
 * to a pool in write mode that leaves the rest of a new block as it
 * finds it, outside an external origin (whose data is copied first).  A
 * mapping in place before the write means that no completed write
 * depends on a mapping a commit could miss.
 */
static bool may_map_before_write(struct thin_c *tc, struct bio *bio,
				 tsp_block_t virt)
{
	struct pool *pool = tc->pool;

	return bio_data_dir(bio) == WRITE && !bio_needs_commit(bio) &&
	       !pool->pf.zero_new_blocks && pool_mode(pool) == PM_WRITE &&
	       !(tc->origin_dev &&
		 virt * pool->sectors_per_block < tc->origin_size);
}

/*
 * Kick @w, whose deferred or completed list the caller just added to.
 * Not while its work item runs: that looks at both lists again before it
 * ends.  A kick of a running work item would queue it again for a pass
 * that finds nothing, and on the unbound workqueue also wake an idle
 * kworker only for it to find the work running and sleep again, once per
 * IO for first writes (their bio, then their data write's completion).
 */
static void wake_worker(struct worker *w)
{
	smp_mb();	/* the caller's list add, then read running */
	if (!READ_ONCE(w->running))
		queue_work(w->pool->wq, &w->work);
}

/* The owner of @virt of @tc. */
static struct worker *worker_for(struct thin_c *tc, tsp_block_t virt)
{
	struct pool *pool = tc->pool;
	u64 region = div_u64(virt, REGION_BLOCKS);

	return &pool->workers[hash_64(region ^ ((u64)tc->dev_id << 40), 32) %
			      pool->nr_workers];
}

/*----------------------------------------------------------------
 * IO epochs (see "Deferred free" above)
 *--------------------------------------------------------------*/

/* Count the bio of @tb in the current epoch.  Caller holds rcu_read_lock(). */
static void epoch_enter(struct pool *pool, struct thin_bio *tb)
{
	unsigned int idx = READ_ONCE(pool->epoch_index) & 1;

	this_cpu_inc(pool->epoch->count[idx]);
	tb->epoch = idx;
}

/* From end_io: may run in interrupt context. */
static void epoch_leave(struct pool *pool, struct bio *bio)
{
	struct thin_bio *tb = thin_bio(bio);

	if (tb->epoch >= 0) {
		this_cpu_dec(pool->epoch->count[tb->epoch]);
		tb->epoch = -1;
	}
}

static long epoch_sum(struct pool *pool, unsigned int idx)
{
	long sum = 0;
	int cpu;

	for_each_possible_cpu(cpu)
		sum += per_cpu_ptr(pool->epoch, cpu)->count[idx];
	return sum;
}

/*
 * Wait for every IO that may use a mapping removed before now.  Such an
 * IO looked the mapping up and entered an epoch inside one RCU read-side
 * section that began before the removal: after the first
 * synchronize_rcu() all of them are counted, in the current generation
 * (the previous grace period saw the last of the other one).  Flip the
 * generation, so that new IOs count in the other one.  An IO that read
 * the generation before the flip may still be about to count itself in
 * the old one: after the second synchronize_rcu() none is, so its
 * counters only fall, and a sum of them that reads zero means all of its
 * IO is done (with increments still arriving, one IO's increment missed
 * on one CPU and its decrement seen on another could hide another IO).
 * Callers hold commit_lock; sleeps.
 */
static void epoch_wait_grace_period(struct pool *pool)
{
	unsigned int old = pool->epoch_index & 1;

	lockdep_assert_held(&pool->commit_lock);
	synchronize_rcu();
	WRITE_ONCE(pool->epoch_index, old ^ 1);
	synchronize_rcu();
	while (epoch_sum(pool, old))
		schedule_timeout_uninterruptible(1);
}

/* Count @bio in the current epoch, outside a lookup's RCU section. */
static void count_in_epoch(struct pool *pool, struct bio *bio)
{
	rcu_read_lock();
	epoch_enter(pool, thin_bio(bio));
	rcu_read_unlock();
}

/* Send a remapped @bio, counted in the epoch. */
static void submit_counted(struct pool *pool, struct bio *bio)
{
	count_in_epoch(pool, bio);
	submit_bio_noacct(bio);
}

static void issue_remapped(struct pool *pool, struct bio *bio,
			   tsp_block_t data_block)
{
	remap(pool, bio, data_block);
	submit_counted(pool, bio);
}

/*----------------------------------------------------------------
 * Pool modes and metadata failure
 *--------------------------------------------------------------*/
static const char *mode_name(enum pool_mode mode)
{
	switch (mode) {
	case PM_WRITE:
		return "write";
	case PM_OUT_OF_DATA_SPACE:
		return "out-of-data-space";
	case PM_OUT_OF_METADATA_SPACE:
		return "out-of-metadata-space";
	case PM_READ_ONLY:
		return "read-only";
	default:
		return "fail";
	}
}

static void error_retry_list(struct pool *pool, blk_status_t status);

/*
 * Tell userspace (dmeventd) to look at the pool: a mode change or a low
 * water mark.  Under mode_lock, which pool_dtr() takes to unbind its
 * target, so the table is not freed under us.
 */
static void pool_event(struct pool *pool)
{
	lockdep_assert_held(&pool->mode_lock);
	if (pool->ti)
		dm_table_event(pool->ti->table);
}

/*
 * Out of data space no longer: undo the timeout, armed or expired, as
 * dm-thin does, so that the next time queues IO for the full time.
 */
static void leave_no_space_mode(struct pool *pool)
{
	cancel_delayed_work(&pool->no_space_timeout);
	WRITE_ONCE(pool->pf.error_if_no_space, pool->table_error_if_no_space);
}

/*
 * Out of data space and queueing IO: error it after no_space_timeout_secs
 * from now (unless the timeout is 0); a timer still pending is moved to
 * the new deadline.
 */
static void arm_no_space_timeout(struct pool *pool)
{
	/* Read once: the parameter may be written meanwhile. */
	unsigned long timeout = READ_ONCE(no_space_timeout_secs);

	lockdep_assert_held(&pool->mode_lock);
	if (pool->pf.error_if_no_space || !timeout)
		return;
	timeout *= HZ;
	pool->no_space_deadline = jiffies + timeout;
	mod_delayed_work(pool->wq, &pool->no_space_timeout, timeout);
}

static void __set_pool_mode(struct pool *pool, enum pool_mode mode)
{
	enum pool_mode old = pool_mode(pool);

	lockdep_assert_held(&pool->mode_lock);
	if (mode == old)
		return;
	if (old == PM_FAIL) {
		DMERR("%s: pool in fail mode cannot change mode",
		      dm_device_name(pool->pool_md));
		return;
	}

	if (mode >= PM_READ_ONLY)
		tsp_pool_metadata_read_only(pool->pmd);
	else if (old == PM_READ_ONLY)
		tsp_pool_metadata_read_write(pool->pmd);
	if (mode == PM_OUT_OF_DATA_SPACE)
		arm_no_space_timeout(pool);
	else if (old == PM_OUT_OF_DATA_SPACE)
		leave_no_space_mode(pool);
	WRITE_ONCE(pool->pf.mode, mode);
	if (mode != PM_WRITE && mode != PM_OUT_OF_DATA_SPACE)
		error_retry_list(pool, BLK_STS_IOERR);

	DMWARN("%s: switching pool to %s mode", dm_device_name(pool->pool_md),
	       mode_name(mode));
	pool_event(pool);
}

static void set_pool_mode(struct pool *pool, enum pool_mode mode)
{
	mutex_lock(&pool->mode_lock);
	__set_pool_mode(pool, mode);
	mutex_unlock(&pool->mode_lock);
}

/*
 * Switch from @from to @to, and only from there: the IO path moves
 * between write and out-of-data-space mode, and must not undo a switch
 * to read-only or fail mode made meanwhile.  Returns the mode now.
 */
static enum pool_mode switch_pool_mode(struct pool *pool, enum pool_mode from,
				       enum pool_mode to)
{
	enum pool_mode now;

	mutex_lock(&pool->mode_lock);
	if (pool_mode(pool) == from)
		__set_pool_mode(pool, to);
	now = pool_mode(pool);
	mutex_unlock(&pool->mode_lock);
	return now;
}

/*
 * Whether @r, the error of a metadata operation, is a mere refusal: the
 * pool is read only or going read only, and no failed update awaits its
 * abort.  The metadata went read only after the caller looked at the
 * pool's mode, by a switch to read-only mode (the metadata refuses
 * updates from the start of the switch, before the mode says so), or by
 * a failure that has been aborted (by another thread, say).
 */
static bool metadata_refused(struct pool *pool, int r)
{
	return r == -EPERM && !tsp_pool_metadata_needs_abort(pool->pmd);
}

/*
 * A metadata operation failed: the transaction is half done.  Drop it,
 * flag the metadata for checking and stop changing it.  A refusal
 * (metadata_refused()) changed nothing: the pool is on its way to
 * read-only mode already.
 */
static void metadata_failed(struct pool *pool, const char *op, int r)
{
	int r_abort;

	if (metadata_refused(pool, r))
		return;

	DMERR_LIMIT("%s: metadata operation '%s' failed: error = %d",
		    dm_device_name(pool->pool_md), op, r);
	/*
	 * Counted before and after the abort, so that the count read after
	 * it differs from one read at any time before it ends: the discards
	 * queued for passdown then (queue_committed_passdowns()) may be of
	 * blocks the rollback maps again.  An abort leaves the pool read-only
	 * for as long as it lives, so the blocks the abort's reopened space
	 * map no longer holds for a passdown in flight are not allocated.  A second failure that lost the race to
	 * another thread's abort finds nothing left to do in
	 * tsp_pool_metadata_fail().
	 */
	atomic_inc(&pool->aborts);
	r_abort = tsp_pool_metadata_fail(pool->pmd);
	atomic_inc(&pool->aborts);
	if (r_abort) {
		DMERR("%s: failed to abort metadata transaction and set 'needs_check'",
		      dm_device_name(pool->pool_md));
		set_pool_mode(pool, PM_FAIL);
		return;
	}
	set_pool_mode(pool, PM_READ_ONLY);
}

/*----------------------------------------------------------------
 * Space checks
 *--------------------------------------------------------------*/
static tsp_block_t metadata_reserve(tsp_block_t nr_blocks)
{
	return min_t(tsp_block_t, METADATA_RESERVE_MAX_BLOCKS,
		     div_u64(nr_blocks, 10));
}

static tsp_block_t metadata_low_water(tsp_block_t nr_blocks)
{
	return min_t(tsp_block_t, METADATA_LOW_WATER_BLOCKS, nr_blocks / 4);
}

/* The free metadata blocks of @space outside the reserve. */
static tsp_block_t metadata_free_unreserved(const struct tsp_pool_space *space)
{
	tsp_block_t reserve = metadata_reserve(space->metadata_blocks);

	return space->metadata_free > reserve ? space->metadata_free - reserve : 0;
}

/**
 * get_metadata_space - the metadata device's size and free blocks
 * @pool: the pool
 * @nr_blocks: set to the metadata device's size in blocks
 * @nr_free: set to its free blocks outside the reserve
 *
 * Return: 0, or the metadata layer's error.
 */
static int get_metadata_space(struct pool *pool, tsp_block_t *nr_blocks,
			      tsp_block_t *nr_free)
{
	struct tsp_pool_space space;
	int r = tsp_pool_get_space(pool->pmd, &space);

	if (r)
		return r;
	*nr_blocks = space.metadata_blocks;
	*nr_free = metadata_free_unreserved(&space);
	return 0;
}

/* Only the metadata reserve is left free. */
static bool metadata_reserve_reached(struct pool *pool)
{
	tsp_block_t nr_blocks, nr_free;

	return !get_metadata_space(pool, &nr_blocks, &nr_free) && !nr_free;
}

/*
 * Stop changing metadata, unless the pool did already: a switch back from
 * read-only or fail mode would make metadata that failed writable again.
 */
static void enter_no_metadata_space_mode(struct pool *pool, const char *why)
{
	mutex_lock(&pool->mode_lock);
	if (!pool_is_read_only(pool)) {
		DMERR("%s: %s", dm_device_name(pool->pool_md), why);
		__set_pool_mode(pool, PM_OUT_OF_METADATA_SPACE);
	}
	mutex_unlock(&pool->mode_lock);
}

/*
 * Send the metadata low water event once; switch to out-of-metadata-space
 * mode when only the reserve is left.  Caller holds commit_lock.
 */
static void check_metadata_space(struct pool *pool)
{
	struct tsp_pool_space space;

	lockdep_assert_held(&pool->commit_lock);
	if (tsp_pool_get_space(pool->pmd, &space)) {
		enter_no_metadata_space_mode(pool, "could not get free metadata blocks");
		return;
	}
	/* Free blocks counting the reserve: the low water mark is on those. */
	if (!pool->metadata_low_water_triggered &&
	    space.metadata_free <= metadata_low_water(space.metadata_blocks)) {
		DMWARN("%s: reached low water mark for metadata device: sending event",
		       dm_device_name(pool->pool_md));
		pool->metadata_low_water_triggered = true;
		mutex_lock(&pool->mode_lock);
		pool_event(pool);
		mutex_unlock(&pool->mode_lock);
	}
	if (!metadata_free_unreserved(&space))
		enter_no_metadata_space_mode(pool, "no free metadata blocks");
}

static void requeue_retry_list(struct pool *pool);

/*
 * Out of data space, but blocks are free: back to write mode, and retry
 * the queued bios.  Caller holds commit_lock.  Blocks freed in this
 * transaction are handed out only after it commits; alloc_block()
 * commits when it finds none, unless the commit will hold them for a
 * passdown.  Those held for a passdown do not count: passdown_done()
 * looks again when it releases them.
 */
static void check_data_space(struct pool *pool)
{
	tsp_block_t nr_free;

	lockdep_assert_held(&pool->commit_lock);
	if (pool_mode(pool) != PM_OUT_OF_DATA_SPACE ||
	    tsp_pool_get_allocatable_block_count(pool->pmd,
						 !list_empty(&pool->passdowns),
						 &nr_free) ||
	    !nr_free)
		return;
	if (switch_pool_mode(pool, PM_OUT_OF_DATA_SPACE, PM_WRITE) == PM_WRITE)
		requeue_retry_list(pool);
}

/*----------------------------------------------------------------
 * Commit
 *--------------------------------------------------------------*/
/*
 * Queue data block @b, freed by a discard, to be discarded on the data
 * device at the commit.  A run that @b extends grows instead.  Without
 * memory the block is not passed down: a discard is a hint to the device.
 */
static void defer_passdown(struct pool *pool, tsp_block_t b)
{
	struct passdown *pd = NULL;

	lockdep_assert_held(&pool->commit_lock);
	if (!list_empty(&pool->passdowns))
		pd = list_last_entry(&pool->passdowns, struct passdown, list);
	if (pd && pd->end == b) {
		pd->end++;
		return;
	}
	pd = kmalloc(sizeof(*pd), GFP_NOIO);
	if (!pd)
		return;
	if (list_empty(&pool->passdowns))
		pool->passdowns_aborts = atomic_read(&pool->aborts);
	pd->begin = b;
	pd->end = b + 1;
	list_add_tail(&pd->list, &pool->passdowns);
	pool->nr_passdowns++;
}

static void free_runs(struct list_head *runs)
{
	struct passdown *pd, *tmp;

	list_for_each_entry_safe(pd, tmp, runs, list) {
		list_del(&pd->list);
		kfree(pd);
	}
}

static void free_passdowns(struct pool *pool)
{
	free_runs(&pool->passdowns);
	pool->nr_passdowns = 0;
}

static void passdown_done(struct work_struct *ws);

static void passdown_endio(struct bio *bio)
{
	struct passdown_batch *batch = bio->bi_private;

	bio_put(bio);
	queue_work(batch->pool->wq, &batch->done_work);
}

/*
 * Worker: discard a batch's runs on the data device, all at once, without
 * waiting (dm-thin does not either), and without commit_lock, as the
 * device may make the submission wait.  Their blocks are the older
 * generation of held blocks: no discard lands on new data.  Errors are
 * ignored, as the device may ignore a discard.
 */
static void send_passdowns(struct work_struct *ws)
{
	struct passdown_batch *batch = container_of(ws, struct passdown_batch,
						    send_work);
	struct pool *pool = batch->pool;
	sector_t spb = pool->sectors_per_block;
	struct passdown *pd;
	struct bio *bio = NULL;
	struct blk_plug plug;
	bool sent;

	blk_start_plug(&plug);
	list_for_each_entry(pd, &batch->runs, list)
		__blkdev_issue_discard(pool->data_dev.bdev, pd->begin * spb,
				       (pd->end - pd->begin) * spb, GFP_NOIO,
				       &bio);
	free_runs(&batch->runs);
	sent = bio;
	if (sent) {
		bio->bi_private = batch;
		bio->bi_end_io = passdown_endio;
		submit_bio(bio);	/* @batch may be gone from here */
	}
	blk_finish_plug(&plug);
	if (!sent)
		passdown_done(&batch->done_work);
}

/*
 * Start a batch of the committed runs, for the pool's workqueue to send;
 * without memory they are not passed down (a discard is a hint).  Caller
 * holds commit_lock.
 *
 * Return: whether it started; passdown_done() runs when it is done.
 */
static bool start_passdown_batch(struct pool *pool)
{
	struct passdown_batch *batch;

	if (list_empty(&pool->passdowns_next))
		return false;
	batch = kmalloc(sizeof(*batch), GFP_NOIO);
	if (!batch) {
		free_runs(&pool->passdowns_next);
		return false;
	}
	batch->pool = pool;
	INIT_LIST_HEAD(&batch->runs);
	list_splice_init(&pool->passdowns_next, &batch->runs);
	INIT_WORK(&batch->send_work, send_passdowns);
	INIT_WORK(&batch->done_work, passdown_done);
	queue_work(pool->wq, &batch->send_work);
	return true;
}

/*
 * The batch of passdowns in flight is done, or there was none: release
 * its blocks (the older held generation), and send the runs committed
 * since (the newer) as the next batch.  Caller holds commit_lock.
 */
static void next_passdown_batch(struct pool *pool)
{
	bool in_flight;

	lockdep_assert_held(&pool->commit_lock);
	tsp_pool_release_held_blocks(pool->pmd);
	in_flight = start_passdown_batch(pool);
	pool->nr_passdowns_next = 0;
	/* None went out: the blocks held for it need not wait. */
	if (!in_flight)
		tsp_pool_release_held_blocks(pool->pmd);
	WRITE_ONCE(pool->passdown_in_flight, in_flight);
	atomic64_inc(&pool->space_gen);
}

/*
 * Worker of a batch of passdowns that is done (passdown_endio()), or
 * that sent nothing.
 */
static void passdown_done(struct work_struct *ws)
{
	struct passdown_batch *batch = container_of(ws, struct passdown_batch,
						    done_work);
	struct pool *pool = batch->pool;

	kfree(batch);
	mutex_lock(&pool->commit_lock);
	next_passdown_batch(pool);
	check_data_space(pool);
	mutex_unlock(&pool->commit_lock);
	/*
	 * Whoever waits flushes pool->wq after: we are done with @pool.  The
	 * barrier orders the store above before wake_up_var()'s look at the
	 * waiters (see wait_var_event()).
	 */
	smp_mb();
	wake_up_var(&pool->passdown_in_flight);
}

/*
 * Wait for the batches of passdowns in flight, and for passdown_done()
 * to be done with the pool.  Not under commit_lock.
 */
static void wait_for_passdowns(struct pool *pool)
{
	wait_var_event(&pool->passdown_in_flight,
		       !READ_ONCE(pool->passdown_in_flight));
	flush_workqueue(pool->wq);
}

/*
 * The commit of the transaction that freed the queued runs succeeded:
 * after the IO grace period, so no IO reads them any more, and after the
 * metadata commit, so no abort can map them again.  They go out as the
 * next batch.  Not after an abort since the first was queued: the
 * transaction that freed them was rolled back.
 */
static void queue_committed_passdowns(struct pool *pool)
{
	if (atomic_read(&pool->aborts) == pool->passdowns_aborts &&
	    pool->nr_passdowns_next < MAX_PASSDOWNS_NEXT) {
		list_splice_tail_init(&pool->passdowns, &pool->passdowns_next);
		pool->nr_passdowns_next += pool->nr_passdowns;
	}
	free_passdowns(pool);
	if (!pool->passdown_in_flight)
		next_passdown_batch(pool);
}

static int __commit(struct pool *pool)
{
	bool pass_down;
	int r;

	lockdep_assert_held(&pool->commit_lock);
	if (!tsp_pool_changed_this_transaction(pool->pmd))
		return 0;
	if (pool_mode(pool) >= PM_READ_ONLY)
		return -EPERM;

	r = blkdev_issue_flush(pool->data_dev.bdev);
	if (r) {
		DMERR_LIMIT("%s: flushing the data device failed: %d",
			    dm_device_name(pool->pool_md), r);
		return r;
	}
	if (pool->freed_this_transaction) {
		epoch_wait_grace_period(pool);
		pool->freed_this_transaction = false;
	}
	pass_down = !list_empty(&pool->passdowns);
	r = pass_down ? tsp_pool_commit_metadata_hold_freed(pool->pmd) :
			tsp_pool_commit_metadata(pool->pmd);
	if (r) {
		/*
		 * The passdowns are kept: after an abort the next commit drops
		 * them (queue_committed_passdowns()); after a refusal the
		 * transaction that freed them stands.
		 */
		metadata_failed(pool, "commit", r);
		return r;
	}
	if (pass_down)
		queue_committed_passdowns(pool);
	atomic64_inc(&pool->commits);
	atomic64_inc(&pool->space_gen);
	check_metadata_space(pool);
	check_data_space(pool);
	return 0;
}

/* Commit the metadata transaction.  May sleep; any context but the IO path. */
static int commit(struct pool *pool)
{
	int r;

	mutex_lock(&pool->commit_lock);
	r = __commit(pool);
	mutex_unlock(&pool->commit_lock);
	return r;
}

/*
 * Run @op, a metadata operation that may commit by itself, after our own
 * commit (data device flush, IO grace period), with no mapping changed
 * by the IO path in between.
 */
static int commit_then(struct pool *pool,
		       int (*op)(struct tsp_pool_metadata *pmd))
{
	int r;

	mutex_lock(&pool->commit_lock);
	r = __commit(pool);
	if (!r)
		r = op(pool->pmd);
	mutex_unlock(&pool->commit_lock);
	return r;
}

/*
 * The status for a FLUSH or FUA bio of @tc that its commit let through:
 * once an abort has dropped changes to the device, writes it completed
 * before may be lost (the bio's own mapping among them: the commit then
 * finds nothing to commit), and no flush makes them durable.  Until the
 * device is closed.
 */
static blk_status_t aborted_changes_status(struct thin_c *tc)
{
	if (!tsp_thin_aborted_changes(tc->td))
		return BLK_STS_OK;
	DMERR_LIMIT("%s: flush failed: an aborted metadata transaction dropped writes",
		    dm_device_name(tc->thin_md));
	return BLK_STS_IOERR;
}

/*
 * Send on @bio, remapped already or an empty flush for the data device,
 * whose device's changes are committed, unless the commit failed
 * (@status) or an abort dropped some of them.
 */
static void issue_committed(struct pool *pool, struct bio *bio,
			    blk_status_t status)
{
	bio->bi_status = status ?: aborted_changes_status(thin_bio(bio)->tc);
	if (bio->bi_status) {
		bio_endio(bio);
		return;
	}
	if (!bio_has_data(bio))
		bio_set_dev(bio, pool->data_dev.bdev);
	submit_counted(pool, bio);
}

/*
 * Worker: commit if any of its bios waits for it (or commit_requested),
 * then release them.  A commit covers every worker's changes: one made
 * by another worker since finds nothing left to commit.
 *
 * Return: BLK_STS_OK, or the error of the commit.
 */
static blk_status_t process_commit(struct worker *w)
{
	struct pool *pool = w->pool;
	struct bio_list waiters, issue;
	struct bio *bio;
	blk_status_t status;

	if (bio_list_empty(&w->flush_waiters) &&
	    bio_list_empty(&w->issue_after_commit) &&
	    !w->commit_requested)
		return BLK_STS_OK;

	w->commit_requested = false;
	status = commit(pool) ? BLK_STS_IOERR : BLK_STS_OK;

	waiters = w->flush_waiters;
	bio_list_init(&w->flush_waiters);
	issue = w->issue_after_commit;
	bio_list_init(&w->issue_after_commit);

	while ((bio = bio_list_pop(&waiters))) {
		bio->bi_status = status ?: aborted_changes_status(thin_bio(bio)->tc);
		bio_endio(bio);
	}
	while ((bio = bio_list_pop(&issue)))
		issue_committed(pool, bio, status);
	return status;
}

/*----------------------------------------------------------------
 * Jobs: provisioning one block
 *--------------------------------------------------------------*/
static struct hlist_head *job_bucket(struct worker *w, struct thin_c *tc,
				     tsp_block_t virt)
{
	return &w->jobs[hash_64(virt ^ ((u64)tc->dev_id << 40), JOB_HASH_BITS)];
}

static struct job *find_job(struct worker *w, struct thin_c *tc,
			    tsp_block_t virt)
{
	struct job *job;

	/* By thin device, not target: two tables may map one device. */
	hlist_for_each_entry(job, job_bucket(w, tc, virt), hash)
		if (job->mapping.td == tc->td && job->mapping.virt == virt)
			return job;
	return NULL;
}

/* Make @job the one running for @virt of @tc, which @w owns. */
static void add_job(struct worker *w, struct job *job, struct thin_c *tc,
		    tsp_block_t virt, struct bio *bio)
{
	job->tc = tc;
	job->mapping.td = tc->td;
	job->mapping.virt = virt;
	job->bio = bio;
	bio_list_init(&job->waiting);
	atomic_set(&job->pending, 1);
	hlist_add_head(&job->hash, job_bucket(w, tc, virt));
}

/*
 * A zeroed job for @w: a spare, else one from the slab, without waiting
 * for memory, which may need this worker's writes to free.  The worker
 * takes and frees each job in its own work item, so the spares need no
 * lock, and the last one freed is the first reused: cheaper than the
 * slab, whose frees of jobs allocated a pass earlier mostly take its
 * slow path.  Worker only.
 *
 * Return: the job, or NULL.
 */
static struct job *alloc_job(struct worker *w)
{
	struct job *job;

	if (hlist_empty(&w->spare_jobs))
		return kmem_cache_zalloc(job_cache, GFP_NOWAIT | __GFP_NOWARN);
	job = hlist_entry(w->spare_jobs.first, struct job, hash);
	hlist_del(&job->hash);
	w->nr_spare_jobs--;
	memset(job, 0, sizeof(*job));
	return job;
}

/* Give @job back to @w's spares, or to the slab if they are full. */
static void free_job(struct worker *w, struct job *job)
{
	if (w->nr_spare_jobs < JOB_SPARES) {
		hlist_add_head(&job->hash, &w->spare_jobs);
		w->nr_spare_jobs++;
	} else {
		kmem_cache_free(job_cache, job);
	}
}

/* Free @w's spare jobs, when the pool is destroyed. */
static void free_spare_jobs(struct worker *w)
{
	struct hlist_node *tmp;
	struct job *job;

	hlist_for_each_entry_safe(job, tmp, &w->spare_jobs, hash)
		kmem_cache_free(job_cache, job);
}

/* Fill @w's spares when the pool is created.  Return: 0 or -ENOMEM. */
static int alloc_spare_jobs(struct worker *w)
{
	struct job *job;

	while (w->nr_spare_jobs < JOB_SPARES) {
		job = kmem_cache_alloc(job_cache, GFP_KERNEL);
		if (!job)
			return -ENOMEM;
		hlist_add_head(&job->hash, &w->spare_jobs);
		w->nr_spare_jobs++;
	}
	return 0;
}

/*
 * From any context: one of the job's IOs is done.  The last one hands the
 * job to the worker, which finishes it.
 */
static void job_io_done(struct job *job, int err)
{
	struct worker *w = worker_for(job->tc, job->mapping.virt);
	unsigned long flags;
	bool first;

	if (err)
		WRITE_ONCE(job->err, err);
	if (!atomic_dec_and_test(&job->pending))
		return;
	spin_lock_irqsave(&w->lock, flags);
	first = list_empty(&w->completed_jobs);
	list_add_tail(&job->list, &w->completed_jobs);
	/*
	 * Otherwise whoever added the first woke the worker.  Under the
	 * lock: once it is dropped, the worker may finish the job, and the
	 * device and the pool (with @w) may go before we touch @w again.
	 */
	if (first)
		wake_worker(w);
	spin_unlock_irqrestore(&w->lock, flags);
}

static void kcopyd_done(int read_err, unsigned long write_err, void *context)
{
	job_io_done(context, (read_err || write_err) ? -EIO : 0);
}

/* The bio that fills the whole block completed. */
static void overwrite_endio(struct bio *bio)
{
	struct job *job = bio->bi_private;
	struct thin_bio *tb = thin_bio(bio);

	bio->bi_end_io = tb->saved_end_io;
	bio->bi_private = tb->saved_private;
	/*
	 * The data write is done: leave the epoch now, not when the worker
	 * completes the bio, or a commit waiting for the epoch would wait
	 * for the worker that runs it.
	 */
	epoch_leave(job->tc->pool, bio);
	job_io_done(job, blk_status_to_errno(bio->bi_status));
}

/* Issue @job's bio to its new block before the block is mapped. */
static void start_overwrite(struct pool *pool, struct job *job)
{
	struct bio *bio = job->bio;
	struct thin_bio *tb = thin_bio(bio);

	job->bio_wrote_block = true;
	tb->saved_end_io = bio->bi_end_io;
	tb->saved_private = bio->bi_private;
	bio->bi_end_io = overwrite_endio;
	bio->bi_private = job;
	issue_remapped(pool, bio, job->mapping.data);
}

/*
 * A write of zeroes into @job's new block, maybe with its bio's data, is
 * done.  A failed WRITE ZEROES is not the job's error: its worker writes
 * the zeroes instead (rezero_jobs()), as blkdev_issue_zeroout() does.
 * One that says the device cannot do it (not supported, or refused as an
 * invalid request, which a SCSI disk with no WRITE SAME gives) makes the
 * pool write its zeroes from then on.
 */
static void fill_endio(struct bio *bio)
{
	struct job *job = bio->bi_private;
	struct pool *pool = job->tc->pool;
	blk_status_t status = bio->bi_status;
	int err = blk_status_to_errno(status);

	if (err && bio_op(bio) == REQ_OP_WRITE_ZEROES) {
		if ((status == BLK_STS_NOTSUPP || status == BLK_STS_TARGET) &&
		    !atomic_xchg(&pool->write_zeroes_failed, 1))
			DMWARN("%s: data device's WRITE ZEROES failed (%d): writing zeroes instead",
			       dm_device_name(pool->pool_md), err);
		WRITE_ONCE(job->write_zeroes_failed, true);
		err = 0;
	}
	bio_put(bio);
	job_io_done(job, err);
}

/* Whether to zero with REQ_OP_WRITE_ZEROES: see pool->write_zeroes_failed. */
static bool zeroing_offloaded(struct pool *pool)
{
	return bdev_write_zeroes_sectors(pool->data_dev.bdev) &&
	       !atomic_read(&pool->write_zeroes_failed);
}

/* Vectors of @zeroes that @nr sectors of zeroes take. */
static unsigned int zeroes_vecs(sector_t nr)
{
	return DIV_ROUND_UP(nr, ZEROES_SECTORS);
}

/* Add @nr sectors of zeroes to @bio, which has zeroes_vecs(@nr) free. */
static void bio_add_zeroes(struct bio *bio, sector_t nr)
{
	sector_t len;

	for (; nr; nr -= len) {
		len = min_t(sector_t, nr, ZEROES_SECTORS);
		__bio_add_page(bio, zeroes, len << SECTOR_SHIFT, 0);
	}
}

/* Send @bio, filling part of @job's new block, as one of @job's IOs. */
static void submit_fill(struct job *job, struct bio *bio)
{
	bio->bi_end_io = fill_endio;
	bio->bi_private = job;
	submit_bio_noacct(bio);
}

/*
 * Zero @nr sectors of the data device from @sector, as IOs of @job: with
 * REQ_OP_WRITE_ZEROES if @offload (zeroing_offloaded(): an NVMe drive
 * zeroes a range without the data crossing the bus; it may deallocate
 * it), else by writing @zeroes (dm-thin always writes zeroes).  The
 * ranges offloaded, at most JOB_ZEROED_RANGES per job, are kept for
 * rezero_jobs().  Worker only; may sleep for a bio.
 */
static void zero_range(struct pool *pool, struct job *job, sector_t sector,
		       sector_t nr, bool offload)
{
	struct bio *bio;
	sector_t len;

	if (nr && offload) {
		job->zeroed[job->nr_zeroed].sector = sector;
		job->zeroed[job->nr_zeroed].nr = nr;
		job->nr_zeroed++;
	}
	for (; nr; sector += len, nr -= len) {
		if (offload) {
			/* The block layer splits it to the device's limit. */
			len = min_t(sector_t, nr, UINT_MAX >> SECTOR_SHIFT);
			bio = bio_alloc_bioset(pool->data_dev.bdev, 0,
					       REQ_OP_WRITE_ZEROES, GFP_NOIO,
					       &pool->zero_bios);
			bio->bi_iter.bi_size = len << SECTOR_SHIFT;
		} else {
			len = min_t(sector_t, nr, BIO_MAX_VECS * ZEROES_SECTORS);
			bio = bio_alloc_bioset(pool->data_dev.bdev,
					       zeroes_vecs(len), REQ_OP_WRITE,
					       GFP_NOIO, &pool->zero_bios);
			bio_add_zeroes(bio, len);
		}
		bio->bi_iter.bi_sector = sector;
		atomic_inc(&job->pending);
		submit_fill(job, bio);
	}
}

/*
 * Write the whole of @job's new block in one bio, @job->bio's data at
 * @begin sectors into it and zeroes around, if one bio holds it all: one
 * IO where zeroing the rest beside the bio takes two or three.  @job->bio
 * itself is not issued; its worker ends it once the block is mapped.  The
 * write carries its priority and its hints (not FUA: the commit that maps
 * the block flushes first) and, zeroes included, is charged to its
 * cgroup.  Worker only; may sleep for a bio.
 *
 * Return: false if the block needs more vectors than a bio has.
 */
static bool write_with_zeroes(struct pool *pool, struct job *job,
			      sector_t begin)
{
	struct bio *bio = job->bio, *write;
	sector_t end = begin + bio_sectors(bio);
	unsigned int nr_vecs = zeroes_vecs(begin) + bio_segments(bio) +
			       zeroes_vecs(pool->sectors_per_block - end);
	struct bvec_iter iter;
	struct bio_vec bv;

	if (nr_vecs > BIO_MAX_VECS)
		return false;
	write = bio_alloc_bioset(pool->data_dev.bdev, nr_vecs, REQ_OP_WRITE,
				 GFP_NOIO, &pool->zero_bios);
	write->bi_opf |= bio->bi_opf & (REQ_SYNC | REQ_IDLE | REQ_META | REQ_PRIO);
	write->bi_ioprio = bio->bi_ioprio;
	write->bi_iter.bi_sector = job->mapping.data * pool->sectors_per_block;
	bio_clone_blkg_association(write, bio);
	bio_add_zeroes(write, begin);
	bio_for_each_segment(bv, bio, iter)
		__bio_add_page(write, bv.bv_page, bv.bv_len, bv.bv_offset);
	bio_add_zeroes(write, pool->sectors_per_block - end);
	/* job->pending counts @bio already: @write's end stands for it. */
	job->bio_wrote_block = true;
	this_cpu_inc(pool->stats->blocks_written_whole);
	submit_fill(job, write);
	return true;
}

/*
 * Provision for a bio that writes part of a new block: zero the rest of
 * the block, writing it with the bio's data where the device has no
 * WRITE ZEROES, else while the bio writes its part; map the block when
 * all of it is written.
 */
static void zero_around(struct pool *pool, struct job *job)
{
	sector_t start = job->mapping.data * pool->sectors_per_block;
	sector_t begin = block_offset(pool, job->bio->bi_iter.bi_sector);
	sector_t end = begin + bio_sectors(job->bio);
	bool offload = zeroing_offloaded(pool);

	if (!offload && write_with_zeroes(pool, job, begin))
		return;
	/* Before the bio: job->pending counts it already, so the job waits. */
	zero_range(pool, job, start, begin, offload);
	zero_range(pool, job, start + end, pool->sectors_per_block - end,
		   offload);
	start_overwrite(pool, job);
}

static struct dm_io_region block_region(struct pool *pool, tsp_block_t b)
{
	struct dm_io_region region = {
		.bdev = pool->data_dev.bdev,
		.sector = b * pool->sectors_per_block,
		.count = pool->sectors_per_block,
	};

	return region;
}

/*
 * Fill @job's new block from the external origin: copy the part of the
 * block the origin covers, zero the rest (unless zeroing is off).
 */
static void copy_from_origin(struct thin_c *tc, struct job *job)
{
	struct pool *pool = tc->pool;
	struct dm_io_region to = block_region(pool, job->mapping.data);
	struct dm_io_region from = {
		.bdev = tc->origin_dev->bdev,
		.sector = job->mapping.virt * pool->sectors_per_block,
	};

	from.count = min_t(sector_t, pool->sectors_per_block,
			   tc->origin_size - from.sector);
	if (pool->pf.zero_new_blocks)
		zero_range(pool, job, to.sector + from.count,
			   to.count - from.count, zeroing_offloaded(pool));
	to.count = from.count;
	dm_kcopyd_copy(pool->copier, &from, 1, &to, 0, kcopyd_done, job);
}

static void defer_bio(struct pool *pool, struct bio *bio);

/*
 * Issue and end the bios workers handed over: on the CPU that mapped
 * them, but for a CPU gone offline meanwhile, or bios that dm core mapped
 * from its own work item after a suspend.
 */
static void do_cpu_completions(struct work_struct *ws)
{
	struct cpu_completions *c = container_of(ws, struct cpu_completions, work);
	struct llist_node *n = llist_reverse_order(llist_del_all(&c->issues));
	struct thin_bio *tb, *tmp;

	llist_for_each_entry_safe(tb, tmp, n, node)
		submit_bio_noacct(dm_bio_from_per_bio_data(tb, sizeof(*tb)));
	n = llist_del_all(&c->bios);
	llist_for_each_entry_safe(tb, tmp, n, node)
		bio_endio(dm_bio_from_per_bio_data(tb, sizeof(*tb)));
}

/*
 * Worker: queue @bio to be ended on the CPU that mapped it.  The worker
 * whose bio found the CPU's list empty queues the CPU's work item, at the
 * end of its batch (kick_completions()); bios other workers add meanwhile
 * wait for that.  A CPU gone offline still gets its work item run, on
 * another CPU.
 */
static void hand_over_bio(struct worker *w, struct bio *bio)
{
	struct thin_bio *tb = thin_bio(bio);
	struct cpu_completions *c = per_cpu_ptr(w->pool->completions, tb->cpu);

	WRITE_ONCE(w->handed_over, w->handed_over + 1);
	if (llist_add(&tb->node, &c->bios))
		cpumask_set_cpu(tb->cpu, w->completions_to_kick);
}

/*
 * Worker: queue the remapped @bio to be issued on the CPU that mapped it.
 * Its work item is queued at once if its list was empty, not at the end
 * of a batch: @bio counts in an epoch, which a commit that the worker may
 * wait for before its batch ends can wait on.
 */
static void hand_over_issue(struct pool *pool, struct bio *bio)
{
	struct thin_bio *tb = thin_bio(bio);
	struct cpu_completions *c = per_cpu_ptr(pool->completions, tb->cpu);

	if (llist_add(&tb->node, &c->issues))
		queue_work_on(tb->cpu, pool->completion_wq, &c->work);
}

/* Worker: queue the work items of the CPUs hand_over_bio() gave bios to. */
static void kick_completions(struct worker *w)
{
	struct pool *pool = w->pool;
	unsigned int cpu;

	for_each_cpu(cpu, w->completions_to_kick)
		queue_work_on(cpu, pool->completion_wq,
			      &per_cpu_ptr(pool->completions, cpu)->work);
	cpumask_clear(w->completions_to_kick);
}

/*
 * Worker: @job's block is mapped, or failed with job->err; release the
 * bios.  @hand_over: a bio that wrote its block is ended by its CPU.
 */
static void finish_job(struct worker *w, struct job *job, bool hand_over)
{
	struct pool *pool = w->pool;
	struct bio *bio = job->bio;

	hlist_del(&job->hash);
	if (job->err) {
		bio->bi_status = errno_to_blk_status(job->err);
		bio_endio(bio);
	} else if (job->bio_wrote_block) {
		if (bio_needs_commit(bio))
			bio_list_add(&w->flush_waiters, bio);
		else if (hand_over)
			hand_over_bio(w, bio);
		else
			bio_endio(bio);
	} else if (bio_needs_commit(bio)) {
		/* Issue the data write once the mapping is durable. */
		remap(pool, bio, job->mapping.data);
		bio_list_add(&w->issue_after_commit, bio);
	} else {
		issue_remapped(pool, bio, job->mapping.data);
	}

	while ((bio = bio_list_pop(&job->waiting)))
		defer_bio(pool, bio);
	free_job(w, job);
}

/*
 * The new blocks of @jobs whose IO failed will not be mapped: give them
 * back, or they would stay allocated for good, as dm-thin leaves them.
 * No IO can be in flight to them: no mapping ever pointed there.
 * Return: 0, or the metadata error (the transaction is then failed).
 */
static int release_failed_blocks(struct pool *pool, struct list_head *jobs)
{
	struct job *job;
	int r;

	list_for_each_entry(job, jobs, list) {
		if (!job->err)
			continue;
		r = tsp_pool_release_data_block(pool->pmd, job->mapping.data);
		if (r)
			return r;
	}
	return 0;
}

/*
 * Take the jobs of @jobs one of whose WRITE ZEROES failed (fill_endio())
 * off it, and zero their offloaded ranges again, by writing zeroes: they
 * come back when that is done.  Worker only.
 */
static void rezero_jobs(struct pool *pool, struct list_head *jobs)
{
	struct zeroed_range ranges[JOB_ZEROED_RANGES];
	struct job *job, *tmp;
	unsigned int i, nr;

	list_for_each_entry_safe(job, tmp, jobs, list) {
		if (!job->write_zeroes_failed || job->err)
			continue;
		list_del(&job->list);
		job->write_zeroes_failed = false;
		nr = job->nr_zeroed;
		memcpy(ranges, job->zeroed, sizeof(ranges));
		job->nr_zeroed = 0;
		/* Held until all are issued, as a job's first IO does. */
		atomic_set(&job->pending, 1);
		for (i = 0; i < nr; i++)
			zero_range(pool, job, ranges[i].sector, ranges[i].nr,
				   false);
		job_io_done(job, 0);
	}
}

/*
 * Worker: map the blocks of every job whose IO finished, and give back
 * those of the jobs whose IO failed, before any is reported done (a
 * failure aborts the transaction: none of the batch is then mapped); then
 * release their bios.  Taking the metadata lock once per
 * batch rather than once per job also means the worker does not yield to
 * the submitter woken by the first completed bio before it has completed
 * the others.
 */
static void process_completed_jobs(struct worker *w)
{
	struct pool *pool = w->pool;
	struct job *job, *tmp;
	LIST_HEAD(jobs);
	LIST_HEAD(mappings);
	unsigned int nr_inserted = 0, nr_written = 0, min_batch;
	bool frees = false, hand_over;
	int r = 0;

	spin_lock_irq(&w->lock);
	list_splice_init(&w->completed_jobs, &jobs);
	spin_unlock_irq(&w->lock);
	rezero_jobs(pool, &jobs);
	if (list_empty(&jobs))
		return;

	list_for_each_entry(job, &jobs, list) {
		if (!job->err) {
			nr_written += job->bio_wrote_block;
			list_add_tail(&job->mapping.list, &mappings);
			frees |= job->breaks_sharing;
		}
	}

	/* Read-only metadata: the blocks cannot be mapped, their IO fails. */
	if (pool_mode(pool) >= PM_READ_ONLY) {
		r = -EIO;
	} else {
		/*
		 * Under the commit lock: a commit flushes the data device
		 * and then commits the metadata, and a mapping inserted in
		 * between would be committed before its data is durable.
		 * And a mapping that replaces a shared block's drops a
		 * reference to it, which may free it: reads of it still in
		 * flight must finish before it is reused (see "Deferred
		 * free").
		 */
		mutex_lock(&pool->commit_lock);
		r = release_failed_blocks(pool, &jobs);
		if (!r)
			r = tsp_pool_insert_mappings(pool->pmd, &mappings,
						     &nr_inserted);
		if (frees && nr_inserted)
			pool->freed_this_transaction = true;
		mutex_unlock(&pool->commit_lock);
		if (r)
			metadata_failed(pool, "map_completed_blocks", r);
	}
	/* On failure the transaction is aborted: none of the batch is mapped. */
	if (r)
		list_for_each_entry(job, &mappings, mapping.list)
			job->err = r;

	min_batch = READ_ONCE(handover_min_batch);
	hand_over = min_batch && nr_written >= min_batch;
	list_for_each_entry_safe(job, tmp, &jobs, list)
		finish_job(w, job, hand_over);
	if (hand_over)
		kick_completions(w);
}

/*----------------------------------------------------------------
 * Out of data space
 *--------------------------------------------------------------*/
static void error_retry_list(struct pool *pool, blk_status_t status)
{
	struct bio_list bios;
	struct bio *bio;

	spin_lock_irq(&pool->lock);
	bios = pool->retry_list;
	bio_list_init(&pool->retry_list);
	spin_unlock_irq(&pool->lock);

	while ((bio = bio_list_pop(&bios))) {
		bio->bi_status = status;
		bio_endio(bio);
	}
}

static void requeue_retry_list(struct pool *pool)
{
	struct bio_list bios;
	struct bio *bio;

	spin_lock_irq(&pool->lock);
	bios = pool->retry_list;
	bio_list_init(&pool->retry_list);
	spin_unlock_irq(&pool->lock);

	while ((bio = bio_list_pop(&bios)))
		defer_bio(pool, bio);
}

static void do_no_space_timeout(struct work_struct *ws)
{
	struct pool *pool = container_of(to_delayed_work(ws), struct pool,
					 no_space_timeout);

	/*
	 * Under mode_lock: leaving the mode undoes this (leave_no_space_mode()).
	 * The deadline: this run may be one cancelled too late, of an earlier
	 * time out of space.
	 */
	mutex_lock(&pool->mode_lock);
	if (pool_mode(pool) == PM_OUT_OF_DATA_SPACE && !pool->pf.error_if_no_space &&
	    time_after_eq(jiffies, pool->no_space_deadline)) {
		DMWARN("%s: no data space for %u s: erroring queued IO",
		       dm_device_name(pool->pool_md), no_space_timeout_secs);
		WRITE_ONCE(pool->pf.error_if_no_space, true);
		error_retry_list(pool, BLK_STS_NOSPC);
		pool_event(pool);	/* the status line changed */
	}
	mutex_unlock(&pool->mode_lock);
}

/*
 * A write needs a new block and there is none.  @space_gen_seen: the
 * pool's space_gen when the allocation that failed started.
 */
static void no_space_for(struct pool *pool, struct bio *bio, u64 space_gen_seen)
{
	struct thin_c *tc = thin_bio(bio)->tc;
	bool requeue;

	if (switch_pool_mode(pool, PM_WRITE, PM_OUT_OF_DATA_SPACE) !=
	    PM_OUT_OF_DATA_SPACE) {
		/* Read-only or failed meanwhile. */
		bio_io_error(bio);
		return;
	}
	/*
	 * A commit or a passdown elsewhere since the allocation started may
	 * have made freed blocks allocatable, and looked
	 * (check_data_space()) before the switch above: look again.  Only
	 * then, so that blocks the count calls free but allocation cannot
	 * find (corrupt metadata) do not send the bio round for ever.
	 */
	mutex_lock(&pool->commit_lock);
	if (atomic64_read(&pool->space_gen) != space_gen_seen)
		check_data_space(pool);
	mutex_unlock(&pool->commit_lock);
	if (pool_mode(pool) == PM_WRITE) {
		defer_bio(pool, bio);
		return;
	}

	if (pool->pf.error_if_no_space) {
		bio->bi_status = BLK_STS_NOSPC;
		bio_endio(bio);
		return;
	}
	/*
	 * When a signal interrupts the suspend, dm core ends its noflush
	 * state before thin_presuspend_undo() clears requeue_no_space, and
	 * would turn a requeue in between into an error: queue the bio.
	 */
	spin_lock_irq(&pool->lock);
	requeue = tc->requeue_no_space && dm_noflush_suspending(tc->ti);
	if (!requeue)
		bio_list_add(&pool->retry_list, bio);
	spin_unlock_irq(&pool->lock);
	if (requeue) {
		bio->bi_status = BLK_STS_DM_REQUEUE;
		bio_endio(bio);
		return;
	}
	/*
	 * Whatever empties the list changes the mode or error_if_no_space
	 * first: if that happened before @bio was on it, do what it did.
	 */
	if (pool_mode(pool) == PM_WRITE)
		requeue_retry_list(pool);
	else if (READ_ONCE(pool->pf.error_if_no_space))
		error_retry_list(pool, BLK_STS_NOSPC);
	else if (pool_mode(pool) != PM_OUT_OF_DATA_SPACE)
		error_retry_list(pool, BLK_STS_IOERR);
}

/* Send the data low water event once, when @nr_free blocks are left. */
static void check_low_water_mark(struct pool *pool, tsp_block_t nr_free)
{
	if (READ_ONCE(pool->low_water_triggered) ||
	    nr_free > pool->low_water_blocks)
		return;
	/* Once, whichever worker gets here first. */
	mutex_lock(&pool->mode_lock);
	if (!pool->low_water_triggered) {
		DMWARN("%s: reached low water mark for data device: sending event",
		       dm_device_name(pool->pool_md));
		WRITE_ONCE(pool->low_water_triggered, true);
		pool_event(pool);
	}
	mutex_unlock(&pool->mode_lock);
}

/*----------------------------------------------------------------
 * The worker's bio processing
 *--------------------------------------------------------------*/

/* Allocate a data block; -ENOSPC has been dealt with (bio queued). */
static int alloc_block(struct pool *pool, struct bio *bio, tsp_block_t *result)
{
	u64 space_gen = atomic64_read(&pool->space_gen);
	struct tsp_pool_space space;
	int r;

	if (pool_mode(pool) != PM_WRITE) {
		if (pool_mode(pool) == PM_OUT_OF_DATA_SPACE) {
			no_space_for(pool, bio, space_gen);
			return -ENOSPC;
		}
		bio_io_error(bio);
		return -EPERM;
	}

	r = tsp_pool_alloc_data_block(pool->pmd, result);
	if (r == -ENOSPC) {
		/* Blocks freed in this transaction become usable at commit. */
		if (commit(pool)) {
			bio_io_error(bio);	/* commit() dealt with the failure */
			return -EIO;
		}
		space_gen = atomic64_read(&pool->space_gen);
		r = tsp_pool_alloc_data_block(pool->pmd, result);
	}
	if (r == -ENOSPC) {
		no_space_for(pool, bio, space_gen);
		return r;
	}
	if (r) {
		metadata_failed(pool, "alloc_data_block", r);
		bio_io_error(bio);
		return r;
	}
	if (tsp_pool_get_space(pool->pmd, &space))
		return 0;
	check_low_water_mark(pool, space.data_free);

	/*
	 * Only the metadata reserve is left: commit, which switches the pool
	 * to out-of-metadata-space mode.  This block's mapping still fits.
	 */
	if (!metadata_free_unreserved(&space))
		(void)commit(pool);
	return 0;
}

/*
 * A write to an unmapped block (@old_block == NULL) or to a shared one:
 * get a new block filled by the bio itself (with zeroing around it), or by
 * copying the shared block or the external origin, then map it
 * (process_completed_jobs).
 */
static void provision(struct worker *w, struct thin_c *tc, struct bio *bio,
		      tsp_block_t virt, const tsp_block_t *old_block)
{
	struct pool *pool = tc->pool;
	struct dm_io_region to, from;
	struct job *job;

	/* Allocated before the block, so a failure leaks nothing. */
	job = alloc_job(w);
	if (!job) {
		bio_list_add(&w->no_job, bio);
		return;
	}
	if (alloc_block(pool, bio, &job->mapping.data)) {
		free_job(w, job);
		return;
	}
	add_job(w, job, tc, virt, bio);
	job->breaks_sharing = !!old_block;

	if (bio_covers_block(pool, bio)) {
		start_overwrite(pool, job);
	} else if (old_block) {
		to = block_region(pool, job->mapping.data);
		from = block_region(pool, *old_block);
		dm_kcopyd_copy(pool->copier, &from, 1, &to, 0, kcopyd_done, job);
	} else if (tc->origin_dev &&
		   virt * pool->sectors_per_block < tc->origin_size) {
		copy_from_origin(tc, job);
	} else if (pool->pf.zero_new_blocks) {
		zero_around(pool, job);
	} else {
		/* The rest of the block keeps whatever it held. */
		start_overwrite(pool, job);
	}
}

/*
 * Worker, in a long pass: @bio's block was unmapped and is now mapped to
 * @data, which @bio may write at once (may_map_before_write()).  No job:
 * the CPU that mapped @bio issues it as it is, so that a device that
 * completes a bio in its submitter's context (brd) does the copy and
 * wakes the submitter there, while the worker, the bottleneck in a long
 * pass, goes on.  In a short pass the job path batches the inserts and
 * the ends of the bios: at 2 vCPUs, this path in every pass, issuing the
 * writes from the worker, ran first writes 5% slower (README,
 * Performance).
 */
static void map_before_write(struct worker *w, struct bio *bio,
			     tsp_block_t data)
{
	struct pool *pool = w->pool;

	this_cpu_inc(pool->stats->mapped_before_write);
	remap(pool, bio, data);
	count_in_epoch(pool, bio);
	hand_over_issue(pool, bio);
}

/*
 * Unmap the whole blocks @bio covers.  thin_map() cut it at the end of
 * its first block's region, so @w owns all of them.
 */
static void process_discard(struct worker *w, struct thin_c *tc,
			    struct bio *bio)
{
	struct pool *pool = tc->pool;
	sector_t start = bio->bi_iter.bi_sector;
	sector_t end = bio_end_sector(bio);
	tsp_block_t begin_b, end_b, b, tb, te, pb;
	bool shared;
	bool commit_failed = false;
	u32 count;
	int r = 0;

	/* A read-only pool ignores discards, as dm-thin does. */
	if (!pool->pf.discard_enabled || pool_is_read_only(pool)) {
		bio_endio(bio);
		return;
	}

	/* Only whole blocks are unmapped. */
	begin_b = div_u64(start + pool->sectors_per_block - 1, pool->sectors_per_block);
	end_b = div_u64(end, pool->sectors_per_block);

	for (b = begin_b; b < end_b; b++) {
		struct job *job = find_job(w, tc, b);

		if (job) {
			bio_list_add(&job->waiting, bio);
			return;
		}
	}

	/*
	 * Writes held for the commit are remapped but not yet in an IO
	 * epoch: one to a block freed here would be issued only after the
	 * commit that makes the block free for reuse.  Send them first.
	 */
	if (!bio_list_empty(&w->issue_after_commit))
		process_commit(w);

	mutex_lock(&pool->commit_lock);
	while (!r && begin_b < end_b) {
		r = tsp_thin_find_mapped_range(tc->td, begin_b, end_b, &tb, &te,
					       &pb, &shared);
		if (r == -ENODATA) {
			r = 0;
			break;
		}
		if (r)
			break;
		r = tsp_thin_remove_range(tc->td, tb, te);
		if (r)
			break;
		pool->freed_this_transaction = true;

		if (pool->pf.discard_passdown) {
			for (b = 0; !r && b < te - tb; b++) {
				r = tsp_pool_get_data_block_refcount(pool->pmd,
								     pb + b, &count);
				if (!r && !count)
					defer_passdown(pool, pb + b);
			}
			/* Bound the list: the commit passes them down. */
			if (!r && pool->nr_passdowns >= MAX_PASSDOWNS) {
				r = __commit(pool);
				commit_failed = r != 0;
			}
		}
		begin_b = te;
	}
	mutex_unlock(&pool->commit_lock);

	if (metadata_refused(pool, r)) {
		/* Read only, or aborted, since the check above: ignored. */
		bio_endio(bio);
		return;
	}
	if (r) {
		/* __commit() has logged or aborted its own failure. */
		if (!commit_failed)
			metadata_failed(pool, "discard", r);
		bio_io_error(bio);
		return;
	}
	bio_endio(bio);
}

/*
 * A read of an unprovisioned block: from the external origin, zeroes past
 * its end; all zeroes without one.
 */
static void read_unprovisioned(struct thin_c *tc, struct bio *bio)
{
	sector_t sector = bio->bi_iter.bi_sector;

	if (!tc->origin_dev || sector >= tc->origin_size) {
		zero_fill_bio(bio);
		bio_endio(bio);
		return;
	}
	if (bio_end_sector(bio) > tc->origin_size) {
		/* Zero it all, then let the origin fill the part it has. */
		zero_fill_bio(bio);
		bio->bi_iter.bi_size = (tc->origin_size - sector) << SECTOR_SHIFT;
	}
	bio_set_dev(bio, tc->origin_dev->bdev);
	submit_bio_noacct(bio);
}

/*
 * Worker: what @bio needs.  @long_pass: it is one of at least
 * handover_min_batch bios of this pass (see map_before_write()).
 */
static void process_bio(struct worker *w, struct thin_c *tc, struct bio *bio,
			bool long_pass)
{
	struct pool *pool = tc->pool;
	struct tsp_thin_lookup_result result;
	tsp_block_t virt;
	struct job *job;
	int r;

	if (pool_mode(pool) == PM_FAIL) {
		bio_io_error(bio);
		return;
	}

	if (bio_op(bio) == REQ_OP_DISCARD) {
		process_discard(w, tc, bio);
		return;
	}

	/*
	 * A flush needs a commit only if its device changed in this
	 * transaction (as dm-thin): the data device's flush makes the
	 * rest durable.
	 */
	if (!bio_has_data(bio)) {
		if (tsp_thin_changed_this_transaction(tc->td)) {
			w->commit_requested = true;
			bio_list_add(&w->issue_after_commit, bio);
		} else {
			issue_committed(pool, bio, BLK_STS_OK);
		}
		return;
	}

	virt = bio_block(pool, bio);
	job = find_job(w, tc, virt);
	if (job) {
		bio_list_add(&job->waiting, bio);
		return;
	}

	/*
	 * -EWOULDBLOCK: not tried, or refused having changed nothing.  Past
	 * the metadata reserve, alloc_block() switches the pool's mode.
	 */
	r = -EWOULDBLOCK;
	if (long_pass && may_map_before_write(tc, bio, virt) &&
	    !metadata_reserve_reached(pool)) {
		r = tsp_thin_provision(tc->td, virt, pool->low_water_blocks,
				       &result);
		if (!r) {
			map_before_write(w, bio, result.block);
			return;
		}
		if (r != -EEXIST && r != -EWOULDBLOCK) {
			metadata_failed(pool, "provision", r);
			bio_io_error(bio);
			return;
		}
	}
	/* -EEXIST: mapped, and @result says where. */
	r = r == -EEXIST ? 0 : tsp_thin_find_block(tc->td, virt, &result);
	if (r == -ENODATA) {
		if (bio_data_dir(bio) == READ)
			read_unprovisioned(tc, bio);
		else
			provision(w, tc, bio, virt, NULL);
		return;
	}
	if (r == -EPERM) {
		/* An update failed, one in thin_map() say: abort it. */
		metadata_failed(pool, "find_block", r);
		bio_io_error(bio);
		return;
	}
	if (r) {
		DMERR_LIMIT("%s: lookup of block %llu failed: %d",
			    dm_device_name(pool->pool_md),
			    (unsigned long long)virt, r);
		bio_io_error(bio);
		return;
	}

	if (bio_data_dir(bio) == WRITE && result.shared) {
		provision(w, tc, bio, virt, &result.block);
		return;
	}

	if (bio_needs_commit(bio)) {
		blk_status_t status = BLK_STS_OK;

		if (tsp_thin_changed_this_transaction(tc->td)) {
			if (bio_data_dir(bio) == WRITE) {
				remap(pool, bio, result.block);
				bio_list_add(&w->issue_after_commit, bio);
				return;
			}
			/*
			 * A FUA read is sent only counted in the epoch: held
			 * back uncounted for a later commit, its block could
			 * meanwhile be freed by a write of this pass breaking
			 * sharing, and reused.  Commit now; only this worker
			 * changes the mapping.
			 */
			w->commit_requested = true;
			status = process_commit(w);
		}
		/* After the check above: an abort clears the changes. */
		bio->bi_status = status ?: aborted_changes_status(tc);
		if (bio->bi_status) {
			bio_endio(bio);
			return;
		}
	}
	issue_remapped(pool, bio, result.block);
}

/* Bios that found no job (provision()) try again, in their order. */
static void process_no_job_bios(struct worker *w)
{
	struct bio_list bios = w->no_job;
	struct bio *bio;

	bio_list_init(&w->no_job);
	while ((bio = bio_list_pop(&bios)))
		process_bio(w, thin_bio(bio)->tc, bio, false);
}

static void process_deferred_bios(struct worker *w)
{
	unsigned int min_batch = READ_ONCE(handover_min_batch), nr = 0;
	struct llist_node *list, *n;
	struct thin_bio *tb, *tmp;
	bool long_pass;

	list = llist_reverse_order(llist_del_all(&w->deferred));
	for (n = list; n && nr < min_batch; n = n->next)
		nr++;
	long_pass = min_batch && nr >= min_batch;
	llist_for_each_entry_safe(tb, tmp, list, node) {
		struct bio *bio = dm_bio_from_per_bio_data(tb, sizeof(*tb));

		process_bio(w, tb->tc, bio, long_pass);
		cond_resched();
	}
}

static bool worker_has_work(struct worker *w)
{
	bool r;

	spin_lock_irq(&w->lock);
	r = !list_empty(&w->completed_jobs) || !llist_empty(&w->deferred);
	spin_unlock_irq(&w->lock);
	return r;
}

static void do_worker(struct work_struct *ws)
{
	struct worker *w = container_of(ws, struct worker, work);

	WRITE_ONCE(w->running, true);
	mutex_lock(&w->pass_lock);
	WRITE_ONCE(w->passes, w->passes + 1);
	process_completed_jobs(w);
	process_no_job_bios(w);
	process_deferred_bios(w);
	/*
	 * Jobs whose IO already completed finish in this pass, and give
	 * theirs to bios that found none.
	 */
	process_completed_jobs(w);
	process_no_job_bios(w);
	process_commit(w);
	mutex_unlock(&w->pass_lock);
	WRITE_ONCE(w->running, false);

	/*
	 * Work added since the lists were last emptied was not kicked: queue
	 * another pass (not a loop here, which flush_workqueue() would wait
	 * on for as long as other devices of the pool keep the worker busy).
	 */
	smp_mb();	/* clear running, then look at the lists */
	if (worker_has_work(w))
		queue_work(w->pool->wq, &w->work);
}

/* Commit once a second when the metadata changed. */
static void do_waker(struct work_struct *ws)
{
	struct pool *pool = container_of(to_delayed_work(ws), struct pool, waker);

	if (tsp_pool_changed_this_transaction(pool->pmd))
		(void)commit(pool);
	queue_delayed_work(pool->wq, &pool->waker, COMMIT_PERIOD);
}

/*
 * Hand @bio to its owner: that of its block, or for an empty flush, this
 * CPU's worker.
 */
static void defer_bio(struct pool *pool, struct bio *bio)
{
	struct thin_bio *tb = thin_bio(bio);
	struct worker *w;

	if (bio_sectors(bio))
		w = worker_for(tb->tc, bio_block(pool, bio));
	else
		w = &pool->workers[raw_smp_processor_id() % pool->nr_workers];
	this_cpu_inc(pool->stats->deferred);
	/*
	 * Only the bio that finds the list empty wakes the worker: the
	 * worker empties the list before it processes what was on it, so a
	 * bio added to a non-empty list will be seen by the pass that the
	 * first one's wake-up queued, or by the running pass's last look at
	 * the list (wake_worker()).
	 */
	if (llist_add(&tb->node, &w->deferred))
		wake_worker(w);
}

/*----------------------------------------------------------------
 * Pool lifetime
 *--------------------------------------------------------------*/
/*
 * The last commit of a pool going away: the metadata's close commits what
 * is left without flushing the data device, so commit as ever (the flush
 * first), and if that fails drop the transaction, so that nothing is
 * committed over data that may not be on disk.  Read-only metadata
 * refuses the abort; its close commits nothing either.
 */
static void final_commit(struct pool *pool)
{
	int r;

	if (!commit(pool))
		return;
	r = tsp_pool_abort_metadata(pool->pmd);
	if (r && r != -EPERM)
		DMERR("%s: could not drop the uncommitted metadata transaction: %d",
		      dm_device_name(pool->pool_md), r);
}

static void pool_destroy(struct pool *pool)
{
	unsigned int i;

	cancel_delayed_work_sync(&pool->waker);
	cancel_delayed_work_sync(&pool->no_space_timeout);
	if (pool->pmd) {
		final_commit(pool);
		if (pool->wq)
			wait_for_passdowns(pool);
		if (tsp_pool_metadata_close(pool->pmd) < 0)
			DMWARN("%s: metadata close failed", __func__);
	}
	if (pool->copier)
		dm_kcopyd_client_destroy(pool->copier);
	if (pool->wq)
		destroy_workqueue(pool->wq);
	if (pool->completion_wq)
		destroy_workqueue(pool->completion_wq);
	free_percpu(pool->completions);
	bioset_exit(&pool->zero_bios);
	free_passdowns(pool);	/* of a transaction never committed */
	if (pool->workers) {
		for (i = 0; i < pool->nr_workers; i++) {
			free_cpumask_var(pool->workers[i].completions_to_kick);
			free_spare_jobs(&pool->workers[i]);
		}
	}
	kfree(pool->workers);
	free_percpu(pool->epoch);
	free_percpu(pool->stats);
	bdev_ref_put(&pool->data_dev);
	bdev_ref_put(&pool->metadata_dev);
	kfree(pool);
}

static void init_worker(struct worker *w, struct pool *pool)
{
	INIT_WORK(&w->work, do_worker);
	w->pool = pool;
	init_llist_head(&w->deferred);
	spin_lock_init(&w->lock);
	INIT_LIST_HEAD(&w->completed_jobs);
	mutex_init(&w->pass_lock);
	INIT_HLIST_HEAD(&w->spare_jobs);
	bio_list_init(&w->flush_waiters);
	bio_list_init(&w->issue_after_commit);
	bio_list_init(&w->no_job);
}

static struct pool *pool_create(struct mapped_device *pool_md,
				struct block_device *metadata_bdev,
				struct block_device *data_bdev,
				u32 sectors_per_block, bool format, char **error)
{
	struct pool *pool;
	unsigned int i;
	int cpu, r;

	pool = kzalloc(sizeof(*pool), GFP_KERNEL);
	if (!pool) {
		*error = "Error allocating memory for pool";
		return ERR_PTR(-ENOMEM);
	}

	pool->pool_md = pool_md;
	pool->sectors_per_block = sectors_per_block;
	pool->sectors_per_block_shift = is_power_of_2(sectors_per_block) ?
					__ffs(sectors_per_block) : -1;
	pool->ref_count = 1;
	spin_lock_init(&pool->lock);
	mutex_init(&pool->commit_lock);
	INIT_LIST_HEAD(&pool->passdowns);
	INIT_LIST_HEAD(&pool->passdowns_next);
	mutex_init(&pool->mode_lock);
	bio_list_init(&pool->retry_list);
	INIT_LIST_HEAD(&pool->thins);
	/* No thin device until the first resume has bound a table. */
	pool->suspended = true;
	INIT_DELAYED_WORK(&pool->waker, do_waker);
	INIT_DELAYED_WORK(&pool->no_space_timeout, do_no_space_timeout);
	atomic64_set(&pool->commits, 0);
	atomic64_set(&pool->space_gen, 0);

	r = bdev_ref_get(&pool->metadata_dev, metadata_bdev->bd_dev);
	if (!r)
		r = bdev_ref_get(&pool->data_dev, data_bdev->bd_dev);
	if (r) {
		*error = "Error taking the pool's own references to its devices";
		goto bad;
	}
	/*
	 * Blank metadata is formatted with no data blocks, as dm-thin does:
	 * the table's length is checked against the data device only after
	 * the constructor, and the first resume grows the pool to it.  A
	 * size taken from a table that then fails to load would stay on
	 * disk, and a pool cannot shrink.
	 */
	r = tsp_pool_metadata_open(pool->metadata_dev.bdev, sectors_per_block,
				   0, format, &pool->pmd);
	if (r) {
		*error = "Error creating metadata object";
		goto bad;
	}
	r = tsp_pool_metadata_set_cache_budget(pool->pmd,
					       (u64)cache_budget_mib << 20);
	if (r) {
		*error = "Error allocating the mapping cache";
		goto bad;
	}

	r = -ENOMEM;
	pool->epoch = alloc_percpu(struct epoch_counts);
	pool->stats = alloc_percpu(struct pool_stats);
	if (!pool->epoch || !pool->stats) {
		*error = "Error allocating per-CPU state";
		goto bad;
	}

	/* No more workers than CPUs: they run on an unbound workqueue. */
	i = READ_ONCE(pool_workers);
	if (!i || i > num_online_cpus())
		i = num_online_cpus();
	pool->nr_workers = min_t(unsigned int, i, MAX_WORKERS);
	pool->workers = kcalloc(pool->nr_workers, sizeof(*pool->workers),
				GFP_KERNEL);
	if (!pool->workers) {
		*error = "Error allocating the pool's workers";
		goto bad;
	}
	for (i = 0; i < pool->nr_workers; i++) {
		init_worker(&pool->workers[i], pool);
		if (!zalloc_cpumask_var(&pool->workers[i].completions_to_kick,
					GFP_KERNEL) ||
		    alloc_spare_jobs(&pool->workers[i])) {
			*error = "Error allocating the pool's workers";
			goto bad;
		}
	}
	pool->completions = alloc_percpu(struct cpu_completions);
	pool->completion_wq = alloc_workqueue("tsp-completions",
					      WQ_HIGHPRI | WQ_MEM_RECLAIM, 0);
	if (!pool->completions || !pool->completion_wq) {
		*error = "Error allocating the pool's completions";
		goto bad;
	}
	for_each_possible_cpu(cpu) {
		struct cpu_completions *c = per_cpu_ptr(pool->completions, cpu);

		init_llist_head(&c->bios);
		init_llist_head(&c->issues);
		INIT_WORK(&c->work, do_cpu_completions);
	}

	r = bioset_init(&pool->zero_bios, BIO_POOL_SIZE, 0, BIOSET_NEED_BVECS);
	if (r) {
		*error = "Error creating pool's bio set";
		goto bad;
	}
	r = -ENOMEM;
	pool->wq = alloc_workqueue("tsp-" DM_MSG_PREFIX, WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
	if (!pool->wq) {
		*error = "Error creating pool's workqueue";
		goto bad;
	}
	pool->copier = dm_kcopyd_client_create(NULL);
	if (IS_ERR(pool->copier)) {
		r = PTR_ERR(pool->copier);
		pool->copier = NULL;
		*error = "Error creating pool's kcopyd client";
		goto bad;
	}

	list_add(&pool->list, &pool_table);
	return pool;
bad:
	pool_destroy(pool);
	return ERR_PTR(r);
}

/*
 * Find or create the pool of @pool_md.  As with dm-thin, a pool keeps its
 * metadata and data devices, its block size and its discard support
 * across table reloads, and no two pools share a device.  Caller holds
 * pool_table_mutex.
 */
static struct pool *pool_find(struct mapped_device *pool_md,
			      struct block_device *metadata_bdev,
			      struct block_device *data_bdev, u32 sectors_per_block,
			      const struct pool_features *pf, char **error)
{
	struct pool *pool;

	lockdep_assert_held(&pool_table_mutex);
	list_for_each_entry(pool, &pool_table, list) {
		bool same_metadata = pool->metadata_dev.bdev == metadata_bdev;
		bool same_data = pool->data_dev.bdev == data_bdev;

		if (pool->pool_md != pool_md) {
			if (same_metadata) {
				*error = "metadata device already in use by a pool";
				return ERR_PTR(-EBUSY);
			}
			if (same_data) {
				*error = "data device already in use by a pool";
				return ERR_PTR(-EBUSY);
			}
			continue;
		}
		if (!same_metadata) {
			*error = "different pool cannot replace a pool";
			return ERR_PTR(-EINVAL);
		}
		if (!same_data) {
			*error = "data device already in use by a pool";
			return ERR_PTR(-EBUSY);
		}
		if (pool->sectors_per_block != sectors_per_block) {
			*error = "cannot change the data block size of a pool";
			return ERR_PTR(-EINVAL);
		}
		/* Thin targets took their discard support from the pool's. */
		if (pool->pf.discard_enabled != pf->discard_enabled) {
			*error = "cannot change the discard support of a pool";
			return ERR_PTR(-EINVAL);
		}
		pool->ref_count++;
		return pool;
	}
	/* A read-only pool never formats its metadata device. */
	pool = pool_create(pool_md, metadata_bdev, data_bdev, sectors_per_block,
			   pf->mode != PM_READ_ONLY, error);
	if (!IS_ERR(pool))
		pool->pf.discard_enabled = pf->discard_enabled;
	return pool;
}

static void pool_put(struct pool *pool)
{
	mutex_lock(&pool_table_mutex);
	if (!--pool->ref_count) {
		list_del(&pool->list);
		pool_destroy(pool);
	}
	mutex_unlock(&pool_table_mutex);
}

/*----------------------------------------------------------------
 * The pool target
 *--------------------------------------------------------------*/
static int parse_pool_features(struct dm_arg_set *as, struct pool_features *pf,
			       struct dm_target *ti)
{
	static const struct dm_arg _args[] = {
		{0, 4, "Invalid number of pool feature arguments"},
	};
	unsigned int argc;
	const char *arg;
	int r;

	if (!as->argc)
		return 0;
	r = dm_read_arg_group(_args, as, &argc, &ti->error);
	if (r)
		return -EINVAL;

	while (argc--) {
		arg = dm_shift_arg(as);
		if (!strcasecmp(arg, "skip_block_zeroing")) {
			pf->zero_new_blocks = false;
		} else if (!strcasecmp(arg, "ignore_discard")) {
			pf->discard_enabled = false;
		} else if (!strcasecmp(arg, "no_discard_passdown")) {
			pf->discard_passdown = false;
		} else if (!strcasecmp(arg, "read_only")) {
			pf->mode = PM_READ_ONLY;
		} else if (!strcasecmp(arg, "error_if_no_space")) {
			pf->error_if_no_space = true;
		} else {
			ti->error = "Unrecognised pool feature requested";
			return -EINVAL;
		}
	}
	return 0;
}

static void pool_dtr(struct dm_target *ti)
{
	struct pool_c *pt = ti->private;
	struct pool *pool = pt->pool;

	/* The pool may outlive this table (its thin devices hold it). */
	mutex_lock(&pool->mode_lock);
	if (pool->ti == ti)
		pool->ti = NULL;
	mutex_unlock(&pool->mode_lock);
	pool_put(pool);
	dm_put_device(ti, pt->metadata_dev);
	dm_put_device(ti, pt->data_dev);
	kfree(pt);
}

/*
 * Discards are passed down only to a data device that takes them whole
 * blocks at a time, as dm-thin decides.
 */
static void disable_passdown_if_unsupported(struct pool_c *pt)
{
	struct block_device *data_bdev = pt->data_dev->bdev;
	const char *reason = NULL;

	if (!pt->adjusted_pf.discard_enabled || !pt->adjusted_pf.discard_passdown)
		return;
	if (!bdev_max_discard_sectors(data_bdev))
		reason = "discard unsupported";
	else if (bdev_max_discard_sectors(data_bdev) < pt->pool->sectors_per_block)
		reason = "max discard sectors smaller than a block";
	if (reason) {
		DMWARN("Data device (%pg) %s: Disabling discard passdown.",
		       data_bdev, reason);
		pt->adjusted_pf.discard_passdown = false;
	}
}

/*
 * thin-scal-pool <metadata dev> <data dev> <data block size (sectors)>
 *	<low water mark (blocks)> [<#feature args> [<arg>]*]
 */
static int pool_ctr(struct dm_target *ti, unsigned int argc, char **argv)
{
	struct dm_arg_set as = { .argc = argc, .argv = argv };
	struct pool_features pf = {
		.mode = PM_WRITE,
		.zero_new_blocks = true,
		.discard_enabled = true,
		.discard_passdown = true,
	};
	struct dm_dev *metadata_dev, *data_dev;
	unsigned long block_size;
	unsigned long long low_water;
	struct pool_c *pt;
	struct pool *pool;
	int r;

	if (argc < 4) {
		ti->error = "Invalid argument count";
		return -EINVAL;
	}

	mutex_lock(&pool_table_mutex);
	as.argc -= 4;
	as.argv += 4;
	r = parse_pool_features(&as, &pf, ti);
	if (r)
		goto out_unlock;

	/* A read-only pool writes no metadata: its device may be read-only. */
	r = dm_get_device(ti, argv[0],
			  pf.mode == PM_READ_ONLY ? OPEN_READ : OPEN_READ_WRITE,
			  &metadata_dev);
	if (r) {
		ti->error = "Error opening metadata block device";
		goto out_unlock;
	}
	r = dm_get_device(ti, argv[1], OPEN_READ_WRITE, &data_dev);
	if (r) {
		ti->error = "Error getting data device";
		goto out_metadata;
	}
	if (metadata_dev->bdev == data_dev->bdev) {
		ti->error = "Error: metadata and data devices are the same device";
		r = -EINVAL;
		goto out_data;
	}

	if (kstrtoul(argv[2], 10, &block_size) ||
	    block_size < TSP_DATA_BLOCK_SIZE_MIN_SECTORS ||
	    block_size > TSP_DATA_BLOCK_SIZE_MAX_SECTORS ||
	    block_size % TSP_DATA_BLOCK_SIZE_MIN_SECTORS) {
		ti->error = "Invalid block size";
		r = -EINVAL;
		goto out_data;
	}
	if (kstrtoull(argv[3], 10, &low_water)) {
		ti->error = "Invalid low water mark";
		r = -EINVAL;
		goto out_data;
	}
	if (ti->len < block_size) {
		ti->error = "Pool is smaller than one data block";
		r = -EINVAL;
		goto out_data;
	}

	pt = kzalloc(sizeof(*pt), GFP_KERNEL);
	if (!pt) {
		ti->error = "Error allocating pool context";
		r = -ENOMEM;
		goto out_data;
	}

	pool = pool_find(dm_table_get_md(ti->table), metadata_dev->bdev,
			 data_dev->bdev, block_size, &pf, &ti->error);
	if (IS_ERR(pool)) {
		r = PTR_ERR(pool);
		goto out_free;
	}

	pt->ti = ti;
	pt->pool = pool;
	pt->metadata_dev = metadata_dev;
	pt->data_dev = data_dev;
	pt->low_water_blocks = low_water;
	pt->requested_pf = pf;
	pt->adjusted_pf = pf;
	disable_passdown_if_unsupported(pt);

	ti->private = pt;
	ti->num_flush_bios = 1;
	ti->flush_supported = true;
	ti->limit_swap_bios = true;
	/*
	 * Discards sent to the pool device itself go to the data device, if
	 * passed down at all.  discards_supported has dm core take them
	 * without asking the data device (as dm-thin); their limits are the
	 * data device's (pool_io_hints()).
	 */
	if (pf.discard_enabled && pf.discard_passdown) {
		ti->num_discard_bios = 1;
		ti->discards_supported = true;
	}
	mutex_unlock(&pool_table_mutex);
	return 0;

out_free:
	kfree(pt);
out_data:
	dm_put_device(ti, data_dev);
out_metadata:
	dm_put_device(ti, metadata_dev);
out_unlock:
	mutex_unlock(&pool_table_mutex);
	return r;
}

/* Bios sent to the pool device itself go to the data device. */
static int pool_map(struct dm_target *ti, struct bio *bio)
{
	struct pool_c *pt = ti->private;

	bio_set_dev(bio, pt->data_dev->bdev);
	return DM_MAPIO_REMAPPED;
}

/* What grows with a pool's devices: its data or its metadata space map. */
struct pool_space {
	const char *device;
	const char *resize_op;
	int (*get_size)(struct tsp_pool_metadata *pmd, tsp_block_t *result);
	int (*resize)(struct tsp_pool_metadata *pmd, tsp_block_t new_size);
};

static const struct pool_space data_space = {
	.device = "pool target",
	.resize_op = "resize_data_dev",
	.get_size = tsp_pool_get_data_block_count,
	.resize = tsp_pool_resize_data_dev,
};

static const struct pool_space metadata_space = {
	.device = "metadata device",
	.resize_op = "resize_metadata_dev",
	.get_size = tsp_pool_get_metadata_dev_size,
	.resize = tsp_pool_resize_metadata_dev,
};

/*
 * Grow @space to @want blocks, and commit (a failed commit does not fail
 * the grow).  Shrinking is refused in every mode; a pool that cannot
 * write its metadata grows when it next can.
 */
static int grow_space(struct pool *pool, const struct pool_space *space,
		      tsp_block_t want)
{
	tsp_block_t have;
	int r;

	r = space->get_size(pool->pmd, &have);
	if (r) {
		DMERR("%s: cannot read the size of the %s: %d",
		      dm_device_name(pool->pool_md), space->device, r);
		return r;
	}
	if (want < have) {
		DMERR("%s: %s (%llu blocks) is smaller than before (%llu blocks)",
		      dm_device_name(pool->pool_md), space->device,
		      (unsigned long long)want, (unsigned long long)have);
		return -EINVAL;
	}
	if (want == have || pool_mode(pool) >= PM_READ_ONLY)
		return 0;

	r = space->resize(pool->pmd, want);
	if (r) {
		metadata_failed(pool, space->resize_op, r);
		return r;
	}
	/*
	 * As dm-thin: commit() deals with its own failure, which must not
	 * keep the pool from resuming.  A commit that failed at the flush
	 * leaves the new size in the transaction for the next one.
	 */
	(void)commit(pool);
	return 0;
}

/* Grow the pool to its table's length and to its metadata device's. */
static int grow_pool(struct pool_c *pt)
{
	struct pool *pool = pt->pool;
	tsp_block_t metadata_blocks =
		div_u64(bdev_nr_sectors(pt->metadata_dev->bdev),
			TSP_METADATA_BLOCK_SECTORS);
	int r;

	r = grow_space(pool, &data_space,
		       div_u64(pt->ti->len, pool->sectors_per_block));
	metadata_blocks = min_t(tsp_block_t, TSP_METADATA_MAX_BLOCKS,
				metadata_blocks);
	if (!r)
		r = grow_space(pool, &metadata_space, metadata_blocks);
	if (!r)
		WRITE_ONCE(pool->metadata_reserve_blocks,
			   metadata_reserve(metadata_blocks));
	return r;
}

static void thin_put(struct thin_c *tc)
{
	if (refcount_dec_and_test(&tc->refcount))
		complete(&tc->can_destroy);
}

/*
 * Suspend (@suspend) the md of every thin target of @pool, or resume
 * those the pool suspended, outside pool->lock (both sleep), each held by
 * a reference.  dm core counts the internal suspends of an md, which must
 * balance: a target destroyed before the resume resumes its md itself
 * (thin_dtr()).  The pool's suspend and resume are serialised by dm core,
 * so @batch of a target is theirs alone.
 */
static void suspend_thins(struct pool *pool, bool suspend)
{
	struct thin_c *tc, *tmp;
	LIST_HEAD(batch);

	spin_lock_irq(&pool->lock);
	pool->suspended = suspend;
	list_for_each_entry(tc, &pool->thins, list) {
		if (tc->suspended_by_pool == suspend)
			continue;
		tc->suspended_by_pool = suspend;
		refcount_inc(&tc->refcount);
		list_add_tail(&tc->batch, &batch);
	}
	spin_unlock_irq(&pool->lock);

	list_for_each_entry_safe(tc, tmp, &batch, batch) {
		if (suspend)
			dm_internal_suspend_noflush(tc->thin_md);
		else
			dm_internal_resume(tc->thin_md);
		list_del(&tc->batch);
		thin_put(tc);
	}
}

/*
 * Suspend the pool's thin devices first, as dm-thin does: their IO in
 * flight finishes (IO queued for data space goes back to dm core) and
 * no more arrives until the pool resumes.
 */
static void pool_presuspend(struct dm_target *ti)
{
	struct pool_c *pt = ti->private;

	suspend_thins(pt->pool, true);
}

static void pool_presuspend_undo(struct dm_target *ti)
{
	struct pool_c *pt = ti->private;

	suspend_thins(pt->pool, false);
}

static int pool_preresume(struct dm_target *ti)
{
	struct pool_c *pt = ti->private;
	struct pool *pool = pt->pool;
	int r;

	/* Bind this table's devices and features to the pool. */
	mutex_lock(&pool->mode_lock);
	pool->ti = ti;
	mutex_unlock(&pool->mode_lock);
	pool->low_water_blocks = pt->low_water_blocks;
	/* discard_enabled is the pool's own, set once (pool_find()). */
	pool->pf.zero_new_blocks = pt->adjusted_pf.zero_new_blocks;
	pool->pf.discard_passdown = pt->adjusted_pf.discard_passdown;
	pool->pf.error_if_no_space = pt->adjusted_pf.error_if_no_space;
	pool->table_error_if_no_space = pt->adjusted_pf.error_if_no_space;

	/*
	 * Under mode_lock: a metadata failure in the workers meanwhile sets
	 * needs_check before it switches to read-only mode.
	 */
	mutex_lock(&pool->mode_lock);
	if (tsp_pool_metadata_needs_check(pool->pmd) &&
	    pt->requested_pf.mode == PM_WRITE) {
		DMERR("%s: unable to switch pool to write mode until repaired",
		      dm_device_name(pool->pool_md));
		__set_pool_mode(pool, PM_READ_ONLY);
	} else if (pool_mode(pool) != PM_FAIL) {
		if (pt->requested_pf.mode == PM_READ_ONLY)
			__set_pool_mode(pool, PM_READ_ONLY);
		else if (pool_mode(pool) == PM_READ_ONLY)
			__set_pool_mode(pool, PM_WRITE);	/* no needs_check */
	}
	mutex_unlock(&pool->mode_lock);

	if (pool_mode(pool) == PM_FAIL)
		return 0;
	r = grow_pool(pt);
	/*
	 * A pool that failed meanwhile resumes, as dm-thin's: its IO is
	 * then errored rather than held by a suspended device.
	 */
	if (r)
		return pool_mode(pool) == PM_FAIL ? 0 : r;

	if (pool_mode(pool) == PM_OUT_OF_DATA_SPACE) {
		tsp_block_t free;

		if (!tsp_pool_get_allocatable_block_count(pool->pmd, false,
							  &free) && free)
			switch_pool_mode(pool, PM_OUT_OF_DATA_SPACE, PM_WRITE);
	}
	if (pool_mode(pool) == PM_OUT_OF_METADATA_SPACE) {
		tsp_block_t nr_meta, nr_meta_free;

		if (!get_metadata_space(pool, &nr_meta, &nr_meta_free) &&
		    nr_meta_free)
			switch_pool_mode(pool, PM_OUT_OF_METADATA_SPACE, PM_WRITE);
	}
	return 0;
}

static void pool_resume(struct dm_target *ti)
{
	struct pool_c *pt = ti->private;
	struct pool *pool = pt->pool;

	mutex_lock(&pool->mode_lock);
	pool->low_water_triggered = false;
	mutex_unlock(&pool->mode_lock);
	mutex_lock(&pool->commit_lock);
	pool->metadata_low_water_triggered = false;
	mutex_unlock(&pool->commit_lock);
	requeue_retry_list(pool);
	queue_delayed_work(pool->wq, &pool->waker, COMMIT_PERIOD);
	/* Still out of space, now queueing: the timeout runs again. */
	mutex_lock(&pool->mode_lock);
	if (pool_mode(pool) == PM_OUT_OF_DATA_SPACE)
		arm_no_space_timeout(pool);
	mutex_unlock(&pool->mode_lock);
	suspend_thins(pool, false);
}

static void pool_postsuspend(struct dm_target *ti)
{
	struct pool_c *pt = ti->private;
	struct pool *pool = pt->pool;

	cancel_delayed_work_sync(&pool->waker);
	cancel_delayed_work_sync(&pool->no_space_timeout);
	flush_workqueue(pool->wq);
	(void)commit(pool);
	wait_for_passdowns(pool);
}

/* A device id in a message: a number of dm-thin's 24 bits. */
static bool parse_dev_id(const char *arg, tsp_thin_id *id)
{
	unsigned long long v;

	if (kstrtoull(arg, 10, &v) || v > TSP_THIN_MAX_DEV_ID) {
		DMERR("Message received with invalid device id: %s", arg);
		return false;
	}
	*id = v;
	return true;
}

static int process_message(struct pool *pool, unsigned int argc, char **argv,
			   char *result, unsigned int maxlen)
{
	unsigned long long old_tid, new_tid;
	tsp_thin_id id, origin;
	int r;

	if (!strcasecmp(argv[0], "create_thin") && argc == 2) {
		if (!parse_dev_id(argv[1], &id))
			return -EINVAL;
		r = tsp_pool_create_thin(pool->pmd, id);
	} else if (!strcasecmp(argv[0], "create_snap") && argc == 3) {
		if (!parse_dev_id(argv[1], &id) || !parse_dev_id(argv[2], &origin))
			return -EINVAL;
		r = tsp_pool_create_snap(pool->pmd, id, origin);
	} else if (!strcasecmp(argv[0], "delete") && argc == 2) {
		if (!parse_dev_id(argv[1], &id))
			return -EINVAL;
		mutex_lock(&pool->commit_lock);
		r = tsp_pool_delete_thin_device(pool->pmd, id);
		if (!r)
			pool->freed_this_transaction = true;
		mutex_unlock(&pool->commit_lock);
	} else if (!strcasecmp(argv[0], "set_transaction_id") && argc == 3) {
		if (kstrtoull(argv[1], 10, &old_tid) ||
		    kstrtoull(argv[2], 10, &new_tid)) {
			DMERR("set_transaction_id: bad number in message arguments");
			return -EINVAL;
		}
		r = tsp_pool_set_metadata_transaction_id(pool->pmd, old_tid, new_tid);
	} else if (!strcasecmp(argv[0], "reserve_metadata_snap") && argc == 1) {
		r = commit_then(pool, tsp_pool_reserve_metadata_snap);
	} else if (!strcasecmp(argv[0], "release_metadata_snap") && argc == 1) {
		r = commit_then(pool, tsp_pool_release_metadata_snap);
	} else {
		DMERR("Unrecognised thin pool target message or wrong argument count: %s (%u)",
		      argv[0], argc);
		return -EINVAL;
	}

	if (r)
		DMWARN("%s message failed: %d", argv[0], r);
	return r;
}

static int emit_stats(struct pool *pool, char *result, unsigned int maxlen)
{
	struct pool_stats sum = { 0 };
	struct tsp_mc_stats cache = { 0 };
	tsp_block_t nr, nr_free, waiting;
	unsigned int sz = 0, i;
	u64 passes = 0, handed_over = 0;
	int cpu;

	for (i = 0; i < pool->nr_workers; i++) {
		passes += READ_ONCE(pool->workers[i].passes);
		handed_over += READ_ONCE(pool->workers[i].handed_over);
	}
	for_each_possible_cpu(cpu) {
		sum.fast += per_cpu_ptr(pool->stats, cpu)->fast;
		sum.deferred += per_cpu_ptr(pool->stats, cpu)->deferred;
		sum.provisioned_in_map +=
			per_cpu_ptr(pool->stats, cpu)->provisioned_in_map;
		sum.mapped_before_write +=
			per_cpu_ptr(pool->stats, cpu)->mapped_before_write;
		sum.blocks_written_whole +=
			per_cpu_ptr(pool->stats, cpu)->blocks_written_whole;
	}
	if (tsp_pool_get_data_block_count(pool->pmd, &nr) ||
	    tsp_pool_get_free_block_count(pool->pmd, &nr_free) ||
	    tsp_pool_get_waiting_block_count(pool->pmd, &waiting))
		nr = nr_free = waiting = 0;
	tsp_pool_cache_stats(pool->pmd, &cache);

	DMEMIT("fast_ios %llu deferred_ios %llu cache_entries %llu cache_hits %llu "
	       "cache_misses %llu cache_evictions %llu commits %llu provisioned_blocks %llu "
	       "workers %u worker_passes %llu handed_over_ios %llu "
	       "provisioned_in_map %llu mapped_before_write %llu blocks_written_whole %llu "
	       "freed_blocks_waiting %llu",
	       (unsigned long long)sum.fast, (unsigned long long)sum.deferred,
	       (unsigned long long)cache.entries, (unsigned long long)cache.hits,
	       (unsigned long long)cache.misses, (unsigned long long)cache.evictions,
	       (unsigned long long)atomic64_read(&pool->commits),
	       (unsigned long long)(nr - nr_free), pool->nr_workers,
	       (unsigned long long)passes, (unsigned long long)handed_over,
	       (unsigned long long)sum.provisioned_in_map,
	       (unsigned long long)sum.mapped_before_write,
	       (unsigned long long)sum.blocks_written_whole,
	       (unsigned long long)waiting);
	return 1;
}

static int pool_message(struct dm_target *ti, unsigned int argc, char **argv,
			char *result, unsigned int maxlen)
{
	struct pool_c *pt = ti->private;
	struct pool *pool = pt->pool;
	int r;

	if (!argc)
		return -EINVAL;
	if (!strcasecmp(argv[0], "stats") && argc == 1)
		return emit_stats(pool, result, maxlen);

	if (pool_is_read_only(pool)) {
		DMERR("%s: unable to service pool target messages in READ_ONLY or FAIL mode",
		      dm_device_name(pool->pool_md));
		return -EOPNOTSUPP;
	}

	r = process_message(pool, argc, argv, result, maxlen);
	if (!r)
		(void)commit(pool);
	else if (tsp_pool_metadata_needs_abort(pool->pmd))
		/* Not a refusal: the update failed half way. */
		metadata_failed(pool, argv[0], r);
	return r;
}

static void emit_flags(struct pool_features *pf, char *result,
		       unsigned int sz, unsigned int maxlen)
{
	unsigned int count = !pf->zero_new_blocks + !pf->discard_enabled +
			     !pf->discard_passdown + (pf->mode == PM_READ_ONLY) +
			     pf->error_if_no_space;

	DMEMIT("%u ", count);
	if (!pf->zero_new_blocks)
		DMEMIT("skip_block_zeroing ");
	if (!pf->discard_enabled)
		DMEMIT("ignore_discard ");
	if (!pf->discard_passdown)
		DMEMIT("no_discard_passdown ");
	if (pf->mode == PM_READ_ONLY)
		DMEMIT("read_only ");
	if (pf->error_if_no_space)
		DMEMIT("error_if_no_space ");
}

static void pool_status(struct dm_target *ti, status_type_t type,
			unsigned int status_flags, char *result,
			unsigned int maxlen)
{
	struct pool_c *pt = ti->private;
	struct pool *pool = pt->pool;
	tsp_block_t nr_meta, free_meta, nr_data, free_data, held;
	u64 trans_id;
	unsigned int sz = 0;
	char buf[BDEVNAME_SIZE], buf2[BDEVNAME_SIZE];
	int r;

	switch (type) {
	case STATUSTYPE_INFO:
		if (pool_mode(pool) == PM_FAIL) {
			DMEMIT("Fail");
			break;
		}
		if (!(status_flags & STATUS_NOFLUSH_FLAG) && !dm_suspended(ti))
			(void)commit(pool);

		r = tsp_pool_get_metadata_transaction_id(pool->pmd, &trans_id) ?:
		    get_metadata_space(pool, &nr_meta, &free_meta) ?:
		    tsp_pool_get_free_block_count(pool->pmd, &free_data) ?:
		    tsp_pool_get_data_block_count(pool->pmd, &nr_data) ?:
		    tsp_pool_get_metadata_snap(pool->pmd, &held);
		if (r) {
			DMERR_LIMIT("%s: reading the pool's status from its metadata failed: %d",
				    dm_device_name(pool->pool_md), r);
			DMEMIT("Error");
			break;
		}

		DMEMIT("%llu %llu/%llu %llu/%llu ", (unsigned long long)trans_id,
		       (unsigned long long)(nr_meta - free_meta),
		       (unsigned long long)nr_meta,
		       (unsigned long long)(nr_data - free_data),
		       (unsigned long long)nr_data);
		if (held)
			DMEMIT("%llu ", (unsigned long long)held);
		else
			DMEMIT("- ");
		if (pool_mode(pool) == PM_OUT_OF_DATA_SPACE)
			DMEMIT("out_of_data_space ");
		else if (pool_is_read_only(pool))
			DMEMIT("ro ");
		else
			DMEMIT("rw ");
		if (!pool->pf.discard_enabled)
			DMEMIT("ignore_discard ");
		else if (pool->pf.discard_passdown)
			DMEMIT("discard_passdown ");
		else
			DMEMIT("no_discard_passdown ");
		if (pool->pf.error_if_no_space)
			DMEMIT("error_if_no_space ");
		else
			DMEMIT("queue_if_no_space ");
		if (tsp_pool_metadata_needs_check(pool->pmd))
			DMEMIT("needs_check ");
		else
			DMEMIT("- ");
		DMEMIT("%llu ", (unsigned long long)metadata_low_water(nr_meta));
		break;

	case STATUSTYPE_TABLE:
		DMEMIT("%s %s %lu %llu ",
		       format_dev_t(buf, pt->metadata_dev->bdev->bd_dev),
		       format_dev_t(buf2, pt->data_dev->bdev->bd_dev),
		       (unsigned long)pool->sectors_per_block,
		       (unsigned long long)pt->low_water_blocks);
		emit_flags(&pt->requested_pf, result, sz, maxlen);
		break;

	case STATUSTYPE_IMA:
		/* dm core reuses the buffer from target to target. */
		*result = '\0';
		break;
	}
}

static int pool_iterate_devices(struct dm_target *ti,
				iterate_devices_callout_fn fn, void *data)
{
	struct pool_c *pt = ti->private;

	return fn(ti, pt->data_dev, 0, ti->len, data);
}

static bool is_factor(sector_t n, u32 divisor)
{
	return !sector_div(n, divisor);
}

/*
 * Kernels before 6.11 round io_min up to the physical block size when it
 * is set; later ones when the stacked limits are validated.
 */
static void set_io_min(struct queue_limits *limits, unsigned int bytes)
{
#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 11, 0)
	blk_limits_io_min(limits, bytes);
#else
	limits->io_min = bytes;
#endif
}

/*
 * The pool device's limits, which its thin devices stack: dm-thin's.  A
 * bio smaller than a block is cut at a power-of-2 factor of the block
 * size, so that the pieces of one block end on its boundary (a RAID
 * stripe, when the block is one).  The data device's io_opt stays when
 * it is a multiple of the block size (a RAID stripe of several blocks);
 * else the block is the optimal IO.
 */
static void pool_io_hints(struct dm_target *ti, struct queue_limits *limits)
{
	struct pool_c *pt = ti->private;
	struct pool *pool = pt->pool;
	u32 block_sectors = pool->sectors_per_block;
	sector_t io_opt_sectors = limits->io_opt >> SECTOR_SHIFT;

	if (limits->max_sectors < block_sectors) {
		while (!is_factor(block_sectors, limits->max_sectors)) {
			if (is_power_of_2(limits->max_sectors))
				limits->max_sectors--;
			limits->max_sectors = rounddown_pow_of_two(limits->max_sectors);
		}
	}

	if (io_opt_sectors < block_sectors ||
	    !is_factor(io_opt_sectors, block_sectors)) {
		if (is_factor(block_sectors, limits->max_sectors))
			set_io_min(limits, limits->max_sectors << SECTOR_SHIFT);
		else
			set_io_min(limits, block_sectors << SECTOR_SHIFT);
		limits->io_opt = block_sectors << SECTOR_SHIFT;
	}

	/*
	 * A pool passing discards down keeps the data device's discard
	 * limits, which dm core stacked; one that does not pass them down
	 * has none (dm core sees no discard bios).  Only a pool that
	 * ignores discards must stop the data device's granularity from
	 * being stacked over it, as dm-thin.
	 */
	if (!pt->adjusted_pf.discard_enabled)
		limits->discard_granularity = 0;
}

static struct target_type pool_target = {
	.name = "thin-scal-pool",
	.features = DM_TARGET_SINGLETON | DM_TARGET_ALWAYS_WRITEABLE |
		    DM_TARGET_IMMUTABLE,
	.version = {1, 23, 0},
	.module = THIS_MODULE,
	.ctr = pool_ctr,
	.dtr = pool_dtr,
	.map = pool_map,
	.presuspend = pool_presuspend,
	.presuspend_undo = pool_presuspend_undo,
	.postsuspend = pool_postsuspend,
	.preresume = pool_preresume,
	.resume = pool_resume,
	.message = pool_message,
	.status = pool_status,
	.iterate_devices = pool_iterate_devices,
	.io_hints = pool_io_hints,
};

/*----------------------------------------------------------------
 * The thin target
 *--------------------------------------------------------------*/
static void thin_dtr(struct dm_target *ti)
{
	struct thin_c *tc = ti->private;
	struct pool *pool = tc->pool;
	bool resume;

	spin_lock_irq(&pool->lock);
	list_del(&tc->list);
	resume = tc->suspended_by_pool;
	spin_unlock_irq(&pool->lock);
	thin_put(tc);
	wait_for_completion(&tc->can_destroy);
	/* Suspended with the pool, and gone before it resumed: undo that. */
	if (resume)
		dm_internal_resume(tc->thin_md);

	tsp_pool_close_thin_device(tc->td);
	pool_put(tc->pool);
	dm_put_device(ti, tc->pool_dev);
	if (tc->origin_dev)
		dm_put_device(ti, tc->origin_dev);
	kfree(tc);
}

/* The pool whose mapped device is @bdev; takes a reference. */
static struct pool *pool_of_bdev(struct block_device *bdev)
{
	struct pool *pool;

	mutex_lock(&pool_table_mutex);
	list_for_each_entry(pool, &pool_table, list) {
		if (disk_devt(dm_disk(pool->pool_md)) == bdev->bd_dev) {
			pool->ref_count++;
			mutex_unlock(&pool_table_mutex);
			return pool;
		}
	}
	mutex_unlock(&pool_table_mutex);
	return NULL;
}

/*
 * thin-scalable <pool dev> <dev id> [<external origin dev>]
 *
 * The external origin is opened read-only and never written.
 */
static int thin_ctr(struct dm_target *ti, unsigned int argc, char **argv)
{
	struct thin_c *tc;
	unsigned long long dev_id;
	int r;

	if (argc != 2 && argc != 3) {
		ti->error = "Invalid argument count";
		return -EINVAL;
	}
	if (kstrtoull(argv[1], 10, &dev_id) || dev_id > TSP_THIN_MAX_DEV_ID) {
		ti->error = "Invalid device id";
		return -EINVAL;
	}

	tc = kzalloc(sizeof(*tc), GFP_KERNEL);
	if (!tc) {
		ti->error = "Out of memory";
		return -ENOMEM;
	}
	tc->ti = ti;
	tc->thin_md = dm_table_get_md(ti->table);
	tc->dev_id = dev_id;
	refcount_set(&tc->refcount, 1);
	init_completion(&tc->can_destroy);

	if (argc == 3) {
		if (!strcmp(argv[0], argv[2])) {
			ti->error = "Error setting origin device: it is the pool device";
			r = -EINVAL;
			goto bad_free;
		}
		r = dm_get_device(ti, argv[2], OPEN_READ, &tc->origin_dev);
		if (r) {
			ti->error = "Error opening origin device";
			goto bad_free;
		}
	}

	r = dm_get_device(ti, argv[0], dm_table_get_mode(ti->table), &tc->pool_dev);
	if (r) {
		ti->error = "Error opening pool device";
		goto bad_origin;
	}

	tc->pool = pool_of_bdev(tc->pool_dev->bdev);
	if (!tc->pool) {
		ti->error = "Couldn't find pool object";
		r = -EINVAL;
		goto bad_pool_dev;
	}
	if (pool_mode(tc->pool) == PM_FAIL) {
		ti->error = "Couldn't open thin device, Pool is in fail mode";
		r = -EINVAL;
		goto bad_pool;
	}

	r = tsp_pool_open_thin_device(tc->pool->pmd, dev_id, &tc->td);
	if (r) {
		ti->error = "Couldn't open thin internal device";
		goto bad_pool;
	}
	tc->td_fast = tsp_thin_fast_of(tc->td);

	spin_lock_irq(&tc->pool->lock);
	if (tc->pool->suspended) {
		spin_unlock_irq(&tc->pool->lock);
		ti->error = "Unable to activate thin device while pool is suspended";
		r = -EINVAL;
		goto bad_td;
	}
	list_add_tail(&tc->list, &tc->pool->thins);
	spin_unlock_irq(&tc->pool->lock);

	ti->private = tc;
	ti->num_flush_bios = 1;
	ti->flush_supported = true;
	ti->limit_swap_bios = true;
	ti->per_io_data_size = sizeof(struct thin_bio);
	/* A pool's discard support is fixed while it exists (pool_find()). */
	if (tc->pool->pf.discard_enabled) {
		ti->discards_supported = true;
		ti->num_discard_bios = 1;
	}
	return 0;

bad_td:
	tsp_pool_close_thin_device(tc->td);
bad_pool:
	pool_put(tc->pool);
bad_pool_dev:
	dm_put_device(ti, tc->pool_dev);
bad_origin:
	if (tc->origin_dev)
		dm_put_device(ti, tc->origin_dev);
bad_free:
	kfree(tc);
	return r;
}

/* Leave the part of @bio from block @end on to dm core, as a new bio. */
static void cut_bio_at(struct pool *pool, struct bio *bio, tsp_block_t end)
{
	sector_t end_sector = end * pool->sectors_per_block;

	if (bio_end_sector(bio) > end_sector)
		dm_accept_partial_bio(bio, end_sector - bio->bi_iter.bi_sector);
}

/*
 * Fast lookup of @virt for @bio: mapped, cached, and (for a write) not
 * shared.  Caller holds rcu_read_lock().
 *
 * Return: 0 if @virt maps to *@data_block for @bio; -EEXIST if it is
 * mapped but shared and @bio is a write; -EWOULDBLOCK if not cached.
 * Always inline, with the cache's lookup: a call would cost the fast
 * path a prologue and its result on the stack.
 */
static __always_inline int find_block_fast(struct thin_c *tc,
					   struct bio *bio, tsp_block_t virt,
					   tsp_block_t *data_block)
{
	struct tsp_thin_lookup_result result;

	if (tsp_thin_find_block_fast(tc->td_fast, virt, &result))
		return -EWOULDBLOCK;
	if (bio_data_dir(bio) == WRITE && result.shared)
		return -EEXIST;
	*data_block = result.block;
	return 0;
}

/*
 * The fast path: remap @bio (@tb its per-bio data) if its first block is
 * mapped and cached.  A bio over several blocks keeps the run of them
 * that are mapped to consecutive data blocks; dm core sends the rest as
 * a new bio.  The lookups and the epoch entry are one RCU read-side
 * section (see "Deferred free").
 *
 * Return: 0 if @bio was remapped, else find_block_fast()'s error for its
 * first block.
 */
static int map_fast(struct thin_c *tc, struct bio *bio, struct thin_bio *tb)
{
	struct pool *pool = tc->pool;
	tsp_block_t virt = bio_block(pool, bio);
	tsp_block_t last = sector_block(pool, bio_end_sector(bio) - 1);
	tsp_block_t first, next, n;
	int r;

	rcu_read_lock();
	r = find_block_fast(tc, bio, virt, &first);
	if (r) {
		rcu_read_unlock();
		return r;
	}
	for (n = 1; virt + n <= last; n++)
		if (find_block_fast(tc, bio, virt + n, &next) || next != first + n)
			break;
	cut_bio_at(pool, bio, virt + n);
	epoch_enter(pool, tb);
	rcu_read_unlock();

	remap(pool, bio, first);
	this_cpu_inc(pool->stats->fast);
	return 0;
}

/*
 * Provision the block of @bio (@tb its per-bio data) here in map, without
 * handing it to a worker and back, if that needs no wait: @bio is a plain
 * write to an unmapped block that zeroing and an external origin leave
 * alone, the block's worker is between passes (it owns the block's jobs),
 * and the metadata can map the block without IO and without waiting for
 * its lock (tsp_thin_provision_nowait()), leaving more free blocks than
 * the low water mark (the worker raises the event) and the metadata
 * reserve free (the worker switches the pool's mode).  Nothing may be
 * waited for here that could wait for IO: bios issued under a bio
 * submission start only when the map function has returned, and a
 * worker's commit waits for the IO in flight.  Maps, then lets dm core
 * issue @bio, as dm-thin's worker does for a pool that does not zero
 * new blocks.  Not inline: its locals, whose addresses it passes on,
 * would give thin_map() a stack canary, which the fast path would pay.
 *
 * Return: true if @bio was remapped to its new block.
 */
static noinline bool provision_in_map(struct thin_c *tc, struct bio *bio,
				      struct thin_bio *tb)
{
	struct pool *pool = tc->pool;
	tsp_block_t virt = bio_block(pool, bio), data;
	struct worker *w;
	int r;

	if (!may_map_before_write(tc, bio, virt))
		return false;

	w = worker_for(tc, virt);
	if (!mutex_trylock(&w->pass_lock))
		return false;
	r = find_job(w, tc, virt) ? -EBUSY :
	    tsp_thin_provision_nowait(tc->td, virt, pool->low_water_blocks,
				      READ_ONCE(pool->metadata_reserve_blocks),
				      &data);
	/* Before the worker may run a discard of the block. */
	if (!r)
		count_in_epoch(pool, bio);
	mutex_unlock(&w->pass_lock);

	if (r) {
		/* The worker meets the failed metadata and deals with it. */
		if (r != -EBUSY && r != -EEXIST && r != -EWOULDBLOCK)
			DMERR_LIMIT("%s: provisioning block %llu in map failed: %d",
				    dm_device_name(pool->pool_md),
				    (unsigned long long)virt, r);
		return false;
	}
	remap(pool, bio, data);
	this_cpu_inc(pool->stats->provisioned_in_map);
	return true;
}

/*
 * The map path.  The fast path remaps reads and plain writes to blocks
 * this device owns alone without taking any lock; a plain write may be
 * provisioned here (provision_in_map()); everything else is deferred to
 * the worker that owns its block, one block per bio (a discard: one
 * region).
 */
static int thin_map(struct dm_target *ti, struct bio *bio)
{
	struct thin_c *tc = ti->private;
	struct pool *pool = tc->pool;
	struct thin_bio *tb = thin_bio(bio);

	tb->tc = tc;
	tb->epoch = -1;
	bio->bi_iter.bi_sector = dm_target_offset(ti, bio->bi_iter.bi_sector);

	if (bio_op(bio) == REQ_OP_DISCARD) {
		/* One region, so that one worker owns all of its blocks. */
		cut_bio_at(pool, bio, (bio_block(pool, bio) | (REGION_BLOCKS - 1)) + 1);
	} else if (bio_has_data(bio)) {
		bool plain = !bio_needs_commit(bio) && pool_mode(pool) < PM_FAIL;
		int r = plain ? map_fast(tc, bio, tb) : -EWOULDBLOCK;

		if (!r)
			return DM_MAPIO_REMAPPED;
		cut_bio_at(pool, bio, bio_block(pool, bio) + 1);
		/* A block known to be mapped is shared: the worker's. */
		if (plain && r != -EEXIST && provision_in_map(tc, bio, tb))
			return DM_MAPIO_REMAPPED;
	}

	tb->cpu = raw_smp_processor_id();	/* see hand_over_bio() */
	defer_bio(pool, bio);
	return DM_MAPIO_SUBMITTED;
}

static int thin_endio(struct dm_target *ti, struct bio *bio, blk_status_t *err)
{
	struct thin_c *tc = ti->private;

	epoch_leave(tc->pool, bio);
	return DM_ENDIO_DONE;
}

static void thin_presuspend(struct dm_target *ti)
{
	struct thin_c *tc = ti->private;
	struct pool *pool = tc->pool;
	struct bio_list bios, keep;
	struct bio *bio;

	if (!dm_noflush_suspending(ti))
		return;

	/*
	 * Hand queued out-of-space bios of this device back to dm core, and
	 * those that run out of space until the suspend is done (still
	 * deferred or waiting for a job now).
	 */
	bio_list_init(&keep);
	spin_lock_irq(&pool->lock);
	tc->requeue_no_space = true;
	bios = pool->retry_list;
	bio_list_init(&pool->retry_list);
	while ((bio = bio_list_pop(&bios))) {
		if (thin_bio(bio)->tc == tc) {
			bio->bi_status = BLK_STS_DM_REQUEUE;
			bio_list_add(&keep, bio);
		} else {
			bio_list_add(&pool->retry_list, bio);
		}
	}
	spin_unlock_irq(&pool->lock);
	while ((bio = bio_list_pop(&keep)))
		bio_endio(bio);
}

static int thin_preresume(struct dm_target *ti)
{
	struct thin_c *tc = ti->private;

	if (tc->origin_dev)
		tc->origin_size = bdev_nr_sectors(tc->origin_dev->bdev);
	return 0;
}

static void stop_requeueing(struct thin_c *tc)
{
	spin_lock_irq(&tc->pool->lock);
	tc->requeue_no_space = false;
	spin_unlock_irq(&tc->pool->lock);
}

/* The suspend failed after thin_presuspend(): queue out-of-space IO again. */
static void thin_presuspend_undo(struct dm_target *ti)
{
	stop_requeueing(ti->private);
}

static void thin_postsuspend(struct dm_target *ti)
{
	struct thin_c *tc = ti->private;

	flush_workqueue(tc->pool->wq);
	stop_requeueing(tc);
}

static void thin_status(struct dm_target *ti, status_type_t type,
			unsigned int status_flags, char *result,
			unsigned int maxlen)
{
	struct thin_c *tc = ti->private;
	struct pool *pool = tc->pool;
	tsp_block_t mapped, highest;
	unsigned int sz = 0;
	char buf[BDEVNAME_SIZE];
	int r;

	if (pool_mode(pool) == PM_FAIL) {
		DMEMIT("Fail");
		return;
	}

	switch (type) {
	case STATUSTYPE_INFO:
		r = tsp_thin_get_mapped_count(tc->td, &mapped) ?:
		    tsp_thin_get_highest_mapped_block(tc->td, &highest);
		if (r && r != -ENODATA) {
			DMERR_LIMIT("%s: reading the thin device's status failed: %d",
				    dm_device_name(dm_table_get_md(ti->table)), r);
			DMEMIT("Error");
			break;
		}
		DMEMIT("%llu ", (unsigned long long)(mapped * pool->sectors_per_block));
		if (!r)
			DMEMIT("%llu", (unsigned long long)((highest + 1) *
					pool->sectors_per_block - 1));
		else
			DMEMIT("-");
		break;

	case STATUSTYPE_TABLE:
		DMEMIT("%s %lu", format_dev_t(buf, tc->pool_dev->bdev->bd_dev),
		       (unsigned long)tc->dev_id);
		if (tc->origin_dev)
			DMEMIT(" %s", format_dev_t(buf, tc->origin_dev->bdev->bd_dev));
		break;

	case STATUSTYPE_IMA:
		*result = '\0';
		break;
	}
}

static int thin_iterate_devices(struct dm_target *ti,
				iterate_devices_callout_fn fn, void *data)
{
	struct thin_c *tc = ti->private;
	struct pool *pool = tc->pool;
	sector_t blocks = 0;

	/* pool->ti: none before the pool's first resume, or after its dtr. */
	mutex_lock(&pool->mode_lock);
	if (pool->ti)
		blocks = pool->ti->len;
	mutex_unlock(&pool->mode_lock);
	(void)sector_div(blocks, pool->sectors_per_block);
	if (!blocks)
		return 0;
	return fn(ti, tc->pool_dev, 0, blocks * pool->sectors_per_block, data);
}

static void thin_io_hints(struct dm_target *ti, struct queue_limits *limits)
{
	struct thin_c *tc = ti->private;
	struct pool *pool = tc->pool;

	/*
	 * Discards are unmapped by the pool whatever the data device
	 * supports.  6.1 reads max_discard_sectors; later kernels derive it
	 * from the hardware limit.
	 */
	if (pool->pf.discard_enabled) {
		limits->discard_granularity = pool->sectors_per_block << SECTOR_SHIFT;
		limits->max_hw_discard_sectors = pool->sectors_per_block * 1024;
		limits->max_discard_sectors = limits->max_hw_discard_sectors;
	}
}

static struct target_type thin_target = {
	.name = "thin-scalable",
	.version = {1, 23, 0},
	.module	= THIS_MODULE,
	.ctr = thin_ctr,
	.dtr = thin_dtr,
	.map = thin_map,
	.end_io = thin_endio,
	.presuspend = thin_presuspend,
	.presuspend_undo = thin_presuspend_undo,
	.postsuspend = thin_postsuspend,
	.preresume = thin_preresume,
	.status = thin_status,
	.iterate_devices = thin_iterate_devices,
	.io_hints = thin_io_hints,
};

static int __init tsp_init(void)
{
	int r;

	zeroes = alloc_pages(GFP_KERNEL | __GFP_ZERO | __GFP_COMP, ZEROES_ORDER);
	if (!zeroes)
		return -ENOMEM;
	job_cache = KMEM_CACHE(job, 0);
	if (!job_cache) {
		r = -ENOMEM;
		goto bad_zeroes;
	}

	r = dm_register_target(&pool_target);
	if (r)
		goto bad_cache;
	r = dm_register_target(&thin_target);
	if (r)
		goto bad_pool;
	return 0;

bad_pool:
	dm_unregister_target(&pool_target);
bad_cache:
	kmem_cache_destroy(job_cache);
bad_zeroes:
	__free_pages(zeroes, ZEROES_ORDER);
	return r;
}

static void __exit tsp_exit(void)
{
	dm_unregister_target(&thin_target);
	dm_unregister_target(&pool_target);
	kmem_cache_destroy(job_cache);
	__free_pages(zeroes, ZEROES_ORDER);
}

module_init(tsp_init);
module_exit(tsp_exit);

MODULE_DESCRIPTION(DM_NAME " thin provisioning target with scalable metadata");
MODULE_AUTHOR("thin-scalable developers");
MODULE_LICENSE("GPL");
/* dm core and lvm2 modprobe dm-<target name>; thin-scalable is ours. */
MODULE_ALIAS("dm-thin-scal-pool");
