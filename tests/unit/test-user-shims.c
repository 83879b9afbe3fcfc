// SPDX-License-Identifier: GPL-2.0-only
/*
 * test-user-shims.c - checks the userspace shims everything else's tests
 * stand on: crc32c, the counted and failable allocator, messages and WARN,
 * locks and their lockdep assertions, sort(), and the file backed dm-bufio
 * with its crash simulation.
 *
 * Only needs the user/ shims.  Everything here is static but main(), so
 * the file links beside persistent-data/ and dm-thin-metadata.c too.
 * Checks that must abort (WARN, lockdep failures, leaked buffers) run in a
 * forked child.  One line per check group on stdout; exit status 1 on failure.
 *
 * Locking: the lock groups start threads; everything else is one thread.
 */
#define DM_MSG_PREFIX "shims-test"
#include "persistent-data/compat.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static int failures;

#define CHECK(cond)							\
	do {								\
		if (!(cond)) {						\
			fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__,	\
				__LINE__, #cond);			\
			failures++;					\
		}							\
	} while (0)

static void report(const char *group, int failures_before)
{
	printf("%-4s %s\n", failures == failures_before ? "ok" : "FAIL", group);
	fflush(stdout);
}

/* Run @fn in a child with stderr silenced; true if it died of SIGABRT. */
static bool aborts(void (*fn)(void *), void *arg)
{
	int status, fd;
	pid_t pid;

	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid < 0)
		return false;
	if (!pid) {
		fd = open("/dev/null", O_WRONLY);
		if (fd >= 0)
			dup2(fd, 2);
		alarm(10);	/* a deadlock instead of an abort fails */
		fn(arg);
		_exit(0);
	}
	if (waitpid(pid, &status, 0) != pid)
		return false;
	return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

/* ------------------------------------------------------------------ */
/* crc32c                                                              */
/* ------------------------------------------------------------------ */

/* Bit at a time, straight from the definition. */
static u32 crc32c_ref(u32 crc, const u8 *p, size_t len)
{
	int bit;

	while (len--) {
		crc ^= *p++;
		for (bit = 0; bit < 8; bit++)
			crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0);
	}
	return crc;
}

static void test_crc32c(void)
{
	int f0 = failures;
	u8 buf[4096 + 64];
	unsigned int i, off, len;

	CHECK(~crc32c(~0u, "123456789", 9) == 0xE3069283u);

	/* RFC 3720 (iSCSI) B.4 vectors. */
	memset(buf, 0, 32);
	CHECK(~crc32c(~0u, buf, 32) == 0x8A9136AAu);
	CHECK(crc32c(~0u, buf, 32) == ~0x8A9136AAu);
	memset(buf, 0xff, 32);
	CHECK(~crc32c(~0u, buf, 32) == 0x62A8AB43u);
	for (i = 0; i < 32; i++)
		buf[i] = i;
	CHECK(~crc32c(~0u, buf, 32) == 0x46DD794Eu);
	for (i = 0; i < 32; i++)
		buf[i] = 31 - i;
	CHECK(~crc32c(~0u, buf, 32) == 0x113FDB5Cu);

	/* Kernel semantics: the seed is the register, nothing inverted. */
	CHECK(crc32c(0, buf, 0) == 0);
	CHECK(crc32c(0x12345678u, buf, 0) == 0x12345678u);

	srand(1);
	for (i = 0; i < sizeof(buf); i++)
		buf[i] = rand();
	/* Every alignment and every tail length of the 8-byte loop. */
	for (off = 0; off < 8; off++)
		for (len = 0; len < 80; len++)
			CHECK(crc32c(~0u, buf + off, len) ==
			      crc32c_ref(~0u, buf + off, len));
	CHECK(crc32c(~0u, buf + 3, 4096) == crc32c_ref(~0u, buf + 3, 4096));
	/* Chaining across a split. */
	CHECK(crc32c(crc32c(~0u, buf, 1000), buf + 1000, 3096) ==
	      crc32c(~0u, buf, 4096));

	report("crc32c", f0);
}

/* ------------------------------------------------------------------ */
/* Allocation                                                          */
/* ------------------------------------------------------------------ */

static void *alloc_churn(void *arg)
{
	int i;

	for (i = 0; i < 20000; i++)
		kfree(kmalloc(16 + i % 64, GFP_KERNEL));
	return NULL;
}

