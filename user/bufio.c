// SPDX-License-Identifier: GPL-2.0-only
/*
 * user/bufio.c - a file backed stand-in for dm-bufio (see user/bufio.h for
 * the contract), plus the crash simulation the crash-consistency tests
 * drive.
 *
 * Two objects:
 *
 *   struct block_device  a file descriptor, its size, an IO event counter
 *                        and the crash state: the crash point, whether the
 *                        "power" is off, the write that was in flight when
 *                        it went off, and the volatile write list (writes
 *                        not yet followed by a flush, when volatile mode is
 *                        on).
 *
 *   struct dm_bufio_client  a cache of fixed size buffers over one device:
 *                        a hash by block number, and an LRU list of the
 *                        buffers nobody holds.  When the cache is over its
 *                        bound (4096 buffers, or $TSP_BUFIO_BUFFERS), the
 *                        least recently released unheld buffers go; a
 *                        dirty one is written back first (write_callback,
 *                        then the write), and stays if that write fails.
 *                        Held buffers are never evicted.
 *
 * As in the kernel, write_callback runs just before every write attempt of
 * a buffer (writeback on eviction, dm_bufio_write_dirty_buffers(), and the
 * write-back in dm_bufio_client_destroy()); the block manager seals
 * checksums there.  dm_bufio_write_dirty_buffers() writes in block order
 * and then flushes.
 *
 * Crash simulation.  Each block write and each flush is one event,
 * numbered from 0 over the device's life.  In volatile mode a write goes
 * to an in-memory list (one entry per range: rewriting a range replaces
 * its entry and moves it to the end) and reads see it; a flush applies the
 * list to the file in order and fdatasyncs.  When the event counter
 * reaches the crash point, that event and every later IO fail with -EIO
 * (a write that fails this way is kept as the "in flight" write).
 * tsp_bdev_crash_apply() then writes to the file what the crash leaves:
 *
 *   DROP_VOLATILE  nothing from the volatile list
 *   KEEP_VOLATILE  the whole volatile list, in order
 *   TEAR_LAST      the whole volatile list, then the in-flight write torn:
 *                  its first half new bytes, second half what was there.
 *                  With no write in flight (the crash hit a flush, or
 *                  there was no crash) it is KEEP_VOLATILE.
 *
 * and clears the crash state.  Applying also kills every client that
 * existed before it: their cached and dirty buffers belong to the world
 * before the crash, so from then on they fail all IO with -EIO (and
 * dm_bufio_client_destroy() writes nothing).  The caller reopens the
 * metadata with a new client.  tsp_bdev_set_volatile(false) and
 * tsp_bdev_close() of a device that has not crashed write the volatile
 * list out, as a device writes back its cache on a clean shutdown.
 *
 * Environment: TSP_BUFIO_BUFFERS=n sets the default cache bound (tests use
 * a small one to force eviction); TSP_BUFIO_NOSYNC=1 skips the fdatasync()
 * calls (a flush still counts as an event and still applies the volatile
 * list), for fast tests on files that need no durability.
 *
 * Memory: plain malloc/free, counted in tsp_bufio_live_allocs(), and kept
 * apart from the kmalloc counter because the metadata tests check that one
 * separately.
 *
 * Locking: one mutex per client covers its hash, LRU list and every
 * buffer's hold count and dirty flag; IO is done under it, so concurrent
 * readers on a client are serialised but safe.  One mutex per device
 * covers the event counter, the crash state and the volatile list; the
 * order is client lock, then device lock.  write_callback and
 * alloc_callback run under the client lock and must not call back into
 * dm-bufio.  Block data itself is the holders' business, as in the kernel.
 */
#define DM_MSG_PREFIX "bufio"
#include "persistent-data/compat.h"

#include <fcntl.h>
#include <linux/fs.h>		/* BLKGETSIZE64 */
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#define TSP_BUFIO_DEFAULT_BUFFERS 4096
#define NEVER ((u64)~0ull)

/* ------------------------------------------------------------------ */
/* Small helpers: counted malloc, a list, a hash                       */
/* ------------------------------------------------------------------ */

static long bufio_live;

