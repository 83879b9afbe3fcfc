/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * compat.h - the one place where the kernel build and the userspace build
 * of persistent-data/ and dm-thin-metadata.c differ.
 *
 * In the kernel this header only includes the real kernel headers.  In
 * userspace (tests and tools) it maps the small set of kernel APIs the
 * metadata layers use onto libc and pthreads, the way the kernel's own
 * tools/testing/radix-tree harness does for the XArray:
 *
 *   kmalloc & co    -> malloc, counted so tests can check for leaks, and
 *                      failing on demand (tsp_user_fail_alloc_after) to
 *                      exercise error paths
 *   mutex, rwsem    -> pthread mutex / rwlock, with owner tracking so
 *                      lockdep_assert_held() is a real assertion
 *   dm-bufio        -> user/bufio.c, a file backed cache with crash
 *                      simulation hooks
 *   crc32c          -> user/crc32c.c, a table driven implementation with
 *                      the kernel's semantics (no final inversion)
 *   DMERR & co      -> stderr
 *   READ_ONCE & co  -> C11 relaxed atomics (so ThreadSanitizer sees every
 *                      marked access); rcu_dereference() and
 *                      rcu_assign_pointer() are acquire loads and release
 *                      stores
 *   RCU readers     -> liburcu, membarrier flavour (-lurcu-memb): every
 *                      thread that calls rcu_read_lock() must first call
 *                      tsp_user_rcu_register_thread() (asserted), and
 *                      tsp_user_rcu_unregister_thread() before it exits
 *   call_rcu, kfree_rcu -> a process-wide queue of callbacks, run by
 *                      tsp_user_rcu_flush() after synchronize_rcu(): by
 *                      whoever queues the TSP_USER_RCU_BATCH'th callback
 *                      (outside a read-side critical section), and by
 *                      rcu_barrier().  No helper thread, so a fork()ed
 *                      child (the crash tests) works like its parent.
 *   hlist, list     -> the subset of <linux/list.h> and <linux/rculist.h>
 *                      used, with the kernel's semantics
 *   seqcount_t      -> the raw_ subset of <linux/seqlock.h>: C11 release
 *                      and acquire fences around relaxed atomics
 *   per-CPU data    -> TSP_USER_NR_CPUS copies; a thread uses the copy
 *                      numbered by the order in which it first asked (mod
 *                      TSP_USER_NR_CPUS), so counters are exact up to that
 *                      many threads
 *
 * ThreadSanitizer cannot see the ordering liburcu's grace periods give
 * (liburcu is not instrumented and relies on membarrier()), so under TSan
 * rcu_read_unlock() releases, and synchronize_rcu() acquires, one
 * synchronisation object (tsp_user_rcu.tsan_sync): exactly the
 * happens-before edge a grace period guarantees, from every read-side
 * critical section that ended before it to the code after it.  No TSan
 * suppression is needed.
 *
 * The RCU state (tsp_user_rcu, tsp_user_rcu_registered) is defined here
 * with weak linkage, one copy per program, so that the shims need no .c
 * file of their own.
 *
 * Locking: none of its own, except tsp_user_rcu.lock around the callback
 * queue.
 */
#ifndef TSP_COMPAT_H
#define TSP_COMPAT_H

#ifdef __KERNEL__

#include <linux/kernel.h>
#include <linux/types.h>
#include <linux/slab.h>
#include <linux/mm.h>
#include <linux/errno.h>
#include <linux/err.h>
#include <linux/string.h>
#include <linux/mutex.h>
#include <linux/rwsem.h>
#include <linux/spinlock.h>
#include <linux/lockdep.h>
#include <linux/crc32c.h>
#include <linux/dm-bufio.h>
#include <linux/device-mapper.h>
#include <linux/sort.h>
#include <linux/math64.h>
#include <linux/bitops.h>
#include <linux/vmalloc.h>
#include <linux/sched.h>
#include <linux/cache.h>
#include <linux/log2.h>
#include <linux/cpumask.h>
#include <linux/percpu.h>
#include <linux/list.h>
#include <linux/rcupdate.h>
#include <linux/rculist.h>
#include <linux/seqlock.h>