static void test_alloc(void)
{
	int f0 = failures;
	long base = tsp_user_live_allocs();
	pthread_t t[4];
	u8 *p, *q, *z;
	unsigned int i;
	bool zero = true;

	p = kmalloc(100, GFP_KERNEL);
	CHECK(p);
	CHECK(tsp_user_live_allocs() == base + 1);
	q = kzalloc(256, GFP_KERNEL);
	CHECK(q);
	for (i = 0; q && i < 256; i++)
		zero &= !q[i];
	CHECK(zero);
	z = kcalloc(10, 10, GFP_NOIO);
	CHECK(z && !z[99]);
	CHECK(tsp_user_live_allocs() == base + 3);
	kfree(p);
	kvfree(q);
	kfree(z);
	kfree(NULL);
	CHECK(tsp_user_live_allocs() == base);
	p = kmalloc(0, GFP_KERNEL);
	CHECK(p);
	kfree(p);
	CHECK(tsp_user_live_allocs() == base);

	/* Fail injection: n more successes, then failures until reset. */
	tsp_user_fail_alloc_after(0);
	CHECK(!kmalloc(8, GFP_KERNEL));
	CHECK(!kzalloc(8, GFP_KERNEL));
	tsp_user_fail_alloc_after(2);
	p = kmalloc(8, GFP_KERNEL);
	q = kvzalloc(8, GFP_KERNEL);
	CHECK(p && q);
	CHECK(!kmalloc(8, GFP_KERNEL));
	CHECK(!kmalloc(8, GFP_KERNEL));
	tsp_user_fail_alloc_after(-1);
	z = kmalloc(8, GFP_KERNEL);
	CHECK(z);
	kfree(p);
	kfree(q);
	kfree(z);
	CHECK(tsp_user_live_allocs() == base);

	/* GFP_NOWAIT fails on demand; GFP_KERNEL is unaffected. */
	setenv("TSP_FAIL_NOWAIT", "1", 1);
	CHECK(!kmalloc(8, GFP_NOWAIT));
	CHECK(!kzalloc(8, GFP_NOWAIT));
	p = kmalloc(8, GFP_KERNEL);
	CHECK(p);
	kfree(p);
	unsetenv("TSP_FAIL_NOWAIT");
	p = kmalloc(8, GFP_NOWAIT);
	CHECK(p);
	kfree(p);
	CHECK(tsp_user_live_allocs() == base);

	/* The counter is exact under concurrency. */
	for (i = 0; i < ARRAY_SIZE(t); i++)
		pthread_create(&t[i], NULL, alloc_churn, NULL);
	for (i = 0; i < ARRAY_SIZE(t); i++)
		pthread_join(t[i], NULL);
	CHECK(tsp_user_live_allocs() == base);

	report("alloc: counting, zeroing, fail-after, GFP_NOWAIT", f0);
}

/* ------------------------------------------------------------------ */
/* Messages and WARN                                                   */
/* ------------------------------------------------------------------ */

static void warn_true(void *arg)
{
	WARN_ON(*(int *)arg == 1);
}

static void test_log(void)
{
	static const char expect[] =
		"error: shims-test: value 42\n"
		"warning: shims-test: careful\n"
		"info: shims-test: shown\n";
	char path[] = "/tmp/tsp-shims-log-XXXXXX";
	int f0 = failures, fd, status, one = 1;
	char got[256] = "";
	ssize_t n;
	pid_t pid;

	fd = mkstemp(path);
	CHECK(fd >= 0);
	if (fd < 0)
		return;
	unlink(path);
	fflush(stderr);
	pid = fork();
	if (!pid) {
		dup2(fd, 2);
		DMERR("value %d", 42);
		DMWARN("careful");
		setenv("TSP_QUIET", "1", 1);
		DMINFO("hidden");
		unsetenv("TSP_QUIET");
		DMINFO("shown\n");
		fflush(stderr);
		_exit(0);
	}
	CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status));
	n = pread(fd, got, sizeof(got) - 1, 0);
	CHECK(n == (ssize_t)strlen(expect));
	CHECK(!strcmp(got, expect));
	close(fd);

	CHECK(WARN_ON(0) == 0);
	CHECK(aborts(warn_true, &one));

	report("messages and WARN_ON", f0);
}

/* ------------------------------------------------------------------ */
/* Locks                                                               */
/* ------------------------------------------------------------------ */

static struct mutex test_mutex;
static spinlock_t test_spin;
static struct rw_semaphore test_rwsem;
static long counter_a, counter_b;

static void *mutex_held_elsewhere(void *arg)
{
	return (void *)(long)tsp_user_lock_held(&test_mutex.l);
}

static void *rwsem_held_elsewhere(void *arg)
{
	return (void *)(long)tsp_user_rwsem_held(&test_rwsem);
}

static void *mutex_hammer(void *arg)
{
	int i;

	for (i = 0; i < 20000; i++) {
		mutex_lock(&test_mutex);
		lockdep_assert_held(&test_mutex);
		counter_a++;
		mutex_unlock(&test_mutex);
		spin_lock(&test_spin);
		counter_b++;
		spin_unlock(&test_spin);
	}
	return NULL;
}

/* Writers keep a == b; readers check they never see them differ. */
static void *rwsem_writer(void *arg)
{
	int i;

	for (i = 0; i < 5000; i++) {
		down_write(&test_rwsem);
		lockdep_assert_held_write(&test_rwsem);
		counter_a++;
		counter_b++;
		up_write(&test_rwsem);
	}
	return NULL;
}

