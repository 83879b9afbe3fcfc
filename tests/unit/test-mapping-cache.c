// SPDX-License-Identifier: GPL-2.0-only
/*
 * test-mapping-cache.c - mapping-cache.[ch] on its own and through the
 * pool metadata API.
 *
 * Groups:
 *
 *   basic        each function once, by hand: hits, replacement, every
 *                kind of invalidation, counters, keys and values too
 *                large to cache (an update to one must drop the old
 *                entry, not keep it), growth, growth failing, a zero
 *                budget
 *   model        random operations against a reference map, with budgets
 *                from "everything fits" (then a lookup of a cached key
 *                must hit) down to 24 entries (constant CLOCK
 *                eviction: a miss is allowed, a wrong answer never), and
 *                with every GFP_NOWAIT allocation failing (no growth)
 *   concurrency  reader threads hammer lookups while two writers insert,
 *                replace and invalidate (one, two, a range, a device,
 *                everything).  A cached value encodes its key and a
 *                per-key generation; a reader checks that a hit is for
 *                its key, was published by a writer, is not older than
 *                what an invalidation or replacement that returned before
 *                the lookup started left, and never goes backwards
 *   metadata     through dm-thin-metadata.h: inserted mappings hit the
 *                fast path; remove, remove_range, delete, abort and a
 *                failed commit make it miss; snapshots make old mappings
 *                shared; find_block and find_mapped_range fill; the cache
 *                can be replaced (set_cache_budget) under fast lookups
 *   hold_freed   blocks freed before tsp_pool_commit_metadata_hold_freed()
 *                stay out of allocation until released (two releases:
 *                they are held in the newer generation), or an abort
 *
 * Every group checks that it leaves no allocation behind (after
 * rcu_barrier(), which in userspace runs the queued call_rcu()s).  The
 * same source runs under ASan/UBSan (make unit) and ThreadSanitizer (make
 * tsan); see persistent-data/compat.h for how TSan is told about grace
 * periods.
 *
 * Usage: test-mapping-cache [seed]; the seed (also $TSP_SEED) is printed
 * first.  TSP_TEST_QUICK=1 runs shorter.  Exit status 0 pass, 1 fail.
 *
 * Locking: the concurrency groups start threads (each registers with
 * RCU); everything else runs on the main thread.
 */
#define DM_MSG_PREFIX "mapping-cache-test"
#include "dm-thin-metadata.h"
#include "mapping-cache.h"

#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Failure reporting and randomness                                    */
/* ------------------------------------------------------------------ */

static u64 seed;
static const char *phase = "setup";
static bool quick;