#else /* userspace */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <assert.h>
#include <endian.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/*
 * __le16/32/64 come from here: glibc pulls it in anyway (<sys/stat.h> under
 * _GNU_SOURCE), so defining our own would clash.
 */
#include <linux/types.h>

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef int32_t s32;
typedef int64_t s64;
typedef uint64_t sector_t;
typedef unsigned int gfp_t;

#define __packed __attribute__((packed))
#define __must_check __attribute__((warn_unused_result))
#define __always_unused __attribute__((unused))
#define __maybe_unused __attribute__((unused))
#define noinline __attribute__((noinline))
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)
#define fallthrough __attribute__((fallthrough))

#define cpu_to_le16(x) htole16(x)
#define cpu_to_le32(x) htole32(x)
#define cpu_to_le64(x) htole64(x)
#define le16_to_cpu(x) le16toh(x)
#define le32_to_cpu(x) le32toh(x)
#define le64_to_cpu(x) le64toh(x)

#define U32_MAX UINT32_MAX
#define U64_MAX UINT64_MAX
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define BUILD_BUG_ON(c) _Static_assert(!(c), #c)
#define BUG_ON(c) assert(!(c))
#define BUG() assert(0)
#define WARN_ON(c) ({ int __w = !!(c); if (__w) tsp_user_warn(__FILE__, __LINE__, #c); __w; })
#define WARN_ON_ONCE(c) WARN_ON(c)
#define min(a, b) ((a) < (b) ? (a) : (b))
#define max(a, b) ((a) > (b) ? (a) : (b))
#define min_t(t, a, b) ((t)(a) < (t)(b) ? (t)(a) : (t)(b))
#define max_t(t, a, b) ((t)(a) > (t)(b) ? (t)(a) : (t)(b))
#define DIV_ROUND_UP(n, d) (((n) + (d) - 1) / (d))
#define round_up(x, y) ((((x) + (y) - 1) / (y)) * (y))
#define container_of(ptr, type, member) \
	((type *)((char *)(ptr) - offsetof(type, member)))
#define swap(a, b) do { typeof(a) __t = (a); (a) = (b); (b) = __t; } while (0)
#define might_sleep() do { } while (0)
#define cond_resched() do { } while (0)
#define EXPORT_SYMBOL_GPL(s)

static inline u64 div_u64(u64 n, u32 d) { return n / d; }
#define hweight64(w) ((unsigned int)__builtin_popcountll(w))
static inline u64 div_u64_rem(u64 n, u32 d, u32 *r) { *r = n % d; return n / d; }

#define MAX_ERRNO 4095
#define IS_ERR_VALUE(x) ((unsigned long)(void *)(x) >= (unsigned long)-MAX_ERRNO)
static inline void *ERR_PTR(long e) { return (void *)e; }
static inline long PTR_ERR(const void *p) { return (long)p; }
static inline bool IS_ERR(const void *p) { return IS_ERR_VALUE(p); }

#ifndef EWOULDBLOCK
#define EWOULDBLOCK EAGAIN
#endif

/* Messages: the kernel's dm prefixes, on stderr. */
void tsp_user_log(const char *level, const char *prefix, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
void tsp_user_warn(const char *file, int line, const char *cond);
#define DMERR(fmt, ...) tsp_user_log("error", DM_MSG_PREFIX, fmt, ##__VA_ARGS__)
#define DMERR_LIMIT(fmt, ...) DMERR(fmt, ##__VA_ARGS__)
#define DMWARN(fmt, ...) tsp_user_log("warning", DM_MSG_PREFIX, fmt, ##__VA_ARGS__)
#define DMINFO(fmt, ...) tsp_user_log("info", DM_MSG_PREFIX, fmt, ##__VA_ARGS__)

/* Memory: counted, and failable on demand for error path tests. */
#define GFP_KERNEL 0u
#define GFP_NOIO 0u
#define GFP_NOWAIT 1u
#define __GFP_ZERO 2u
#define __GFP_NOWARN 0u
void *tsp_user_alloc(size_t size, gfp_t gfp);
void tsp_user_free(const void *p);
/* Number of live allocations; tests check it returns to its start value. */
long tsp_user_live_allocs(void);
/* Make the allocation after the next @n succeed fail (-1: never fail). */
void tsp_user_fail_alloc_after(long n);
#define kmalloc(s, g) tsp_user_alloc((s), (g))
#define kzalloc(s, g) tsp_user_alloc((s), (g) | __GFP_ZERO)
#define kcalloc(n, s, g) tsp_user_alloc((size_t)(n) * (s), (g) | __GFP_ZERO)
#define kvmalloc(s, g) tsp_user_alloc((s), (g))
#define kvzalloc(s, g) tsp_user_alloc((s), (g) | __GFP_ZERO)
#define kvcalloc(n, s, g) tsp_user_alloc((size_t)(n) * (s), (g) | __GFP_ZERO)
#define kfree(p) tsp_user_free(p)
#define kvfree(p) tsp_user_free(p)

/* Locks: pthreads with an owner so lockdep_assert_held() can check. */
struct tsp_user_lock {
	pthread_mutex_t m;
	pthread_t owner;
	bool held;
};
struct mutex { struct tsp_user_lock l; };
struct rw_semaphore {
	pthread_rwlock_t rw;
	pthread_t writer;
	bool write_held;
	int readers;	/* approximate; only used by the assertion */
};
typedef struct tsp_user_lock spinlock_t;

void tsp_user_lock_init(struct tsp_user_lock *l);
void tsp_user_lock_acquire(struct tsp_user_lock *l);
void tsp_user_lock_release(struct tsp_user_lock *l);
bool tsp_user_lock_held(const struct tsp_user_lock *l);
#define mutex_init(x) tsp_user_lock_init(&(x)->l)
#define mutex_lock(x) tsp_user_lock_acquire(&(x)->l)
#define mutex_unlock(x) tsp_user_lock_release(&(x)->l)
#define spin_lock_init(x) tsp_user_lock_init(x)
#define spin_lock(x) tsp_user_lock_acquire(x)
#define spin_unlock(x) tsp_user_lock_release(x)
#define spin_lock_irq(x) tsp_user_lock_acquire(x)
#define spin_unlock_irq(x) tsp_user_lock_release(x)

void init_rwsem(struct rw_semaphore *s);
void down_read(struct rw_semaphore *s);
void up_read(struct rw_semaphore *s);
void down_write(struct rw_semaphore *s);
int down_write_trylock(struct rw_semaphore *s);
void up_write(struct rw_semaphore *s);
bool tsp_user_rwsem_held(struct rw_semaphore *s);

#define lockdep_assert_held(x) assert(_Generic((x), \
	struct mutex *: tsp_user_lock_held(&((struct mutex *)(void *)(x))->l), \
	spinlock_t *: tsp_user_lock_held((spinlock_t *)(void *)(x)), \
	struct rw_semaphore *: tsp_user_rwsem_held((struct rw_semaphore *)(void *)(x))))
