// SPDX-License-Identifier: GPL-2.0-only
/*
 * mapping-cache.c - the RCU mapping cache in front of the btrees.
 *
 * Why: dm-thin's map path takes the pool metadata lock and the block
 * manager's locks for every IO.  Here a provisioned block is found by a
 * hash lookup that takes no lock at all, so many CPUs can map IO at once
 * without their caches fighting over a lock's cache line.
 *
 * Layout:
 *
 *   tables[]   per shard, an RCU pointer to its hash table (an array of
 *              hlist heads); read by lookups, changed when a shard grows
 *   shards[]   per shard: spinlock, CLOCK list, counters; touched by
 *              writers only, so lookups never share their cache lines
 *   stats      per-CPU hit and miss counters, written by lookups
 *
 *       hash(dev, virt) = | shard bits | bucket bits | ...unused...  |
 *
 * The top bits of a multiplicative hash pick the shard, the next ones
 * the bucket in the shard's table.  There are at least as many shards as
 * possible CPUs (at least MC_MIN_SHARDS), fewer only when the budget
 * cannot give every shard MC_MIN_SHARD_ENTRIES entries.
 *
 * Growth: a shard's table starts at 2^MC_MIN_TABLE_BITS buckets, so an
 * idle pool costs a few KiB whatever its budget, and grows fourfold
 * whenever the shard holds more than two entries per bucket, up to one
 * bucket per entry the budget allows (at most 2^MC_MAX_TABLE_BITS).
 * Growing happens in an insert, under the shard lock, with GFP_NOWAIT;
 * if that fails the shard keeps its table (longer chains) and tries
 * again at twice as many entries.  Entries move one at a time from the
 * old chains to the new table, which is published when complete; the old
 * table is freed after a grace period.  A lookup on the old table while
 * this happens may follow a moved entry into a new chain: it still ends
 * (every chain ends in NULL, no entry is freed) and still compares keys,
 * so the worst it can do is miss.
 *
 * An entry is immutable from the moment it is published until it is
 * freed: key (dev, virt) and value (block, time).  Changing a value
 * replaces the entry (hlist_replace_rcu()), so a reader sees the old
 * value or the new one, never a torn mix, on any architecture.  Removed
 * entries are freed with kfree_rcu(): a reader standing on one may finish
 * with it.
 *
 * Eviction: each shard keeps its entries on a list in CLOCK order; the
 * hand is the head of the list.  A lookup that hits sets the entry's
 * referenced byte, but only if it is clear, so a hot entry's cache line
 * is written once per sweep rather than once per lookup.  When a full
 * shard needs room, the hand clears referenced entries and moves them to
 * the tail, and evicts the first entry it finds clear (or, if readers
 * keep re-referencing everything, the head after two sweeps' worth of
 * steps).  New entries go to the tail, unreferenced.
 *
 * Budget: an entry costs its slab object plus one bucket head (a full
 * table holds between one half and one head per entry), so max_entries =
 * budget / (object + head).  The shard and per-CPU structs are not
 * counted.  A budget too small for one entry gives a cache that never
 * caches.
 *
 * Locking:
 *
 *   what                           readers (lookup)     writers
 *   tables[], and the chains       rcu_dereference      shard lock + rcu_assign
 *   entry key and value            plain (immutable)    set before publishing
 *   entry->referenced              READ/WRITE_ONCE      shard lock, WRITE_ONCE
 *   entry->clock, shard fields     never                shard lock
 *   shard->nr                      never                shard lock (WRITE_ONCE:
 *                                                       range invalidation
 *                                                       reads it unlocked)
 *   stats (per CPU)                this_cpu_inc         summed by get_stats
 *   table->bits                    plain                set before publishing
 *   geometry (shard_bits, ...)     plain                set at create
 *
 * Entries never move between shards, and a writer holds one shard lock at
 * a time, so there is no lock order.
 */
#define DM_MSG_PREFIX "thin-scalable mapping cache"

#include "mapping-cache.h"

