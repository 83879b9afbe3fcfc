// SPDX-License-Identifier: GPL-2.0-only
/*
 * tools/xml-restore.c - "restore": writes a thin_dump XML document into a
 * metadata image, as thin_restore does, through the library.
 *
 * Order of work, chosen so that bad input never damages the output:
 *   1. parse and validate the whole document (xml-parse.c);
 *   2. check the image is a file or block device big enough for it
 *      (a lower bound: the library's -ENOSPC is the final word);
 *   3. zero the image's superblock so that opening it formats;
 *   4. format with the dump's data block size and data device size, set
 *      the superblock's time, transaction id and flags, create each device
 *      with its details, map each block, commit.
 * If anything fails after step 3 the superblock is zeroed again, so a
 * half restored image is never mistaken for a pool.
 *
 * mapped_blocks in the XML is advice: a device gets the number of blocks
 * its mappings actually cover, and a disagreement is reported as a
 * warning (thin_restore recounts the same way).
 */
#define DM_MSG_PREFIX "thin-scalable-meta"

#include "tools/tsm.h"

/* Bitmap entries per space map bitmap block (16 byte header, 2 bits each). */
#define SM_ENTRIES_PER_BITMAP ((TSP_METADATA_BLOCK_SIZE - 16) * 4)
/* Btree node: 32 byte header, then keys and values. */
#define BTREE_SPACE (TSP_METADATA_BLOCK_SIZE - 32)

static u64 div_up(u64 n, u64 d)
{
	return n / d + !!(n % d);
}

/*
 * The fewest metadata blocks a restore of @x can use: a superblock, the
 * metadata space map (one index block and its bitmaps), the data space
 * map's bitmaps and their index tree, the device details tree, the top
 * level mapping tree and each device's mapping tree with full leaves.
 */
static u64 min_metadata_blocks(const struct tsm_xml *x, u64 nr_meta_blocks)
{
	u64 need = 1, data_bitmaps;
	size_t i;

	need += 1 + div_up(nr_meta_blocks, SM_ENTRIES_PER_BITMAP);
	data_bitmaps = div_up(x->nr_data_blocks, SM_ENTRIES_PER_BITMAP);
	need += data_bitmaps + div_up(data_bitmaps, BTREE_SPACE / (8 + 16));
	need += div_up(x->nr_devs ? x->nr_devs : 1, BTREE_SPACE / (8 + 24));
	need += div_up(x->nr_devs ? x->nr_devs : 1, BTREE_SPACE / (8 + 8));
	for (i = 0; i < x->nr_devs; i++)
		need += div_up(x->devs[i].nr_blocks ? x->devs[i].nr_blocks : 1,
			       BTREE_SPACE / (8 + 8));
	return need;
}

static int restore_device(struct tsp_pool_metadata *pmd, const char *image,
			  const struct tsm_xml_device *xd)
{
	struct tsp_thin_details details = {
		.mapped_blocks = xd->nr_blocks,
		.transaction_id = xd->transaction,
		.creation_time = xd->creation_time,
		.snapshotted_time = xd->snap_time,
	};
	struct tsp_thin_device *td;
	tsp_block_t count;
	size_t i;
	u64 j;
	int r;

	if (xd->mapped_blocks != xd->nr_blocks)
		fprintf(stderr, "thin-scalable-meta: warning: device %llu (line %lu): mapped_blocks=%llu but its mappings cover %llu blocks; using %llu\n",
			(unsigned long long)xd->dev_id, xd->line,
			(unsigned long long)xd->mapped_blocks,
			(unsigned long long)xd->nr_blocks,
			(unsigned long long)xd->nr_blocks);

	r = tsp_pool_restore_thin(pmd, xd->dev_id, &details);
	if (r) {
		tsm_err("%s: cannot create device %llu: %s", image,
			(unsigned long long)xd->dev_id, tsm_strerror(r));
		return r;
	}
	r = tsp_pool_open_thin_device(pmd, xd->dev_id, &td);
	if (r) {
		tsm_err("%s: cannot open device %llu: %s", image,
			(unsigned long long)xd->dev_id, tsm_strerror(r));
		return r;
	}
	for (i = 0; i < xd->nr_maps; i++) {
		const struct tsm_xml_mapping *m = &xd->maps[i];

		for (j = 0; j < m->length; j++) {
			r = tsp_thin_restore_block(td, m->origin + j,
						   m->data + j, m->time);
			if (r) {
				tsm_err("%s: device %llu: cannot map block %llu to %llu (line %lu): %s%s",
					image, (unsigned long long)xd->dev_id,
					(unsigned long long)(m->origin + j),
					(unsigned long long)(m->data + j),
					m->line, tsm_strerror(r),
					r == -ENOSPC ? ": the metadata device is too small" : "");
				goto out;
			}
		}
	}
	r = tsp_thin_get_mapped_count(td, &count);
	if (r) {
		tsm_err("%s: device %llu: cannot read the mapped count: %s",
			image, (unsigned long long)xd->dev_id, tsm_strerror(r));
		goto out;
	}
	if (count != xd->nr_blocks) {
		tsm_err("%s: device %llu: library bug: mapped count %llu after restoring %llu blocks",
			image, (unsigned long long)xd->dev_id,
			(unsigned long long)count,
			(unsigned long long)xd->nr_blocks);
		r = -EIO;
	}
out:
	tsp_pool_close_thin_device(td);
	return r;
}