long tsp_bufio_live_allocs(void)
{
	return __atomic_load_n(&bufio_live, __ATOMIC_RELAXED);
}

static long bufio_holds;

long tsp_bufio_holds(void)
{
	return __atomic_load_n(&bufio_holds, __ATOMIC_RELAXED);
}

static void *bmalloc(size_t size, bool zero)
{
	void *p = zero ? calloc(1, size) : malloc(size);

	if (p)
		__atomic_add_fetch(&bufio_live, 1, __ATOMIC_RELAXED);
	return p;
}

static void bfree(void *p)
{
	if (!p)
		return;
	__atomic_sub_fetch(&bufio_live, 1, __ATOMIC_RELAXED);
	free(p);
}

struct link {
	struct link *prev, *next;
};

static void link_init(struct link *h)
{
	h->prev = h->next = h;
}

static bool link_empty(const struct link *h)
{
	return h->next == h;
}

static void link_add_tail(struct link *n, struct link *h)
{
	n->prev = h->prev;
	n->next = h;
	h->prev->next = n;
	h->prev = n;
}

static void link_del(struct link *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	n->prev = n->next = n;
}

static inline unsigned int hash_u64(u64 key, unsigned int bits)
{
	return (unsigned int)((key * 0x9E3779B97F4A7C15ull) >> (64 - bits));
}

static bool env_is_one(const char *name)
{
	const char *v = getenv(name);

	return v && v[0] == '1' && v[1] == '\0';
}

static __attribute__((noreturn)) void bufio_bug(const char *what)
{
	DMERR("BUG: %s", what);
	fflush(stderr);
	abort();
}

/* ------------------------------------------------------------------ */
/* The device                                                          */
/* ------------------------------------------------------------------ */

/* One write kept in the volatile list, or the write in flight at a crash. */
struct vol_write {
	struct link order;		/* in write order */
	struct vol_write *hnext;	/* hash chain, keyed by offset */
	u64 off;
	u32 len;
	u8 data[];
};

#define VOL_HASH_MIN_BITS 8

struct block_device {
	int fd;
	bool read_only;
	bool nosync;
	u64 size;			/* bytes; fixed at open */

	pthread_mutex_t lock;		/* protects everything below */
	unsigned int nr_clients;
	u64 generation;			/* clients of older ones are dead */
	u64 events;
	u64 crash_at;
	bool crashed;
	bool fail_writes;		/* tsp_bdev_fail_writes() */
	struct vol_write *inflight;	/* the write that hit the crash */

	bool is_volatile;
	struct link vol;		/* struct vol_write, oldest first */
	struct vol_write **vol_hash;
	unsigned int vol_hash_bits;
	unsigned long nr_vol;
	/*
	 * While every volatile write has length vol_len at a multiple of it,
	 * a read of one such block is a single hash lookup; otherwise reads
	 * overlay the whole list.
	 */
	bool vol_uniform;
	u32 vol_len;
};