#define MC_MIN_SHARDS 64
#define MC_MIN_SHARD_ENTRIES 16
#define MC_MIN_TABLE_BITS 4
#define MC_MAX_TABLE_BITS 17		/* 1 MiB of heads per shard */
#define MC_GROW_BITS 2
/* Invalidate a range key by key when it is at most this long. */
#define MC_RANGE_BY_KEY 16
/* Per shard, so the count fits an unsigned int with room to spare. */
#define MC_MAX_SHARD_ENTRIES (1U << 30)
#define MC_HASH_MULT 0x9e3779b97f4a7c15ULL	/* 2^64 / golden ratio */

/**
 * struct mc_entry - one cached mapping
 * @hash: in its bucket's chain; readers walk it
 * @clock: in its shard's CLOCK list, while hashed (writers only)
 * @rcu: for kfree_rcu(), once unhashed and off the CLOCK list
 * @dev: thin device id
 * @virt: virtual block
 * @block: data block
 * @time: mapping time
 * @referenced: CLOCK's bit: set by lookups, cleared by the hand
 */
struct mc_entry {
	struct hlist_node hash;
	union {
		struct list_head clock;
		struct rcu_head rcu;
	};
	u64 dev;
	u64 virt;
	u64 block;
	u32 time;
	u8 referenced;
};

/**
 * struct mc_table - one shard's hash table
 * @bits: log2 of the number of buckets
 * @buckets: chains of struct mc_entry (a separate allocation, so that its
 *	size is a power of two)
 * @rcu: for freeing it once replaced
 */
struct mc_table {
	unsigned int bits;
	struct hlist_head *buckets;
	struct rcu_head rcu;
};

/**
 * struct mc_shard - what the writers of one shard share
 * @lock: protects everything here, the shard's table pointer and chains
 * @clock: entries in CLOCK order, the hand at the head
 * @nr: entries in the shard
 * @max: entries the shard may hold
 * @max_bits: the largest table the shard may grow to
 * @grow_at: grow the table when @nr exceeds this
 * @evictions: entries CLOCK dropped
 */
struct mc_shard {
	spinlock_t lock;
	struct list_head clock;
	unsigned int nr;
	unsigned int max;
	unsigned int max_bits;
	unsigned int grow_at;
	u64 evictions;
} ____cacheline_aligned_in_smp;

struct mc_cpu_stats {
	u64 hits;
	u64 misses;
};

struct tsp_mapping_cache {
	/* Set at create, read by everybody. */
	unsigned int shard_bits;	/* log2 of nr_shards */
	unsigned int nr_shards;
	u64 max_entries;
	struct mc_cpu_stats __percpu *stats;
	struct mc_table __rcu **tables;	/* per shard */
	struct mc_shard *shards;
};

/* Bytes one entry costs: its slab object and a bucket head. */
static u64 mc_entry_cost(void)
{
	return round_up(sizeof(struct mc_entry), 32) + sizeof(struct hlist_head);
}

static u64 mc_hash(u64 dev, u64 virt)
{
	/* Injective for virt < 2^40 and 24-bit ids; the top bits are used. */
	return (virt ^ (dev << 40)) * MC_HASH_MULT;
}

static unsigned int mc_shard_index(const struct tsp_mapping_cache *mc, u64 h)
{
	return mc->shard_bits ? h >> (64 - mc->shard_bits) : 0;
}

static struct hlist_head *mc_bucket(const struct tsp_mapping_cache *mc,
				    struct mc_table *t, u64 h)
{
	h <<= mc->shard_bits;
	return &t->buckets[t->bits ? h >> (64 - t->bits) : 0];
}

static struct mc_table *mc_table_alloc(unsigned int bits, gfp_t gfp)
{
	struct mc_table *t = kmalloc(sizeof(*t), gfp);

	if (!t)
		return NULL;
	t->bits = bits;
	t->buckets = kcalloc(1U << bits, sizeof(struct hlist_head), gfp);
	if (!t->buckets) {
		kfree(t);
		return NULL;
	}
	return t;
}

static void mc_table_free(struct mc_table *t)
{
	kfree(t->buckets);
	kfree(t);
}

/* RCU callback: a replaced table, once no lookup can be on it. */
static void mc_table_free_rcu(struct rcu_head *rcu)
{
	mc_table_free(container_of(rcu, struct mc_table, rcu));
}