static void *rwsem_reader(void *arg)
{
	long bad = 0;
	int i;

	for (i = 0; i < 5000; i++) {
		down_read(&test_rwsem);
		lockdep_assert_held(&test_rwsem);
		bad += counter_a != counter_b;
		up_read(&test_rwsem);
	}
	return (void *)bad;
}

static void assert_unheld_mutex(void *arg)
{
	lockdep_assert_held(&test_mutex);
}

static void lock_mutex_twice(void *arg)
{
	mutex_lock(&test_mutex);
	mutex_lock(&test_mutex);
}

static void unlock_unheld_mutex(void *arg)
{
	mutex_unlock(&test_mutex);
}

static void assert_unheld_spin(void *arg)
{
	lockdep_assert_held(&test_spin);
}

static void assert_write_when_read(void *arg)
{
	down_read(&test_rwsem);
	lockdep_assert_held_write(&test_rwsem);
}

static void assert_unheld_rwsem(void *arg)
{
	lockdep_assert_held(&test_rwsem);
}

static void test_locks(void)
{
	int f0 = failures;
	pthread_t t[6];
	void *ret;
	long bad = 0;
	unsigned int i;

	mutex_init(&test_mutex);
	spin_lock_init(&test_spin);
	init_rwsem(&test_rwsem);

	/* mutex: held means held by this thread. */
	CHECK(!tsp_user_lock_held(&test_mutex.l));
	mutex_lock(&test_mutex);
	lockdep_assert_held(&test_mutex);
	CHECK(tsp_user_lock_held(&test_mutex.l));
	pthread_create(&t[0], NULL, mutex_held_elsewhere, NULL);
	pthread_join(t[0], &ret);
	CHECK(!ret);
	mutex_unlock(&test_mutex);
	CHECK(!tsp_user_lock_held(&test_mutex.l));
	CHECK(aborts(assert_unheld_mutex, NULL));
	CHECK(aborts(lock_mutex_twice, NULL));
	CHECK(aborts(unlock_unheld_mutex, NULL));

	spin_lock(&test_spin);
	lockdep_assert_held(&test_spin);
	spin_unlock(&test_spin);
	spin_lock_irq(&test_spin);
	CHECK(tsp_user_lock_held(&test_spin));
	spin_unlock_irq(&test_spin);
	CHECK(aborts(assert_unheld_spin, NULL));

	/* rwsem: write held by me, or read held by anyone. */
	CHECK(!tsp_user_rwsem_held(&test_rwsem));
	down_read(&test_rwsem);
	lockdep_assert_held(&test_rwsem);
	down_read(&test_rwsem);		/* readers nest */
	up_read(&test_rwsem);
	CHECK(tsp_user_rwsem_held(&test_rwsem));
	up_read(&test_rwsem);
	CHECK(!tsp_user_rwsem_held(&test_rwsem));
	down_write(&test_rwsem);
	lockdep_assert_held(&test_rwsem);
	lockdep_assert_held_write(&test_rwsem);
	pthread_create(&t[0], NULL, rwsem_held_elsewhere, NULL);
	pthread_join(t[0], &ret);
	CHECK(!ret);
	up_write(&test_rwsem);
	CHECK(!tsp_user_rwsem_held(&test_rwsem));
	CHECK(aborts(assert_unheld_rwsem, NULL));
	CHECK(aborts(assert_write_when_read, NULL));

	/* Mutual exclusion under contention. */
	counter_a = counter_b = 0;
	for (i = 0; i < 4; i++)
		pthread_create(&t[i], NULL, mutex_hammer, NULL);
	for (i = 0; i < 4; i++)
		pthread_join(t[i], NULL);
	CHECK(counter_a == 80000 && counter_b == 80000);

	counter_a = counter_b = 0;
	for (i = 0; i < 6; i++)
		pthread_create(&t[i], NULL, i < 2 ? rwsem_writer : rwsem_reader,
			       NULL);
	for (i = 0; i < 6; i++) {
		pthread_join(t[i], &ret);
		bad += (long)ret;
	}
	CHECK(!bad);
	CHECK(counter_a == 10000);

	report("locks and lockdep_assert_held", f0);
}

/* ------------------------------------------------------------------ */
/* sort()                                                              */
/* ------------------------------------------------------------------ */

struct rec {
	u32 key;
	u32 payload[2];
};

static unsigned long nr_swaps;

static int cmp_rec(const void *a, const void *b)
{
	const struct rec *x = a, *y = b;

	return x->key < y->key ? -1 : x->key > y->key;
}

static void swap_rec(void *a, void *b, int size)
{
	struct rec t;

	CHECK(size == sizeof(t));
	memcpy(&t, a, sizeof(t));
	memcpy(a, b, sizeof(t));
	memcpy(b, &t, sizeof(t));
	nr_swaps++;
}