static void __attribute__((noreturn, format(printf, 3, 4)))
fail(const char *file, int line, const char *fmt, ...)
{
	va_list ap;

	fflush(stdout);
	fprintf(stderr, "FAIL %s:%d (phase %s, seed %" PRIu64 "): ", file, line,
		phase, seed);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

#define CHECK(c)							\
	do {								\
		if (!(c))						\
			fail(__FILE__, __LINE__, "%s", #c);		\
	} while (0)

#define CHECK_R(expr, want)						\
	do {								\
		long long __r = (expr), __w = (want);			\
		if (__r != __w)						\
			fail(__FILE__, __LINE__, "%s = %lld, expected %lld", \
			     #expr, __r, __w);				\
	} while (0)

/* splitmix64, one state per thread. */
static u64 rnd_next(u64 *state)
{
	u64 z = (*state += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static u64 rng;

static u64 rnd_below(u64 n)
{
	return n ? rnd_next(&rng) % n : 0;
}

static long allocs_base;

/* Nothing left: run the queued frees first. */
static void check_no_leaks(void)
{
	rcu_barrier();
	CHECK_R(tsp_user_live_allocs(), allocs_base);
}

/* ------------------------------------------------------------------ */
/* basic                                                               */
/* ------------------------------------------------------------------ */

static bool lookup(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		   u64 *block, u32 *time)
{
	struct tsp_mc_mapping m = { ~0ULL, ~0U };
	bool hit;

	rcu_read_lock();
	hit = tsp_mc_lookup(mc, dev, virt, &m);
	rcu_read_unlock();
	if (hit) {
		*block = m.block;
		*time = m.time;
	}
	return hit;
}

static void expect_hit(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
		       u64 block, u32 time, int line)
{
	u64 b;
	u32 t;

	if (!lookup(mc, dev, virt, &b, &t))
		fail(__FILE__, line, "(%llu, %llu) missed", (unsigned long long)dev,
		     (unsigned long long)virt);
	if (b != block || t != time)
		fail(__FILE__, line, "(%llu, %llu) = (%llu, %u), expected (%llu, %u)",
		     (unsigned long long)dev, (unsigned long long)virt,
		     (unsigned long long)b, t, (unsigned long long)block, time);
}

static void expect_miss(struct tsp_mapping_cache *mc, u64 dev, u64 virt,
			int line)
{
	u64 b;
	u32 t;

	if (lookup(mc, dev, virt, &b, &t))
		fail(__FILE__, line, "(%llu, %llu) hit, expected a miss",
		     (unsigned long long)dev, (unsigned long long)virt);
}

#define HIT(mc, d, v, b, t) expect_hit(mc, d, v, b, t, __LINE__)
#define MISS(mc, d, v) expect_miss(mc, d, v, __LINE__)

static void test_basic(void)
{
	struct tsp_mapping_cache *mc;
	struct tsp_mc_stats st;
	u64 v;

	phase = "basic";
	CHECK_R(tsp_mc_create(1 << 20, &mc), 0);
	tsp_mc_get_stats(mc, &st);
	CHECK(st.entries == 0 && st.hits == 0 && st.misses == 0);
	/* 1 MiB: 64 shards of 256 64-byte buckets of 3 mappings. */
	CHECK_R(st.max_entries, 64 * 256 * 3);

	MISS(mc, 1, 10);
	CHECK(tsp_mc_insert(mc, 1, 10, 1000, 7));
	HIT(mc, 1, 10, 1000, 7);
	MISS(mc, 2, 10);	/* another device */
	MISS(mc, 1, 11);
	/* Same value again: kept; new value: replaced. */
	CHECK(tsp_mc_insert(mc, 1, 10, 1000, 7));
	CHECK(tsp_mc_insert(mc, 1, 10, 2000, 8));
	HIT(mc, 1, 10, 2000, 8);
	CHECK(tsp_mc_insert(mc, 1, 10, 2000, 9));
	HIT(mc, 1, 10, 2000, 9);
	tsp_mc_get_stats(mc, &st);
	CHECK_R(st.entries, 1);
	CHECK_R(st.hits, 3);
	CHECK_R(st.misses, 3);

	/* Large and extreme keys and values. */
	CHECK(tsp_mc_insert(mc, TSP_THIN_MAX_DEV_ID, (1ULL << 40) - 1,
			    (1ULL << 40) - 1, 0xffffff));
	HIT(mc, TSP_THIN_MAX_DEV_ID, (1ULL << 40) - 1, (1ULL << 40) - 1, 0xffffff);
	CHECK(tsp_mc_insert(mc, 0, 0, 0, 0));
	HIT(mc, 0, 0, 0, 0);
	/* Beyond 40 bits of virtual block: never cached. */
	CHECK(!tsp_mc_insert(mc, 0, 1ULL << 40, 1, 1));
	CHECK(!tsp_mc_insert(mc, TSP_THIN_MAX_DEV_ID, U64_MAX, 1, 1));
	MISS(mc, 0, 1ULL << 40);
	MISS(mc, TSP_THIN_MAX_DEV_ID, U64_MAX);
	tsp_mc_invalidate(mc, 0, 1ULL << 40);
	tsp_mc_invalidate_range(mc, 0, 1ULL << 40, U64_MAX);
	HIT(mc, 0, 0, 0, 0);
	/* A value too large to cache drops the old one. */
	CHECK(tsp_mc_insert(mc, 5, 5, 50, 1));
	CHECK(!tsp_mc_insert(mc, 5, 5, 1ULL << 40, 1));
	MISS(mc, 5, 5);
	CHECK(tsp_mc_insert(mc, 5, 5, 50, 1));
	CHECK(!tsp_mc_insert(mc, 5, 5, 50, 1U << 24));
	MISS(mc, 5, 5);
	CHECK(!tsp_mc_insert(mc, 5, 6, 1ULL << 40, 1));
	MISS(mc, 5, 6);

	tsp_mc_invalidate(mc, 1, 10);
	MISS(mc, 1, 10);
	tsp_mc_invalidate(mc, 1, 10);	/* absent: nothing happens */
	HIT(mc, 0, 0, 0, 0);

	/* Ranges: short (key by key) and long (a walk), both ends exact. */
	for (v = 0; v < 100; v++) {
		CHECK(tsp_mc_insert(mc, 3, v, v + 5, 1));
		CHECK(tsp_mc_insert(mc, 4, v, v + 6, 2));
	}
	tsp_mc_invalidate_range(mc, 3, 10, 20);
	tsp_mc_invalidate_range(mc, 3, 30, 30);		/* empty */
	tsp_mc_invalidate_range(mc, 3, 50, 1ULL << 40);	/* by walk */
	for (v = 0; v < 100; v++) {
		if ((v >= 10 && v < 20) || v >= 50)
			MISS(mc, 3, v);
		else
			HIT(mc, 3, v, v + 5, 1);
		HIT(mc, 4, v, v + 6, 2);
	}
	tsp_mc_invalidate_dev(mc, 4);
	for (v = 0; v < 100; v++)
		MISS(mc, 4, v);
	HIT(mc, 3, 0, 5, 1);
	tsp_mc_get_stats(mc, &st);
	CHECK_R(st.entries, 40 + 2);

	tsp_mc_clear(mc);
	tsp_mc_get_stats(mc, &st);
	CHECK_R(st.entries, 0);
	CHECK(st.hits > 0 && st.evictions == 0);
	MISS(mc, 3, 0);
	MISS(mc, 0, 0);

	tsp_mc_destroy(mc);
	check_no_leaks();

	/*
	 * Growth failing: every insert still caches its mapping, evicting
	 * another one; what stays cached is right.
	 */
	CHECK_R(tsp_mc_create(1 << 20, &mc), 0);
	setenv("TSP_FAIL_NOWAIT", "1", 1);
	/* Far apart, so that every shard gets some. */
	for (v = 0; v < 10000; v++)
		CHECK(tsp_mc_insert(mc, 1, v * 1000, v + 3, 2));
	unsetenv("TSP_FAIL_NOWAIT");
	tsp_mc_get_stats(mc, &st);
	CHECK_R(st.buckets, 64 << 2);
	CHECK_R(st.entries, 64 * 4 * 3);
	CHECK_R(st.evictions, 10000 - 64 * 4 * 3);
	HIT(mc, 1, 9999 * 1000, 10002, 2);	/* the last insert stays */
	for (v = 0; v < 10000; v++) {
		u64 b;
		u32 t;

		if (lookup(mc, 1, v * 1000, &b, &t))
			CHECK(b == v + 3 && t == 2);
	}
	tsp_mc_destroy(mc);
	check_no_leaks();

	/*
	 * Tables grow fourfold when both of a key's buckets are full, up to
	 * the budget's share; nothing is lost on the way.
	 */
	CHECK_R(tsp_mc_create(8 << 20, &mc), 0);
	tsp_mc_get_stats(mc, &st);
	CHECK_R(st.buckets, 64 << 2);
	for (v = 0; v < 50000; v++)
		CHECK(tsp_mc_insert(mc, v % 3, v, v * 7, v & 0xffffff));
	tsp_mc_get_stats(mc, &st);
	CHECK_R(st.entries, 50000);
	CHECK_R(st.evictions, 0);
	/* About 780 mappings a shard need 1024 buckets; 8 MiB allow 2048. */
	CHECK(st.buckets >= 64 << 10 && st.buckets <= 64 << 11);
	for (v = 0; v < 50000; v++) {
		HIT(mc, v % 3, v, v * 7, v & 0xffffff);
		if (v % 2)
			tsp_mc_invalidate(mc, v % 3, v);
	}
	for (v = 0; v < 50000; v++) {
		if (v % 2)
			MISS(mc, v % 3, v);
		else
			HIT(mc, v % 3, v, v * 7, v & 0xffffff);
	}
	tsp_mc_destroy(mc);
	check_no_leaks();

	/* One bucket: a key's two buckets are the same one. */
	CHECK_R(tsp_mc_create(100, &mc), 0);
	for (v = 0; v < 10; v++)
		CHECK(tsp_mc_insert(mc, 2, v, v, 1));
	tsp_mc_get_stats(mc, &st);
	CHECK(st.max_entries == 3 && st.entries == 3 && st.evictions == 7);
	HIT(mc, 2, 9, 9, 1);
	tsp_mc_invalidate(mc, 2, 9);
	MISS(mc, 2, 9);
	tsp_mc_get_stats(mc, &st);
	CHECK_R(st.entries, 2);
	tsp_mc_destroy(mc);

	/* A budget too small for an entry: nothing is ever cached. */
	CHECK_R(tsp_mc_create(0, &mc), 0);
	CHECK(!tsp_mc_insert(mc, 1, 1, 1, 1));
	MISS(mc, 1, 1);
	tsp_mc_invalidate(mc, 1, 1);
	tsp_mc_invalidate_range(mc, 1, 0, 1000);
	tsp_mc_clear(mc);
	tsp_mc_get_stats(mc, &st);
	CHECK(st.max_entries == 0 && st.entries == 0 && st.misses == 1);
	tsp_mc_destroy(mc);

	/* Creation failing at each allocation in turn. */
	for (v = 0;; v++) {
		int r;

		tsp_user_fail_alloc_after(v);
		r = tsp_mc_create(1 << 16, &mc);
		tsp_user_fail_alloc_after(-1);
		if (!r)
			break;
		CHECK_R(r, -ENOMEM);
		CHECK_R(tsp_user_live_allocs(), allocs_base);
	}
	/* The cache, shards, table pointers, per-CPU counters, tables. */
	CHECK(v > 4);
	tsp_mc_destroy(mc);
	check_no_leaks();
	printf("ok   %s\n", phase);
}

/* ------------------------------------------------------------------ */
/* model                                                               */
/* ------------------------------------------------------------------ */

#define M_DEVS 4
#define M_VIRTS 1500		/* per device, some of them far apart */
#define M_NONE (~0ULL)

struct model {
	u64 block[M_DEVS][M_VIRTS];	/* M_NONE: not cached */
	u32 time[M_DEVS][M_VIRTS];
	u64 nr;
};

/* Virtual block number of slot @i: dense, then beyond 2^40. */
static u64 virt_of(u32 i)
{
	return i < M_VIRTS - 100 ? i : (1ULL << 40) + (u64)(i - (M_VIRTS - 100)) * 977;
}

static void model_set(struct model *m, u32 d, u32 i, u64 block, u32 time)
{
	if (m->block[d][i] == M_NONE && block != M_NONE)
		m->nr++;
	else if (m->block[d][i] != M_NONE && block == M_NONE)
		m->nr--;
	m->block[d][i] = block;
	m->time[d][i] = time;
}

/*
 * @complete: every insert must stick (no eviction, no failed
 * allocation), so a cached key must hit.
 */
static void model_check_all(struct tsp_mapping_cache *mc, struct model *m,
			    bool complete)
{
	struct tsp_mc_stats st;
	u64 b;
	u32 d, i, t;

	for (d = 0; d < M_DEVS; d++) {
		for (i = 0; i < M_VIRTS; i++) {
			if (!lookup(mc, d, virt_of(i), &b, &t)) {
				if (complete && m->block[d][i] != M_NONE)
					fail(__FILE__, __LINE__, "dev %u slot %u: lost", d, i);
				continue;
			}
			if (m->block[d][i] != b || m->time[d][i] != t)
				fail(__FILE__, __LINE__,
				     "dev %u slot %u: cached (%llu, %u), model (%llu, %u)",
				     d, i, (unsigned long long)b, t,
				     (unsigned long long)m->block[d][i], m->time[d][i]);
		}
	}
	tsp_mc_get_stats(mc, &st);
	CHECK(st.entries <= st.max_entries);
	CHECK(st.entries <= m->nr);
	if (complete)
		CHECK_R(st.entries, m->nr);
}

static void model_run(u64 budget, bool fail_nowait, unsigned int nr_ops)
{
	struct model *m = malloc(sizeof(*m));
	struct tsp_mapping_cache *mc;
	struct tsp_mc_stats st;
	bool complete = !fail_nowait && budget >= (4u << 20);
	u64 next_block = 1, hits = 0, lookups = 0, b, begin, end;
	unsigned int op;
	u32 d, i, j, t;

	CHECK(m);
	memset(m->block, 0xff, sizeof(m->block));
	m->nr = 0;
	CHECK_R(tsp_mc_create(budget, &mc), 0);
	if (fail_nowait)
		setenv("TSP_FAIL_NOWAIT", "1", 1);

	for (op = 0; op < nr_ops; op++) {
		unsigned int what = rnd_below(10000);

		/* Half the operations on a hot fifth of the keys. */
		d = rnd_below(M_DEVS);
		i = rnd_below(rnd_below(2) ? M_VIRTS / 5 : M_VIRTS);
		if (what < 5000) {
			/* Insert or replace; a third of them with the same value. */
			if (m->block[d][i] != M_NONE && rnd_below(3) == 0) {
				b = m->block[d][i];
				t = m->time[d][i];
			} else {
				b = next_block++;
				t = rnd_below(1 << 24);
			}
			if (tsp_mc_insert(mc, d, virt_of(i), b, t))
				model_set(m, d, i, b, t);
			else
				model_set(m, d, i, M_NONE, 0);
		} else if (what < 9000) {
			lookups++;
			if (lookup(mc, d, virt_of(i), &b, &t)) {
				hits++;
				if (m->block[d][i] != b || m->time[d][i] != t)
					fail(__FILE__, __LINE__,
					     "op %u: dev %u slot %u: cached (%llu, %u), model (%llu, %u)",
					     op, d, i, (unsigned long long)b, t,
					     (unsigned long long)m->block[d][i],
					     m->time[d][i]);
			} else if (complete && m->block[d][i] != M_NONE) {
				fail(__FILE__, __LINE__, "op %u: dev %u slot %u lost",
				     op, d, i);
			}
		} else if (what < 9600) {
			tsp_mc_invalidate(mc, d, virt_of(i));
			model_set(m, d, i, M_NONE, 0);
		} else if (what < 9980) {
			/* Short or long ranges, in slot space. */
			j = i + (rnd_below(16) ? rnd_below(20) : rnd_below(M_VIRTS));
			if (j > M_VIRTS)
				j = M_VIRTS;
			begin = virt_of(i);
			end = j == M_VIRTS ? U64_MAX : virt_of(j);
			tsp_mc_invalidate_range(mc, d, begin, end);
			for (; i < j; i++)
				model_set(m, d, i, M_NONE, 0);
		} else if (what < 9995) {
			tsp_mc_invalidate_dev(mc, d);
			for (i = 0; i < M_VIRTS; i++)
				model_set(m, d, i, M_NONE, 0);
		} else {
			tsp_mc_clear(mc);
			for (d = 0; d < M_DEVS; d++)
				for (i = 0; i < M_VIRTS; i++)
					model_set(m, d, i, M_NONE, 0);
		}
		/* What the model dropped is also gone from the cache. */
		if (op % 5000 == 4999)
			model_check_all(mc, m, complete);
	}
	model_check_all(mc, m, complete);
	unsetenv("TSP_FAIL_NOWAIT");

	tsp_mc_get_stats(mc, &st);
	if (complete)
		CHECK(st.evictions == 0);
	else
		CHECK(st.evictions > 0 && hits > 0);
	if (fail_nowait)
		CHECK_R(st.buckets, 64 << 2);	/* never grew */
	printf("     budget %7llu%s: %llu entries max, %llu buckets, %llu lookups, %llu hits, %llu evictions\n",
	       (unsigned long long)budget, fail_nowait ? " (no memory)" : "",
	       (unsigned long long)st.max_entries, (unsigned long long)st.buckets,
	       (unsigned long long)lookups, (unsigned long long)hits,
	       (unsigned long long)st.evictions);
	tsp_mc_destroy(mc);
	free(m);
	check_no_leaks();
}

static void test_model(void)
{
	unsigned int nr_ops = quick ? 40000 : 200000;

	phase = "model";
	model_run(8u << 20, false, nr_ops);	/* everything fits */
	model_run(32u << 10, false, nr_ops);	/* some eviction */
	model_run(4u << 10, false, nr_ops);	/* 192 entries */
	model_run(800, false, nr_ops);		/* two shards of 4 buckets */
	model_run(1u << 20, true, nr_ops / 4);	/* tables cannot grow */
	printf("ok   %s\n", phase);
}

/* ------------------------------------------------------------------ */
/* concurrency                                                         */
/* ------------------------------------------------------------------ */

#define C_DEVS 2
#define C_VIRTS 2048
#define C_KEYS (C_DEVS * C_VIRTS)
#define C_READERS 3
#define C_WRITERS 2
#define C_GEN_BITS 28	/* and 12 bits of key: C_KEYS <= 4096 */

/*
 * Key k is (dev k / C_VIRTS, virt k % C_VIRTS); writer w owns the keys
 * with k % C_WRITERS == w (except for clear, range and device
 * invalidations, which writer 0 does under c_big_lock, while writer 1
 * waits).  Generation g of key k is the value (block k << C_GEN_BITS | g,
 * time gen_time(g)): a block below 2^40, as the cache requires.
 */
struct c_key {
	u64 published;	/* highest generation handed to tsp_mc_insert() */
	u64 floor;	/* generations below are gone for new lookups */
} ____cacheline_aligned_in_smp;

static struct c_key c_keys[C_KEYS];
static struct tsp_mapping_cache *c_mc;
static bool c_stop;
static pthread_rwlock_t c_big_lock = PTHREAD_RWLOCK_INITIALIZER;
static u64 c_reader_lookups[C_READERS], c_reader_hits[C_READERS];
static u64 c_writer_ops[C_WRITERS];

static u32 gen_time(u64 g)
{
	return (u32)(g * 2654435761u) & 0xffffff;
}

static u64 c_dev(u32 k)
{
	return k / C_VIRTS + 1;
}

static u64 c_virt(u32 k)
{
	return (k % C_VIRTS) * 3;	/* gaps, for ranges */
}

static void *c_reader(void *arg)
{
	unsigned int id = (unsigned long)arg;
	u64 state = seed ^ (0x1000 + id), seen[C_KEYS] = { 0 };
	u64 lookups = 0, hits = 0, block;
	u32 time;

	tsp_user_rcu_register_thread();
	while (!__atomic_load_n(&c_stop, __ATOMIC_ACQUIRE)) {
		u32 k = rnd_next(&state) % C_KEYS;
		u64 floor = __atomic_load_n(&c_keys[k].floor, __ATOMIC_ACQUIRE);
		u64 g, published;

		lookups++;
		if (!lookup(c_mc, c_dev(k), c_virt(k), &block, &time))
			continue;
		hits++;
		published = __atomic_load_n(&c_keys[k].published, __ATOMIC_ACQUIRE);
		g = block & ((1ULL << C_GEN_BITS) - 1);
		if (block >> C_GEN_BITS != k || time != gen_time(g) || g == 0)
			fail(__FILE__, __LINE__,
			     "reader %u: key %u returned (%#llx, %#x): not its value",
			     id, k, (unsigned long long)block, time);
		if (g > published)
			fail(__FILE__, __LINE__,
			     "reader %u: key %u generation %llu not published (%llu)",
			     id, k, (unsigned long long)g,
			     (unsigned long long)published);
		if (g < floor)
			fail(__FILE__, __LINE__,
			     "reader %u: key %u generation %llu is stale (gone below %llu)",
			     id, k, (unsigned long long)g, (unsigned long long)floor);
		if (g < seen[k])
			fail(__FILE__, __LINE__,
			     "reader %u: key %u went back from %llu to %llu",
			     id, k, (unsigned long long)seen[k],
			     (unsigned long long)g);
		seen[k] = g;
	}
	tsp_user_rcu_unregister_thread();
	c_reader_lookups[id] = lookups;
	c_reader_hits[id] = hits;
	return NULL;
}

/* Key @k's generations so far are all gone. */
static void c_kill(u32 k)
{
	__atomic_store_n(&c_keys[k].floor,
			 __atomic_load_n(&c_keys[k].published, __ATOMIC_RELAXED) + 1,
			 __ATOMIC_RELEASE);
}

static void *c_writer(void *arg)
{
	unsigned int id = (unsigned long)arg;
	u64 state = seed ^ (0x2000 + id), ops = 0;
	u32 k, d, a, b;

	while (!__atomic_load_n(&c_stop, __ATOMIC_ACQUIRE)) {
		unsigned int what = rnd_next(&state) % 1000;

		k = (rnd_next(&state) % (C_KEYS / C_WRITERS)) * C_WRITERS + id;
		ops++;
		if (what < 700) {
			u64 g = c_keys[k].published + 1;

			CHECK(g < (1ULL << C_GEN_BITS));

			pthread_rwlock_rdlock(&c_big_lock);
			__atomic_store_n(&c_keys[k].published, g, __ATOMIC_RELEASE);
			tsp_mc_insert(c_mc, c_dev(k), c_virt(k), (u64)k << C_GEN_BITS | g,
				      gen_time(g));
			/* Inserted or not, older generations are gone. */
			__atomic_store_n(&c_keys[k].floor, g, __ATOMIC_RELEASE);
			pthread_rwlock_unlock(&c_big_lock);
		} else if (what < 950 || id) {
			pthread_rwlock_rdlock(&c_big_lock);
			tsp_mc_invalidate(c_mc, c_dev(k), c_virt(k));
			c_kill(k);
			pthread_rwlock_unlock(&c_big_lock);
		} else {
			/* Operations on many keys, both writers' keys. */
			what = rnd_next(&state) % 1000;
			pthread_rwlock_wrlock(&c_big_lock);
			d = rnd_next(&state) % C_DEVS;
			if (what < 980) {
				a = rnd_next(&state) % C_VIRTS;
				b = a + rnd_next(&state) % (what < 900 ? 8 : C_VIRTS);
				if (b > C_VIRTS)
					b = C_VIRTS;
				tsp_mc_invalidate_range(c_mc, d + 1, c_virt(a),
							c_virt(b - 1) + 1);
				for (; a < b; a++)
					c_kill(d * C_VIRTS + a);
			} else if (what < 998) {
				tsp_mc_invalidate_dev(c_mc, d + 1);
				for (a = 0; a < C_VIRTS; a++)
					c_kill(d * C_VIRTS + a);
			} else {
				tsp_mc_clear(c_mc);
				for (k = 0; k < C_KEYS; k++)
					c_kill(k);
			}
			pthread_rwlock_unlock(&c_big_lock);
		}
	}
	c_writer_ops[id] = ops;
	return NULL;
}

/* @fits: the budget holds every key, so nothing may be evicted. */
static void concurrency_run(u64 budget, bool fits, double seconds)
{
	pthread_t readers[C_READERS], writers[C_WRITERS];
	struct tsp_mc_stats st;
	u64 lookups = 0, hits = 0, wops = 0;
	unsigned long i;

	memset(c_keys, 0, sizeof(c_keys));
	c_stop = false;
	CHECK_R(tsp_mc_create(budget, &c_mc), 0);
	for (i = 0; i < C_READERS; i++)
		CHECK_R(pthread_create(&readers[i], NULL, c_reader, (void *)i), 0);
	for (i = 0; i < C_WRITERS; i++)
		CHECK_R(pthread_create(&writers[i], NULL, c_writer, (void *)i), 0);
	usleep((useconds_t)(seconds * 1e6));
	__atomic_store_n(&c_stop, true, __ATOMIC_RELEASE);
	for (i = 0; i < C_WRITERS; i++) {
		pthread_join(writers[i], NULL);
		wops += c_writer_ops[i];
	}
	for (i = 0; i < C_READERS; i++) {
		pthread_join(readers[i], NULL);
		lookups += c_reader_lookups[i];
		hits += c_reader_hits[i];
	}
	tsp_mc_get_stats(c_mc, &st);
	CHECK_R(st.hits, hits);
	CHECK_R(st.hits + st.misses, lookups);
	CHECK(hits > 0 && wops > 0);
	if (fits)
		CHECK(st.evictions == 0 && st.buckets > 64 << 2);
	else
		CHECK(st.evictions > 0);
	printf("     budget %7llu: %llu writer ops, %llu lookups, %llu hits, %llu evictions, %llu buckets\n",
	       (unsigned long long)budget, (unsigned long long)wops,
	       (unsigned long long)lookups, (unsigned long long)hits,
	       (unsigned long long)st.evictions, (unsigned long long)st.buckets);
	tsp_mc_destroy(c_mc);
	c_mc = NULL;
	check_no_leaks();
}

static void test_concurrency(void)
{
	double t = quick ? 0.5 : 2.0;

	phase = "concurrency";
	concurrency_run(1u << 20, true, t);	/* tables grow */
	concurrency_run(8u << 10, false, t);	/* constant eviction */
	concurrency_run(64u << 10, false, t);	/* some; tables grow */
	printf("ok   %s\n", phase);
}

/* ------------------------------------------------------------------ */
/* metadata                                                            */
/* ------------------------------------------------------------------ */

struct pool {
	char path[256];
	struct block_device *bdev;
	struct tsp_pool_metadata *pmd;
};

static void pool_create(struct pool *p)
{
	const char *dir = access("/dev/shm", W_OK) ? "/tmp" : "/dev/shm";
	int fd;

	snprintf(p->path, sizeof(p->path), "%s/tsp-mc-XXXXXX", dir);
	fd = mkstemp(p->path);
	CHECK(fd >= 0);
	CHECK(!ftruncate(fd, 4096 * 4096));
	close(fd);
	p->bdev = tsp_bdev_open(p->path, false);
	CHECK(p->bdev);
	CHECK_R(tsp_pool_metadata_open(p->bdev, 128, 100000, true, &p->pmd), 0);
}

static void pool_destroy(struct pool *p)
{
	CHECK_R(tsp_pool_metadata_close(p->pmd), 0);
	tsp_bdev_close(p->bdev);
	unlink(p->path);
}

/* pool_destroy(), checking the metadata with thin_check (if installed). */
static void pool_destroy_checked(struct pool *p)
{
	char cmd[320];

	CHECK_R(tsp_pool_metadata_close(p->pmd), 0);
	tsp_bdev_close(p->bdev);
	snprintf(cmd, sizeof(cmd),
		 "! command -v thin_check >/dev/null || thin_check -q %s", p->path);
	CHECK_R(system(cmd), 0);
	unlink(p->path);
}

static int fast(struct tsp_thin_device *td, tsp_block_t virt,
		struct tsp_thin_lookup_result *res)
{
	int r;

	res->block = ~0ULL;
	rcu_read_lock();
	r = tsp_thin_find_block_fast(tsp_thin_fast_of(td), virt, res);
	rcu_read_unlock();
	return r;
}

#define FAST_HIT(td, v, b, sh)						\
	do {								\
		struct tsp_thin_lookup_result __res;			\
		CHECK_R(fast(td, v, &__res), 0);			\
		CHECK_R(__res.block, b);				\
		CHECK_R(__res.shared, sh);				\
	} while (0)

#define FAST_MISS(td, v)						\
	do {								\
		struct tsp_thin_lookup_result __res;			\
		CHECK_R(fast(td, v, &__res), -EWOULDBLOCK);		\
	} while (0)

#define N_MAPPED 100

static void test_metadata(void)
{
	struct tsp_thin_device *td1, *td2, *td;
	struct tsp_thin_lookup_result res;
	tsp_block_t block[N_MAPPED], b, tb, te, pb;
	struct tsp_new_mapping batch[3];
	LIST_HEAD(batch_list);
	unsigned int nr_inserted;
	struct tsp_mc_stats st;
	struct pool p;
	bool shared;
	u64 v;
	int r;

	phase = "metadata";
	pool_create(&p);
	CHECK_R(tsp_pool_create_thin(p.pmd, 1), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &td1), 0);

	/* Inserted mappings are cached as they are made. */
	for (v = 0; v < N_MAPPED; v++) {
		CHECK_R(tsp_pool_alloc_data_block(p.pmd, &block[v]), 0);
		CHECK_R(tsp_thin_insert_block(td1, v, block[v]), 0);
	}
	for (v = 0; v < N_MAPPED; v++)
		FAST_HIT(td1, v, block[v], false);
	/* Past the highest mapping: a miss without a cache lookup. */
	FAST_MISS(td1, N_MAPPED);
	CHECK_R(tsp_pool_cache_stats(p.pmd, &st), 0);
	CHECK(st.entries == N_MAPPED && st.hits == N_MAPPED && st.misses == 0);

	/* A new cache is empty; the slow paths fill it. */
	CHECK_R(tsp_pool_metadata_set_cache_budget(p.pmd, 1 << 20), 0);
	FAST_MISS(td1, 0);
	CHECK_R(tsp_pool_cache_stats(p.pmd, &st), 0);
	CHECK(st.entries == 0 && st.misses == 1);
	CHECK_R(tsp_thin_find_block(td1, 0, &res), 0);
	CHECK(res.block == block[0] && !res.shared);
	FAST_HIT(td1, 0, block[0], false);
	CHECK_R(tsp_thin_find_mapped_range(td1, 1, N_MAPPED, &tb, &te, &pb,
					   &shared), 0);
	CHECK(tb == 1 && pb == block[1] && te > 1);
	for (v = 1; v < te; v++)
		FAST_HIT(td1, v, block[v], false);
	CHECK_R(tsp_thin_find_block(td1, N_MAPPED, &res), -ENODATA);
	FAST_MISS(td1, N_MAPPED);
	for (v = 0; v < N_MAPPED; v++)
		CHECK_R(tsp_thin_find_block(td1, v, &res), 0);

	/* Unmapping: gone from the fast path before the call returns. */
	CHECK_R(tsp_thin_remove_block(td1, 5), 0);
	FAST_MISS(td1, 5);
	CHECK_R(tsp_thin_find_block(td1, 5, &res), -ENODATA);
	CHECK_R(tsp_thin_remove_range(td1, 10, 20), 0);
	CHECK_R(tsp_thin_remove_range(td1, 60, 1ULL << 40), 0);
	for (v = 0; v < N_MAPPED; v++) {
		if (v == 5 || (v >= 10 && v < 20) || v >= 60)
			FAST_MISS(td1, v);
		else
			FAST_HIT(td1, v, block[v], false);
	}
	/* Remapping replaces the cached block. */
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 30, b), 0);
	block[30] = b;
	FAST_HIT(td1, 30, b, false);

	/*
	 * A batch maps and caches in list order up to its first failure: a
	 * data block beyond the data device (refused, the metadata stays
	 * usable).  Then the rest of the batch again.
	 */
	for (v = 0; v < ARRAY_SIZE(batch); v++) {
		batch[v].td = td1;
		batch[v].virt = 700 + v;
		CHECK_R(tsp_pool_alloc_data_block(p.pmd, &batch[v].data), 0);
		list_add_tail(&batch[v].list, &batch_list);
	}
	b = batch[1].data;
	batch[1].data = 1ULL << 40;
	CHECK_R(tsp_pool_insert_mappings(p.pmd, &batch_list, &nr_inserted),
		-EINVAL);
	CHECK_R(nr_inserted, 1);
	FAST_HIT(td1, 700, batch[0].data, false);
	FAST_MISS(td1, 701);
	FAST_MISS(td1, 702);
	CHECK_R(tsp_thin_find_block(td1, 702, &res), -ENODATA);
	batch[1].data = b;
	list_del(&batch[0].list);
	CHECK_R(tsp_pool_insert_mappings(p.pmd, &batch_list, &nr_inserted), 0);
	CHECK_R(nr_inserted, 2);
	for (v = 0; v < ARRAY_SIZE(batch); v++) {
		FAST_HIT(td1, 700 + v, batch[v].data, false);
		CHECK_R(tsp_thin_remove_block(td1, 700 + v), 0);
	}
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);

	/* A snapshot: the origin's old mappings are now shared. */
	CHECK_R(tsp_pool_create_snap(p.pmd, 2, 1), 0);
	FAST_HIT(td1, 0, block[0], true);
	FAST_HIT(td1, 30, block[30], true);
	CHECK_R(tsp_thin_find_block(td1, 0, &res), 0);
	CHECK(res.shared);
	/* Breaking sharing: a new block, exclusively owned. */
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 0, b), 0);
	block[0] = b;
	FAST_HIT(td1, 0, b, false);
	/* The snapshot has its own (empty) cache entries, filled on demand. */
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 2, &td2), 0);
	FAST_MISS(td2, 1);
	CHECK_R(tsp_thin_find_block(td2, 1, &res), 0);
	FAST_HIT(td2, 1, block[1], true);
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);

	/* Abort: everything uncommitted goes, and the whole cache with it. */
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 500, b), 0);
	FAST_HIT(td1, 500, b, false);
	CHECK_R(tsp_thin_remove_block(td1, 1), 0);
	CHECK_R(tsp_pool_abort_metadata(p.pmd), 0);
	FAST_MISS(td1, 500);
	FAST_MISS(td1, 2);
	FAST_MISS(td2, 1);
	CHECK_R(tsp_thin_find_block(td1, 500, &res), -ENODATA);
	CHECK_R(tsp_thin_find_block(td1, 1, &res), 0);	/* back */
	CHECK(res.block == block[1] && res.shared);
	FAST_HIT(td1, 1, block[1], true);
	CHECK_R(tsp_pool_cache_stats(p.pmd, &st), 0);
	CHECK_R(st.entries, 1);
	/*
	 * Writes to td1 may have been lost, so its flushes must fail, until
	 * its last opener closes it; td2 lost nothing.
	 */
	CHECK(tsp_thin_aborted_changes(td1));
	CHECK(!tsp_thin_aborted_changes(td2));
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &td), 0);
	CHECK(td == td1 && tsp_thin_aborted_changes(td));
	tsp_pool_close_thin_device(td);
	CHECK(tsp_thin_aborted_changes(td1));
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	CHECK(tsp_thin_aborted_changes(td1));
	tsp_pool_close_thin_device(td1);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &td1), 0);
	CHECK(!tsp_thin_aborted_changes(td1));

	/* Deleting a device drops its entries: a new one of that id misses. */
	CHECK_R(tsp_thin_find_block(td2, 2, &res), 0);
	tsp_pool_close_thin_device(td2);
	CHECK_R(tsp_pool_delete_thin_device(p.pmd, 2), 0);
	CHECK_R(tsp_pool_create_thin(p.pmd, 2), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 2, &td2), 0);
	FAST_MISS(td2, 1);
	FAST_MISS(td2, 2);
	CHECK_R(tsp_pool_cache_stats(p.pmd, &st), 0);
	CHECK_R(st.entries, 1);
	tsp_pool_close_thin_device(td2);

	/*
	 * A device open when its creation is aborted is gone: its lookups
	 * fail, they do not find every block unmapped.
	 */
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	CHECK_R(tsp_pool_create_thin(p.pmd, 3), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 3, &td2), 0);
	CHECK_R(tsp_thin_find_block(td2, 7, &res), -ENODATA);
	CHECK_R(tsp_pool_abort_metadata(p.pmd), 0);
	CHECK_R(tsp_thin_find_block(td2, 7, &res), -ENODEV);
	/* Not created again while that handle is open: two would share it. */
	CHECK_R(tsp_pool_create_thin(p.pmd, 3), -EBUSY);
	tsp_pool_close_thin_device(td2);
	CHECK_R(tsp_pool_create_thin(p.pmd, 3), 0);
	CHECK_R(tsp_pool_delete_thin_device(p.pmd, 3), 0);

	/* A budget of 0: nothing cached, every fast lookup misses. */
	CHECK_R(tsp_pool_metadata_set_cache_budget(p.pmd, 0), 0);
	CHECK_R(tsp_thin_find_block(td1, 1, &res), 0);
	FAST_MISS(td1, 1);
	CHECK_R(tsp_pool_metadata_set_cache_budget(p.pmd, TSP_MC_DEFAULT_BUDGET), 0);

	/*
	 * Read only while the data space map keeps a bitmap write locked
	 * (the last allocation's): unlocked first, so the block manager
	 * drops its pins without a warning, and written at the next commit.
	 */
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 700, b), 0);
	tsp_pool_metadata_read_only(p.pmd);
	tsp_pool_metadata_read_write(p.pmd);
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 701, b), 0);
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	CHECK_R(tsp_pool_check(p.pmd), 0);

	/*
	 * An update fails, and the metadata goes read only (a read-only
	 * reload) before the failure is dealt with: giving up still aborts
	 * the update, and keeps needs_check in core, where the pool's resume
	 * sees it; read only metadata writes nothing, so an abort after
	 * going writable again finds the flag gone from disk.
	 */
	tsp_user_fail_alloc_after(0);
	r = tsp_pool_create_thin(p.pmd, 9);
	tsp_user_fail_alloc_after(-1);
	CHECK_R(r, -ENOMEM);
	CHECK(tsp_pool_metadata_needs_abort(p.pmd));
	tsp_pool_metadata_read_only(p.pmd);
	CHECK_R(tsp_pool_metadata_fail(p.pmd), 0);
	CHECK(!tsp_pool_metadata_needs_abort(p.pmd));
	CHECK(tsp_pool_metadata_needs_check(p.pmd));
	CHECK_R(tsp_thin_find_block(td1, 701, &res), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 9, &td2), -ENODATA);
	tsp_pool_metadata_read_write(p.pmd);
	CHECK_R(tsp_pool_abort_metadata(p.pmd), 0);
	CHECK(!tsp_pool_metadata_needs_check(p.pmd));

	/*
	 * Giving up after a failure: aborted, needs_check committed, read
	 * only; a second call (another failure) changes nothing.
	 */
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 800, b), 0);
	CHECK(!tsp_pool_metadata_needs_check(p.pmd));
	CHECK_R(tsp_pool_metadata_fail(p.pmd), 0);
	CHECK(tsp_pool_metadata_needs_check(p.pmd));
	FAST_MISS(td1, 800);
	CHECK_R(tsp_thin_find_block(td1, 800, &res), -ENODATA);
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), -EPERM);
	CHECK_R(tsp_pool_metadata_fail(p.pmd), 0);
	tsp_pool_metadata_read_write(p.pmd);

	/* A new handle: the abort above marked td1's. */
	CHECK(tsp_thin_aborted_changes(td1));
	tsp_pool_close_thin_device(td1);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &td1), 0);

	/* A commit fails: the abort drops td1's change, which it did not commit. */
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 900, b), 0);
	tsp_bdev_fail_writes(p.bdev, true);
	r = tsp_pool_commit_metadata(p.pmd);
	tsp_bdev_fail_writes(p.bdev, false);
	CHECK_R(r, -EIO);
	CHECK(!tsp_thin_aborted_changes(td1));
	/* As the pool gives up: abort, then commit needs_check. */
	CHECK_R(tsp_pool_metadata_fail(p.pmd), 0);
	CHECK(tsp_thin_aborted_changes(td1));
	CHECK_R(tsp_thin_find_block(td1, 900, &res), -ENODATA);
	tsp_pool_metadata_read_write(p.pmd);
	tsp_pool_close_thin_device(td1);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &td1), 0);

	/* A failed update empties the cache (the metadata is in doubt). */
	CHECK_R(tsp_thin_find_block(td1, 1, &res), 0);
	FAST_HIT(td1, 1, block[1], true);
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td1, 600, b), 0);
	tsp_bdev_crash_at(p.bdev, tsp_bdev_events(p.bdev));
	CHECK(tsp_pool_commit_metadata(p.pmd) < 0);
	FAST_MISS(td1, 1);
	FAST_MISS(td1, 600);
	CHECK_R(tsp_thin_find_block(td1, 1, &res), -EPERM);
	FAST_MISS(td1, 1);
	CHECK_R(tsp_bdev_crash_apply(p.bdev, TSP_CRASH_DROP_VOLATILE), 0);

	tsp_pool_close_thin_device(td1);
	tsp_pool_metadata_close(p.pmd);
	tsp_bdev_close(p.bdev);
	unlink(p.path);
	check_no_leaks();
	printf("ok   %s\n", phase);
}