#define lockdep_assert_held_write(x) assert((x)->write_held && \
	pthread_equal((x)->writer, pthread_self()))

/* Marked accesses, and the annotations sparse reads in the kernel. */
#define READ_ONCE(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define WRITE_ONCE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)
#define __rcu
#define __percpu
#define ____cacheline_aligned_in_smp
#define ____cacheline_aligned __attribute__((aligned(64)))
#define ilog2(n) (63 - __builtin_clzll((u64)(n)))
#define __ffs(word) ((unsigned long)__builtin_ctzl(word))	/* word != 0 */
#define is_power_of_2(n) ((n) != 0 && (((n) & ((n) - 1)) == 0))
static inline unsigned long roundup_pow_of_two(unsigned long n)
{
	return n <= 1 ? 1 : 1UL << (64 - __builtin_clzl(n - 1));
}

/*
 * seqcount_t: the raw_ subset (no lockdep), with the kernel's barriers as
 * C11 fences.  The data a sequence count guards must be read and written
 * with READ_ONCE()/WRITE_ONCE().  ThreadSanitizer does not model fences
 * (GCC refuses them under -fsanitize=thread), so there the ordering comes
 * from read-modify-writes of the count instead: the writer's increment
 * acquires and a reader's final read releases (a fetch_add of 0), which
 * orders the reader's loads of the data before the writer's stores when
 * the reader's read comes first.
 */
typedef struct {
	unsigned int sequence;
} seqcount_t;

static inline void seqcount_init(seqcount_t *s)
{
	WRITE_ONCE(s->sequence, 0);
}