static void test_sort(void)
{
	int f0 = failures, pass;
	struct rec v[300];
	size_t n, i;

	srand(2);
	for (pass = 0; pass < 2; pass++) {
		for (n = 0; n <= ARRAY_SIZE(v); n += (n < 20 ? 1 : 37)) {
			u64 sum = 0, sum2 = 0;

			for (i = 0; i < n; i++) {
				v[i].key = rand() % (n / 2 + 1);
				v[i].payload[0] = v[i].key * 3;
				v[i].payload[1] = ~v[i].key;
				sum += v[i].key;
			}
			sort(v, n, sizeof(v[0]), cmp_rec,
			     pass ? swap_rec : NULL);
			for (i = 0; i < n; i++) {
				sum2 += v[i].key;
				CHECK(v[i].payload[0] == v[i].key * 3);
				CHECK(v[i].payload[1] == ~v[i].key);
				if (i)
					CHECK(v[i - 1].key <= v[i].key);
			}
			CHECK(sum == sum2);
		}
	}
	CHECK(nr_swaps > 0);	/* the swap_fn path really used it */

	report("sort() with and without swap_fn", f0);
}

/* ------------------------------------------------------------------ */
/* bufio                                                               */
/* ------------------------------------------------------------------ */

#define BS 4096u
#define NBLK 64u

static char tmp_path[] = "/tmp/tsp-shims-XXXXXX";
static int tmp_fd = -1;

struct aux {
	u64 magic;
	u64 seen_write;
};

#define AUX_MAGIC 0x7473706175780aull

/* What the callbacks saw. */
static struct {
	unsigned int allocs;
	unsigned int writes;
	u64 order[64];
	bool check_file_old;	/* verify the file is not yet written */
	unsigned int premature;	/* file already had the data */
	unsigned int aux_dirty;	/* aux was not zeroed */
} cb;

static void reset_cb(void)
{
	memset(&cb, 0, sizeof(cb));
}

static u8 pattern(u64 block, unsigned int gen, size_t i)
{
	return (u8)(block * 131 + gen * 17 + i * 7 + (i >> 8));
}

static void fill(void *p, u64 block, unsigned int gen, size_t len)
{
	size_t i;

	for (i = 0; i < len; i++)
		((u8 *)p)[i] = pattern(block, gen, i);
}

static bool matches(const void *p, u64 block, unsigned int gen, size_t from,
		    size_t to)
{
	size_t i;

	for (i = from; i < to; i++)
		if (((const u8 *)p)[i] != pattern(block, gen, i))
			return false;
	return true;
}

/* Is block @block of the file, bytes [from, to), of generation @gen? */
static bool file_has(u64 block, unsigned int gen, size_t from, size_t to)
{
	u8 buf[BS];

	if (pread(tmp_fd, buf, BS, block * BS) != BS)
		return false;
	return matches(buf, block, gen, from, to);
}

static void reset_file(unsigned int gen)
{
	u8 buf[BS];
	u64 b;

	for (b = 0; b < NBLK; b++) {
		fill(buf, b, gen, BS);
		if (pwrite(tmp_fd, buf, BS, b * BS) != BS)
			abort();
	}
}

static void alloc_cb(struct dm_buffer *b)
{
	struct aux *a = dm_bufio_get_aux_data(b);

	if (a->magic || a->seen_write)
		cb.aux_dirty++;
	a->magic = AUX_MAGIC;
	cb.allocs++;
}

static void write_cb(struct dm_buffer *b)
{
	struct aux *a = dm_bufio_get_aux_data(b);
	u64 block = dm_bufio_get_block_number(b);
	u8 buf[BS];

	if (a->magic != AUX_MAGIC)
		cb.aux_dirty++;
	a->seen_write++;
	if (cb.writes < ARRAY_SIZE(cb.order))
		cb.order[cb.writes] = block;
	cb.writes++;
	if (cb.check_file_old && pread(tmp_fd, buf, BS, block * BS) == BS &&
	    !memcmp(buf, dm_bufio_get_block_data(b), BS))
		cb.premature++;
}

static struct dm_bufio_client *new_client(struct block_device *bdev)
{
	struct dm_bufio_client *c;

	c = dm_bufio_client_create(bdev, BS, 1, sizeof(struct aux), alloc_cb,
				   write_cb, 0);
	CHECK(!IS_ERR(c));
	return IS_ERR(c) ? NULL : c;
}

/* dm_bufio_new + fill with @gen + mark dirty + release. */
static void write_block(struct dm_bufio_client *c, u64 block, unsigned int gen)
{
	struct dm_buffer *b;
	void *p = dm_bufio_new(c, block, &b);

	CHECK(!IS_ERR(p));
	if (IS_ERR(p))
		return;
	fill(p, block, gen, BS);
	dm_bufio_mark_buffer_dirty(b);
	dm_bufio_release(b);
}

/* Read @block through @c and compare with @gen. */
static bool client_has(struct dm_bufio_client *c, u64 block, unsigned int gen)
{
	struct dm_buffer *b;
	void *p = dm_bufio_read(c, block, &b);
	bool ok;

	if (IS_ERR(p))
		return false;
	ok = matches(p, block, gen, 0, BS);
	dm_bufio_release(b);
	return ok;
}