/*
 * The pool's passdowns: blocks a commit frees stay out of allocation
 * until released, and an abort releases them.  A fresh pool allocates
 * from block 0 up.
 */
static void test_hold_freed(void)
{
	struct tsp_thin_device *td;
	struct pool p;
	tsp_block_t b, v, nf, na;

	phase = "hold_freed";
	pool_create(&p);
	CHECK_R(tsp_pool_create_thin(p.pmd, 1), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &td), 0);
	for (v = 0; v < 10; v++) {
		CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
		CHECK_R(b, v);
		CHECK_R(tsp_thin_insert_block(td, v, b), 0);
	}
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);

	/*
	 * Held in the newer generation, then in the older, then free; the
	 * allocatable count leaves them out while they are held.
	 */
	CHECK_R(tsp_thin_remove_range(td, 0, 2), 0);
	CHECK_R(tsp_pool_get_free_block_count(p.pmd, &nf), 0);
	CHECK_R(tsp_pool_get_allocatable_block_count(p.pmd, false, &na), 0);
	CHECK(na == nf);
	CHECK_R(tsp_pool_get_allocatable_block_count(p.pmd, true, &na), 0);
	CHECK(na == nf - 2);
	CHECK_R(tsp_pool_commit_metadata_hold_freed(p.pmd), 0);
	CHECK_R(tsp_pool_get_allocatable_block_count(p.pmd, false, &na), 0);
	CHECK(na == nf - 2);
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(b, 10);
	tsp_pool_release_held_blocks(p.pmd);
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(b, 11);
	tsp_pool_release_held_blocks(p.pmd);
	CHECK_R(tsp_pool_get_free_block_count(p.pmd, &nf), 0);
	CHECK_R(tsp_pool_get_allocatable_block_count(p.pmd, false, &na), 0);
	CHECK(na == nf);
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK_R(b, 0);

	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	CHECK_R(tsp_thin_remove_range(td, 2, 3), 0);
	CHECK_R(tsp_pool_commit_metadata_hold_freed(p.pmd), 0);
	CHECK_R(tsp_pool_abort_metadata(p.pmd), 0);
	CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
	CHECK(b == 1 || b == 2);

	tsp_pool_close_thin_device(td);
	pool_destroy(&p);
	check_no_leaks();
	printf("ok   %s\n", phase);
}