static inline unsigned int raw_read_seqcount(const seqcount_t *s)
{
	return __atomic_load_n(&s->sequence, __ATOMIC_ACQUIRE);
}

static inline int read_seqcount_retry(seqcount_t *s, unsigned int start)
{
#ifdef __SANITIZE_THREAD__
	return __atomic_fetch_add(&s->sequence, 0, __ATOMIC_RELEASE) != start;
#else
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	return READ_ONCE(s->sequence) != start;
#endif
}

static inline void raw_write_seqcount_begin(seqcount_t *s)
{
#ifdef __SANITIZE_THREAD__
	__atomic_fetch_add(&s->sequence, 1, __ATOMIC_ACQUIRE);
#else
	WRITE_ONCE(s->sequence, READ_ONCE(s->sequence) + 1);
	__atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}

static inline void raw_write_seqcount_end(seqcount_t *s)
{
	__atomic_store_n(&s->sequence, READ_ONCE(s->sequence) + 1,
			 __ATOMIC_RELEASE);
}

/* Lists: struct list_head and struct hlist_*, the kernel's semantics. */
struct list_head {
	struct list_head *next, *prev;
};

#define LIST_HEAD(name) struct list_head name = { &(name), &(name) }

static inline void INIT_LIST_HEAD(struct list_head *l)
{
	l->next = l;
	l->prev = l;
}

static inline bool list_empty(const struct list_head *l)
{
	return l->next == l;
}

static inline void tsp_user_list_insert(struct list_head *n,
					struct list_head *prev,
					struct list_head *next)
{
	n->next = next;
	n->prev = prev;
	prev->next = n;
	next->prev = n;
}

static inline void list_add(struct list_head *n, struct list_head *head)
{
	tsp_user_list_insert(n, head, head->next);
}

static inline void list_add_tail(struct list_head *n, struct list_head *head)
{
	tsp_user_list_insert(n, head->prev, head);
}

static inline void list_del(struct list_head *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	n->next = NULL;
	n->prev = NULL;
}

static inline void list_move_tail(struct list_head *n, struct list_head *head)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	list_add_tail(n, head);
}

static inline void list_replace(struct list_head *old, struct list_head *n)
{
	tsp_user_list_insert(n, old->prev, old->next);
}

#define list_entry(ptr, type, member) container_of(ptr, type, member)
#define list_first_entry(head, type, member) \
	list_entry((head)->next, type, member)
#define list_next_entry(pos, member) \
	list_entry((pos)->member.next, typeof(*(pos)), member)
#define list_for_each_entry(pos, head, member)				\
	for (pos = list_first_entry(head, typeof(*(pos)), member);		\
	     &(pos)->member != (head);						\
	     pos = list_next_entry(pos, member))
#define list_for_each_entry_safe(pos, tmp, head, member)			\
	for (pos = list_first_entry(head, typeof(*(pos)), member),		\
	     tmp = list_next_entry(pos, member);				\
	     &(pos)->member != (head);						\
	     pos = tmp, tmp = list_next_entry(tmp, member))

struct hlist_node {
	struct hlist_node *next, **pprev;
};

struct hlist_head {
	struct hlist_node *first;
};

/* RCU: readers on liburcu, deferred callbacks on our own queue. */
#define rcu_head tsp_urcu_rcu_head	/* liburcu's own, out of our way */
#include <urcu/urcu-memb.h>
#undef rcu_head
#undef rcu_read_lock
#undef rcu_read_unlock
#undef synchronize_rcu
#undef call_rcu
#undef rcu_barrier
#undef rcu_dereference
#undef rcu_assign_pointer

#ifdef __SANITIZE_THREAD__
#include <sanitizer/tsan_interface.h>
#define tsp_user_tsan_acquire(addr) __tsan_acquire(addr)
#define tsp_user_tsan_release(addr) __tsan_release(addr)
#else
#define tsp_user_tsan_acquire(addr) do { } while (0)
#define tsp_user_tsan_release(addr) do { } while (0)
#endif

/* Callbacks queued before one flush; few enough to keep memory bounded. */
#define TSP_USER_RCU_BATCH 256

