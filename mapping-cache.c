// SPDX-License-Identifier: GPL-2.0-only
/*
 * mapping-cache.c - the RCU mapping cache in front of the btrees.
 *
 * Why: dm-thin's map path takes the pool metadata lock and the block
 * manager's locks for every IO.  Here a provisioned block is found by a
 * hash lookup that takes no lock at all, so many CPUs can map IO at once
 * without their caches fighting over a lock's cache line.
 *
 * Layout: per shard, a set-associative hash table.
 *
 *   tables[]   per shard, an RCU pointer to its table: an array of
 *              buckets, each one cache line with room for TSP_MC_WAYS
 *              mappings and a sequence count
 *   shards[]   per shard: spinlock and counters; touched by writers only,
 *              so lookups never share their cache lines
 *   stats      per-CPU hit and miss counters, written by lookups
 *
 *       key   = dev << 40 | virt
 *       group = key >> TSP_MC_GROUP_BITS
 *               (2^TSP_MC_GROUP_BITS neighbouring blocks)
 *
 *       group * MULT1 = | shard bits | first bucket bits  | ... |
 *       group * MULT2 = | second bucket bits |   ...unused...   |
 *       (MULT1 and MULT2: TSP_MC_HASH_MULT1 and TSP_MC_HASH_MULT2)
 *
 *       bucket index = hash bits ^ (key % 2^TSP_MC_GROUP_BITS)
 *
 * A mapping lives in one of its key's two buckets in its shard's table,
 * the first one while that has room: a lookup reads one line of mappings,
 * two when the key overflowed into its second bucket or is not cached.
 * With two choices a bucket rarely overflows while others have room.
 * The buckets of a key are picked by a hash of its group, and the key's
 * place in the group only permutes the low bits of the index: so a group
 * of neighbouring blocks (a sequential run of first writes, the hot part
 * of a volume) lives in one page of buckets, not in a page per block.
 *
 * A key packs the device id (24 bits, as in dm-thin) and the virtual
 * block, a value the data block and the time as the mapping btree does
 * (block << 24 | time).  A virtual block at or beyond 2^40 (a device over
 * 64 PiB at the smallest block size) is never cached: a miss is always
 * allowed.
 *
 * The read side (tsp_mc_lookup() and the layout it reads) is inline in
 * mapping-cache.h, for the map path; this file holds the writers.
 *
 * Reading a bucket: a writer changes a bucket only inside the bucket's
 * sequence count, under the shard lock.  A lookup reads the count, the
 * bucket and the count again, and reads the bucket again if the count
 * moved.  If the count is odd (a writer is in the bucket) the lookup does
 * not wait: it takes the bucket as empty.  So a lookup never spins, not
 * even in an interrupt that came in on top of the writer (nor under
 * PREEMPT_RT, where the writer may be preempted), and a change of one
 * mapping is all or nothing for it on any architecture.
 *
 * Shards: at least as many as possible CPUs (at least MC_MIN_SHARDS),
 * fewer only when the budget cannot give every shard MC_MIN_SHARD_BUCKETS
 * buckets.
 *
 * Growth: a shard's table starts at 2^MC_MIN_TABLE_BITS buckets, so an
 * idle pool costs a few KiB of tables whatever its budget, and grows
 * fourfold when an insert finds both of its key's buckets full, up to the
 * shard's share of the budget (at most 2^MC_MAX_TABLE_BITS buckets).
 * That insert grows it, under the shard lock, with GFP_NOWAIT: every
 * mapping is copied into a new table, which is then published; the old
 * one is freed after a grace period, so a lookup still on it reads a
 * consistent, older state.  If a mapping finds both of its buckets in
 * the new table full (rare: it is a quarter as full as the old one), the
 * shard tries a table larger still; at the largest, such a mapping is
 * dropped and counted as an eviction.  If the allocation fails, the
 * insert evicts instead, and the shard tries again only once it holds
 * twice as many mappings.
 *
 * Eviction: when a key's buckets are full and the table cannot grow, the
 * insert evicts a mapping of the key's first bucket, chosen by CLOCK over
 * its ways: the hand clears and skips ways looked up since it last passed,
 * and evicts the first way it finds clear (after a full turn, the one it
 * started at).  A lookup that hits sets its way's referenced byte, but
 * only if it is clear, so a hot bucket's line is written once per sweep
 * rather than once per lookup.
 *
 * Budget: a bucket costs its cache line (two under lockdep, whose
 * seqcount_t is larger), so max_entries = TSP_MC_WAYS per bucket of the
 * largest tables the budget allows.  The shard and per-CPU
 * structs are not counted.  A budget too small for a bucket gives a cache
 * that never caches.
 *
 * Locking:
 *
 *   what                         readers (lookup)       writers
 *   tables[]                     rcu_dereference        shard lock +
 *                                                       rcu_assign_pointer
 *   bucket used, key[], val[]    READ_ONCE, in the      shard lock; in the
 *                                bucket's seq           seq, WRITE_ONCE
 *   bucket referenced[]          READ/WRITE_ONCE        shard lock, WRITE_ONCE
 *   bucket hand                  never                  shard lock
 *   shard->nr                    never                  shard lock (WRITE_ONCE:
 *                                                       range invalidation
 *                                                       reads it unlocked)
 *   shard, other fields          never                  shard lock
 *   stats (per CPU)              this_cpu_inc           summed by get_stats
 *   table->bits, buckets         plain                  set before publishing
 *   geometry (shard_bits, ...)   plain                  set at create
 *
 * A key's buckets are in its shard, and a writer holds one shard lock at
 * a time, so there is no lock order.
 */
