// SPDX-License-Identifier: GPL-2.0-only
/*
 * space-map-format.c - validators for the space map blocks shared by the
 * metadata and data space maps.  Locking: none.
 */
#define DM_MSG_PREFIX "thin-scalable metadata"

#include "space-map-format.h"

static void bitmap_prepare_for_write(const struct tsp_block_validator *v,
				     struct tsp_block *b, size_t block_size)
{
	struct tsp_disk_bitmap_header *h = tsp_block_data(b);

	h->blocknr = cpu_to_le64(tsp_block_location(b));
	h->csum = cpu_to_le32(tsp_bm_checksum(&h->not_used,
					      block_size - sizeof(__le32),
					      TSP_BITMAP_CSUM_XOR));
}

static int bitmap_check(const struct tsp_block_validator *v,
			struct tsp_block *b, size_t block_size)
{
	struct tsp_disk_bitmap_header *h = tsp_block_data(b);
	u32 csum;

	if (le64_to_cpu(h->blocknr) != tsp_block_location(b)) {
		DMERR("bitmap block %llu claims to be block %llu",
		      (unsigned long long)tsp_block_location(b),
		      (unsigned long long)le64_to_cpu(h->blocknr));
		return -EILSEQ;
	}
	csum = tsp_bm_checksum(&h->not_used, block_size - sizeof(__le32),
			       TSP_BITMAP_CSUM_XOR);
	if (csum != le32_to_cpu(h->csum)) {
		DMERR("bitmap block %llu has a bad checksum",
		      (unsigned long long)tsp_block_location(b));
		return -EILSEQ;
	}
	return 0;
}

const struct tsp_block_validator tsp_bitmap_validator = {
	.name = "space map bitmap",
	.prepare_for_write = bitmap_prepare_for_write,
	.check = bitmap_check,
};

static void index_prepare_for_write(const struct tsp_block_validator *v,
				    struct tsp_block *b, size_t block_size)
{
	struct tsp_disk_metadata_index *mi = tsp_block_data(b);

	mi->blocknr = cpu_to_le64(tsp_block_location(b));
	mi->csum = cpu_to_le32(tsp_bm_checksum(&mi->padding,
					       block_size - sizeof(__le32),
					       TSP_INDEX_CSUM_XOR));
}

static int index_check(const struct tsp_block_validator *v,
		       struct tsp_block *b, size_t block_size)
{
	struct tsp_disk_metadata_index *mi = tsp_block_data(b);
	u32 csum;

	if (le64_to_cpu(mi->blocknr) != tsp_block_location(b)) {
		DMERR("space map index block %llu claims to be block %llu",
		      (unsigned long long)tsp_block_location(b),
		      (unsigned long long)le64_to_cpu(mi->blocknr));
		return -EILSEQ;
	}
	csum = tsp_bm_checksum(&mi->padding, block_size - sizeof(__le32),
			       TSP_INDEX_CSUM_XOR);
	if (csum != le32_to_cpu(mi->csum)) {
		DMERR("space map index block %llu has a bad checksum",
		      (unsigned long long)tsp_block_location(b));
		return -EILSEQ;
	}
	return 0;
}

const struct tsp_block_validator tsp_index_validator = {
	.name = "space map index",
	.prepare_for_write = index_prepare_for_write,
	.check = index_check,
};