/* The shard's table, for the holder of its lock. */
static struct mc_table *__table(struct tsp_mapping_cache *mc,
				struct mc_shard *shard)
{
	lockdep_assert_held(&shard->lock);
	return rcu_dereference_protected(mc->tables[shard - mc->shards],
					 lockdep_is_held(&shard->lock));
}

static unsigned int mc_grow_at(unsigned int bits, unsigned int max_bits)
{
	return bits < max_bits ? 2U << bits : UINT_MAX;
}

/**
 * tsp_mc_create - make an empty cache
 * @budget: bytes the entries and the bucket array may take
 * @result: the new cache
 *
 * Context: process, may sleep (GFP_KERNEL).
 *
 * Return: 0, or -ENOMEM.
 */
int tsp_mc_create(u64 budget, struct tsp_mapping_cache **result)
{
	unsigned int nr_shards, i, bits, max_bits;
	struct tsp_mapping_cache *mc;
	u64 max_entries, per_shard;

	max_entries = div_u64(budget, (u32)mc_entry_cost());
	nr_shards = max_t(unsigned int, MC_MIN_SHARDS,
			  roundup_pow_of_two(num_possible_cpus()));
	while (nr_shards > 1 &&
	       max_entries < (u64)nr_shards * MC_MIN_SHARD_ENTRIES)
		nr_shards >>= 1;
	per_shard = min_t(u64, div_u64(max_entries, nr_shards),
			  MC_MAX_SHARD_ENTRIES);

	/* Full, a table has between one and two entries per bucket. */
	max_bits = per_shard ? min_t(unsigned int, ilog2(per_shard),
				     MC_MAX_TABLE_BITS) : 0;
	bits = min_t(unsigned int, max_bits, MC_MIN_TABLE_BITS);

	mc = kzalloc(sizeof(*mc), GFP_KERNEL);
	if (!mc)
		return -ENOMEM;
	mc->nr_shards = nr_shards;
	mc->shard_bits = ilog2(nr_shards);
	mc->max_entries = per_shard * nr_shards;

	mc->shards = kcalloc(nr_shards, sizeof(struct mc_shard), GFP_KERNEL);
	if (!mc->shards)
		goto bad_shards;
	mc->tables = kcalloc(nr_shards, sizeof(*mc->tables), GFP_KERNEL);
	if (!mc->tables)
		goto bad_tables;
	mc->stats = alloc_percpu(struct mc_cpu_stats);
	if (!mc->stats)
		goto bad_stats;
	for (i = 0; i < nr_shards; i++) {
		struct mc_table *t = mc_table_alloc(bits, GFP_KERNEL);

		if (!t)
			goto bad_table;
		RCU_INIT_POINTER(mc->tables[i], t);
		spin_lock_init(&mc->shards[i].lock);
		INIT_LIST_HEAD(&mc->shards[i].clock);
		mc->shards[i].max = per_shard;
		mc->shards[i].max_bits = max_bits;
		mc->shards[i].grow_at = mc_grow_at(bits, max_bits);
	}
	*result = mc;
	return 0;

bad_table:
	while (i--)
		mc_table_free(rcu_dereference_protected(mc->tables[i], true));
	free_percpu(mc->stats);
bad_stats:
	kfree(mc->tables);
bad_tables:
	kfree(mc->shards);
bad_shards:
	kfree(mc);
	return -ENOMEM;
}

/**
 * tsp_mc_destroy - free a cache and every entry in it
 * @mc: the cache, or NULL
 *
 * The caller guarantees that nobody uses @mc any more, lookups included
 * (after unpublishing it, wait for a grace period first).  Entries still
 * in it are freed at once.  Then rcu_barrier() waits for the tables that
 * growing replaced: their callback is this module's code, so it must
 * have run before the module can go.  (In the kernel, entries handed to
 * kfree_rcu() need nothing of ours and are not waited for; in userspace
 * rcu_barrier() runs every queued free, so tests can count leaks.)
 *
 * Context: process, may sleep.
 */