static int pread_full(int fd, void *buf, size_t len, u64 off)
{
	u8 *p = buf;

	while (len) {
		ssize_t n = pread(fd, p, len, (off_t)off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -EIO;	/* error or short read */
		p += n;
		len -= n;
		off += n;
	}
	return 0;
}

static int pwrite_full(int fd, const void *buf, size_t len, u64 off)
{
	const u8 *p = buf;

	while (len) {
		ssize_t n = pwrite(fd, p, len, (off_t)off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -EIO;
		p += n;
		len -= n;
		off += n;
	}
	return 0;
}

static int bdev_sync(struct block_device *bdev)
{
	if (bdev->nosync || bdev->read_only)
		return 0;
	return fdatasync(bdev->fd) ? -EIO : 0;
}

static struct vol_write *vol_alloc(u64 off, const void *data, u32 len)
{
	struct vol_write *w = bmalloc(sizeof(*w) + len, false);

	if (!w)
		return NULL;
	link_init(&w->order);
	w->hnext = NULL;
	w->off = off;
	w->len = len;
	memcpy(w->data, data, len);
	return w;
}

static struct vol_write **vol_slot(struct block_device *bdev, u64 off, u32 len)
{
	struct vol_write **pw = &bdev->vol_hash[hash_u64(off, bdev->vol_hash_bits)];

	while (*pw && ((*pw)->off != off || (*pw)->len != len))
		pw = &(*pw)->hnext;
	return pw;
}

static void vol_grow_hash(struct block_device *bdev)
{
	unsigned int bits = bdev->vol_hash_bits + 1;
	struct vol_write **h = bmalloc(sizeof(*h) << bits, true);
	struct link *l;

	if (!h)
		return;		/* longer chains, still correct */
	bfree(bdev->vol_hash);
	bdev->vol_hash = h;
	bdev->vol_hash_bits = bits;
	for (l = bdev->vol.next; l != &bdev->vol; l = l->next) {
		struct vol_write *w = container_of(l, struct vol_write, order);
		struct vol_write **pw = &h[hash_u64(w->off, bits)];

		w->hnext = *pw;
		*pw = w;
	}
}

/* Drop the whole volatile list. */
static void vol_clear(struct block_device *bdev)
{
	while (!link_empty(&bdev->vol)) {
		struct vol_write *w = container_of(bdev->vol.next,
						   struct vol_write, order);

		link_del(&w->order);
		bfree(w);
	}
	memset(bdev->vol_hash, 0, sizeof(*bdev->vol_hash) << bdev->vol_hash_bits);
	bdev->nr_vol = 0;
	bdev->vol_uniform = true;
	bdev->vol_len = 0;
}

/* Write the volatile list to the file in order, then drop it. */
static int vol_apply(struct block_device *bdev)
{
	struct link *l;
	int r = 0;

	for (l = bdev->vol.next; l != &bdev->vol; l = l->next) {
		struct vol_write *w = container_of(l, struct vol_write, order);
		int e = pwrite_full(bdev->fd, w->data, w->len, w->off);

		if (e && !r)
			r = e;
	}
	vol_clear(bdev);
	return r;
}

static int vol_add(struct block_device *bdev, u64 off, const void *data,
		   u32 len)
{
	struct vol_write **pw = vol_slot(bdev, off, len);
	struct vol_write *w = *pw;

	if (w) {
		/* A full rewrite of the range: replace it, now the newest. */
		memcpy(w->data, data, len);
		link_del(&w->order);
		link_add_tail(&w->order, &bdev->vol);
		return 0;
	}

	w = vol_alloc(off, data, len);
	if (!w)
		return -ENOMEM;
	*pw = w;
	link_add_tail(&w->order, &bdev->vol);
	if (!bdev->nr_vol++)
		bdev->vol_len = len;
	if (len != bdev->vol_len || off % len)
		bdev->vol_uniform = false;
	if (bdev->nr_vol > (2ul << bdev->vol_hash_bits))
		vol_grow_hash(bdev);
	return 0;
}

/* Lay the volatile writes that overlap [off, off + len) over @buf. */
static void vol_overlay(struct block_device *bdev, u64 off, u8 *buf, u32 len)
{
	struct link *l;

	if (!bdev->nr_vol)
		return;

	if (bdev->vol_uniform && len == bdev->vol_len && !(off % len)) {
		struct vol_write *w = *vol_slot(bdev, off, len);

		if (w)
			memcpy(buf, w->data, len);
		return;
	}

	/* Oldest first, so the newest write of each byte wins. */
	for (l = bdev->vol.next; l != &bdev->vol; l = l->next) {
		struct vol_write *w = container_of(l, struct vol_write, order);
		u64 s = max(off, w->off);
		u64 e = min(off + len, w->off + w->len);

		if (s < e)
			memcpy(buf + (s - off), w->data + (s - w->off), e - s);
	}
}

/*
 * Start one write or flush event: count it and decide whether the power
 * goes off now.  Returns 0 to go ahead, -EIO if the device is (now) dead.
 */
static int bdev_event(struct block_device *bdev, u64 off, const void *data,
		      u32 len)
{
	u64 ev = bdev->events++;

	if (bdev->crashed || bdev->fail_writes)
		return -EIO;
	if (ev < bdev->crash_at)
		return 0;

	bdev->crashed = true;
	if (data) {
		bdev->inflight = vol_alloc(off, data, len);
		if (!bdev->inflight)
			DMERR("no memory to keep the torn write at event %llu",
			      (unsigned long long)ev);
	}
	return -EIO;
}

static int bdev_read(struct block_device *bdev, u64 gen, u64 off, void *buf,
		     u32 len)
{
	int r = -EIO;

	pthread_mutex_lock(&bdev->lock);
	if (gen != bdev->generation || bdev->crashed)
		goto out;
	if (off > bdev->size || len > bdev->size - off)
		goto out;
	r = pread_full(bdev->fd, buf, len, off);
	if (!r)
		vol_overlay(bdev, off, buf, len);
out:
	pthread_mutex_unlock(&bdev->lock);
	return r;
}

static int bdev_write(struct block_device *bdev, u64 gen, u64 off,
		      const void *data, u32 len)
{
	int r = -EIO;

	pthread_mutex_lock(&bdev->lock);
	if (gen != bdev->generation)
		goto out;
	if (bdev->read_only) {
		r = -EROFS;
		goto out;
	}
	if (off > bdev->size || len > bdev->size - off)
		goto out;
	r = bdev_event(bdev, off, data, len);
	if (r)
		goto out;
	if (bdev->is_volatile)
		r = vol_add(bdev, off, data, len);
	else
		r = pwrite_full(bdev->fd, data, len, off);
out:
	pthread_mutex_unlock(&bdev->lock);
	return r;
}

static int bdev_flush(struct block_device *bdev, u64 gen)
{
	int r = -EIO;

	pthread_mutex_lock(&bdev->lock);
	if (gen != bdev->generation)
		goto out;
	if (bdev->read_only) {
		r = 0;
		goto out;
	}
	r = bdev_event(bdev, 0, NULL, 0);
	if (r)
		goto out;
	r = vol_apply(bdev);
	if (!r)
		r = bdev_sync(bdev);
out:
	pthread_mutex_unlock(&bdev->lock);
	return r;
}

struct block_device *tsp_bdev_open(const char *path, bool read_only)
{
	struct block_device *bdev;
	struct stat st;
	int saved;

	bdev = bmalloc(sizeof(*bdev), true);
	if (!bdev) {
		errno = ENOMEM;
		return NULL;
	}
	bdev->vol_hash_bits = VOL_HASH_MIN_BITS;
	bdev->vol_hash = bmalloc(sizeof(*bdev->vol_hash) << VOL_HASH_MIN_BITS,
				 true);
	if (!bdev->vol_hash) {
		errno = ENOMEM;
		goto bad_hash;
	}

	bdev->fd = open(path, (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC);
	if (bdev->fd < 0)
		goto bad_open;
	if (fstat(bdev->fd, &st))
		goto bad_size;
	if (S_ISBLK(st.st_mode)) {
		if (ioctl(bdev->fd, BLKGETSIZE64, &bdev->size))
			goto bad_size;
	} else if (S_ISREG(st.st_mode)) {
		bdev->size = (u64)st.st_size;
	} else {
		errno = EINVAL;
		goto bad_size;
	}

	bdev->read_only = read_only;
	bdev->nosync = env_is_one("TSP_BUFIO_NOSYNC");
	pthread_mutex_init(&bdev->lock, NULL);
	bdev->crash_at = NEVER;
	link_init(&bdev->vol);
	bdev->vol_uniform = true;
	return bdev;

bad_size:
	saved = errno;
	close(bdev->fd);
	errno = saved;
bad_open:
	bfree(bdev->vol_hash);
bad_hash:
	bfree(bdev);
	return NULL;
}

void tsp_bdev_close(struct block_device *bdev)
{
	if (!bdev)
		return;
	if (bdev->nr_clients) {
		DMERR("closing a device with %u bufio clients still open",
		      bdev->nr_clients);
		bufio_bug("device closed under its clients");
	}

	if (bdev->crashed) {
		vol_clear(bdev);
	} else if (bdev->nr_vol) {
		if (vol_apply(bdev) || bdev_sync(bdev))
			DMERR("writing the volatile list at close failed");
	}
	bfree(bdev->inflight);
	bfree(bdev->vol_hash);
	close(bdev->fd);
	pthread_mutex_destroy(&bdev->lock);
	bfree(bdev);
}

uint64_t tsp_bdev_sectors(struct block_device *bdev)
{
	return bdev->size >> 9;
}

bool bdev_read_only(struct block_device *bdev)
{
	return bdev->read_only;
}

void tsp_bdev_set_volatile(struct block_device *bdev, bool on)
{
	pthread_mutex_lock(&bdev->lock);
	if (!on && !bdev->crashed && bdev->nr_vol &&
	    vol_apply(bdev))
		DMERR("writing the volatile list failed");
	bdev->is_volatile = on;
	pthread_mutex_unlock(&bdev->lock);
}

uint64_t tsp_bdev_events(struct block_device *bdev)
{
	u64 ev;

	pthread_mutex_lock(&bdev->lock);
	ev = bdev->events;
	pthread_mutex_unlock(&bdev->lock);
	return ev;
}

void tsp_bdev_crash_at(struct block_device *bdev, uint64_t event)
{
	pthread_mutex_lock(&bdev->lock);
	bdev->crash_at = event;
	pthread_mutex_unlock(&bdev->lock);
}

void tsp_bdev_fail_writes(struct block_device *bdev, bool on)
{
	pthread_mutex_lock(&bdev->lock);
	bdev->fail_writes = on;
	pthread_mutex_unlock(&bdev->lock);
}

bool tsp_bdev_crashed(struct block_device *bdev)
{
	bool crashed;

	pthread_mutex_lock(&bdev->lock);
	crashed = bdev->crashed;
	pthread_mutex_unlock(&bdev->lock);
	return crashed;
}

/* Write the in-flight write over the file: first half new, rest old. */
static int tear_inflight(struct block_device *bdev)
{
	struct vol_write *w = bdev->inflight;
	u32 half = w->len / 2;

	return pwrite_full(bdev->fd, w->data, half, w->off);
}

int tsp_bdev_crash_apply(struct block_device *bdev, enum tsp_crash_mode mode)
{
	int r = 0;

	pthread_mutex_lock(&bdev->lock);
	switch (mode) {
	case TSP_CRASH_DROP_VOLATILE:
		vol_clear(bdev);
		break;
	case TSP_CRASH_KEEP_VOLATILE:
		r = vol_apply(bdev);
		break;
	case TSP_CRASH_TEAR_LAST:
		r = vol_apply(bdev);
		if (!r && bdev->inflight)
			r = tear_inflight(bdev);
		break;
	default:
		r = -EINVAL;
		goto out;
	}
	if (!r)
		r = bdev_sync(bdev);

	bfree(bdev->inflight);
	bdev->inflight = NULL;
	bdev->crashed = false;
	bdev->crash_at = NEVER;
	bdev->generation++;
out:
	pthread_mutex_unlock(&bdev->lock);
	return r;
}

/* ------------------------------------------------------------------ */
/* The client                                                          */
/* ------------------------------------------------------------------ */

struct dm_buffer {
	struct dm_bufio_client *c;
	struct dm_buffer *hnext;	/* hash chain */
	struct link lru;		/* on c->lru while hold == 0 */
	u64 block;
	unsigned int hold;
	bool dirty;
	void *data;
	max_align_t aux[];		/* c->aux_size bytes */
};

#define CLIENT_HASH_MIN_BITS 10

struct dm_bufio_client {
	struct block_device *bdev;
	unsigned int block_size;
	unsigned int aux_size;
	u64 nr_blocks;
	u64 generation;			/* bdev generation at creation */
	void (*alloc_callback)(struct dm_buffer *);
	void (*write_callback)(struct dm_buffer *);

	pthread_mutex_t lock;		/* protects everything below */
	struct dm_buffer **hash;
	unsigned int hash_bits;
	unsigned long nr_buffers;
	unsigned long max_buffers;	/* cache bound */
	unsigned long min_buffers;	/* dm_bufio_set_minimum_buffers() */
	struct link lru;		/* unheld buffers, oldest first */
};

static struct dm_buffer **__slot(struct dm_bufio_client *c, u64 block)
{
	struct dm_buffer **pb = &c->hash[hash_u64(block, c->hash_bits)];

	while (*pb && (*pb)->block != block)
		pb = &(*pb)->hnext;
	return pb;
}

static void __grow_hash(struct dm_bufio_client *c)
{
	unsigned int bits = c->hash_bits + 1, i;
	struct dm_buffer **h = bmalloc(sizeof(*h) << bits, true);

	if (!h)
		return;		/* longer chains, still correct */
	for (i = 0; i < (1u << c->hash_bits); i++) {
		while (c->hash[i]) {
			struct dm_buffer *b = c->hash[i];
			struct dm_buffer **pb = &h[hash_u64(b->block, bits)];

			c->hash[i] = b->hnext;
			b->hnext = *pb;
			*pb = b;
		}
	}
	bfree(c->hash);
	c->hash = h;
	c->hash_bits = bits;
}

static struct dm_buffer *__alloc_buffer(struct dm_bufio_client *c, u64 block)
{
	struct dm_buffer *b = bmalloc(sizeof(*b) + c->aux_size, true);

	if (!b)
		return NULL;
	b->data = bmalloc(c->block_size, false);
	if (!b->data) {
		bfree(b);
		return NULL;
	}
	b->c = c;
	b->block = block;
	link_init(&b->lru);
	return b;
}

static void __free_buffer(struct dm_buffer *b)
{
	bfree(b->data);
	bfree(b);
}

static void __insert(struct dm_bufio_client *c, struct dm_buffer *b)
{
	struct dm_buffer **pb = __slot(c, b->block);

	b->hnext = *pb;
	*pb = b;
	if (++c->nr_buffers > (2ul << c->hash_bits))
		__grow_hash(c);
}

/* Unhash and free an unheld buffer. */
static void __remove(struct dm_bufio_client *c, struct dm_buffer *b)
{
	struct dm_buffer **pb = __slot(c, b->block);

	*pb = b->hnext;
	link_del(&b->lru);
	c->nr_buffers--;
	__free_buffer(b);
}

static void __hold(struct dm_buffer *b)
{
	__atomic_add_fetch(&bufio_holds, 1, __ATOMIC_RELAXED);
	if (!b->hold++)
		link_del(&b->lru);
}

static int __write_buffer(struct dm_bufio_client *c, struct dm_buffer *b)
{
	int r;

	if (c->write_callback)
		c->write_callback(b);
	r = bdev_write(c->bdev, c->generation, b->block * c->block_size,
		       b->data, c->block_size);
	if (!r)
		b->dirty = false;
	return r;
}

/* Shrink the cache to its bound, oldest unheld buffers first. */
static void __evict(struct dm_bufio_client *c)
{
	unsigned long bound = max(c->max_buffers, c->min_buffers);
	struct link *l, *next;

	for (l = c->lru.next; l != &c->lru && c->nr_buffers > bound; l = next) {
		struct dm_buffer *b = container_of(l, struct dm_buffer, lru);

		next = l->next;
		if (b->dirty && __write_buffer(c, b))
			continue;	/* keep it; it is still dirty */
		__remove(c, b);
	}
}

static int cmp_block(const void *a, const void *b)
{
	u64 x = (*(struct dm_buffer * const *)a)->block;
	u64 y = (*(struct dm_buffer * const *)b)->block;

	return x < y ? -1 : x > y;
}

/* Write every dirty buffer, in block order; returns the first error. */
static int __write_dirty(struct dm_bufio_client *c)
{
	struct dm_buffer **v, *b;
	unsigned long n = 0, i;
	int r = 0, e;

	for (i = 0; i < (1ul << c->hash_bits); i++)
		for (b = c->hash[i]; b; b = b->hnext)
			n += b->dirty;
	if (!n)
		return 0;

	v = bmalloc(n * sizeof(*v), false);
	if (!v) {
		/* No memory to sort: write them in hash order instead. */
		for (i = 0; i < (1ul << c->hash_bits); i++)
			for (b = c->hash[i]; b; b = b->hnext)
				if (b->dirty && (e = __write_buffer(c, b)) && !r)
					r = e;
		return r;
	}

	n = 0;
	for (i = 0; i < (1ul << c->hash_bits); i++)
		for (b = c->hash[i]; b; b = b->hnext)
			if (b->dirty)
				v[n++] = b;
	qsort(v, n, sizeof(*v), cmp_block);
	for (i = 0; i < n; i++) {
		e = __write_buffer(c, v[i]);
		if (e && !r)
			r = e;
	}
	bfree(v);
	return r;
}

struct dm_bufio_client *
dm_bufio_client_create(struct block_device *bdev, unsigned int block_size,
		       unsigned int reserved_buffers, unsigned int aux_size,
		       void (*alloc_callback)(struct dm_buffer *),
		       void (*write_callback)(struct dm_buffer *),
		       unsigned int flags)
{
	struct dm_bufio_client *c;
	const char *env;

	if (!bdev || !block_size || block_size % 512)
		return ERR_PTR(-EINVAL);

	c = bmalloc(sizeof(*c), true);
	if (!c)
		return ERR_PTR(-ENOMEM);
	c->hash_bits = CLIENT_HASH_MIN_BITS;
	c->hash = bmalloc(sizeof(*c->hash) << c->hash_bits, true);
	if (!c->hash) {
		bfree(c);
		return ERR_PTR(-ENOMEM);
	}

	c->bdev = bdev;
	c->block_size = block_size;
	c->aux_size = aux_size;
	c->nr_blocks = bdev->size / block_size;
	c->alloc_callback = alloc_callback;
	c->write_callback = write_callback;
	pthread_mutex_init(&c->lock, NULL);
	link_init(&c->lru);

	c->max_buffers = TSP_BUFIO_DEFAULT_BUFFERS;
	env = getenv("TSP_BUFIO_BUFFERS");
	if (env && strtoul(env, NULL, 0) > 0)
		c->max_buffers = strtoul(env, NULL, 0);
	c->min_buffers = reserved_buffers;

	pthread_mutex_lock(&bdev->lock);
	bdev->nr_clients++;
	c->generation = bdev->generation;
	pthread_mutex_unlock(&bdev->lock);
	return c;
}

void dm_bufio_client_destroy(struct dm_bufio_client *c)
{
	struct dm_buffer *b;
	unsigned long leaked = 0, i;

	pthread_mutex_lock(&c->lock);
	for (i = 0; i < (1ul << c->hash_bits); i++)
		for (b = c->hash[i]; b; b = b->hnext)
			if (b->hold) {
				DMERR("leaked buffer %llu, hold count %u",
				      (unsigned long long)b->block, b->hold);
				leaked++;
			}
	if (leaked)
		bufio_bug("dm_bufio_client_destroy with buffers held");

	/* As the kernel does: write back, without a flush, errors ignored. */
	__write_dirty(c);

	for (i = 0; i < (1ul << c->hash_bits); i++)
		while (c->hash[i])
			__remove(c, c->hash[i]);
	pthread_mutex_unlock(&c->lock);

	pthread_mutex_lock(&c->bdev->lock);
	c->bdev->nr_clients--;
	pthread_mutex_unlock(&c->bdev->lock);

	pthread_mutex_destroy(&c->lock);
	bfree(c->hash);
	bfree(c);
}

enum get_mode {
	GET_CACHED,	/* dm_bufio_get: only if cached */
	GET_READ,	/* dm_bufio_read */
	GET_NEW,	/* dm_bufio_new: no read */
};

static void *get_buffer(struct dm_bufio_client *c, u64 block,
			struct dm_buffer **bp, enum get_mode mode)
{
	struct dm_buffer *b;
	int r;

	pthread_mutex_lock(&c->lock);
	b = *__slot(c, block);
	if (b)
		goto found;
	if (mode == GET_CACHED) {
		pthread_mutex_unlock(&c->lock);
		return NULL;
	}

	r = -EIO;
	if (block >= c->nr_blocks)
		goto bad;
	r = -ENOMEM;
	b = __alloc_buffer(c, block);
	if (!b)
		goto bad;
	if (c->alloc_callback)
		c->alloc_callback(b);
	if (mode == GET_READ) {
		r = bdev_read(c->bdev, c->generation, block * c->block_size,
			      b->data, c->block_size);
		if (r) {
			__free_buffer(b);
			goto bad;
		}
	} else {
		/* Undefined in dm-bufio: a pattern, for tests to notice a read. */
		memset(b->data, TSP_BUFIO_NEW_FILL, c->block_size);
	}
	__insert(c, b);
found:
	__hold(b);
	__evict(c);
	pthread_mutex_unlock(&c->lock);
	*bp = b;
	return b->data;

bad:
	pthread_mutex_unlock(&c->lock);
	return ERR_PTR(r);
}

void *dm_bufio_read(struct dm_bufio_client *c, uint64_t block,
		    struct dm_buffer **bp)
{
	return get_buffer(c, block, bp, GET_READ);
}

void *dm_bufio_get(struct dm_bufio_client *c, uint64_t block,
		   struct dm_buffer **bp)
{
	return get_buffer(c, block, bp, GET_CACHED);
}

void *dm_bufio_new(struct dm_bufio_client *c, uint64_t block,
		   struct dm_buffer **bp)
{
	return get_buffer(c, block, bp, GET_NEW);
}

void dm_bufio_prefetch(struct dm_bufio_client *c, uint64_t block,
		       unsigned int n_blocks)
{
	/* Only a hint; reads are synchronous here anyway. */
}

void dm_bufio_release(struct dm_buffer *b)
{
	struct dm_bufio_client *c = b->c;

	pthread_mutex_lock(&c->lock);
	if (!b->hold)
		bufio_bug("dm_bufio_release of a buffer nobody holds");
	__atomic_sub_fetch(&bufio_holds, 1, __ATOMIC_RELAXED);
	if (!--b->hold)
		link_add_tail(&b->lru, &c->lru);
	__evict(c);
	pthread_mutex_unlock(&c->lock);
}

void dm_bufio_mark_buffer_dirty(struct dm_buffer *b)
{
	struct dm_bufio_client *c = b->c;

	pthread_mutex_lock(&c->lock);
	if (!b->hold)
		bufio_bug("dm_bufio_mark_buffer_dirty of a buffer nobody holds");
	b->dirty = true;
	pthread_mutex_unlock(&c->lock);
}

int dm_bufio_write_dirty_buffers(struct dm_bufio_client *c)
{
	int r, f;

	pthread_mutex_lock(&c->lock);
	r = __write_dirty(c);
	f = bdev_flush(c->bdev, c->generation);
	pthread_mutex_unlock(&c->lock);
	return r ? r : f;
}

int dm_bufio_issue_flush(struct dm_bufio_client *c)
{
	return bdev_flush(c->bdev, c->generation);
}

void dm_bufio_forget(struct dm_bufio_client *c, uint64_t block)
{
	struct dm_buffer *b;

	pthread_mutex_lock(&c->lock);
	b = *__slot(c, block);
	if (b && !b->hold)
		__remove(c, b);
	pthread_mutex_unlock(&c->lock);
}

void dm_bufio_set_minimum_buffers(struct dm_bufio_client *c, unsigned int n)
{
	pthread_mutex_lock(&c->lock);
	c->min_buffers = n;
	pthread_mutex_unlock(&c->lock);
}

unsigned int dm_bufio_get_block_size(struct dm_bufio_client *c)
{
	return c->block_size;
}

uint64_t dm_bufio_get_device_size(struct dm_bufio_client *c)
{
	return c->nr_blocks;
}

uint64_t dm_bufio_get_block_number(struct dm_buffer *b)
{
	return b->block;
}

void *dm_bufio_get_block_data(struct dm_buffer *b)
{
	return b->data;
}

void *dm_bufio_get_aux_data(struct dm_buffer *b)
{
	return b->aux;
}

struct dm_bufio_client *dm_bufio_get_client(struct dm_buffer *b)
{
	return b->c;
}
