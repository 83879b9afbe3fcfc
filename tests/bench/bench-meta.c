// SPDX-License-Identifier: GPL-2.0-only
/*
 * bench-meta.c - throughput of the pool metadata API in userspace.
 *
 * One thin device with N mappings (default 1M, virtual blocks 0..N-1
 * inserted in random order, committed every 10,000), on a metadata image
 * in /dev/shm (or $BENCH_DIR).  Then:
 *
 *   lookups    tsp_thin_find_block() of random mapped virtual blocks, the
 *              whole tree in the block cache (warm); and again with the
 *              default cache bound, for comparison
 *   fast       tsp_thin_find_block_fast() (the map path's lookup in the
 *              RCU mapping cache) of random mapped virtual blocks, every
 *              mapping cached (warm): by 1 and by 2 threads at once over
 *              all N mappings, and by 1 thread over 16,384 of them (what
 *              a lookup costs when its cache lines are in the CPU cache)
 *   inserts    tsp_pool_alloc_data_block() + tsp_thin_insert_block() of
 *              new virtual blocks in random order, with a commit every
 *              1, 100 and 10,000 inserts (commit time included)
 *   provision  tsp_thin_provision_nowait() of new virtual blocks in
 *              random order, as the map path provisions (the blocking
 *              insert when refused), a commit every 10,000
 *   remaps     the same for mapped blocks, each freeing its old data
 *              block (as breaking sharing does), a commit every 100
 *
 * Single threaded but for the 2-thread fast row.  Output: a table of ops,
 * wall seconds, ops/s, us/op and CPU us/op (user + system: what counts
 * when the machine is busy; with 2 threads, us/op is wall time over all
 * their lookups, CPU us/op what one lookup costs).  The target for a
 * cached lookup is well under 1 us (taken as 0.5 us of CPU); the lines
 * after the table say whether it is met.
 *
 * Usage: bench-meta [mappings]  (also $BENCH_MAPPINGS)
 *
 * Locking: the fast rows' threads only do fast lookups (each registered
 * with RCU); everything else is single threaded.
 */
#define DM_MSG_PREFIX "bench-meta"
#include "dm-thin-metadata.h"

#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#define DATA_BLOCK_SECTORS 128
#define COMMIT_EVERY 10000
#define CACHE_ALL "1048576"	/* buffers: more than the whole tree */
#define FAST_OPS 5000000	/* fast lookups per thread */
#define FAST_HOT 16384		/* mappings in the small working set */

static void __attribute__((noreturn)) die(const char *what, int r)
{
	fprintf(stderr, "bench-meta: %s failed: %d\n", what, r);
	exit(1);
}