static int restore(const struct tsm_xml *x, const char *image)
{
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	size_t i;
	int r;

	bdev = tsp_bdev_open(image, false);
	if (!bdev) {
		tsm_err("%s: %s", image, strerror(errno));
		return -1;
	}
	r = tsp_pool_metadata_open(bdev, x->data_block_size,
				   x->nr_data_blocks, true, &pmd);
	if (r) {
		tsm_err("%s: cannot format the metadata: %s%s", image,
			tsm_strerror(r),
			r == -ENOSPC ? ": the device is too small" : "");
		tsp_bdev_close(bdev);
		return -1;
	}
	r = tsp_pool_restore_superblock(pmd, x->time, x->transaction,
					x->flags);
	if (r) {
		tsm_err("%s: cannot set the superblock: %s", image,
			tsm_strerror(r));
		goto fail;
	}
	for (i = 0; i < x->nr_devs; i++) {
		r = restore_device(pmd, image, &x->devs[i]);
		if (r)
			goto fail;
	}
	r = tsp_pool_commit_metadata(pmd);
	if (r) {
		tsm_err("%s: commit failed: %s%s", image, tsm_strerror(r),
			r == -ENOSPC ? ": the metadata device is too small" : "");
		goto fail;
	}
	r = tsp_pool_metadata_close(pmd);
	tsp_bdev_close(bdev);
	if (r) {
		tsm_err("%s: closing the metadata failed: %s", image,
			tsm_strerror(r));
		return -1;
	}
	return 0;

fail:
	/* Commit nothing more on the way out. */
	tsp_pool_metadata_read_only(pmd);
	tsp_pool_metadata_close(pmd);
	tsp_bdev_close(bdev);
	return -1;
}

int tsm_cmd_restore(int argc, char **argv)
{
	const char *in = NULL, *out = NULL;
	char err[512];
	struct tsm_xml x;
	u64 bytes, nr_blocks, need;
	int i, rc = 1;

	for (i = 1; i < argc; i++) {
		if ((!strcmp(argv[i], "-i") || !strcmp(argv[i], "--input")) &&
		    i + 1 < argc) {
			in = argv[++i];
		} else if ((!strcmp(argv[i], "-o") ||
			    !strcmp(argv[i], "--output")) && i + 1 < argc) {
			out = argv[++i];
		} else {
			tsm_err("restore: unexpected argument '%s'", argv[i]);
			return 2;
		}
	}
	if (!in || !out) {
		tsm_err("usage: thin-scalable-meta restore -i DUMP.xml -o META.img");
		return 2;
	}

	if (tsm_xml_parse_file(in, &x, err, sizeof(err))) {
		tsm_err("%s", err);
		return 1;
	}
	if (tsm_image_size(out, &bytes))
		goto out;
	nr_blocks = min(bytes / TSP_METADATA_BLOCK_SIZE,
			TSP_TM_MAX_BLOCKS);
	need = min_metadata_blocks(&x, nr_blocks);
	if (nr_blocks < need) {
		tsm_err("%s: too small: %llu metadata blocks of %u bytes, the dump needs at least %llu",
			out, (unsigned long long)nr_blocks,
			TSP_METADATA_BLOCK_SIZE, (unsigned long long)need);
		goto out;
	}
	if (tsm_image_zero_superblock(out))
		goto out;
	if (restore(&x, out)) {
		if (!tsm_image_zero_superblock(out))
			tsm_err("%s: restore failed; its superblock is cleared",
				out);
		goto out;
	}
	rc = 0;
out:
	tsm_xml_free(&x);
	return rc;
}