void tsp_mc_destroy(struct tsp_mapping_cache *mc)
{
	struct mc_entry *e, *tmp;
	unsigned int i;

	if (!mc)
		return;
	for (i = 0; i < mc->nr_shards; i++) {
		list_for_each_entry_safe(e, tmp, &mc->shards[i].clock, clock)
			kfree(e);
		mc_table_free(rcu_dereference_protected(mc->tables[i], true));
	}
	rcu_barrier();
	free_percpu(mc->stats);
	kfree(mc->tables);
	kfree(mc->shards);
	kfree(mc);
}

/**
 * tsp_mc_lookup - find a cached mapping
 * @mc: the cache
 * @dev: thin device id
 * @virt: virtual block
 * @result: out, the mapping on a hit
 *
 * Context: any; inside the caller's rcu_read_lock(), which keeps @mc's
 * tables and entries alive while it runs.  Never sleeps and takes no
 * lock; writes only this CPU's counters and, the first time an entry is
 * hit after CLOCK cleared it, the entry's referenced byte.
 *
 * Return: true on a hit.  A hit is a mapping the cache held at some
 * moment during the call: an update that completed before the call
 * started is seen, one racing with it may or may not be.
 */
bool tsp_mc_lookup(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		   struct tsp_mc_mapping *result)
{
	u64 h = mc_hash(dev, virt);
	struct mc_table *t;
	struct mc_entry *e;
	bool hit = false;

	RCU_LOCKDEP_WARN(!rcu_read_lock_held(), "mapping cache lookup outside RCU");
	t = rcu_dereference(mc->tables[mc_shard_index(mc, h)]);
	hlist_for_each_entry_rcu(e, mc_bucket(mc, t, h), hash) {
		if (e->virt == virt && e->dev == dev) {
			result->block = e->block;
			result->time = e->time;
			if (!READ_ONCE(e->referenced))
				WRITE_ONCE(e->referenced, 1);
			hit = true;
			break;
		}
	}
	if (hit)
		this_cpu_inc(mc->stats->hits);
	else
		this_cpu_inc(mc->stats->misses);
	return hit;
}

static struct mc_entry *__find(struct tsp_mapping_cache *mc,
			       struct mc_shard *shard, u64 h, u64 dev, u64 virt)
{
	struct mc_entry *e;

	hlist_for_each_entry(e, mc_bucket(mc, __table(mc, shard), h), hash)
		if (e->virt == virt && e->dev == dev)
			return e;
	return NULL;
}

/*
 * Move @e, which lookups may be standing on, from its chain to the head
 * of @to.  Unlike hlist_add_head_rcu(), whose node is not yet visible,
 * @e's next pointer is published: a lookup standing on @e then goes on
 * along either chain.
 */
static void __move_entry(struct mc_entry *e, struct hlist_head *to)
{
	struct hlist_node *first = to->first;

	hlist_del_rcu(&e->hash);
	rcu_assign_pointer(hlist_next_rcu(&e->hash), first);
	e->hash.pprev = &to->first;
	if (first)
		first->pprev = &e->hash.next;
	rcu_assign_pointer(hlist_first_rcu(to), &e->hash);
}

/*
 * Give the shard a table MC_GROW_BITS larger, moving every entry (see
 * "Growth" at the top).  No change if the allocation fails.
 */
static void __grow(struct tsp_mapping_cache *mc, struct mc_shard *shard)
{
	struct mc_table *old = __table(mc, shard), *new;
	unsigned int bits, i;
	struct hlist_node *n;
	struct mc_entry *e;

	bits = min(old->bits + MC_GROW_BITS, shard->max_bits);
	new = mc_table_alloc(bits, GFP_NOWAIT | __GFP_NOWARN);
	if (!new) {
		shard->grow_at = shard->nr < UINT_MAX / 2 ? 2 * shard->nr : UINT_MAX;
		return;
	}
	for (i = 0; i < (1U << old->bits); i++) {
		while ((n = old->buckets[i].first)) {
			e = hlist_entry(n, struct mc_entry, hash);
			__move_entry(e, mc_bucket(mc, new,
						  mc_hash(e->dev, e->virt)));
		}
	}
	rcu_assign_pointer(mc->tables[shard - mc->shards], new);
	call_rcu(&old->rcu, mc_table_free_rcu);
	shard->grow_at = mc_grow_at(bits, shard->max_bits);
}

