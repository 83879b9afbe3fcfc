// SPDX-License-Identifier: GPL-2.0-only
/*
 * block-manager.c - metadata blocks over dm-bufio, checked on read and
 * sealed on write by a per-kind validator.
 *
 * Each buffer's aux data remembers the validator that last accepted its
 * contents, so a block is checksummed once per read from disk, not on
 * every lock; a block read as one kind and locked as another is refused.
 * dm-bufio calls our write callback just before it writes a buffer: that
 * is where the validator fills in the location and checksum.
 *
 * Pinning: a block written in this transaction is usually written again
 * soon (the path to the last insert, the space map bitmap being
 * allocated from), so a write lock keeps its buffer held after the
 * unlock, in a small table indexed by block number, and the next write
 * lock of that block takes it from there instead of looking it up in
 * dm-bufio (whose lock and buffer lookup are most of a lock's cost).  A
 * write lock of a pinned block adds no hold: the pin's hold stands for
 * it.  A pinned block is marked dirty in dm-bufio once, when its pin is
 * dropped, not at every unlock (dm-bufio's lock again): held, it cannot
 * be evicted, and clean in dm-bufio's eyes it is not written before.  A
 * pin is dropped when another block needs its slot (unless the block is
 * write locked), when the block is forgotten, and at every flush, before
 * the dirty blocks are written: after a commit no block is written in
 * place until it is shadowed to a new one.  Read locks never use the
 * table.
 *
 * Locking: dm-bufio's own.  The caller guarantees a block is not read
 * while another holder has it write locked, and that write locks, and
 * the calls that drop pins (flush, forget, read only, destroy), are made
 * by one holder at a time with no reader about (the pool metadata lock,
 * held for writing), which is what makes the pin table safe to use
 * without a lock of its own.  A block kept write locked beyond that (the
 * data space map's last bitmap) stays in the pin table untouched: no pin
 * drop takes a write locked block's slot.  A kept block (tsp_bm_keep())
 * is read locked and unlocked as any other by its readers, who take
 * holds of their own; its writer does not touch it meanwhile.  Readers
 * may share a buffer:
 * the first to lock it after it was read from disk checks it, and two of
 * them may do so at once, each storing the same validator.
 */
#define DM_MSG_PREFIX "thin-scalable metadata"

#include "block-manager.h"

/* Slots in the pin table; a power of two. */
#define BM_PINNED_SLOTS 16

struct tsp_block_manager {
	struct dm_bufio_client *bufio;
	bool read_only;
	unsigned int write_locked;	/* blocks write locked now */
	struct dm_buffer *pinned[BM_PINNED_SLOTS];	/* see "Pinning" */
};

/* Per-buffer state kept in dm-bufio's aux area. */
struct bm_aux {
	const struct tsp_block_validator *validator;	/* NULL: unchecked */
	struct tsp_block_manager *bm;	/* of the last write lock */
	bool write_locked;
	bool kept;		/* write locked, readers may share it */
	bool pinned;		/* in the pin table, holding a hold of its own */
	bool dirty;		/* pinned, written, not yet marked dirty */
};

static struct dm_buffer *to_buffer(struct tsp_block *b)
{
	return (struct dm_buffer *)b;
}

static struct bm_aux *buffer_aux(struct dm_buffer *buf)
{
	return dm_bufio_get_aux_data(buf);
}

/* dm-bufio callback: a buffer was created. */
static void bm_alloc_callback(struct dm_buffer *buf)
{
	struct bm_aux *aux = buffer_aux(buf);

	aux->validator = NULL;
	aux->bm = NULL;
	aux->write_locked = false;
	aux->kept = false;
	aux->pinned = false;
	aux->dirty = false;
}

/* dm-bufio callback, just before a buffer is written; must not fail. */
static void bm_write_callback(struct dm_buffer *buf)
{
	const struct tsp_block_validator *v = READ_ONCE(buffer_aux(buf)->validator);

	if (v)
		v->prepare_for_write(v, (struct tsp_block *)buf,
				     TSP_METADATA_BLOCK_SIZE);
}

/**
 * tsp_bm_create - a block manager of 4 KiB blocks over a device
 * @bdev: the metadata device
 * @max_held: how many blocks may be locked at once (reserved buffers,
 *	to which the pin table's slots are added)
 *
 * Context: may sleep.  Returns the block manager or an ERR_PTR.
 */
struct tsp_block_manager *tsp_bm_create(struct block_device *bdev,
					unsigned int max_held)
{
	struct tsp_block_manager *bm;

	bm = kzalloc(sizeof(*bm), GFP_KERNEL);
	if (!bm)
		return ERR_PTR(-ENOMEM);

	bm->bufio = dm_bufio_client_create(bdev, TSP_METADATA_BLOCK_SIZE,
					   max_held + BM_PINNED_SLOTS,
					   sizeof(struct bm_aux),
					   bm_alloc_callback, bm_write_callback,
					   0);
	if (IS_ERR(bm->bufio)) {
		long r = PTR_ERR(bm->bufio);

		kfree(bm);
		return ERR_PTR(r);
	}

	return bm;
}