/* Free data blocks of @p now. */
static tsp_block_t nr_free(struct pool *p)
{
	tsp_block_t n;

	CHECK_R(tsp_pool_get_free_block_count(p->pmd, &n), 0);
	return n;
}

/* A refused provision of @virt changed nothing. */
static void expect_refused(struct pool *p, struct tsp_thin_device *td,
			   tsp_block_t virt, tsp_block_t free_before)
{
	struct tsp_thin_lookup_result res;
	tsp_block_t b;

	CHECK_R(tsp_thin_provision_nowait(td, virt, 0, 0, &b), -EWOULDBLOCK);
	CHECK_R(nr_free(p), free_before);
	CHECK_R(tsp_thin_find_block(td, virt, &res), -ENODATA);
	FAST_MISS(td, virt);
}

/* Blocking allocation and insert, as the pool's worker does them. */
static tsp_block_t provision_blocking(struct tsp_pool_metadata *pmd,
				      struct tsp_thin_device *td,
				      tsp_block_t virt)
{
	tsp_block_t b;

	CHECK_R(tsp_pool_alloc_data_block(pmd, &b), 0);
	CHECK_R(tsp_thin_insert_block(td, virt, b), 0);
	return b;
}

#define NW_VIRTS 20000

/*
 * tsp_thin_provision_nowait(): after a commit (every node and bitmap on
 * the way shared with it), where a node must split and no new block is
 * prepared, and where it would
 * leave no more than its keep_free blocks free, it is refused and
 * changes nothing, not even which block the next allocation hands out;
 * otherwise it maps as a blocking allocation and insert do.  Then a
 * random mix of it with blocking provisions (tsp_thin_provision(), and
 * allocation then insert), removals, a snapshot and commits, against a
 * model, ending with tsp_pool_check() and thin_check (if installed)
 * clean.
 */
