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
 *
 * Locking: none of its own.
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
void up_write(struct rw_semaphore *s);
bool tsp_user_rwsem_held(struct rw_semaphore *s);

#define lockdep_assert_held(x) assert(_Generic((x), \
	struct mutex *: tsp_user_lock_held(&((struct mutex *)(void *)(x))->l), \
	spinlock_t *: tsp_user_lock_held((spinlock_t *)(void *)(x)), \
	struct rw_semaphore *: tsp_user_rwsem_held((struct rw_semaphore *)(void *)(x))))
#define lockdep_assert_held_write(x) assert((x)->write_held && \
	pthread_equal((x)->writer, pthread_self()))

/* crc32c with the kernel's semantics: seed in, no final inversion. */
u32 crc32c(u32 seed, const void *data, unsigned int len);

void sort(void *base, size_t num, size_t size,
	  int (*cmp)(const void *, const void *),
	  void (*swap_fn)(void *, void *, int));

/* The subset of linux/dm-bufio.h we use, backed by a file. */
#include "../user/bufio.h"

#endif /* __KERNEL__ */

#endif /* TSP_COMPAT_H */
