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
 * Contexts (every function; details in the kernel-doc in mapping-cache.c):
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

bool tsp_mc_lookup(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		   struct tsp_mc_mapping *result);
bool tsp_mc_insert(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		   u64 block, u32 time);
void tsp_mc_invalidate(struct tsp_mapping_cache *mc, u64 dev, u64 virt);
void tsp_mc_invalidate_range(struct tsp_mapping_cache *mc, u64 dev,
			     u64 begin, u64 end);
void tsp_mc_invalidate_dev(struct tsp_mapping_cache *mc, u64 dev);
void tsp_mc_clear(struct tsp_mapping_cache *mc);

void tsp_mc_get_stats(struct tsp_mapping_cache *mc, struct tsp_mc_stats *stats);

#endif /* TSP_MAPPING_CACHE_H */