static struct dm_buffer **pin_slot(struct tsp_block_manager *bm, tsp_block_t b)
{
	return &bm->pinned[b & (BM_PINNED_SLOTS - 1)];
}

/*
 * Drop the pin in @slot, if any.  A write locked block keeps its pin: the
 * lock has no hold of its own.
 */
static void unpin_slot(struct dm_buffer **slot)
{
	struct dm_buffer *buf = *slot;
	struct bm_aux *aux;

	if (!buf)
		return;
	aux = buffer_aux(buf);
	if (WARN_ON_ONCE(aux->write_locked))
		return;
	if (aux->dirty) {
		dm_bufio_mark_buffer_dirty(buf);
		aux->dirty = false;
	}
	aux->pinned = false;
	*slot = NULL;
	dm_bufio_release(buf);
}

static void unpin_all(struct tsp_block_manager *bm)
{
	unsigned int i;

	for (i = 0; i < BM_PINNED_SLOTS; i++)
		unpin_slot(&bm->pinned[i]);
}

/*
 * Pin @buf, just write locked with a hold of its own, which the pin takes
 * over; not if its slot holds a write locked block.
 */
static void pin(struct tsp_block_manager *bm, struct dm_buffer *buf)
{
	struct dm_buffer **slot = pin_slot(bm, dm_bufio_get_block_number(buf));

	if (*slot && buffer_aux(*slot)->write_locked)
		return;
	unpin_slot(slot);
	buffer_aux(buf)->pinned = true;
	*slot = buf;
}

/* The pinned buffer of block @b, or NULL. */
static struct dm_buffer *find_pinned(struct tsp_block_manager *bm,
				     tsp_block_t b)
{
	struct dm_buffer *buf = *pin_slot(bm, b);

	return buf && dm_bufio_get_block_number(buf) == b ? buf : NULL;
}

void tsp_bm_destroy(struct tsp_block_manager *bm)
{
	unpin_all(bm);
	dm_bufio_client_destroy(bm->bufio);
	kfree(bm);
}

tsp_block_t tsp_bm_nr_blocks(struct tsp_block_manager *bm)
{
	return dm_bufio_get_device_size(bm->bufio);
}

/*
 * Check a freshly read buffer with @v, or confirm it was already checked
 * as the same kind.  A NULL @v reads the raw block (superblock probing).
 */
static int bm_validate(struct dm_buffer *buf, const struct tsp_block_validator *v)
{
	struct bm_aux *aux = buffer_aux(buf);
	const struct tsp_block_validator *known = READ_ONCE(aux->validator);
	int r;

	if (!v || known == v)
		return 0;

	if (known) {
		DMERR("block %llu was read as %s, now asked for as %s",
		      (unsigned long long)dm_bufio_get_block_number(buf),
		      known->name, v->name);
		return -EILSEQ;
	}

	r = v->check(v, (struct tsp_block *)buf, TSP_METADATA_BLOCK_SIZE);
	if (r) {
		DMERR("%s block %llu failed its check (%d)", v->name,
		      (unsigned long long)dm_bufio_get_block_number(buf), r);
		return r;
	}
	/* Two readers may check a fresh buffer at once; both store @v. */
	WRITE_ONCE(aux->validator, v);
	return 0;
}

/* Where bm_lock() takes a block's contents from. */
enum bm_source {
	BM_READ,	/* the cache, else the device */
	BM_CACHED,	/* the cache only: -EWOULDBLOCK if it is not there */
	BM_ZERO,	/* nowhere: the block starts zeroed */
	BM_CACHED_ZERO,	/* as BM_ZERO, if its buffer is cached (BM_CACHED) */
};

static int bm_lock(struct tsp_block_manager *bm, tsp_block_t b,
		   const struct tsp_block_validator *v, bool write,
		   enum bm_source source, struct tsp_block **result)
{
	struct dm_buffer *buf, *pinned;
	struct bm_aux *aux;
	void *p;
	int r;

	if (write && bm->read_only)
		return -EPERM;

	pinned = write ? find_pinned(bm, b) : NULL;
	/* Checked against the device's end when pinned, in this transaction. */
	if (!pinned && b >= tsp_bm_nr_blocks(bm)) {
		DMERR("metadata block %llu is beyond the end of the device (%llu blocks)",
		      (unsigned long long)b,
		      (unsigned long long)tsp_bm_nr_blocks(bm));
		return -EILSEQ;
	}