struct rcu_head {
	struct rcu_head *next;
	void (*func)(struct rcu_head *head);
};
typedef void (*rcu_callback_t)(struct rcu_head *head);

struct tsp_user_rcu_state {
	pthread_mutex_t lock;		/* protects the two fields below */
	struct rcu_head *pending;	/* queued callbacks, newest first */
	unsigned long nr_pending;
	char tsan_sync;			/* only its address is used */
};

extern struct tsp_user_rcu_state tsp_user_rcu;
struct tsp_user_rcu_state tsp_user_rcu __attribute__((weak)) = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
};
extern __thread bool tsp_user_rcu_registered;
__thread bool tsp_user_rcu_registered __attribute__((weak));

static inline void tsp_user_rcu_register_thread(void)
{
	urcu_memb_register_thread();
	tsp_user_rcu_registered = true;
}

static inline void tsp_user_rcu_unregister_thread(void)
{
	tsp_user_rcu_registered = false;
	urcu_memb_unregister_thread();
}

static inline void rcu_read_lock(void)
{
	BUG_ON(!tsp_user_rcu_registered);
	urcu_memb_read_lock();
}

static inline void rcu_read_unlock(void)
{
	tsp_user_tsan_release(&tsp_user_rcu.tsan_sync);
	urcu_memb_read_unlock();
}

static inline void synchronize_rcu(void)
{
	urcu_memb_synchronize_rcu();
	tsp_user_tsan_acquire(&tsp_user_rcu.tsan_sync);
}

/* Stricter than the kernel's, which checks only with lockdep. */
#define rcu_read_lock_held() urcu_memb_read_ongoing()
#define RCU_LOCKDEP_WARN(c, s) BUG_ON(c)

#define rcu_dereference(p) __atomic_load_n(&(p), __ATOMIC_ACQUIRE)
#define rcu_dereference_protected(p, c) (p)
#define rcu_assign_pointer(p, v) __atomic_store_n(&(p), (v), __ATOMIC_RELEASE)
#define RCU_INIT_POINTER(p, v) WRITE_ONCE(p, v)

/*
 * Run every queued callback after a grace period.  Not from inside a
 * read-side critical section (the grace period would wait for itself).
 * A callback "function" below 4096 is kfree_rcu()'s offset of the
 * rcu_head in the object to free, as in the kernel.
 */
static inline void tsp_user_rcu_flush(void)
{
	struct rcu_head *head, *next;

	pthread_mutex_lock(&tsp_user_rcu.lock);
	head = tsp_user_rcu.pending;
	tsp_user_rcu.pending = NULL;
	tsp_user_rcu.nr_pending = 0;
	pthread_mutex_unlock(&tsp_user_rcu.lock);
	if (!head)
		return;
	synchronize_rcu();
	for (; head; head = next) {
		unsigned long offset = (unsigned long)head->func;

		next = head->next;
		if (offset < 4096)
			kfree((char *)head - offset);
		else
			head->func(head);
	}
}

static inline void call_rcu(struct rcu_head *head, rcu_callback_t func)
{
	unsigned long nr;

	head->func = func;
	pthread_mutex_lock(&tsp_user_rcu.lock);
	head->next = tsp_user_rcu.pending;
	tsp_user_rcu.pending = head;
	nr = ++tsp_user_rcu.nr_pending;
	pthread_mutex_unlock(&tsp_user_rcu.lock);
	if (nr >= TSP_USER_RCU_BATCH && !urcu_memb_read_ongoing())
		tsp_user_rcu_flush();
}

#define kfree_rcu(ptr, field)						\
	call_rcu(&(ptr)->field,						\
		 (rcu_callback_t)(unsigned long)offsetof(typeof(*(ptr)), field))

/* Unlike the kernel's, this runs the callbacks itself. */
static inline void rcu_barrier(void)
{
	tsp_user_rcu_flush();
}

#define hlist_entry(ptr, type, member) container_of(ptr, type, member)
#define hlist_first_rcu(head) ((head)->first)
#define hlist_next_rcu(node) ((node)->next)
#define hlist_entry_safe(ptr, type, member)				\
	({ typeof(ptr) __ptr = (ptr);					\
	   __ptr ? hlist_entry(__ptr, type, member) : NULL; })

