/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * mapping-cache.h - a sharded hash of (thin device, virtual block) ->
 * (data block, time) that the map path reads under RCU alone: no lock, no
 * atomic read-modify-write, and no store but the first hit's CLOCK byte
 * after the hand cleared it.
 * It sits in front of the btrees of dm-thin-metadata.c, which keeps it a
 * subset of the metadata (see dm-thin-metadata.h for that contract).
 *
 * The cache has a byte budget; an insert that finds no room evicts with
 * CLOCK (the tables grow up to the budget, when GFP_NOWAIT can allocate).
 * A miss is always allowed, a wrong answer never.
 *
 * Contexts (every function; details in the kernel-doc in mapping-cache.c,
 * and below for the lookup, which is inline):
 *
 *   function                    context               locks taken
 *   tsp_mc_lookup()             caller's RCU section  none
 *   tsp_mc_insert()             process, no sleep     one shard spinlock
 *   tsp_mc_invalidate()         process, no sleep     one shard spinlock
 *   tsp_mc_invalidate_range()   process, may resched  shard spinlocks
 *   tsp_mc_invalidate_dev()     process, may resched  shard spinlocks
 *   tsp_mc_clear()              process, may resched  shard spinlocks
 *   tsp_mc_get_stats()          process, no sleep     shard spinlocks
 *   tsp_mc_create()             process, may sleep    none
 *   tsp_mc_destroy()            process, may sleep    none; no other user
 *
 * Updates of one key must be serialised by the caller (the pool metadata
 * lock does it) for "the last update wins" to mean anything; the cache
 * itself stays consistent under any interleaving.
 */
#ifndef TSP_MAPPING_CACHE_H
#define TSP_MAPPING_CACHE_H

#include "persistent-data/compat.h"

/* The pool metadata's default budget. */
#define TSP_MC_DEFAULT_BUDGET (64ULL << 20)

struct tsp_mapping_cache;

/**
 * struct tsp_mc_mapping - what a cached virtual block maps to
 * @block: the data block
 * @time: the mapping's time (24 bits), to compare with the device's
 *	snapshotted_time
 */
struct tsp_mc_mapping {
	u64 block;
	u32 time;
};

/**
 * struct tsp_mc_stats - a snapshot of the counters
 * @entries: mappings cached now
 * @max_entries: how many the budget allows
 * @hits: lookups that found their mapping
 * @misses: lookups that did not
 * @evictions: entries dropped to make room: by CLOCK, or when growing
 *	found no room for one (not invalidations)
 * @buckets: hash buckets now (the tables grow with the entries)
 */
struct tsp_mc_stats {
	u64 entries;
	u64 max_entries;
	u64 hits;
	u64 misses;
	u64 evictions;
	u64 buckets;
};

int __must_check tsp_mc_create(u64 budget, struct tsp_mapping_cache **result);
void tsp_mc_destroy(struct tsp_mapping_cache *mc);

bool tsp_mc_insert(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		   u64 block, u32 time);
void tsp_mc_invalidate(struct tsp_mapping_cache *mc, u64 dev, u64 virt);
void tsp_mc_invalidate_range(struct tsp_mapping_cache *mc, u64 dev,
			     u64 begin, u64 end);
void tsp_mc_invalidate_dev(struct tsp_mapping_cache *mc, u64 dev);
void tsp_mc_clear(struct tsp_mapping_cache *mc);

void tsp_mc_get_stats(struct tsp_mapping_cache *mc, struct tsp_mc_stats *stats);

/*
 * The lookup is inline, as rhashtable's is: the map path calls it for
 * every IO, and a call into another file costs it a prologue, a return
 * and its result on the stack.  So the read side's layout is here; only
 * mapping-cache.c writes it.  mapping-cache.c explains the layout, the
 * hashing and the locking.
 */
#define TSP_MC_WAYS 3			/* mappings a bucket holds */
#define TSP_MC_GROUP_BITS 6		/* 64 buckets: a 4 KiB page of them */
#define TSP_MC_VIRT_BITS 40
#define TSP_MC_TIME_BITS 24
#define TSP_MC_HASH_MULT1 0x9e3779b97f4a7c15ULL	/* 2^64 / golden ratio */
#define TSP_MC_HASH_MULT2 0xc2b2ae3d27d4eb4fULL	/* odd, bits well mixed */

/**
 * struct tsp_mc_bucket - room for TSP_MC_WAYS mappings, one cache line
 * @seq: odd while a writer changes @used, @key or @val
 * @used: bit i set: way i holds a mapping
 * @hand: the way CLOCK looks at first (writers only)
 * @referenced: per way, CLOCK's bit: set by lookups, cleared by the hand
 * @key: per way, dev << TSP_MC_VIRT_BITS | virt
 * @val: per way, block << TSP_MC_TIME_BITS | time
 */
struct tsp_mc_bucket {
	seqcount_t seq;
	u8 used;
	u8 hand;
	u8 referenced[TSP_MC_WAYS];
	u64 key[TSP_MC_WAYS];
	u64 val[TSP_MC_WAYS];
} ____cacheline_aligned;

/**
 * struct tsp_mc_table - one shard's hash table
 * @bits: log2 of the number of buckets
 * @buckets: the buckets (a separate allocation, so that its size is a
 *	power of two and kmalloc aligns it to a cache line)
 * @rcu: for freeing it once replaced
 */