	buf = pinned;
	if (pinned)
		p = dm_bufio_get_block_data(buf);
	else if (source == BM_ZERO)
		p = dm_bufio_new(bm->bufio, b, &buf);
	else if (source == BM_CACHED || source == BM_CACHED_ZERO)
		p = dm_bufio_get(bm->bufio, b, &buf);
	else
		p = dm_bufio_read(bm->bufio, b, &buf);
	if (!p)
		return -EWOULDBLOCK;
	if (IS_ERR(p))
		return PTR_ERR(p);

	aux = buffer_aux(buf);
	if (aux->write_locked && (write || !aux->kept)) {
		/* Corrupt metadata: a block that points to itself, say. */
		DMERR("metadata block %llu is already write locked",
		      (unsigned long long)b);
		if (!pinned)
			dm_bufio_release(buf);
		return -EILSEQ;
	}
	if (source == BM_ZERO || source == BM_CACHED_ZERO) {
		memset(p, 0, TSP_METADATA_BLOCK_SIZE);
		WRITE_ONCE(aux->validator, v);
	} else {
		r = bm_validate(buf, v);
		if (r) {
			/* A reader's own hold goes; a writer's pin with it. */
			if (pinned)
				unpin_slot(pin_slot(bm, b));
			else
				dm_bufio_release(buf);
			dm_bufio_forget(bm->bufio, b);
			return r;
		}
	}

	/* Readers may share a buffer: only the (one) writer marks it. */
	if (write) {
		aux->write_locked = true;
		aux->bm = bm;
		bm->write_locked++;
		if (!pinned)
			pin(bm, buf);
	}
	*result = (struct tsp_block *)buf;
	return 0;
}

/**
 * tsp_bm_read_lock - read a block and check it
 * @bm: block manager
 * @b: block number
 * @v: the kind of block expected, or NULL for the raw contents
 * @result: the locked block; release with tsp_bm_unlock()
 *
 * Context: may sleep.  Returns 0, -EILSEQ (failed the check, beyond the
 * device, or already known as another kind) or an IO error.
 */
int tsp_bm_read_lock(struct tsp_block_manager *bm, tsp_block_t b,
		     const struct tsp_block_validator *v,
		     struct tsp_block **result)
{
	return bm_lock(bm, b, v, false, BM_READ, result);
}

/* As tsp_bm_read_lock(), for writing; -EPERM when read only. */
int tsp_bm_write_lock(struct tsp_block_manager *bm, tsp_block_t b,
		      const struct tsp_block_validator *v,
		      struct tsp_block **result)
{
	return bm_lock(bm, b, v, true, BM_READ, result);
}

/* Write lock a block without reading it; its contents start zeroed. */
int tsp_bm_write_lock_zero(struct tsp_block_manager *bm, tsp_block_t b,
			   const struct tsp_block_validator *v,
			   struct tsp_block **result)
{
	return bm_lock(bm, b, v, true, BM_ZERO, result);
}

/**
 * tsp_bm_write_lock_zero_cached - tsp_bm_write_lock_zero(), without waiting
 * @bm: block manager
 * @b: block number
 * @v: the kind of block it becomes
 * @result: the locked block; release with tsp_bm_unlock()
 *
 * For a block whose buffer tsp_bm_prepare_zero() put in the cache: it
 * issues and waits for no IO, and allocates no buffer, so it may be
 * called where metadata IO cannot complete.
 *
 * Context: may sleep (dm-bufio's lock).  Return: 0, -EWOULDBLOCK if the
 * block's buffer is not cached (any more), or -EPERM when read only.
 */
int tsp_bm_write_lock_zero_cached(struct tsp_block_manager *bm, tsp_block_t b,
				  const struct tsp_block_validator *v,
				  struct tsp_block **result)
{
	return bm_lock(bm, b, v, true, BM_CACHED_ZERO, result);
}

/**
 * tsp_bm_prepare_zero - get a buffer for a block that will be written new
 * @bm: block manager
 * @b: a block that is not in use, and nobody reads
 *
 * Puts a buffer for @b in the cache without reading it, for
 * tsp_bm_write_lock_zero_cached() to take later, if dm-bufio has not
 * evicted it by then; its contents until then are undefined.  Nothing
 * happens if @b is cached already.
 *
 * Context: may sleep and wait for IO (dm-bufio may have to write another
 * buffer out to make room).  Return: 0, -EINVAL if @b is beyond the
 * device, or dm-bufio's error (-ENOMEM).
 */
int tsp_bm_prepare_zero(struct tsp_block_manager *bm, tsp_block_t b)
{
	struct dm_buffer *buf;
	void *p;

	if (b >= tsp_bm_nr_blocks(bm))
		return -EINVAL;
	p = dm_bufio_new(bm->bufio, b, &buf);
	if (IS_ERR(p))
		return PTR_ERR(p);
	dm_bufio_release(buf);
	return 0;
}