/* Unhash @e; it is freed once current readers are done with it. */
static void __remove(struct mc_shard *shard, struct mc_entry *e)
{
	lockdep_assert_held(&shard->lock);
	hlist_del_rcu(&e->hash);
	list_del(&e->clock);
	WRITE_ONCE(shard->nr, shard->nr - 1);
	kfree_rcu(e, rcu);
}

/* Make room for one entry in a non-empty shard: one step of CLOCK. */
static void __evict_one(struct mc_shard *shard)
{
	unsigned int steps = 2 * shard->nr;
	struct mc_entry *e;

	lockdep_assert_held(&shard->lock);
	for (;;) {
		e = list_first_entry(&shard->clock, struct mc_entry, clock);
		if (!READ_ONCE(e->referenced) || !steps--)
			break;
		WRITE_ONCE(e->referenced, 0);
		list_move_tail(&e->clock, &shard->clock);
	}
	__remove(shard, e);
	shard->evictions++;
}

/**
 * tsp_mc_insert - cache a mapping, replacing any for the same block
 * @mc: the cache
 * @dev: thin device id
 * @virt: virtual block
 * @block: data block
 * @time: mapping time
 *
 * Afterwards the cache holds either this mapping for (@dev, @virt) or
 * none: if the allocation fails (GFP_NOWAIT) an older entry for the key
 * is removed rather than left behind.  A full shard evicts one entry.
 *
 * Context: process (not interrupt); does not sleep.  Takes the key's
 * shard lock.
 *
 * Return: true if the mapping is now cached.
 */
bool tsp_mc_insert(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		   u64 block, u32 time)
{
	u64 h = mc_hash(dev, virt);
	struct mc_shard *shard = &mc->shards[mc_shard_index(mc, h)];
	struct mc_entry *old, *e;

	if (!shard->max)
		return false;

	spin_lock(&shard->lock);
	old = __find(mc, shard, h, dev, virt);
	if (old && old->block == block && old->time == time) {
		spin_unlock(&shard->lock);
		return true;
	}

	e = kmalloc(sizeof(*e), GFP_NOWAIT | __GFP_NOWARN);
	if (!e) {
		if (old)
			__remove(shard, old);
		spin_unlock(&shard->lock);
		return false;
	}
	e->dev = dev;
	e->virt = virt;
	e->block = block;
	e->time = time;
	e->referenced = 0;

	if (old) {
		/* Same chain position and CLOCK position: one atomic switch. */
		hlist_replace_rcu(&old->hash, &e->hash);
		list_replace(&old->clock, &e->clock);
		kfree_rcu(old, rcu);
	} else {
		if (shard->nr >= shard->max)
			__evict_one(shard);
		hlist_add_head_rcu(&e->hash, mc_bucket(mc, __table(mc, shard), h));
		list_add_tail(&e->clock, &shard->clock);
		WRITE_ONCE(shard->nr, shard->nr + 1);
		if (shard->nr > shard->grow_at)
			__grow(mc, shard);
	}
	spin_unlock(&shard->lock);
	return true;
}

/**
 * tsp_mc_invalidate - forget one virtual block's mapping
 * @mc: the cache
 * @dev: thin device id
 * @virt: virtual block
 *
 * Lookups that start after this returns miss; one already running may
 * still return the old mapping (see dm-thin-metadata.h).
 *
 * Context: process; does not sleep.  Takes the key's shard lock.
 */
void tsp_mc_invalidate(struct tsp_mapping_cache *mc, u64 dev, u64 virt)
{
	u64 h = mc_hash(dev, virt);
	struct mc_shard *shard = &mc->shards[mc_shard_index(mc, h)];
	struct mc_entry *e;

	if (!shard->max)
		return;
	spin_lock(&shard->lock);
	e = __find(mc, shard, h, dev, virt);
	if (e)
		__remove(shard, e);
	spin_unlock(&shard->lock);
}

