// SPDX-License-Identifier: GPL-2.0-only
/*
 * user/compat.c - the userspace bodies behind persistent-data/compat.h:
 * dm log messages, WARN, counted and failable kmalloc, mutexes, spinlocks
 * and rw semaphores with owner tracking, and sort().
 *
 * Messages: "<level>: <prefix>: <message>" on stderr, one write per line.
 * TSP_QUIET=1 in the environment drops "info" lines.  A WARN prints where
 * it fired and aborts: in the tests a WARN is a failure, never a note.
 *
 * Allocation: every kmalloc-family call goes through tsp_user_alloc(),
 * which counts live allocations (tsp_user_live_allocs()) so a test can
 * check a phase left nothing behind, and aligns a power-of-two size
 * naturally (up to a page) as kmalloc does.  Failure injection, for error
 * path tests:
 *   tsp_user_fail_alloc_after(n)  the next n allocations succeed, every
 *                                 one after that fails until
 *                                 tsp_user_fail_alloc_after(-1)
 *   TSP_FAIL_NOWAIT=1 (env)       every GFP_NOWAIT allocation fails, so
 *                                 the non-blocking paths fall back
 *
 * Locks: a mutex or spinlock is a pthread mutex plus the owning thread, so
 * lockdep_assert_held() asks "does *this* thread hold it?".  An rwsem is a
 * pthread rwlock plus the writer and a count of readers; "held" means
 * write held by this thread or read held by anyone (pthreads cannot tell
 * us which threads hold it for read).  Taking a lock this thread already
 * holds, or releasing one it does not hold, is reported and aborts rather
 * than deadlocking or corrupting state silently.
 *
 * Locking: the counters are atomics; the owner fields are written only by
 * the thread holding the lock and read with atomic loads, so the checks
 * are safe under ThreadSanitizer.  Nothing here takes a lock of its own.
 */
#define DM_MSG_PREFIX "compat"
#include "persistent-data/compat.h"

#include <stdarg.h>

/* ------------------------------------------------------------------ */
/* Messages                                                            */
/* ------------------------------------------------------------------ */

static bool env_is_one(const char *name)
{
	const char *v = getenv(name);

	return v && v[0] == '1' && v[1] == '\0';
}

void tsp_user_log(const char *level, const char *prefix, const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	size_t len;

	if (env_is_one("TSP_QUIET") && !strcmp(level, "info"))
		return;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);

	/* DMERR() adds the newline itself; tolerate callers that also do. */
	len = strlen(msg);
	if (len && msg[len - 1] == '\n')
		msg[len - 1] = '\0';

	/* One fprintf call so lines from different threads do not mix. */
	fprintf(stderr, "%s: %s: %s\n", level, prefix, msg);
}

void tsp_user_warn(const char *file, int line, const char *cond)
{
	fprintf(stderr, "WARNING: %s:%d: WARN_ON(%s)\n", file, line, cond);
	fflush(stderr);
	abort();
}

/* ------------------------------------------------------------------ */
/* Memory                                                              */
/* ------------------------------------------------------------------ */

static long live_allocs;
/* Allocations still allowed to succeed; -1: no injection. */
static long alloc_budget = -1;

/* Consume one unit of budget; false if this allocation must fail. */
static bool take_alloc_budget(void)
{
	long cur = __atomic_load_n(&alloc_budget, __ATOMIC_RELAXED);

	for (;;) {
		if (cur < 0)
			return true;
		if (cur == 0)
			return false;
		if (__atomic_compare_exchange_n(&alloc_budget, &cur, cur - 1,
						false, __ATOMIC_RELAXED,
						__ATOMIC_RELAXED))
			return true;
	}
}

void *tsp_user_alloc(size_t size, gfp_t gfp)
{
	void *p;

	if ((gfp & GFP_NOWAIT) && env_is_one("TSP_FAIL_NOWAIT"))
		return NULL;
	if (!take_alloc_budget())
		return NULL;

	/* kmalloc(0) returns a unique pointer that must still be freed. */
	if (!size)
		size = 1;
	/* Like kmalloc, a power-of-two size up to a page is naturally aligned. */
	if (size >= 64 && is_power_of_2(size)) {
		if (posix_memalign(&p, size < 4096 ? size : 4096, size))
			p = NULL;
		else if (gfp & __GFP_ZERO)
			memset(p, 0, size);
	} else {
		p = (gfp & __GFP_ZERO) ? calloc(1, size) : malloc(size);
	}
	if (p)
		__atomic_add_fetch(&live_allocs, 1, __ATOMIC_RELAXED);
	return p;
}

void tsp_user_free(const void *p)
{
	if (!p)
		return;
	__atomic_sub_fetch(&live_allocs, 1, __ATOMIC_RELAXED);
	free((void *)p);
}

long tsp_user_live_allocs(void)
{
	return __atomic_load_n(&live_allocs, __ATOMIC_RELAXED);
}