/**
 * tsp_bm_lock_cached - lock a block only if it is in the cache
 * @bm: block manager
 * @b: block number
 * @v: the kind of block expected
 * @write: lock for writing (as tsp_bm_write_lock()), else for reading
 * @result: the locked block; release with tsp_bm_unlock()
 *
 * Issues and waits for no IO, so it may be called where metadata IO
 * cannot complete (under a bio submission).
 *
 * Context: may sleep (dm-bufio's lock).  Return: 0, -EWOULDBLOCK if the
 * block is not cached (or still being read), or as tsp_bm_read_lock().
 */
int tsp_bm_lock_cached(struct tsp_block_manager *bm, tsp_block_t b,
		       const struct tsp_block_validator *v, bool write,
		       struct tsp_block **result)
{
	return bm_lock(bm, b, v, write, BM_CACHED, result);
}

/*
 * Release a lock; a write locked block becomes dirty (see "Pinning" for
 * when a pinned one is marked so).
 */
void tsp_bm_unlock(struct tsp_block *b)
{
	struct dm_buffer *buf = to_buffer(b);
	struct bm_aux *aux = buffer_aux(buf);

	if (aux->write_locked && !aux->kept) {
		aux->write_locked = false;
		aux->bm->write_locked--;
		if (aux->pinned) {
			aux->dirty = true;
			return;		/* the pin keeps the hold */
		}
		dm_bufio_mark_buffer_dirty(buf);
	}
	dm_bufio_release(buf);
}

/**
 * tsp_bm_keep - let readers share a block its writer keeps write locked
 * @b: a write locked block
 *
 * Until tsp_bm_unkeep(), @b may be read locked (and unlocked) as if it
 * were not write locked.  Its writer changes it only while no reader
 * holds it (the caller's lock sees to that), and unkeeps it before it
 * unlocks it.  For a writer that changes one block again and again, so
 * that it need not unlock and relock it in between, while readers come
 * and go; it still has to be unlocked before a flush.
 */
void tsp_bm_keep(struct tsp_block *b)
{
	struct bm_aux *aux = buffer_aux(to_buffer(b));

	WARN_ON_ONCE(!aux->write_locked);
	aux->kept = true;
}

/**
 * tsp_bm_unkeep - take a kept block back for its writer, to unlock it
 * @b: a block kept with tsp_bm_keep(), whose readers have all unlocked it
 */
void tsp_bm_unkeep(struct tsp_block *b)
{
	buffer_aux(to_buffer(b))->kept = false;
}

/**
 * tsp_bm_flush - write every dirty block and flush the device cache
 * @bm: block manager
 *
 * Drops every pin, so that the pinned blocks written since they were
 * pinned are marked dirty and written too.  A block still write locked
 * (kept or not) would miss the flush, with the changes of its earlier
 * locks if it is pinned, or be written while it changes: that is
 * refused, as a caller's bug: -EDEADLK, which no update takes for a
 * refusal that leaves the metadata usable (-EBUSY is one).  Context: may
 * sleep.  Returns 0, -EDEADLK if a block is write locked, or an IO error.
 */
int tsp_bm_flush(struct tsp_block_manager *bm)
{
	if (bm->read_only)
		return -EPERM;
	if (bm->write_locked) {
		DMERR("%u metadata blocks are write locked at a flush",
		      bm->write_locked);
		return -EDEADLK;
	}
	unpin_all(bm);
	return dm_bufio_write_dirty_buffers(bm->bufio);
}

/* Drop a cached block, e.g. after it failed a check. */
void tsp_bm_forget(struct tsp_block_manager *bm, tsp_block_t b)
{
	if (find_pinned(bm, b))
		unpin_slot(pin_slot(bm, b));
	dm_bufio_forget(bm->bufio, b);
}

void tsp_bm_set_read_only(struct tsp_block_manager *bm)
{
	bm->read_only = true;
	unpin_all(bm);
}

void tsp_bm_set_read_write(struct tsp_block_manager *bm)
{
	bm->read_only = false;
}

tsp_block_t tsp_block_location(struct tsp_block *b)
{
	return dm_bufio_get_block_number(to_buffer(b));
}

void *tsp_block_data(struct tsp_block *b)
{
	return dm_bufio_get_block_data(to_buffer(b));
}

/**
 * tsp_bm_checksum - dm-thin's metadata checksum
 * @data: bytes to sum
 * @len: their length
 * @init_xor: the per-kind salt
 *
 * crc32c seeded with ~0, without the final inversion, xor the salt.
 */
u32 tsp_bm_checksum(const void *data, size_t len, u32 init_xor)
{
	return crc32c(~(u32)0, data, len) ^ init_xor;
}