static void test_provision_nowait(void)
{
	static tsp_block_t model[NW_VIRTS];	/* data block + 1, 0: unmapped */
	static tsp_block_t snap_model[NW_VIRTS];	/* model[] at the snapshot */
	struct tsp_thin_lookup_result res;
	unsigned int ok = 0, refused = 0, random_ok = 0, mapped_seen = 0, i;
	struct tsp_thin_device *td, *snap;
	tsp_block_t b, v, mapped, free_before;
	struct tsp_pool_space space;
	struct pool p;
	int r;

	phase = "provision_nowait";
	pool_create(&p);
	CHECK_R(tsp_pool_create_thin(p.pmd, 1), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &td), 0);
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);

	expect_refused(&p, td, 0, nr_free(&p));
	CHECK(!tsp_pool_changed_this_transaction(p.pmd));

	/* Once a blocking update has copied them, no copy is needed. */
	CHECK_R(provision_blocking(p.pmd, td, 0), 0);
	for (v = 1; v < 100; v++) {
		CHECK_R(tsp_thin_provision_nowait(td, v, 0, 0, &b), 0);
		CHECK_R(b, v);
		FAST_HIT(td, v, b, false);
	}
	/* Mapped: nothing changes, and block 100 is still the next one. */
	free_before = nr_free(&p);
	CHECK_R(tsp_thin_provision_nowait(td, 5, 0, 0, &b), -EEXIST);
	CHECK_R(tsp_thin_provision_nowait(td, 99, 0, 0, &b), -EEXIST);
	CHECK_R(nr_free(&p), free_before);
	CHECK_R(tsp_thin_find_block(td, 5, &res), 0);
	CHECK_R(res.block, 5);
	/* Not the block that would leave only @keep_free free. */
	CHECK_R(tsp_thin_provision_nowait(td, 100, nr_free(&p) - 1, 0, &b),
		-EWOULDBLOCK);
	CHECK_R(tsp_thin_provision(td, 100, nr_free(&p) - 1, &res),
		-EWOULDBLOCK);
	/* Nor where only @metadata_keep_free metadata blocks are free. */
	CHECK_R(tsp_pool_get_space(p.pmd, &space), 0);
	CHECK_R(tsp_thin_provision_nowait(td, 100, 0, space.metadata_free, &b),
		-EWOULDBLOCK);
	CHECK_R(nr_free(&p), free_before);
	CHECK_R(tsp_thin_provision_nowait(td, 100, nr_free(&p) - 2,
					  space.metadata_free - 1, &b), 0);
	CHECK_R(b, 100);
	CHECK_R(tsp_thin_get_mapped_count(td, &mapped), 0);
	CHECK_R(mapped, 101);

	/*
	 * Leaves fill up; a split needs a new node.  The first is refused,
	 * none being prepared; the blocking provision after it prepares
	 * some for the next splits (tsp_tm_prepare_new_blocks()).
	 */
	for (v = 101; v < 5000; v++) {
		free_before = nr_free(&p);
		r = tsp_thin_provision_nowait(td, v, 0, 0, &b);
		if (r == -EWOULDBLOCK) {
			refused++;
			CHECK_R(nr_free(&p), free_before);
			CHECK_R(tsp_thin_find_block(td, v, &res), -ENODATA);
			b = provision_blocking(p.pmd, td, v);
		} else {
			CHECK_R(r, 0);
			ok++;
		}
		CHECK_R(b, v);
	}
	CHECK(refused > 0 && ok > 500 * refused);
	for (v = 0; v < 5000; v++)
		model[v] = v + 1;

	snap = NULL;
	for (i = 0; i < (quick ? 20000 : 100000); i++) {
		unsigned int op = rnd_below(100);

		free_before = nr_free(&p);
		v = rnd_below(NW_VIRTS);
		if (op < 50) {
			r = tsp_thin_provision_nowait(td, v, 0, 0, &b);
			if (model[v]) {
				/* Refused if the way to its leaf is not copied. */
				CHECK(r == -EEXIST || r == -EWOULDBLOCK);
				mapped_seen += r == -EEXIST;
				CHECK_R(nr_free(&p), free_before);
				CHECK_R(tsp_thin_find_block(td, v, &res), 0);
				CHECK_R(res.block, model[v] - 1);
			} else if (r == -EWOULDBLOCK) {
				CHECK_R(nr_free(&p), free_before);
				CHECK_R(tsp_thin_find_block(td, v, &res), -ENODATA);
			} else {
				CHECK_R(r, 0);
				CHECK_R(nr_free(&p), free_before - 1);
				model[v] = b + 1;
				random_ok++;
			}
		} else if (op < 60) {
			if (!model[v])
				model[v] = provision_blocking(p.pmd, td, v) + 1;
		} else if (op < 70) {
			r = tsp_thin_provision(td, v, 0, &res);
			if (model[v]) {
				CHECK_R(r, -EEXIST);
				CHECK_R(res.block, model[v] - 1);
				CHECK_R(res.shared, model[v] == snap_model[v]);
				CHECK_R(nr_free(&p), free_before);
			} else {
				CHECK_R(r, 0);
				CHECK(!res.shared);
				CHECK_R(nr_free(&p), free_before - 1);
				FAST_HIT(td, v, res.block, false);
				model[v] = res.block + 1;
			}
		} else if (op < 97) {
			CHECK_R(tsp_thin_remove_block(td, v), model[v] ? 0 : -ENODATA);
			model[v] = 0;
		} else if (op < 99 || snap) {
			CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
		} else {
			/* Now every node of the origin is shared. */
			memcpy(snap_model, model, sizeof(model));
			CHECK_R(tsp_pool_create_snap(p.pmd, 2, 1), 0);
			CHECK_R(tsp_pool_open_thin_device(p.pmd, 2, &snap), 0);
		}
	}
	for (v = 0; v < NW_VIRTS; v++) {
		r = tsp_thin_find_block(td, v, &res);
		if (model[v]) {
			CHECK_R(r, 0);
			CHECK_R(res.block, model[v] - 1);
		} else {
			CHECK_R(r, -ENODATA);
		}
	}
	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	/* A block found mapped, or a refusal, leaves nothing to commit. */
	for (v = 0; !model[v]; v++)
		;
	CHECK_R(tsp_thin_provision(td, v, 0, &res), -EEXIST);
	CHECK_R(tsp_thin_provision(td, NW_VIRTS, nr_free(&p), &res),
		-EWOULDBLOCK);
	/* A low water mark of all blocks there could be refuses too. */
	CHECK_R(tsp_thin_provision(td, NW_VIRTS, ~0ULL, &res), -EWOULDBLOCK);
	CHECK_R(tsp_thin_provision_nowait(td, NW_VIRTS, ~0ULL, 0, &b),
		-EWOULDBLOCK);
	CHECK(!tsp_pool_changed_this_transaction(p.pmd));
	CHECK_R(tsp_pool_check(p.pmd), 0);
	/* Not every mapped block refused: most have their path copied. */
	CHECK(mapped_seen > 0);

	if (snap)
		tsp_pool_close_thin_device(snap);
	tsp_pool_close_thin_device(td);
	pool_destroy_checked(&p);
	check_no_leaks();
	printf("ok   %s (%u of the next 4899 provisions refused, %u random ones done, %u found mapped)\n",
	       phase, refused, random_ok, mapped_seen);
}

