// SPDX-License-Identifier: GPL-2.0-only
/*
 * tools/xml-dump.c - writes a pool's metadata as thin_dump XML, byte for
 * byte what thin_dump 0.9.0 writes for the same metadata.
 *
 * What thin_dump does, and so what we do:
 *   - attributes in a fixed order, two spaces of indent per level, the
 *     uuid always empty (the on-disk uuid is not printed);
 *   - devices in dev_id order, each with the mapped_blocks, transaction
 *     and times stored in its details (not recounted);
 *   - mappings in virtual block order, coalesced into runs: a mapping
 *     extends the current run when its virtual block and data block are
 *     each one past the run's last and its time is the run's time.  Runs
 *     cross btree leaf boundaries.  A run of one is a <single_mapping>,
 *     a longer one a <range_mapping>.
 *
 * The device list is collected first and each device is then opened on
 * its own, so that no library call is made from inside a walk callback.
 */
#define DM_MSG_PREFIX "thin-scalable-meta"

#include "tools/tsm.h"

struct dump_dev {
	tsp_thin_id id;
	struct tsp_thin_details d;
};

struct dev_list {
	struct dump_dev *devs;
	size_t nr;
	size_t alloc;
};

static int collect_dev(void *context, tsp_thin_id dev,
		       const struct tsp_thin_details *d)
{
	struct dev_list *l = context;

	if (l->nr == l->alloc) {
		size_t n = l->alloc ? l->alloc * 2 : 16;
		struct dump_dev *nd = realloc(l->devs, n * sizeof(*nd));

		if (!nd)
			return -ENOMEM;
		l->devs = nd;
		l->alloc = n;
	}
	l->devs[l->nr].id = dev;
	l->devs[l->nr].d = *d;
	l->nr++;
	return 0;
}

/* The run being built while mappings are walked. */
struct run {
	FILE *out;
	tsp_thin_id dev;
	tsp_block_t nr_data_blocks;	/* mappings must stay below */
	bool bad;			/* one did not: reported */
	bool active;
	tsp_block_t virt;	/* first virtual block */
	tsp_block_t data;	/* first data block */
	tsp_block_t len;
	u32 time;
};

static void run_flush(struct run *r)
{
	if (!r->active)
		return;
	if (r->len == 1)
		fprintf(r->out, "    <single_mapping origin_block=\"%llu\" data_block=\"%llu\" time=\"%u\"/>\n",
			(unsigned long long)r->virt,
			(unsigned long long)r->data, r->time);
	else
		fprintf(r->out, "    <range_mapping origin_begin=\"%llu\" data_begin=\"%llu\" length=\"%llu\" time=\"%u\"/>\n",
			(unsigned long long)r->virt,
			(unsigned long long)r->data,
			(unsigned long long)r->len, r->time);
	r->active = false;
}

static int emit_mapping(void *context, tsp_block_t virt, tsp_block_t data,
			u32 time)
{
	struct run *r = context;

	if (data >= r->nr_data_blocks) {
		tsm_err("device %llu: virtual block %llu maps to data block %llu, beyond the %llu data blocks",
			(unsigned long long)r->dev, (unsigned long long)virt,
			(unsigned long long)data,
			(unsigned long long)r->nr_data_blocks);
		r->bad = true;
		return -EILSEQ;
	}
	if (r->active && virt == r->virt + r->len &&
	    data == r->data + r->len && time == r->time) {
		r->len++;
		return 0;
	}
	run_flush(r);
	r->active = true;
	r->virt = virt;
	r->data = data;
	r->len = 1;
	r->time = time;
	return 0;
}

static int dump_device(struct tsp_pool_metadata *pmd, FILE *out,
		       const struct tsp_pool_info *info, const struct dump_dev *dd)
{
	struct tsp_thin_device *td;
	struct run run = {
		.out = out,
		.dev = dd->id,
		.nr_data_blocks = info->nr_data_blocks,
	};
	int r;

	fprintf(out, "  <device dev_id=\"%llu\" mapped_blocks=\"%llu\" transaction=\"%llu\" creation_time=\"%u\" snap_time=\"%u\">\n",
		(unsigned long long)dd->id,
		(unsigned long long)dd->d.mapped_blocks,
		(unsigned long long)dd->d.transaction_id,
		dd->d.creation_time, dd->d.snapshotted_time);

	r = tsp_pool_open_thin_device(pmd, dd->id, &td);
	if (r) {
		tsm_err("cannot open device %llu: %s",
			(unsigned long long)dd->id, tsm_strerror(r));
		return r;
	}
	r = tsp_thin_walk_mappings(td, emit_mapping, &run);
	tsp_pool_close_thin_device(td);
	if (r) {
		if (!run.bad)
			tsm_err("cannot walk the mappings of device %llu: %s",
				(unsigned long long)dd->id, tsm_strerror(r));
		return r;
	}
	run_flush(&run);
	fprintf(out, "  </device>\n");
	return 0;
}

int tsm_dump_pool(struct tsp_pool_metadata *pmd, FILE *out)
{
	struct tsp_pool_info info;
	struct dev_list list = { NULL, 0, 0 };
	size_t i;
	int r;

	r = tsp_pool_get_info(pmd, &info);
	if (r) {
		tsm_err("cannot read the superblock: %s", tsm_strerror(r));
		return r;
	}
	r = tsp_pool_walk_devices(pmd, collect_dev, &list);
	if (r) {
		tsm_err("cannot walk the devices: %s", tsm_strerror(r));
		goto out;
	}

	fprintf(out, "<superblock uuid=\"\" time=\"%u\" transaction=\"%llu\" flags=\"%u\" version=\"%u\" data_block_size=\"%u\" nr_data_blocks=\"%llu\">\n",
		info.time, (unsigned long long)info.transaction_id,
		info.flags, info.version, info.data_block_size,
		(unsigned long long)info.nr_data_blocks);
	for (i = 0; i < list.nr; i++) {
		r = dump_device(pmd, out, &info, &list.devs[i]);
		if (r)
			goto out;
	}
	fprintf(out, "</superblock>\n");
out:
	free(list.devs);
	return r;
}
