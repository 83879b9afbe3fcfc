/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * space-map-format.h - on-disk layout shared by the metadata and the data
 * space maps (dm-thin's format; all little-endian).
 *
 * A space map stores a 2-bit reference count per block in bitmap blocks.
 * The value 3 means "3 or more: look the count up in the overflow btree"
 * (block -> __le32 count).  Within each little-endian 64-bit word entry i
 * uses bits 2i and 2i+1, and bit 2i is the HIGH bit of the count.
 * Bitmaps are found through index entries: for the metadata space map one
 * index block of up to 255 entries, for the data space map a btree keyed
 * by bitmap number.
 *
 * Locking: none (pure layout helpers).
 */
#ifndef TSP_SPACE_MAP_FORMAT_H
#define TSP_SPACE_MAP_FORMAT_H

#include "block-manager.h"

#define TSP_BITMAP_CSUM_XOR 240779
#define TSP_INDEX_CSUM_XOR 160478

/* The root of a space map, kept in the superblock's 128-byte slot. */
struct tsp_disk_sm_root {
	__le64 nr_blocks;
	__le64 nr_allocated;
	__le64 bitmap_root;	/* metadata: index block; data: index btree */
	__le64 ref_count_root;	/* overflow btree */
} __packed;

struct tsp_disk_index_entry {
	__le64 blocknr;		/* the bitmap block */
	__le32 nr_free;		/* entries with count 0 */
	__le32 none_free_before; /* no free entry below this one */
} __packed;

#define TSP_MAX_METADATA_BITMAPS 255

struct tsp_disk_metadata_index {
	__le32 csum;
	__le32 padding;
	__le64 blocknr;
	struct tsp_disk_index_entry index[TSP_MAX_METADATA_BITMAPS];
} __packed;

struct tsp_disk_bitmap_header {
	__le32 csum;
	__le32 not_used;
	__le64 blocknr;
} __packed;

#define TSP_ENTRIES_PER_BITMAP \
	((TSP_METADATA_BLOCK_SIZE - sizeof(struct tsp_disk_bitmap_header)) * 4)

extern const struct tsp_block_validator tsp_bitmap_validator;
extern const struct tsp_block_validator tsp_index_validator;

/* In-core form of an index entry. */
struct tsp_index_entry {
	tsp_block_t blocknr;
	u32 nr_free;
	u32 none_free_before;
};

static inline void tsp_index_entry_pack(const struct tsp_index_entry *ie,
					struct tsp_disk_index_entry *disk)
{
	disk->blocknr = cpu_to_le64(ie->blocknr);
	disk->nr_free = cpu_to_le32(ie->nr_free);
	disk->none_free_before = cpu_to_le32(ie->none_free_before);
}

static inline void tsp_index_entry_unpack(const struct tsp_disk_index_entry *disk,
					  struct tsp_index_entry *ie)
{
	ie->blocknr = le64_to_cpu(disk->blocknr);
	ie->nr_free = le32_to_cpu(disk->nr_free);
	ie->none_free_before = le32_to_cpu(disk->none_free_before);
}

static inline __le64 *tsp_bitmap_words(void *block_data)
{
	return (__le64 *)((char *)block_data + sizeof(struct tsp_disk_bitmap_header));
}

/* The 2-bit count of entry @i of a bitmap block. */
static inline unsigned int tsp_bitmap_get(void *block_data, unsigned int i)
{
	u64 w = le64_to_cpu(tsp_bitmap_words(block_data)[i / 32]);
	unsigned int bit = (i % 32) * 2;

	return (unsigned int)(((w >> bit) & 1) << 1 | ((w >> (bit + 1)) & 1));
}

static inline void tsp_bitmap_set(void *block_data, unsigned int i,
				  unsigned int count)
{
	__le64 *wp = tsp_bitmap_words(block_data) + i / 32;
	unsigned int bit = (i % 32) * 2;
	u64 w = le64_to_cpu(*wp);

	w &= ~(3ULL << bit);
	w |= (u64)((count >> 1) & 1) << bit;
	w |= (u64)(count & 1) << (bit + 1);
	*wp = cpu_to_le64(w);
}

/**
 * tsp_bitmap_count_free - count the free entries of a bitmap block
 * @block_data: the bitmap block
 * @nr: how many entries to look at, from the first
 * @first_free: out, the first of them with count 0, or @nr if none has
 *
 * Returns how many of the first @nr entries have count 0.
 */
static inline u32 tsp_bitmap_count_free(void *block_data, u32 nr,
					u32 *first_free)
{
	u32 i, n = 0;

	*first_free = nr;
	for (i = 0; i < nr; i++) {
		if (tsp_bitmap_get(block_data, i))
			continue;
		if (!n++)
			*first_free = i;
	}
	return n;
}

#endif /* TSP_SPACE_MAP_FORMAT_H */