#define PC_VIRTS 8000

/* Provision @virt as the map path does, or else as the worker does. */
static tsp_block_t provision_any(struct tsp_thin_device *td, tsp_block_t virt)
{
	struct tsp_thin_lookup_result res;
	tsp_block_t b;
	int r = tsp_thin_provision_nowait(td, virt, 0, 0, &b);

	if (r == -EWOULDBLOCK) {
		r = tsp_thin_provision(td, virt, 0, &res);
		b = res.block;
	}
	CHECK_R(r, 0);
	return b;
}

/* Provision [@begin, @end) of @td in order, into @model (block + 1). */
static void provision_run(struct tsp_thin_device *td, tsp_block_t *model,
			  tsp_block_t begin, tsp_block_t end)
{
	for (; begin < end; begin++)
		model[begin] = provision_any(td, begin) + 1;
}

/* Each device maps what its model says, and nothing else. */
static void check_models(struct tsp_thin_device **tds,
			 tsp_block_t (*models)[PC_VIRTS], unsigned int nr)
{
	struct tsp_thin_lookup_result res;
	tsp_block_t v;
	unsigned int d;
	int r;

	for (d = 0; d < nr; d++) {
		for (v = 0; v < PC_VIRTS; v++) {
			r = tsp_thin_find_block(tds[d], v, &res);
			if (!models[d][v]) {
				CHECK_R(r, -ENODATA);
				continue;
			}
			CHECK_R(r, 0);
			CHECK_R(res.block, models[d][v] - 1);
		}
	}
}