struct tsp_mc_table {
	unsigned int bits;
	struct tsp_mc_bucket *buckets;
	struct rcu_head rcu;
};

struct tsp_mc_cpu_stats {
	u64 hits;
	u64 misses;
};

struct tsp_mc_shard;

/**
 * struct tsp_mapping_cache - the cache; every field is set at create
 * @shard_bits: log2 of @nr_shards
 * @nr_shards: how many shards
 * @max_entries: how many mappings the budget allows
 * @stats: per-CPU hit and miss counters
 * @tables: per shard, its table (RCU)
 * @shards: per shard, what its writers share (mapping-cache.c)
 */
struct tsp_mapping_cache {
	unsigned int shard_bits;
	unsigned int nr_shards;
	u64 max_entries;
	struct tsp_mc_cpu_stats __percpu *stats;
	struct tsp_mc_table __rcu **tables;
	struct tsp_mc_shard *shards;
};

/* The key of (@dev, @virt); false if it cannot be cached. */
static inline bool tsp_mc_key(u64 dev, u64 virt, u64 *key)
{
	if (dev >> (64 - TSP_MC_VIRT_BITS) || virt >> TSP_MC_VIRT_BITS)
		return false;
	*key = dev << TSP_MC_VIRT_BITS | virt;
	return true;
}

static inline unsigned int
tsp_mc_shard_index(const struct tsp_mapping_cache *mc, u64 key)
{
	u64 h = (key >> TSP_MC_GROUP_BITS) * TSP_MC_HASH_MULT1;

	return mc->shard_bits ? h >> (64 - mc->shard_bits) : 0;
}

/* @key's first (@second false) or second bucket in @t. */
static inline struct tsp_mc_bucket *
tsp_mc_bucket_of(const struct tsp_mapping_cache *mc, struct tsp_mc_table *t,
		 u64 key, bool second)
{
	u64 group = key >> TSP_MC_GROUP_BITS;
	u64 h = second ? group * TSP_MC_HASH_MULT2 :
			 (group * TSP_MC_HASH_MULT1) << mc->shard_bits;
	unsigned int index = t->bits ? h >> (64 - t->bits) : 0;

	index ^= key & ((1U << TSP_MC_GROUP_BITS) - 1);
	return &t->buckets[index & ((1U << t->bits) - 1)];
}

/*
 * The way of @b that holds @key, or -1.  Inside @b's sequence count, or
 * under its shard's lock.
 */
static __always_inline int tsp_mc_find_way(const struct tsp_mc_bucket *b, u64 key)
{
	unsigned int used = READ_ONCE(b->used), i;

	for (i = 0; i < TSP_MC_WAYS; i++)
		if ((used & (1U << i)) && READ_ONCE(b->key[i]) == key)
			return i;
	return -1;
}

/*
 * Look for @key in @b without a lock (see "Reading a bucket" in
 * mapping-cache.c); on a hit set @val and the way's referenced byte.
 */
static __always_inline bool tsp_mc_read_bucket(struct tsp_mc_bucket *b,
					       u64 key, u64 *val)
{
	unsigned int seq;
	int way;

	do {
		seq = raw_read_seqcount(&b->seq);
		way = seq & 1 ? -1 : tsp_mc_find_way(b, key);
		if (way >= 0)
			*val = READ_ONCE(b->val[way]);
		/* Odd: a writer is in the bucket; it reads as empty. */
	} while (read_seqcount_retry(&b->seq, seq) && !(seq & 1));

	if (way < 0)
		return false;
	if (!READ_ONCE(b->referenced[way]))
		WRITE_ONCE(b->referenced[way], 1);
	return true;
}

/**
 * tsp_mc_lookup - find a cached mapping
 * @mc: the cache
 * @dev: thin device id
 * @virt: virtual block
 * @result: out, the mapping on a hit
 *
 * Context: any; inside the caller's rcu_read_lock(), which keeps @mc's
 * tables alive while it runs.  Never waits and takes no lock; writes only
 * this CPU's counters and, the first time a mapping is hit after CLOCK
 * cleared it, its referenced byte.
 *
 * Return: true on a hit.  A hit is a mapping the cache held at some
 * moment during the call: an update that completed before the call
 * started is seen, one racing with it may or may not be.
 */
static __always_inline bool tsp_mc_lookup(struct tsp_mapping_cache *mc,
					  u64 dev, u64 virt,
					  struct tsp_mc_mapping *result)
{
	struct tsp_mc_table *t;
	bool hit = false;
	u64 key, val = 0;	/* set on a hit; 0 quiets -Wmaybe-uninitialized */

	RCU_LOCKDEP_WARN(!rcu_read_lock_held(),
			 "mapping cache lookup outside RCU");
	if (tsp_mc_key(dev, virt, &key)) {
		t = rcu_dereference(mc->tables[tsp_mc_shard_index(mc, key)]);
		hit = tsp_mc_read_bucket(tsp_mc_bucket_of(mc, t, key, false),
					 key, &val) ||
		      tsp_mc_read_bucket(tsp_mc_bucket_of(mc, t, key, true),
					 key, &val);
	}
	if (hit) {
		result->block = val >> TSP_MC_TIME_BITS;
		result->time = val & ((1U << TSP_MC_TIME_BITS) - 1);
		this_cpu_inc(mc->stats->hits);
	} else {
		this_cpu_inc(mc->stats->misses);
	}
	return hit;
}

#endif /* TSP_MAPPING_CACHE_H */