void tsp_user_fail_alloc_after(long n)
{
	__atomic_store_n(&alloc_budget, n < 0 ? -1 : n, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ */
/* Mutexes and spinlocks                                               */
/* ------------------------------------------------------------------ */

static void lock_bug(const char *what, const void *lock)
{
	fprintf(stderr, "BUG: %s (lock %p)\n", what, lock);
	fflush(stderr);
	abort();
}

static bool owned_by_me(const bool *held, const pthread_t *owner)
{
	pthread_t o;

	if (!__atomic_load_n(held, __ATOMIC_ACQUIRE))
		return false;
	__atomic_load(owner, &o, __ATOMIC_RELAXED);
	return pthread_equal(o, pthread_self());
}

void tsp_user_lock_init(struct tsp_user_lock *l)
{
	pthread_mutex_init(&l->m, NULL);
	l->held = false;
	l->owner = pthread_self();
}

void tsp_user_lock_acquire(struct tsp_user_lock *l)
{
	pthread_t self = pthread_self();

	if (owned_by_me(&l->held, &l->owner))
		lock_bug("recursive locking", l);
	pthread_mutex_lock(&l->m);
	__atomic_store(&l->owner, &self, __ATOMIC_RELAXED);
	__atomic_store_n(&l->held, true, __ATOMIC_RELEASE);
}

void tsp_user_lock_release(struct tsp_user_lock *l)
{
	if (!owned_by_me(&l->held, &l->owner))
		lock_bug("unlocking a lock this thread does not hold", l);
	__atomic_store_n(&l->held, false, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&l->m);
}

bool tsp_user_lock_held(const struct tsp_user_lock *l)
{
	return owned_by_me(&l->held, &l->owner);
}

/* ------------------------------------------------------------------ */
/* rw semaphores                                                       */
/* ------------------------------------------------------------------ */

void init_rwsem(struct rw_semaphore *s)
{
	pthread_rwlock_init(&s->rw, NULL);
	s->writer = pthread_self();
	s->write_held = false;
	s->readers = 0;
}

void down_read(struct rw_semaphore *s)
{
	if (owned_by_me(&s->write_held, &s->writer))
		lock_bug("down_read with the rwsem write held", s);
	pthread_rwlock_rdlock(&s->rw);
	__atomic_add_fetch(&s->readers, 1, __ATOMIC_RELAXED);
}

void up_read(struct rw_semaphore *s)
{
	if (__atomic_sub_fetch(&s->readers, 1, __ATOMIC_RELAXED) < 0)
		lock_bug("up_read without down_read", s);
	pthread_rwlock_unlock(&s->rw);
}

void down_write(struct rw_semaphore *s)
{
	pthread_t self = pthread_self();

	if (owned_by_me(&s->write_held, &s->writer))
		lock_bug("recursive down_write", s);
	pthread_rwlock_wrlock(&s->rw);
	__atomic_store(&s->writer, &self, __ATOMIC_RELAXED);
	__atomic_store_n(&s->write_held, true, __ATOMIC_RELEASE);
}

int down_write_trylock(struct rw_semaphore *s)
{
	pthread_t self = pthread_self();

	if (owned_by_me(&s->write_held, &s->writer))
		lock_bug("recursive down_write_trylock", s);
	if (pthread_rwlock_trywrlock(&s->rw))
		return 0;
	__atomic_store(&s->writer, &self, __ATOMIC_RELAXED);
	__atomic_store_n(&s->write_held, true, __ATOMIC_RELEASE);
	return 1;
}

void up_write(struct rw_semaphore *s)
{
	if (!owned_by_me(&s->write_held, &s->writer))
		lock_bug("up_write by a thread not holding the rwsem", s);
	__atomic_store_n(&s->write_held, false, __ATOMIC_RELEASE);
	pthread_rwlock_unlock(&s->rw);
}

bool tsp_user_rwsem_held(struct rw_semaphore *s)
{
	return owned_by_me(&s->write_held, &s->writer) ||
	       __atomic_load_n(&s->readers, __ATOMIC_RELAXED) > 0;
}

/* ------------------------------------------------------------------ */
/* sort()                                                              */
/* ------------------------------------------------------------------ */

/*
 * The kernel's sort() is an in-place heapsort that lets the caller
 * supply the swap.  Without a swap function qsort() does the job; with
 * one, a plain heapsort that moves elements only through @swap_fn.
 */
static void sift_down(char *base, size_t root, size_t n, size_t size,
		      int (*cmp)(const void *, const void *),
		      void (*swap_fn)(void *, void *, int))
{
	for (;;) {
		size_t child = 2 * root + 1;

		if (child >= n)
			return;
		if (child + 1 < n &&
		    cmp(base + child * size, base + (child + 1) * size) < 0)
			child++;
		if (cmp(base + root * size, base + child * size) >= 0)
			return;
		swap_fn(base + root * size, base + child * size, (int)size);
		root = child;
	}
}

void sort(void *base, size_t num, size_t size,
	  int (*cmp)(const void *, const void *),
	  void (*swap_fn)(void *, void *, int))
{
	char *b = base;
	size_t i;

	if (num < 2)
		return;
	if (!swap_fn) {
		qsort(base, num, size, cmp);
		return;
	}

	for (i = num / 2; i-- > 0; )
		sift_down(b, i, num, size, cmp, swap_fn);
	for (i = num - 1; i > 0; i--) {
		swap_fn(b, b + i * size, (int)size);
		sift_down(b, 0, i, size, cmp, swap_fn);
	}
}