/* Close *@td and open a new, empty device @dev in its place. */
static void replace_device(struct tsp_pool_metadata *pmd,
			   struct tsp_thin_device **td, tsp_block_t *model,
			   tsp_thin_id dev)
{
	tsp_pool_close_thin_device(*td);
	CHECK_R(tsp_pool_create_thin(pmd, dev), 0);
	CHECK_R(tsp_pool_open_thin_device(pmd, dev, td), 0);
	memset(model, 0, PC_VIRTS * sizeof(*model));
}

/*
 * A device's provisions in order go straight into the leaf of the last
 * one (its btree cursor).  Anything else that changes the device's tree,
 * shares it or ends the transaction must make the next provision walk
 * down the tree again.  Runs of provisions in order, each after one of:
 * a snapshot in the same transaction (whose mappings must not change),
 * other inserts of the next keys, a range removal that frees the
 * cursor's leaf, a commit, provisions of another device in turn (one
 * device's cursor is kept at a time).  On a new device, inserts that split the
 * root leaf (which the cursor holds); on another, a range removal that
 * moves the lower keys of the cursor's leaf to its sibling.  Every
 * device must map what its model says; then tsp_pool_check() and
 * thin_check (if installed).
 */
static void test_provision_cursor(void)
{
	static tsp_block_t models[2][PC_VIRTS];
	struct tsp_thin_device *tds[2];
	tsp_block_t v;
	struct pool p;

	phase = "provision_cursor";
	pool_create(&p);
	CHECK_R(tsp_pool_create_thin(p.pmd, 1), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &tds[0]), 0);
	provision_run(tds[0], models[0], 0, 1000);

	CHECK_R(tsp_pool_create_snap(p.pmd, 2, 1), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 2, &tds[1]), 0);
	memcpy(models[1], models[0], sizeof(models[0]));
	provision_run(tds[0], models[0], 1000, 2000);
	check_models(tds, models, 2);

	provision_run(tds[0], models[0], 2000, 2100);
	for (v = 2100; v < 2400; v++)
		models[0][v] = provision_blocking(p.pmd, tds[0], v) + 1;
	provision_run(tds[0], models[0], 2400, 2500);
	check_models(tds, models, 2);

	/* The removal frees the leaf. */
	provision_run(tds[0], models[0], 3000, 3100);
	CHECK_R(tsp_thin_remove_range(tds[0], 2000, 3100), 0);
	memset(&models[0][2000], 0, 1100 * sizeof(models[0][0]));
	provision_run(tds[1], models[1], 2000, 2100);
	provision_run(tds[0], models[0], 3100, 3200);
	check_models(tds, models, 2);

	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	provision_run(tds[0], models[0], 3200, 3300);
	provision_run(tds[1], models[1], 3200, 3300);
	check_models(tds, models, 2);

	/* Two devices in turn: each provision parks the other's cursor. */
	for (v = 3300; v < 3600; v++) {
		models[0][v] = provision_any(tds[0], v) + 1;
		models[1][v] = provision_any(tds[1], v) + 1;
	}
	check_models(tds, models, 2);

	/* A leaf that is the root becomes an internal node when it splits. */
	replace_device(p.pmd, &tds[1], models[1], 3);
	provision_run(tds[1], models[1], 0, 100);
	for (v = 100; v < 400; v++)
		models[1][v] = provision_blocking(p.pmd, tds[1], v) + 1;
	provision_run(tds[1], models[1], 400, 500);
	check_models(tds, models, 2);

	/*
	 * Even blocks in order, the last leaf (the cursor's) a little less
	 * than full; emptying most of the leaf before it has the two even
	 * out, which moves the cursor's leaf's lowest keys, and the odd
	 * blocks between them, to the other.
	 */
	replace_device(p.pmd, &tds[1], models[1], 4);
	for (v = 0; v < 2000; v += 2)
		models[1][v] = provision_any(tds[1], v) + 1;
	CHECK_R(tsp_thin_remove_range(tds[1], 1008, 1480), 0);
	memset(&models[1][1008], 0, 472 * sizeof(models[1][0]));
	for (v = 1513; v < 1800; v += 2)
		models[1][v] = provision_any(tds[1], v) + 1;
	check_models(tds, models, 2);

	CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	CHECK_R(tsp_pool_check(p.pmd), 0);

	tsp_pool_close_thin_device(tds[1]);
	tsp_pool_close_thin_device(tds[0]);
	pool_destroy_checked(&p);
	check_no_leaks();
	printf("ok   %s\n", phase);
}