static void destroy_with_held_buffer(void *arg)
{
	struct block_device *bdev = tsp_bdev_open(tmp_path, false);
	struct dm_bufio_client *c = new_client(bdev);
	struct dm_buffer *b;

	dm_bufio_read(c, 1, &b);
	dm_bufio_client_destroy(c);
}

static void test_bufio_basic(void)
{
	int f0 = failures;
	long live0 = tsp_bufio_live_allocs();
	struct block_device *bdev, *ro;
	struct dm_bufio_client *c, *c2;
	struct dm_buffer *b, *b2;
	struct aux *a;
	u64 e0;
	void *p, *p2;
	unsigned int i;
	bool filled = true;

	reset_file(0);
	reset_cb();
	bdev = tsp_bdev_open(tmp_path, false);
	CHECK(bdev);
	if (!bdev)
		return;
	CHECK(tsp_bdev_sectors(bdev) == NBLK * BS / 512);
	CHECK(!tsp_bdev_open("/nonexistent/tsp", false) && errno == ENOENT);

	c = dm_bufio_client_create(bdev, 1000, 1, 0, NULL, NULL, 0);
	CHECK(IS_ERR(c) && PTR_ERR(c) == -EINVAL);
	c = new_client(bdev);
	if (!c)
		return;
	CHECK(dm_bufio_get_block_size(c) == BS);
	CHECK(dm_bufio_get_device_size(c) == NBLK);

	/* read, get, identity, aux */
	p = dm_bufio_read(c, 3, &b);
	CHECK(!IS_ERR(p) && matches(p, 3, 0, 0, BS));
	CHECK(cb.allocs == 1 && !cb.aux_dirty);
	CHECK(dm_bufio_get_block_number(b) == 3);
	CHECK(dm_bufio_get_block_data(b) == p);
	CHECK(dm_bufio_get_client(b) == c);
	a = dm_bufio_get_aux_data(b);
	CHECK(a->magic == AUX_MAGIC);
	CHECK(((uintptr_t)a & (sizeof(long) - 1)) == 0);
	p2 = dm_bufio_get(c, 3, &b2);
	CHECK(p2 == p && b2 == b);
	dm_bufio_release(b2);
	dm_bufio_release(b);
	p2 = dm_bufio_read(c, 3, &b2);		/* cached: no new alloc */
	CHECK(p2 == p && cb.allocs == 1);
	dm_bufio_release(b2);
	CHECK(!dm_bufio_get(c, 4, &b));

	/* Beyond the end of the device. */
	p = dm_bufio_read(c, NBLK, &b);
	CHECK(IS_ERR(p) && PTR_ERR(p) == -EIO);
	p = dm_bufio_read(c, ~0ull / BS, &b);
	CHECK(IS_ERR(p) && PTR_ERR(p) == -EIO);
	p = dm_bufio_new(c, NBLK + 5, &b);
	CHECK(IS_ERR(p) && PTR_ERR(p) == -EIO);

	/* new: not read, filled with the pattern of undefined contents. */
	p = dm_bufio_new(c, 6, &b);
	CHECK(!IS_ERR(p));
	for (i = 0; !IS_ERR(p) && i < BS; i++)
		filled &= ((u8 *)p)[i] == TSP_BUFIO_NEW_FILL;
	CHECK(filled);
	dm_bufio_release(b);

	/* Dirty buffers: written in block order at write_dirty_buffers. */
	write_block(c, 7, 1);
	write_block(c, 5, 1);
	write_block(c, 2, 1);
	CHECK(file_has(5, 0, 0, BS));
	CHECK(cb.writes == 0);
	e0 = tsp_bdev_events(bdev);
	cb.check_file_old = true;
	CHECK(dm_bufio_write_dirty_buffers(c) == 0);
	cb.check_file_old = false;
	CHECK(cb.writes == 3 && !cb.premature);
	CHECK(cb.order[0] == 2 && cb.order[1] == 5 && cb.order[2] == 7);
	CHECK(tsp_bdev_events(bdev) == e0 + 4);	/* 3 writes, 1 flush */
	CHECK(file_has(2, 1, 0, BS) && file_has(5, 1, 0, BS) &&
	      file_has(7, 1, 0, BS) && file_has(6, 0, 0, BS));

	/* Nothing dirty: just the flush. */
	CHECK(dm_bufio_write_dirty_buffers(c) == 0);
	CHECK(cb.writes == 3 && tsp_bdev_events(bdev) == e0 + 5);
	CHECK(dm_bufio_issue_flush(c) == 0);
	CHECK(tsp_bdev_events(bdev) == e0 + 6);

	/* A buffer read, then marked dirty, is written like a new one. */
	p = dm_bufio_read(c, 8, &b);
	CHECK(!IS_ERR(p));
	dm_bufio_mark_buffer_dirty(b);
	dm_bufio_release(b);
	CHECK(dm_bufio_write_dirty_buffers(c) == 0);
	CHECK(cb.writes == 4 && cb.order[3] == 8);

	/* forget: a dirty unheld buffer is dropped unwritten. */
	p = dm_bufio_read(c, 9, &b);
	CHECK(!IS_ERR(p));
	fill(p, 9, 1, BS);
	dm_bufio_mark_buffer_dirty(b);
	dm_bufio_release(b);
	dm_bufio_forget(c, 9);
	CHECK(!dm_bufio_get(c, 9, &b));
	CHECK(dm_bufio_write_dirty_buffers(c) == 0);
	CHECK(cb.writes == 4 && file_has(9, 0, 0, BS));
	CHECK(client_has(c, 9, 0));		/* re-read from the file */

	/* forget of a held buffer does nothing. */
	p = dm_bufio_read(c, 10, &b);
	dm_bufio_forget(c, 10);
	CHECK(dm_bufio_get(c, 10, &b2) == p);
	dm_bufio_release(b2);
	dm_bufio_release(b);

	/* A second client sees what the first wrote. */
	c2 = new_client(bdev);
	CHECK(c2 && client_has(c2, 5, 1));
	dm_bufio_client_destroy(c2);

	/* destroy writes back dirty buffers (no flush), as the kernel does. */
	write_block(c, 11, 1);
	e0 = tsp_bdev_events(bdev);
	dm_bufio_client_destroy(c);
	CHECK(cb.writes == 5 && file_has(11, 1, 0, BS));
	CHECK(tsp_bdev_events(bdev) == e0 + 1);
	CHECK(!cb.aux_dirty);

	/* A read-only device reads, and refuses writes. */
	ro = tsp_bdev_open(tmp_path, true);
	CHECK(ro);
	c = new_client(ro);
	CHECK(client_has(c, 11, 1));
	write_block(c, 12, 1);
	CHECK(dm_bufio_write_dirty_buffers(c) == -EROFS);
	dm_bufio_forget(c, 12);
	dm_bufio_client_destroy(c);
	tsp_bdev_close(ro);
	CHECK(file_has(12, 0, 0, BS));

	CHECK(aborts(destroy_with_held_buffer, NULL));

	tsp_bdev_close(bdev);
	CHECK(tsp_bufio_live_allocs() == live0);

	report("bufio: read/get/new/dirty/flush/forget/callbacks", f0);
}