/* Writers: under the lock that serialises changes to the list. */
static inline void hlist_add_head_rcu(struct hlist_node *n,
				      struct hlist_head *h)
{
	struct hlist_node *first = h->first;

	n->next = first;
	n->pprev = &h->first;
	rcu_assign_pointer(h->first, n);
	if (first)
		first->pprev = &n->next;
}

/*
 * @n->next stays, for readers standing on @n.  The kernel's plain
 * WRITE_ONCE() relies on address dependencies to order a reader's loads
 * of @next's fields; C11 (and so TSan) needs the store to be a release
 * for the acquire in rcu_dereference() to pair with.
 */
static inline void hlist_del_rcu(struct hlist_node *n)
{
	struct hlist_node *next = n->next;

	rcu_assign_pointer(*n->pprev, next);
	if (next)
		next->pprev = n->pprev;
	n->pprev = NULL;
}

static inline void hlist_replace_rcu(struct hlist_node *old,
				     struct hlist_node *n)
{
	struct hlist_node *next = old->next;

	n->next = next;
	n->pprev = old->pprev;
	rcu_assign_pointer(*n->pprev, n);
	if (next)
		next->pprev = &n->next;
	old->pprev = NULL;
}

#define hlist_for_each_entry(pos, head, member)				\
	for (pos = hlist_entry_safe((head)->first, typeof(*(pos)), member); \
	     pos;							\
	     pos = hlist_entry_safe((pos)->member.next, typeof(*(pos)), member))

/* Readers: inside rcu_read_lock(). */
#define hlist_for_each_entry_rcu(pos, head, member)			\
	for (pos = hlist_entry_safe(rcu_dereference((head)->first),	\
				    typeof(*(pos)), member);		\
	     pos;							\
	     pos = hlist_entry_safe(rcu_dereference((pos)->member.next), \
				    typeof(*(pos)), member))

/*
 * Per-CPU data: TSP_USER_NR_CPUS copies TSP_USER_PERCPU_UNIT bytes apart
 * (so two threads' counters never share a cache line).  this_cpu_*() is
 * not atomic, as in the kernel: two threads share a copy only beyond
 * TSP_USER_NR_CPUS threads, and then an increment may be lost.
 */
#define TSP_USER_NR_CPUS 64
#define TSP_USER_PERCPU_UNIT 128

static inline unsigned int tsp_user_this_cpu(void)
{
	static __thread int cpu = -1;
	static unsigned int next;

	if (unlikely(cpu < 0))
		cpu = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) %
		      TSP_USER_NR_CPUS;
	return cpu;
}

static inline void *tsp_user_alloc_percpu(size_t size)
{
	BUG_ON(size > TSP_USER_PERCPU_UNIT);
	return kzalloc(TSP_USER_PERCPU_UNIT * TSP_USER_NR_CPUS, GFP_KERNEL);
}

#define num_possible_cpus() TSP_USER_NR_CPUS
#define for_each_possible_cpu(cpu) \
	for ((cpu) = 0; (cpu) < TSP_USER_NR_CPUS; (cpu)++)
#define alloc_percpu(type) ((type *)tsp_user_alloc_percpu(sizeof(type)))
#define free_percpu(p) kfree(p)
#define per_cpu_ptr(p, cpu) \
	((typeof(p))((char *)(p) + (size_t)(cpu) * TSP_USER_PERCPU_UNIT))
#define this_cpu_ptr(p) per_cpu_ptr(p, tsp_user_this_cpu())
#define this_cpu_add(pcp, n)						\
	do {								\
		typeof(&(pcp)) __pcp = this_cpu_ptr(&(pcp));		\
		WRITE_ONCE(*__pcp, READ_ONCE(*__pcp) + (n));		\
	} while (0)
#define this_cpu_inc(pcp) this_cpu_add(pcp, 1)

/* crc32c with the kernel's semantics: seed in, no final inversion. */
u32 crc32c(u32 seed, const void *data, unsigned int len);

void sort(void *base, size_t num, size_t size,
	  int (*cmp)(const void *, const void *),
	  void (*swap_fn)(void *, void *, int));

/* The subset of linux/dm-bufio.h we use, backed by a file. */
#include "../user/bufio.h"

#endif /* __KERNEL__ */

#endif /* TSP_COMPAT_H */