#define DM_MSG_PREFIX "thin-scalable mapping cache"

#include "mapping-cache.h"

#define MC_MIN_SHARDS 64
#define MC_MIN_SHARD_BUCKETS 4
#define MC_MIN_TABLE_BITS 2
#define MC_MAX_TABLE_BITS 14		/* 1 MiB of buckets per shard */
#define MC_GROW_BITS 2
/* Invalidate a range key by key when it is at most this long. */
#define MC_RANGE_BY_KEY 16

/**
 * struct tsp_mc_shard - what the writers of one shard share
 * @lock: protects everything here, the shard's table pointer and buckets
 * @nr: mappings in the shard
 * @max_bits: the largest table the shard may grow to
 * @grow_at: do not try to grow before @nr reaches this (after a failed
 *	allocation)
 * @evictions: mappings CLOCK dropped
 */
struct tsp_mc_shard {
	spinlock_t lock;
	unsigned int nr;
	unsigned int max_bits;
	unsigned int grow_at;
	u64 evictions;
} ____cacheline_aligned_in_smp;

/* The value of (@block, @time); false if it cannot be cached. */
static bool mc_value(u64 block, u32 time, u64 *val)
{
	if (block >> (64 - TSP_MC_TIME_BITS) || time >> TSP_MC_TIME_BITS)
		return false;
	*val = block << TSP_MC_TIME_BITS | time;
	return true;
}

static struct tsp_mc_table *mc_table_alloc(unsigned int bits, gfp_t gfp)
{
	struct tsp_mc_table *t = kmalloc(sizeof(*t), gfp);
	unsigned int i;

	if (!t)
		return NULL;
	t->bits = bits;
	t->buckets = kcalloc(1U << bits, sizeof(struct tsp_mc_bucket), gfp);
	if (!t->buckets) {
		kfree(t);
		return NULL;
	}
	for (i = 0; i < (1U << bits); i++)
		seqcount_init(&t->buckets[i].seq);
	return t;
}

static void mc_table_free(struct tsp_mc_table *t)
{
	kfree(t->buckets);
	kfree(t);
}

/* RCU callback: a replaced table, once no lookup can be on it. */
static void mc_table_free_rcu(struct rcu_head *rcu)
{
	mc_table_free(container_of(rcu, struct tsp_mc_table, rcu));
}

/* The shard's table, for the holder of its lock. */
static struct tsp_mc_table *__table(struct tsp_mapping_cache *mc,
				struct tsp_mc_shard *shard)
{
	lockdep_assert_held(&shard->lock);
	return rcu_dereference_protected(mc->tables[shard - mc->shards],
					 lockdep_is_held(&shard->lock));
}

/**
 * tsp_mc_create - make an empty cache
 * @budget: bytes the tables may take
 * @result: the new cache
 *
 * Context: process, may sleep (GFP_KERNEL).
 *
 * Return: 0, or -ENOMEM.
 */