static void test_bufio_evict(void)
{
	int f0 = failures;
	long live0 = tsp_bufio_live_allocs();
	struct block_device *bdev;
	struct dm_bufio_client *c;
	struct dm_buffer *b0, *b;
	void *p0, *p;
	u64 i;

	reset_file(0);
	reset_cb();
	bdev = tsp_bdev_open(tmp_path, false);
	CHECK(bdev);
	if (!bdev)
		return;
	setenv("TSP_BUFIO_BUFFERS", "8", 1);
	c = new_client(bdev);
	unsetenv("TSP_BUFIO_BUFFERS");
	if (!c)
		return;

	p0 = dm_bufio_read(c, 0, &b0);		/* held throughout */
	CHECK(!IS_ERR(p0));
	cb.check_file_old = true;
	for (i = 1; i <= 20; i++) {
		p = dm_bufio_read(c, i, &b);
		CHECK(!IS_ERR(p));
		if (IS_ERR(p))
			continue;
		if (i <= 5) {
			fill(p, i, 2, BS);
			dm_bufio_mark_buffer_dirty(b);
		}
		dm_bufio_release(b);
	}
	cb.check_file_old = false;

	/* The old dirty buffers were written back on their way out. */
	CHECK(cb.writes == 5 && !cb.premature);
	for (i = 1; i <= 5; i++)
		CHECK(file_has(i, 2, 0, BS));
	CHECK(!dm_bufio_get(c, 1, &b));
	CHECK(!dm_bufio_get(c, 6, &b));
	p = dm_bufio_get(c, 20, &b);		/* recent: still cached */
	CHECK(p);
	if (p)
		dm_bufio_release(b);
	/* Held: never evicted. */
	p = dm_bufio_get(c, 0, &b);
	CHECK(p == p0 && b == b0);
	if (p)
		dm_bufio_release(b);
	dm_bufio_release(b0);
	CHECK(dm_bufio_write_dirty_buffers(c) == 0);
	CHECK(cb.writes == 5);

	/* The minimum raises the bound. */
	dm_bufio_set_minimum_buffers(c, 40);
	for (i = 21; i <= 50; i++)
		CHECK(client_has(c, i, 0));
	p = dm_bufio_get(c, 21, &b);
	CHECK(p);
	if (p)
		dm_bufio_release(b);

	dm_bufio_client_destroy(c);
	tsp_bdev_close(bdev);
	CHECK(tsp_bufio_live_allocs() == live0);

	report("bufio: bounded cache, eviction writes back, held stays", f0);
}