/*
 * Lookups from threads, fast and (every other one) through the btree,
 * while the main thread remaps blocks, commits and replaces the cache.
 * The btree lookups of two readers share the block manager's kept
 * buffers with each other and with the main thread's updates.  "hits"
 * counts the lookups that found a mapping, both kinds.  Mapping generation g of virtual block v is
 * s_hist[v][g]; s_count[v] generations have been handed to the metadata,
 * and s_done[v] is the newest whose insert has returned.  A fast hit
 * must be one of generations s_done[v] (read before the lookup) to
 * s_count[v] - 1 (read after it).
 */
#define S_VIRTS 256
#define S_ROUNDS 100

static struct tsp_thin_device *s_td;
static u64 s_hist[S_VIRTS][S_ROUNDS + 1];
static unsigned int s_count[S_VIRTS], s_done[S_VIRTS];
static bool s_stop;

static void *s_reader(void *arg)
{
	struct tsp_thin_lookup_result res;
	u64 state = seed ^ (0x3000 + (unsigned long)arg), n = 0, i;
	int r;

	tsp_user_rcu_register_thread();
	for (i = 0; !__atomic_load_n(&s_stop, __ATOMIC_ACQUIRE); i++) {
		u32 v = rnd_next(&state) % S_VIRTS;
		unsigned int g, done, count;

		done = __atomic_load_n(&s_done[v], __ATOMIC_ACQUIRE);
		if (i & 1) {
			r = tsp_thin_find_block(s_td, v, &res);
			if (r && r != -ENODATA)
				fail(__FILE__, __LINE__, "virt %u: lookup: %d", v, r);
		} else {
			r = fast(s_td, v, &res);
		}
		if (r)
			continue;
		count = __atomic_load_n(&s_count[v], __ATOMIC_ACQUIRE);
		for (g = done; g < count; g++)
			if (__atomic_load_n(&s_hist[v][g], __ATOMIC_RELAXED) == res.block)
				break;
		if (g == count)
			fail(__FILE__, __LINE__,
			     "virt %u: block %llu is none of generations %u..%u",
			     v, (unsigned long long)res.block, done, count - 1);
		if (res.shared)
			fail(__FILE__, __LINE__, "virt %u: shared", v);
		n++;
	}
	tsp_user_rcu_unregister_thread();
	return (void *)(unsigned long)n;
}

static void test_metadata_concurrent(void)
{
	pthread_t readers[2];
	unsigned long i, hits = 0;
	unsigned int round, rounds = quick ? 20 : S_ROUNDS;
	struct tsp_thin_lookup_result res;
	struct pool p;
	tsp_block_t b;
	u32 v;

	phase = "metadata, concurrent";
	pool_create(&p);
	CHECK_R(tsp_pool_create_thin(p.pmd, 1), 0);
	CHECK_R(tsp_pool_open_thin_device(p.pmd, 1, &s_td), 0);
	memset(s_count, 0, sizeof(s_count));
	memset(s_done, 0, sizeof(s_done));
	s_stop = false;
	for (i = 0; i < ARRAY_SIZE(readers); i++)
		CHECK_R(pthread_create(&readers[i], NULL, s_reader, (void *)i), 0);
	for (round = 0; round <= rounds; round++) {
		for (v = 0; v < S_VIRTS; v += round ? 1 + rnd_below(8) : 1) {
			unsigned int g = s_count[v];

			CHECK_R(tsp_pool_alloc_data_block(p.pmd, &b), 0);
			__atomic_store_n(&s_hist[v][g], b, __ATOMIC_RELAXED);
			__atomic_store_n(&s_count[v], g + 1, __ATOMIC_RELEASE);
			CHECK_R(tsp_thin_insert_block(s_td, v, b), 0);
			__atomic_store_n(&s_done[v], g, __ATOMIC_RELEASE);
		}
		if (round % 10 == 9)
			CHECK_R(tsp_pool_metadata_set_cache_budget(p.pmd,
					round % 20 == 9 ? 1 << 16 : 1 << 20), 0);
		for (v = 0; v < S_VIRTS; v++) {
			CHECK_R(tsp_thin_find_block(s_td, v, &res), 0);
			CHECK_R(res.block, s_hist[v][s_count[v] - 1]);
		}
		CHECK_R(tsp_pool_commit_metadata(p.pmd), 0);
	}
	__atomic_store_n(&s_stop, true, __ATOMIC_RELEASE);
	for (i = 0; i < ARRAY_SIZE(readers); i++) {
		void *n;

		pthread_join(readers[i], &n);
		hits += (unsigned long)n;
	}
	CHECK(hits > 0);
	tsp_pool_close_thin_device(s_td);
	s_td = NULL;
	pool_destroy(&p);
	check_no_leaks();
	printf("ok   %s (%lu hits)\n", phase, hits);
}

int main(int argc, char **argv)
{
	const char *env = getenv("TSP_SEED");

	seed = argc > 1 ? strtoull(argv[1], NULL, 0) :
	       env ? strtoull(env, NULL, 0) : (u64)time(NULL);
	rng = seed;
	quick = getenv("TSP_TEST_QUICK") && !strcmp(getenv("TSP_TEST_QUICK"), "1");
	printf("test-mapping-cache: seed %" PRIu64 "\n", seed);
	setenv("TSP_QUIET", "1", 0);
	setenv("TSP_BUFIO_NOSYNC", "1", 0);

	tsp_user_rcu_register_thread();
	allocs_base = tsp_user_live_allocs();
	test_basic();
	test_model();
	test_concurrency();
	test_metadata();
	test_hold_freed();
	test_provision_nowait();
	test_provision_cursor();
	test_metadata_concurrent();
	tsp_user_rcu_unregister_thread();
	return 0;
}
