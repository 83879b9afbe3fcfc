/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * user/bufio.h - a userspace stand-in for the subset of linux/dm-bufio.h
 * that persistent-data/block-manager.c uses, so the same block manager
 * runs in the module and in tests and tools.
 *
 * A "block device" here is a regular file or a real block device opened
 * by path.  Writes are cached; dm_bufio_write_dirty_buffers() writes every
 * dirty buffer and then flushes (fdatasync), as the kernel's does.
 *
 * Crash simulation (for the crash-consistency tests): the device can keep
 * every write that has not been followed by a flush in a "volatile" list
 * instead of the file (tsp_bdev_set_volatile()), and can be told to "lose
 * power" at the Nth write or flush event (tsp_bdev_crash_at()).  From the
 * crash on every IO fails with -EIO; tsp_bdev_crash_apply() then decides
 * what reached the medium: none of the volatile writes, all of them, and
 * optionally a torn copy (first half new, second half old) of the write
 * that was in flight.
 *
 * Locking: one mutex per client; safe for concurrent readers.
 */
#ifndef TSP_USER_BUFIO_H
#define TSP_USER_BUFIO_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct block_device;		/* opaque: a file and its crash state */
struct dm_buffer;
struct dm_bufio_client;

/* Open @path read-write (or read-only); returns NULL with errno set. */
struct block_device *tsp_bdev_open(const char *path, bool read_only);
void tsp_bdev_close(struct block_device *bdev);
/* Size in 512-byte sectors. */
uint64_t tsp_bdev_sectors(struct block_device *bdev);
/* The kernel's bdev_read_only(): whether @bdev was opened read-only. */
bool bdev_read_only(struct block_device *bdev);

/* Crash simulation, see above. */
void tsp_bdev_set_volatile(struct block_device *bdev, bool on);
/* Event counter: each block write and each flush is one event. */
uint64_t tsp_bdev_events(struct block_device *bdev);
/* Fail every IO from event number @event on (0 based); ~0 = never. */
void tsp_bdev_crash_at(struct block_device *bdev, uint64_t event);
bool tsp_bdev_crashed(struct block_device *bdev);
/*
 * While @on, every write and flush fails with -EIO (and counts as an
 * event), and reads work: a device that refuses writes, but no crash.
 */
void tsp_bdev_fail_writes(struct block_device *bdev, bool on);
enum tsp_crash_mode {
	TSP_CRASH_DROP_VOLATILE,	/* no unflushed write survives */
	TSP_CRASH_KEEP_VOLATILE,	/* every unflushed write survives */
	TSP_CRASH_TEAR_LAST,		/* keep all but the last, tear it */
};
/* Write to the file what a crash in @mode leaves; clears the crash. */
int tsp_bdev_crash_apply(struct block_device *bdev, enum tsp_crash_mode mode);

/*
 * Live allocations made by user/bufio.c itself (devices, clients, buffers,
 * volatile writes); tests check it returns to its start value.
 */
long tsp_bufio_live_allocs(void);

/* Holds on buffers now, over every client: each read, get or new adds one. */
long tsp_bufio_holds(void);

#define DM_BUFIO_CLIENT_NO_SLEEP 0x1

struct dm_bufio_client *
dm_bufio_client_create(struct block_device *bdev, unsigned int block_size,
		       unsigned int reserved_buffers, unsigned int aux_size,
		       void (*alloc_callback)(struct dm_buffer *),
		       void (*write_callback)(struct dm_buffer *),
		       unsigned int flags);
void dm_bufio_client_destroy(struct dm_bufio_client *c);
void *dm_bufio_read(struct dm_bufio_client *c, uint64_t block,
		    struct dm_buffer **bp);
void *dm_bufio_get(struct dm_bufio_client *c, uint64_t block,
		   struct dm_buffer **bp);
/*
 * A buffer new to the cache starts filled with TSP_BUFIO_NEW_FILL bytes:
 * dm-bufio leaves its contents undefined.
 */
#define TSP_BUFIO_NEW_FILL 0xa5
void *dm_bufio_new(struct dm_bufio_client *c, uint64_t block,
		   struct dm_buffer **bp);
void dm_bufio_prefetch(struct dm_bufio_client *c, uint64_t block,
		       unsigned int n_blocks);
void dm_bufio_release(struct dm_buffer *b);
void dm_bufio_mark_buffer_dirty(struct dm_buffer *b);
int dm_bufio_write_dirty_buffers(struct dm_bufio_client *c);
int dm_bufio_issue_flush(struct dm_bufio_client *c);
void dm_bufio_forget(struct dm_bufio_client *c, uint64_t block);
void dm_bufio_set_minimum_buffers(struct dm_bufio_client *c, unsigned int n);
unsigned int dm_bufio_get_block_size(struct dm_bufio_client *c);
uint64_t dm_bufio_get_device_size(struct dm_bufio_client *c);
uint64_t dm_bufio_get_block_number(struct dm_buffer *b);
void *dm_bufio_get_block_data(struct dm_buffer *b);
void *dm_bufio_get_aux_data(struct dm_buffer *b);
struct dm_bufio_client *dm_bufio_get_client(struct dm_buffer *b);

#endif /* TSP_USER_BUFIO_H */
