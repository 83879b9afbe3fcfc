/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * tools/tsm.h - what the pieces of the thin-scalable-meta tool share:
 * the in-memory form of a thin_dump XML document (parsed and validated
 * by xml-parse.c, written to a pool by xml-restore.c, compared against
 * the model by stress.c), the XML dumper (xml-dump.c), the image helpers
 * (thin-scalable-meta.c) and the subcommand entry points.
 *
 * Userspace only; single threaded; every allocation here is plain
 * malloc (the library's counted allocator is left to the library).
 */
#ifndef TSP_TOOLS_TSM_H
#define TSP_TOOLS_TSM_H

#include <stdio.h>

#include "dm-thin-metadata.h"
#include "persistent-data/transaction-manager.h"

/* Mapping times are 24 bits on disk. */
#define TSM_MAX_TIME ((1u << 24) - 1)
/* A data block number has the 40 bits left above the time. */
#define TSM_MAX_DATA_BLOCKS (1ULL << 40)

/**
 * struct tsm_xml_mapping - one <range_mapping> or <single_mapping>
 * @origin: first virtual block
 * @data: first data block
 * @length: number of blocks (1 for a single_mapping)
 * @time: the mappings' time
 * @line: where it was in the XML, for messages
 */
struct tsm_xml_mapping {
	u64 origin;
	u64 data;
	u64 length;
	u32 time;
	unsigned long line;
};

/**
 * struct tsm_xml_device - one <device>
 * @mapped_blocks: as the XML states it (may disagree with @nr_blocks)
 * @nr_blocks: sum of the lengths of @maps
 * @maps: its mappings sorted by origin, not overlapping
 */
struct tsm_xml_device {
	u64 dev_id;
	u64 mapped_blocks;
	u64 transaction;
	u32 creation_time;
	u32 snap_time;
	unsigned long line;
	u64 nr_blocks;
	struct tsm_xml_mapping *maps;
	size_t nr_maps;
	size_t alloc_maps;
};

/**
 * struct tsm_xml - a whole thin_dump document
 * @devs: sorted by dev_id, no duplicates
 * @nr_blocks: mapped blocks over all devices
 */
struct tsm_xml {
	char *uuid;
	u32 time;
	u64 transaction;
	u32 flags;
	u32 version;
	u32 data_block_size;
	u64 nr_data_blocks;
	struct tsm_xml_device *devs;
	size_t nr_devs;
	size_t alloc_devs;
	u64 nr_blocks;
};

/*
 * Parse and validate a thin_dump document.  Returns 0, or -1 with a one
 * line reason (naming the line) in @err.  @x is freed on failure.
 */
int tsm_xml_parse_file(const char *path, struct tsm_xml *x,
		       char *err, size_t errlen);
/*
 * The same for a document in memory.  @no_data_bounds: do not hold data
 * blocks to nr_data_blocks (thin_dump -m prints 0 there: a metadata
 * snapshot has no data space map).
 */
int tsm_xml_parse_buffer(const char *buf, size_t len, bool no_data_bounds,
			 struct tsm_xml *x, char *err, size_t errlen);
void tsm_xml_free(struct tsm_xml *x);

/*
 * Write @pmd's committed view as thin_dump 0.9.0 does, byte for byte.
 * Returns 0 or a negative errno (library error; message printed).
 */
int tsm_dump_pool(struct tsp_pool_metadata *pmd, FILE *out);

/*
 * Image helpers (thin-scalable-meta.c).  A "metadata image" is a regular
 * file or a block device.
 */

/* Size in bytes; -1 with a message on stderr if unusable. */
int tsm_image_size(const char *path, u64 *bytes);
/* Overwrite the superblock with zeroes; -1 with a message on failure. */
int tsm_image_zero_superblock(const char *path);
/* Open an existing pool.  Returns 0, or -1 with a message. */
int tsm_open_pool(const char *path, bool read_only, struct block_device **bdev,
		  struct tsp_pool_metadata **pmd);
/* Close what tsm_open_pool() opened; returns tsp_pool_metadata_close()'s code. */
int tsm_close_pool(struct block_device *bdev, struct tsp_pool_metadata *pmd);

/* Subcommands: each returns the process exit code. */
int tsm_cmd_restore(int argc, char **argv);
int tsm_cmd_stress(int argc, char **argv);

/* strerror(-@r), with plain words for the library's -EILSEQ. */
const char *tsm_strerror(int r);

/* Print "thin-scalable-meta: <msg>" to stderr. */
void tsm_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif /* TSP_TOOLS_TSM_H */