/* Remove, shard by shard, every entry @match() picks. */
static void mc_remove_matching(struct tsp_mapping_cache *mc,
			       bool (*match)(const struct mc_entry *e,
					     u64 dev, u64 begin, u64 end),
			       u64 dev, u64 begin, u64 end)
{
	struct mc_entry *e, *tmp;
	struct mc_shard *shard;
	unsigned int i;

	for (i = 0; i < mc->nr_shards; i++) {
		shard = &mc->shards[i];
		spin_lock(&shard->lock);
		list_for_each_entry_safe(e, tmp, &shard->clock, clock)
			if (match(e, dev, begin, end))
				__remove(shard, e);
		spin_unlock(&shard->lock);
		cond_resched();
	}
}

static bool match_range(const struct mc_entry *e, u64 dev, u64 begin, u64 end)
{
	return e->dev == dev && e->virt >= begin && e->virt < end;
}

static bool match_dev(const struct mc_entry *e, u64 dev, u64 begin, u64 end)
{
	return e->dev == dev;
}

static bool match_all(const struct mc_entry *e, u64 dev, u64 begin, u64 end)
{
	return true;
}

/* Entries cached now, read without the shard locks: an estimate. */
static u64 mc_nr_entries(struct tsp_mapping_cache *mc)
{
	u64 nr = 0;
	unsigned int i;

	for (i = 0; i < mc->nr_shards; i++)
		nr += READ_ONCE(mc->shards[i].nr);
	return nr;
}

/**
 * tsp_mc_invalidate_range - forget the mappings of [@begin, @end) of a device
 * @mc: the cache
 * @dev: thin device id
 * @begin: first virtual block
 * @end: one past the last
 *
 * Short ranges (up to the number of cached entries) are removed key by
 * key; longer ones by a walk of every shard's entries, whichever is less
 * work.  Same visibility as tsp_mc_invalidate().
 *
 * Context: process; may reschedule between shards (cond_resched()).
 * Takes each shard lock in turn.
 */
void tsp_mc_invalidate_range(struct tsp_mapping_cache *mc, u64 dev,
			     u64 begin, u64 end)
{
	u64 virt;

	if (begin >= end)
		return;
	if (end - begin <= MC_RANGE_BY_KEY || end - begin <= mc_nr_entries(mc)) {
		for (virt = begin; virt < end; virt++)
			tsp_mc_invalidate(mc, dev, virt);
		return;
	}
	mc_remove_matching(mc, match_range, dev, begin, end);
}

/**
 * tsp_mc_invalidate_dev - forget every mapping of a device
 * @mc: the cache
 * @dev: thin device id
 *
 * Context: process; may reschedule between shards.  Walks every entry.
 */
void tsp_mc_invalidate_dev(struct tsp_mapping_cache *mc, u64 dev)
{
	mc_remove_matching(mc, match_dev, dev, 0, 0);
}

/**
 * tsp_mc_clear - forget everything
 * @mc: the cache
 *
 * The counters (hits, misses, evictions) are kept.
 *
 * Context: process; may reschedule between shards.
 */
void tsp_mc_clear(struct tsp_mapping_cache *mc)
{
	mc_remove_matching(mc, match_all, 0, 0, 0);
}

/**
 * tsp_mc_get_stats - read the counters
 * @mc: the cache
 * @stats: out
 *
 * The per-CPU counters are summed without stopping lookups, so hits and
 * misses are a moment's approximation.
 *
 * Context: process; does not sleep.  Takes each shard lock in turn.
 */
void tsp_mc_get_stats(struct tsp_mapping_cache *mc, struct tsp_mc_stats *stats)
{
	struct mc_cpu_stats *s;
	unsigned int i;
	int cpu;

	memset(stats, 0, sizeof(*stats));
	stats->max_entries = mc->max_entries;
	for_each_possible_cpu(cpu) {
		s = per_cpu_ptr(mc->stats, cpu);
		stats->hits += READ_ONCE(s->hits);
		stats->misses += READ_ONCE(s->misses);
	}
	for (i = 0; i < mc->nr_shards; i++) {
		spin_lock(&mc->shards[i].lock);
		stats->entries += mc->shards[i].nr;
		stats->evictions += mc->shards[i].evictions;
		stats->buckets += 1ULL << __table(mc, &mc->shards[i])->bits;
		spin_unlock(&mc->shards[i].lock);
	}
}