#define TRY(expr)					\
	do {						\
		int __r = (expr);			\
		if (__r)				\
			die(#expr, __r);		\
	} while (0)

static double clock_s(clockid_t id)
{
	struct timespec ts;

	clock_gettime(id, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Wall time; CPU time of the process (user + system) kept beside it. */
static double cpu_start;

static double start(void)
{
	cpu_start = clock_s(CLOCK_PROCESS_CPUTIME_ID);
	return clock_s(CLOCK_MONOTONIC);
}

static double now(void)
{
	return clock_s(CLOCK_MONOTONIC);
}

static double cpu_since(void)
{
	return clock_s(CLOCK_PROCESS_CPUTIME_ID) - cpu_start;
}

static u64 rng = 0x243f6a8885a308d3ULL;

static u64 rnd(void)
{
	u64 z = (rng += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/* 0..n-1 in random order. */
static u64 *permutation(u64 n)
{
	u64 *perm = malloc(n * sizeof(*perm)), i;

	if (!perm)
		die("malloc", -ENOMEM);
	for (i = 0; i < n; i++)
		perm[i] = i;
	for (i = n; i > 1; i--) {
		u64 j = rnd() % i, x = perm[i - 1];

		perm[i - 1] = perm[j];
		perm[j] = x;
	}
	return perm;
}

struct pool {
	char path[4096];
	struct block_device *bdev;
	struct tsp_pool_metadata *pmd;
	struct tsp_thin_device *td;
};

static void pool_open(struct pool *p, bool format, tsp_block_t nr_data)
{
	p->bdev = tsp_bdev_open(p->path, false);
	if (!p->bdev)
		die("tsp_bdev_open", -errno);
	TRY(tsp_pool_metadata_open(p->bdev, DATA_BLOCK_SECTORS, nr_data, format,
				   &p->pmd));
	if (format)
		TRY(tsp_pool_create_thin(p->pmd, 1));
	TRY(tsp_pool_open_thin_device(p->pmd, 1, &p->td));
}

static void pool_close(struct pool *p)
{
	tsp_pool_close_thin_device(p->td);
	TRY(tsp_pool_metadata_close(p->pmd));
	tsp_bdev_close(p->bdev);
}

static void insert(struct pool *p, tsp_block_t virt)
{
	tsp_block_t data;

	TRY(tsp_pool_alloc_data_block(p->pmd, &data));
	TRY(tsp_thin_insert_block(p->td, virt, data));
}

/* @secs: wall time since now(); CPU time is taken here. */
static double row(const char *what, u64 ops, double secs)
{
	double cpu = cpu_since();

	printf("%-32s %8" PRIu64 " %8.3f %10.0f %9.3f %9.3f\n", what, ops,
	       secs, ops / secs, secs * 1e6 / ops, cpu * 1e6 / ops);
	fflush(stdout);
	return cpu * 1e6 / ops;
}

/* Random lookups of mapped blocks. */
static void lookups(struct pool *p, u64 nr, u64 n)
{
	struct tsp_thin_lookup_result res;
	u64 i;

	for (i = 0; i < n; i++)
		TRY(tsp_thin_find_block(p->td, rnd() % nr, &res));
}

struct fast_arg {
	struct pool *p;
	u64 span;		/* look up virtual blocks 0..span-1 */
	u64 seed;
	u64 misses;
};

/*
 * The map path's lookup, inline everywhere else: out of line here, so
 * that scripts/bench-callgrind can count its instructions.
 */
static noinline int
bench_find_block_fast(const struct tsp_thin_fast *fast, tsp_block_t virt,
		      struct tsp_thin_lookup_result *result)
{
	return tsp_thin_find_block_fast(fast, virt, result);
}

/* FAST_OPS fast lookups of random blocks below @span. */
static void *fast_thread(void *argp)
{
	struct fast_arg *a = argp;
	const struct tsp_thin_fast *fast = tsp_thin_fast_of(a->p->td);
	struct tsp_thin_lookup_result res;
	u64 state = a->seed, misses = 0, i, z;

	tsp_user_rcu_register_thread();
	for (i = 0; i < FAST_OPS; i++) {
		/* splitmix64, inline and per thread */
		z = (state += 0x9e3779b97f4a7c15ULL);
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
		z ^= z >> 31;
		rcu_read_lock();
		if (bench_find_block_fast(fast, z % a->span, &res))
			misses++;
		rcu_read_unlock();
	}
	tsp_user_rcu_unregister_thread();
	a->misses = misses;
	return NULL;
}

/* A row of @nr_threads threads doing fast lookups; returns CPU us/op. */
static double fast_row(const char *what, struct pool *p, u64 span,
		       unsigned int nr_threads)
{
	struct fast_arg args[2];
	pthread_t threads[2];
	unsigned int i;
	u64 misses = 0;
	double t;

	t = start();
	for (i = 0; i < nr_threads; i++) {
		args[i] = (struct fast_arg){ p, span, 0x1234567ULL * (i + 1), 0 };
		if (pthread_create(&threads[i], NULL, fast_thread, &args[i]))
			die("pthread_create", -errno);
	}
	for (i = 0; i < nr_threads; i++) {
		pthread_join(threads[i], NULL);
		misses += args[i].misses;
	}
	t = now() - t;
	if (misses)
		die("fast lookups of cached blocks missed", -(int)misses);
	return row(what, (u64)FAST_OPS * nr_threads, t);
}

int main(int argc, char **argv)
{
	const char *env = getenv("BENCH_MAPPINGS");
	const char *dir = getenv("BENCH_DIR");
	u64 nr = argc > 1 ? strtoull(argv[1], NULL, 0) :
		 env ? strtoull(env, NULL, 0) : 1000000;
	u64 meta_blocks = 4096 + nr / 16, i, *perm, next_virt;
	static const u64 batches[] = { 1, 100, 10000 };
	static const u64 totals[] = { 2000, 50000, 200000 };
	struct tsp_thin_lookup_result res;
	double t, cached_us, fast_us[3];
	struct pool p;
	unsigned int b;
	char what[64];
	int fd;

	setenv("TSP_QUIET", "1", 0);
	if (!dir)
		dir = access("/dev/shm", W_OK) ? "/tmp" : "/dev/shm";
	snprintf(p.path, sizeof(p.path), "%s/tsp-bench-XXXXXX", dir);
	fd = mkstemp(p.path);
	if (fd < 0 || ftruncate(fd, (off_t)meta_blocks * TSP_METADATA_BLOCK_SIZE))
		die("creating the metadata image", -errno);
	close(fd);

	perm = permutation(nr);

	printf("bench-meta: %" PRIu64 " mappings, metadata image %s (%" PRIu64
	       " MiB)\n", nr, p.path, meta_blocks * 4 / 1024);

	/* Build the device: random order, a commit every 10,000. */
	setenv("TSP_BUFIO_BUFFERS", CACHE_ALL, 1);
	pool_open(&p, true, 4 * nr + 1000000);
	t = start();
	for (i = 0; i < nr; i++) {
		insert(&p, perm[i]);
		if ((i + 1) % COMMIT_EVERY == 0)
			TRY(tsp_pool_commit_metadata(p.pmd));
	}
	TRY(tsp_pool_commit_metadata(p.pmd));
	t = now() - t;
	printf("setup: %" PRIu64 " random inserts in %.2f s (%.0f/s), %.2f s CPU\n\n",
	       nr, t, nr / t, cpu_since());
	free(perm);

	printf("%-32s %8s %8s %10s %9s %9s\n", "operation", "ops", "wall s",
	       "ops/s", "us/op", "cpu us/op");

	pool_close(&p);

	/* Reopened, one pass to load every node, then measure. */
	pool_open(&p, false, 0);
	lookups(&p, nr, nr);
	t = start();
	lookups(&p, nr, 2000000);
	cached_us = row("lookup, random, warm cache", 2000000, now() - t);

	/* Every mapping in the mapping cache (room to spare), then fast. */
	TRY(tsp_pool_metadata_set_cache_budget(p.pmd, 64 * nr + (1 << 20)));
	for (i = 0; i < nr; i++)
		TRY(tsp_thin_find_block(p.td, i, &res));
	fast_us[0] = fast_row("fast lookup, warm, 1 thread", &p, nr, 1);
	fast_us[1] = fast_row("fast lookup, warm, 2 threads", &p, nr, 2);
	fast_us[2] = fast_row("fast lookup, warm, 1 thread, hot", &p,
			      min_t(u64, nr, FAST_HOT), 1);
	pool_close(&p);

	/* The default cache bound: misses read from the image. */
	unsetenv("TSP_BUFIO_BUFFERS");
	pool_open(&p, false, 0);
	lookups(&p, nr, 200000);
	t = start();
	lookups(&p, nr, 500000);
	row("lookup, random, default cache", 500000, now() - t);
	pool_close(&p);

	/*
	 * Inserts of new virtual blocks (each once, in random order, past
	 * the mapped ones) in batched commits.
	 */
	setenv("TSP_BUFIO_BUFFERS", CACHE_ALL, 1);
	pool_open(&p, false, 0);
	next_virt = nr;
	for (b = 0; b < ARRAY_SIZE(batches); b++) {
		u64 n = totals[b], *virt = permutation(n);

		t = start();
		for (i = 0; i < n; i++) {
			insert(&p, next_virt + virt[i]);
			if ((i + 1) % batches[b] == 0)
				TRY(tsp_pool_commit_metadata(p.pmd));
		}
		t = now() - t;
		next_virt += n;
		free(virt);
		snprintf(what, sizeof(what), "insert, commit every %" PRIu64,
			 batches[b]);
		row(what, n, t);
	}

	/*
	 * Provisioning as the map path does it: tsp_thin_provision_nowait()
	 * of new virtual blocks in random order (so below the device's
	 * highest mapping: the metadata cannot tell them unmapped without
	 * the tree), a blocking allocation and insert when it is refused,
	 * a commit every 10,000.
	 */
	{
		u64 n = 200000, *virt = permutation(n), refused = 0;
		tsp_block_t data;
		int r;

		t = start();
		for (i = 0; i < n; i++) {
			r = tsp_thin_provision_nowait(p.td, next_virt + virt[i],
						      0, 0, &data);
			if (r == -EWOULDBLOCK) {
				refused++;
				insert(&p, next_virt + virt[i]);
			} else {
				TRY(r);
			}
			if ((i + 1) % COMMIT_EVERY == 0)
				TRY(tsp_pool_commit_metadata(p.pmd));
		}
		t = now() - t;
		next_virt += n;
		free(virt);
		snprintf(what, sizeof(what), "provision nowait (%" PRIu64 "%% refused)",
			 refused * 100 / n);
		row(what, n, t);
	}

	/*
	 * Remapping mapped blocks to new data blocks (as breaking sharing
	 * does): each old data block is freed in the transaction.
	 */
	t = start();
	for (i = 0; i < 20000; i++) {
		insert(&p, rnd() % nr);
		if ((i + 1) % 100 == 0)
			TRY(tsp_pool_commit_metadata(p.pmd));
	}
	t = now() - t;
	row("remap mapped, commit every 100", 20000, t);
	pool_close(&p);
	unlink(p.path);

	printf("\nCPU time is user + system of the process: it is what counts on\n"
	       "a busy machine, where wall time includes waiting for a CPU.\n");
	printf("target: cached lookup well under 1 us (0.5): %.3f us CPU, %s\n",
	       cached_us, cached_us < 0.5 ? "met" : "NOT met");
	printf("target: fast lookup well under 1 us (0.5): %.0f ns CPU (1 thread), "
	       "%.0f ns (2 threads), %.0f ns (hot), %s\n",
	       fast_us[0] * 1000, fast_us[1] * 1000, fast_us[2] * 1000,
	       fast_us[0] < 0.5 && fast_us[1] < 0.5 ? "met" : "NOT met");
	return 0;
}