/* Volatile writes: visible to reads, on the file only after a flush. */
static void test_bufio_volatile(void)
{
	int f0 = failures;
	long live0 = tsp_bufio_live_allocs();
	struct block_device *bdev;
	struct dm_bufio_client *c, *small;
	struct dm_buffer *b;
	u8 *p, expect[BS];
	int i;

	reset_file(0);
	reset_cb();
	bdev = tsp_bdev_open(tmp_path, false);
	CHECK(bdev);
	if (!bdev)
		return;
	tsp_bdev_set_volatile(bdev, true);

	/* destroy writes without a flush: the writes stay volatile. */
	c = new_client(bdev);
	write_block(c, 4, 1);
	dm_bufio_client_destroy(c);
	c = new_client(bdev);
	write_block(c, 4, 2);			/* rewrite: newest wins */
	write_block(c, 5, 1);
	dm_bufio_client_destroy(c);
	CHECK(file_has(4, 0, 0, BS) && file_has(5, 0, 0, BS));
	c = new_client(bdev);
	CHECK(client_has(c, 4, 2) && client_has(c, 5, 1));
	dm_bufio_client_destroy(c);

	/* Mixed block sizes: partial overlaps, newest byte wins. */
	small = dm_bufio_client_create(bdev, 512, 1, 0, NULL, NULL, 0);
	CHECK(!IS_ERR(small));
	p = dm_bufio_read(small, 4 * 8 + 1, &b);	/* inside block 4 */
	CHECK(!IS_ERR(p));
	for (i = 0; !IS_ERR(p) && i < 512; i++)
		CHECK(p[i] == pattern(4, 2, 512 + i));
	if (!IS_ERR(p)) {
		memset(p, 0xab, 512);
		dm_bufio_mark_buffer_dirty(b);
		dm_bufio_release(b);
	}
	dm_bufio_client_destroy(small);
	fill(expect, 4, 2, BS);
	memset(expect + 512, 0xab, 512);
	c = new_client(bdev);
	p = dm_bufio_read(c, 4, &b);
	CHECK(!IS_ERR(p) && !memcmp(p, expect, BS));
	if (!IS_ERR(p))
		dm_bufio_release(b);
	CHECK(file_has(4, 0, 0, BS));

	/* A flush puts the list on the file. */
	CHECK(dm_bufio_issue_flush(c) == 0);
	CHECK(file_has(5, 1, 0, BS) && file_has(4, 2, 0, 512) &&
	      file_has(4, 2, 1024, BS));
	dm_bufio_client_destroy(c);

	/* Turning volatile mode off writes the list out too. */
	c = new_client(bdev);
	write_block(c, 6, 3);
	dm_bufio_client_destroy(c);
	CHECK(file_has(6, 0, 0, BS));
	tsp_bdev_set_volatile(bdev, false);
	CHECK(file_has(6, 3, 0, BS));

	/* ... and so does a clean close. */
	tsp_bdev_set_volatile(bdev, true);
	c = new_client(bdev);
	write_block(c, 7, 3);
	dm_bufio_client_destroy(c);
	CHECK(file_has(7, 0, 0, BS));
	tsp_bdev_close(bdev);
	CHECK(file_has(7, 3, 0, BS));
	CHECK(tsp_bufio_live_allocs() == live0);

	report("bufio: volatile writes, overlay reads, flush applies", f0);
}

/* Concurrent readers on one small client: eviction under contention. */
static void *reader_thread(void *arg)
{
	struct dm_bufio_client *c = arg;
	unsigned int seed = (unsigned int)(uintptr_t)&seed, i;
	long bad = 0;

	for (i = 0; i < 3000; i++) {
		u64 blk = rand_r(&seed) % NBLK;
		struct dm_buffer *b;
		void *p = dm_bufio_read(c, blk, &b);

		if (IS_ERR(p)) {
			bad++;
			continue;
		}
		bad += !matches(p, blk, 0, 0, BS);
		dm_bufio_release(b);
	}
	return (void *)bad;
}

static void test_bufio_threads(void)
{
	int f0 = failures;
	long live0 = tsp_bufio_live_allocs(), bad = 0;
	struct block_device *bdev;
	struct dm_bufio_client *c;
	pthread_t t[4];
	unsigned int i;
	void *ret;

	reset_file(0);
	reset_cb();
	bdev = tsp_bdev_open(tmp_path, false);
	CHECK(bdev);
	if (!bdev)
		return;
	setenv("TSP_BUFIO_BUFFERS", "16", 1);
	c = new_client(bdev);
	unsetenv("TSP_BUFIO_BUFFERS");
	if (!c)
		return;
	for (i = 0; i < ARRAY_SIZE(t); i++)
		pthread_create(&t[i], NULL, reader_thread, c);
	for (i = 0; i < ARRAY_SIZE(t); i++) {
		pthread_join(t[i], &ret);
		bad += (long)ret;
	}
	CHECK(!bad);
	CHECK(cb.writes == 0);
	dm_bufio_client_destroy(c);
	tsp_bdev_close(bdev);
	CHECK(tsp_bufio_live_allocs() == live0);

	report("bufio: concurrent readers on one client", f0);
}