int tsp_mc_create(u64 budget, struct tsp_mapping_cache **result)
{
	u64 nr_buckets = div_u64(budget, sizeof(struct tsp_mc_bucket));
	u64 per_shard;
	unsigned int nr_shards, i, bits, max_bits;
	struct tsp_mapping_cache *mc;

	nr_shards = max_t(unsigned int, MC_MIN_SHARDS,
			  roundup_pow_of_two(num_possible_cpus()));
	while (nr_shards > 1 &&
	       nr_buckets < (u64)nr_shards * MC_MIN_SHARD_BUCKETS)
		nr_shards >>= 1;
	per_shard = div_u64(nr_buckets, nr_shards);
	max_bits = per_shard ? min_t(unsigned int, ilog2(per_shard),
				     MC_MAX_TABLE_BITS) : 0;
	bits = min_t(unsigned int, max_bits, MC_MIN_TABLE_BITS);

	mc = kzalloc(sizeof(*mc), GFP_KERNEL);
	if (!mc)
		return -ENOMEM;
	mc->nr_shards = nr_shards;
	mc->shard_bits = ilog2(nr_shards);
	if (per_shard)
		mc->max_entries = ((u64)nr_shards << max_bits) * TSP_MC_WAYS;

	mc->shards = kcalloc(nr_shards, sizeof(struct tsp_mc_shard), GFP_KERNEL);
	if (!mc->shards)
		goto bad_shards;
	mc->tables = kcalloc(nr_shards, sizeof(*mc->tables), GFP_KERNEL);
	if (!mc->tables)
		goto bad_tables;
	mc->stats = alloc_percpu(struct tsp_mc_cpu_stats);
	if (!mc->stats)
		goto bad_stats;
	for (i = 0; i < nr_shards; i++) {
		struct tsp_mc_table *t = mc_table_alloc(bits, GFP_KERNEL);

		if (!t)
			goto bad_table;
		RCU_INIT_POINTER(mc->tables[i], t);
		spin_lock_init(&mc->shards[i].lock);
		mc->shards[i].max_bits = max_bits;
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
 * tsp_mc_destroy - free a cache
 * @mc: the cache, or NULL
 *
 * The caller guarantees that nobody uses @mc any more, lookups included
 * (after unpublishing it, wait for a grace period first).  Then
 * rcu_barrier() waits for the tables that growing replaced: their
 * callback is this module's code, so it must have run before the module
 * can go.
 *
 * Context: process, may sleep.
 */
void tsp_mc_destroy(struct tsp_mapping_cache *mc)
{
	unsigned int i;

	if (!mc)
		return;
	for (i = 0; i < mc->nr_shards; i++)
		mc_table_free(rcu_dereference_protected(mc->tables[i], true));
	rcu_barrier();
	free_percpu(mc->stats);
	kfree(mc->tables);
	kfree(mc->shards);
	kfree(mc);
}

/* Put (@key, @val) in @way of @b, which lookups may be reading. */
static void __set_way(struct tsp_mc_bucket *b, unsigned int way, u64 key,
		      u64 val)
{
	raw_write_seqcount_begin(&b->seq);
	WRITE_ONCE(b->key[way], key);
	WRITE_ONCE(b->val[way], val);
	WRITE_ONCE(b->used, b->used | (1U << way));
	raw_write_seqcount_end(&b->seq);
}

/* Empty the ways of @b in @ways (a mask). */
static void __clear_ways(struct tsp_mc_shard *shard, struct tsp_mc_bucket *b,
			 unsigned int ways)
{
	unsigned int i;

	lockdep_assert_held(&shard->lock);
	raw_write_seqcount_begin(&b->seq);
	WRITE_ONCE(b->used, b->used & ~ways);
	raw_write_seqcount_end(&b->seq);
	for (i = 0; i < TSP_MC_WAYS; i++)
		if (ways & (1U << i))
			WRITE_ONCE(shard->nr, shard->nr - 1);
}

/*
 * Where @key is in @t: the one of its two buckets that holds it, with the
 * way in *@way; NULL if neither does.  For the holder of the shard lock.
 */
static struct tsp_mc_bucket *mc_find(struct tsp_mapping_cache *mc,
				     struct tsp_mc_table *t, u64 key, int *way)
{
	struct tsp_mc_bucket *b;
	unsigned int i;

	for (i = 0; i < 2; i++) {
		b = tsp_mc_bucket_of(mc, t, key, i);
		*way = tsp_mc_find_way(b, key);
		if (*way >= 0)
			return b;
	}
	return NULL;
}

/*
 * Where @key may go in @t: the first free way of its two buckets, the
 * first bucket's before the second's; the bucket, with the way in *@way,
 * or NULL if both are full.  @key must not be in @t.  For the holder of
 * the shard lock, or on a table not yet published.
 */
static struct tsp_mc_bucket *mc_free_way(struct tsp_mapping_cache *mc,
					 struct tsp_mc_table *t, u64 key,
					 int *way)
{
	struct tsp_mc_bucket *b;
	unsigned int i, free_ways;

	for (i = 0; i < 2; i++) {
		b = tsp_mc_bucket_of(mc, t, key, i);
		free_ways = ~b->used & ((1U << TSP_MC_WAYS) - 1);
		if (free_ways) {
			*way = __ffs(free_ways);
			return b;
		}
	}
	return NULL;
}

/* The way of the full bucket @b that CLOCK gives up (see "Eviction"). */
static unsigned int __clock_victim(struct tsp_mc_bucket *b)
{
	unsigned int way = b->hand, steps;

	for (steps = 0; steps < TSP_MC_WAYS && READ_ONCE(b->referenced[way]);
	     steps++) {
		WRITE_ONCE(b->referenced[way], 0);
		way = (way + 1) % TSP_MC_WAYS;
	}
	b->hand = (way + 1) % TSP_MC_WAYS;
	return way;
}

/*
 * Copy the mappings of @from into the empty, unpublished table @to.
 * Return: how many found both of their buckets in @to full.
 */
static unsigned int mc_copy_table(struct tsp_mapping_cache *mc,
				  struct tsp_mc_table *from,
				  struct tsp_mc_table *to)
{
	unsigned int i, way, dropped = 0;
	struct tsp_mc_bucket *b, *into;
	int free_way;

	for (i = 0; i < (1U << from->bits); i++) {
		b = &from->buckets[i];
		for (way = 0; way < TSP_MC_WAYS; way++) {
			if (!(b->used & (1U << way)))
				continue;
			into = mc_free_way(mc, to, b->key[way], &free_way);
			if (!into) {
				dropped++;
				continue;
			}
			into->key[free_way] = b->key[way];
			into->val[free_way] = b->val[way];
			into->referenced[free_way] =
				READ_ONCE(b->referenced[way]);
			into->used |= 1U << free_way;
		}
	}
	return dropped;
}

/*
 * Give the shard a larger table, copying every mapping (see "Growth"):
 * MC_GROW_BITS larger, or larger still if some mapping found no room,
 * up to the largest the shard may have, where such mappings are dropped.
 * Return: false if the table is as large as it may be, or the allocation
 * failed now or the last time (see @grow_at).
 */
static bool __grow(struct tsp_mapping_cache *mc, struct tsp_mc_shard *shard)
{
	struct tsp_mc_table *old = __table(mc, shard), *new;
	unsigned int bits = old->bits, dropped;

	if (bits >= shard->max_bits || shard->nr < shard->grow_at)
		return false;
	for (;;) {
		bits = min(bits + MC_GROW_BITS, shard->max_bits);
		new = mc_table_alloc(bits, GFP_NOWAIT | __GFP_NOWARN);
		if (!new) {
			shard->grow_at = shard->nr < UINT_MAX / 2 ?
					 2 * shard->nr : UINT_MAX;
			return false;
		}
		dropped = mc_copy_table(mc, old, new);
		if (!dropped || bits == shard->max_bits)
			break;
		mc_table_free(new);
	}
	WRITE_ONCE(shard->nr, shard->nr - dropped);
	shard->evictions += dropped;
	rcu_assign_pointer(mc->tables[shard - mc->shards], new);
	call_rcu(&old->rcu, mc_table_free_rcu);
	shard->grow_at = 0;
	return true;
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
 * none: a mapping that cannot be cached (see "key" and "value" at the
 * top) removes an older one for the key rather than leave it behind.
 * When the key's buckets are full the table grows or, if it cannot,
 * CLOCK evicts a mapping.
 *
 * Context: process (not interrupt); does not sleep.  Takes the key's
 * shard lock.
 *
 * Return: true if the mapping is now cached.
 */
bool tsp_mc_insert(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		   u64 block, u32 time)
{
	struct tsp_mc_shard *shard;
	struct tsp_mc_table *t;
	struct tsp_mc_bucket *b;
	bool cacheable;
	u64 key, val;
	int way;

	if (!mc->max_entries || !tsp_mc_key(dev, virt, &key))
		return false;
	cacheable = mc_value(block, time, &val);
	shard = &mc->shards[tsp_mc_shard_index(mc, key)];

	spin_lock(&shard->lock);
	t = __table(mc, shard);
	b = mc_find(mc, t, key, &way);
	if (b) {
		if (!cacheable)
			__clear_ways(shard, b, 1U << way);
		else if (b->val[way] != val)
			__set_way(b, way, key, val);
	} else if (cacheable) {
		b = mc_free_way(mc, t, key, &way);
		/* A larger table does not hold @key either. */
		while (!b && __grow(mc, shard))
			b = mc_free_way(mc, __table(mc, shard), key, &way);
		if (b) {
			WRITE_ONCE(shard->nr, shard->nr + 1);
		} else {
			b = tsp_mc_bucket_of(mc, __table(mc, shard), key, false);
			way = __clock_victim(b);
			shard->evictions++;
		}
		WRITE_ONCE(b->referenced[way], 0);
		__set_way(b, way, key, val);
	}
	spin_unlock(&shard->lock);
	return cacheable;
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
	struct tsp_mc_shard *shard;
	struct tsp_mc_bucket *b;
	u64 key;
	int way;

	if (!mc->max_entries || !tsp_mc_key(dev, virt, &key))
		return;
	shard = &mc->shards[tsp_mc_shard_index(mc, key)];
	spin_lock(&shard->lock);
	b = mc_find(mc, __table(mc, shard), key, &way);
	if (b)
		__clear_ways(shard, b, 1U << way);
	spin_unlock(&shard->lock);
}

/* Remove, shard by shard, every mapping whose key @match() picks. */
static void mc_remove_matching(struct tsp_mapping_cache *mc,
			       bool (*match)(u64 key, u64 dev, u64 begin,
					     u64 end),
			       u64 dev, u64 begin, u64 end)
{
	unsigned int i, j, way, ways;
	struct tsp_mc_shard *shard;
	struct tsp_mc_table *t;
	struct tsp_mc_bucket *b;

	for (i = 0; i < mc->nr_shards; i++) {
		shard = &mc->shards[i];
		spin_lock(&shard->lock);
		t = __table(mc, shard);
		for (j = 0; j < (1U << t->bits); j++) {
			b = &t->buckets[j];
			ways = 0;
			for (way = 0; way < TSP_MC_WAYS; way++)
				if ((b->used & (1U << way)) &&
				    match(b->key[way], dev, begin, end))
					ways |= 1U << way;
			if (ways)
				__clear_ways(shard, b, ways);
		}
		spin_unlock(&shard->lock);
		cond_resched();
	}
}

static bool match_range(u64 key, u64 dev, u64 begin, u64 end)
{
	u64 virt = key & ((1ULL << TSP_MC_VIRT_BITS) - 1);

	return key >> TSP_MC_VIRT_BITS == dev && virt >= begin && virt < end;
}

static bool match_dev(u64 key, u64 dev, u64 begin, u64 end)
{
	return key >> TSP_MC_VIRT_BITS == dev;
}

static bool match_all(u64 key, u64 dev, u64 begin, u64 end)
{
	return true;
}

/* Mappings cached now, read without the shard locks: an estimate. */
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
 * Short ranges (up to the number of cached mappings) are removed key by
 * key; longer ones by a walk of every shard's table, whichever is less
 * work.  Same visibility as tsp_mc_invalidate().
 *
 * Context: process; may reschedule between shards (cond_resched()).
 * Takes each shard lock in turn.
 */
void tsp_mc_invalidate_range(struct tsp_mapping_cache *mc, u64 dev,
			     u64 begin, u64 end)
{
	u64 virt;

	/* Nothing at or beyond 2^TSP_MC_VIRT_BITS is cached. */
	end = min_t(u64, end, 1ULL << TSP_MC_VIRT_BITS);
	if (begin >= end)
		return;
	if (end - begin <= MC_RANGE_BY_KEY ||
	    end - begin <= mc_nr_entries(mc)) {
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
 * Context: process; may reschedule between shards.  Walks every table.
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
	struct tsp_mc_cpu_stats *s;
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