/*
 * One crash scenario: blocks 1, 2, 3 dirty with generation 1, the crash
 * at event e0 + @k of dm_bufio_write_dirty_buffers() (writes of 1, 2, 3 are
 * events e0..e0+2, the flush e0+3; k == 4: no crash), then @mode.
 */
static void crash_scenario(bool vol, unsigned int k, enum tsp_crash_mode mode)
{
	struct block_device *bdev;
	struct dm_bufio_client *c, *c2;
	struct dm_buffer *b;
	unsigned int j;
	void *p;
	u64 e0;
	int r;

	reset_file(0);
	reset_cb();
	bdev = tsp_bdev_open(tmp_path, false);
	CHECK(bdev);
	if (!bdev)
		return;
	tsp_bdev_set_volatile(bdev, vol);
	c = new_client(bdev);
	for (j = 1; j <= 3; j++)
		write_block(c, j, 1);

	e0 = tsp_bdev_events(bdev);
	tsp_bdev_crash_at(bdev, e0 + k);
	r = dm_bufio_write_dirty_buffers(c);
	CHECK(r == (k < 4 ? -EIO : 0));
	CHECK(tsp_bdev_crashed(bdev) == (k < 4));
	CHECK(cb.writes == 3);		/* a callback before every attempt */

	if (k < 4) {
		/* Power is off: every IO fails. */
		p = dm_bufio_read(c, 20, &b);
		CHECK(IS_ERR(p) && PTR_ERR(p) == -EIO);
		if (!IS_ERR(p))
			dm_bufio_release(b);
		CHECK(dm_bufio_issue_flush(c) == -EIO);
	}

	CHECK(tsp_bdev_crash_apply(bdev, mode) == 0);
	CHECK(!tsp_bdev_crashed(bdev));

	/* The old client is dead: no IO, and destroy writes nothing. */
	p = dm_bufio_read(c, 21, &b);
	CHECK(IS_ERR(p) && PTR_ERR(p) == -EIO);
	if (!IS_ERR(p))
		dm_bufio_release(b);
	write_block(c, 22, 1);
	dm_bufio_client_destroy(c);
	CHECK(file_has(22, 0, 0, BS));

	for (j = 0; j < 3; j++) {
		u64 blk = j + 1;
		/* Did write j complete, and did it reach the file? */
		bool done = j < k;
		bool kept = done && (!vol || k == 4 ||
				     mode != TSP_CRASH_DROP_VOLATILE);

		if (j == k && mode == TSP_CRASH_TEAR_LAST)
			CHECK(file_has(blk, 1, 0, BS / 2) &&
			      file_has(blk, 0, BS / 2, BS));
		else
			CHECK(file_has(blk, kept ? 1 : 0, 0, BS));
	}

	/* IO works again through a new client. */
	c2 = new_client(bdev);
	CHECK(client_has(c2, 20, 0));
	write_block(c2, 23, 4);
	CHECK(dm_bufio_write_dirty_buffers(c2) == 0);
	CHECK(file_has(23, 4, 0, BS));
	dm_bufio_client_destroy(c2);
	tsp_bdev_close(bdev);
}

static void test_bufio_crash(void)
{
	static const enum tsp_crash_mode modes[] = {
		TSP_CRASH_DROP_VOLATILE, TSP_CRASH_KEEP_VOLATILE,
		TSP_CRASH_TEAR_LAST,
	};
	int f0 = failures, vol;
	long live0 = tsp_bufio_live_allocs();
	unsigned int k, m;

	for (vol = 0; vol < 2; vol++)
		for (k = 0; k <= 4; k++)
			for (m = 0; m < ARRAY_SIZE(modes); m++) {
				int before = failures;

				crash_scenario(vol, k, modes[m]);
				if (failures != before)
					fprintf(stderr,
						"  in scenario volatile=%d crash=%u mode=%u\n",
						vol, k, m);
			}
	CHECK(tsp_bufio_live_allocs() == live0);

	report("bufio: crash at every event, all three modes", f0);
}

int main(void)
{
	tmp_fd = mkstemp(tmp_path);
	if (tmp_fd < 0 || ftruncate(tmp_fd, (off_t)NBLK * BS)) {
		perror("temp file");
		return 1;
	}

	test_crc32c();
	test_alloc();
	test_log();
	test_locks();
	test_sort();
	test_bufio_basic();
	test_bufio_evict();
	test_bufio_volatile();
	test_bufio_threads();
	test_bufio_crash();

	close(tmp_fd);
	unlink(tmp_path);
	if (failures) {
		printf("%d check(s) failed\n", failures);
		return 1;
	}
	printf("all user shim checks passed\n");
	return 0;
}
