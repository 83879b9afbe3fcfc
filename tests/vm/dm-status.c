// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-status: the status of a thin pool or thin device as lvm2 sees it.
 *
 * Reads the status of a device-mapper device (a DM_DEVICE_STATUS ioctl
 * through libdevmapper, as "dmsetup status" does) and parses it with
 * libdevmapper's own parsers, the ones lvm2 relies on:
 * dm_get_status_thin_pool() for thin-pool and thin-scal-pool,
 * dm_get_status_thin() for thin and thin-scalable.  Prints the target's
 * name and every parsed field as key=value lines:
 *
 *   target=thin-scal-pool
 *   transaction_id=0
 *   used_metadata_blocks=10
 *   ...
 *
 * usage: dm-status [--noflush] <dm device name>
 *        dm-status --parse <target> <status params>
 *
 * --noflush asks the pool not to commit before reporting (dmsetup status
 * --noflush); --parse parses a status string given on the command line
 * instead of asking the kernel (to try the parser by hand).
 *
 * Exit status: 0 when the status parsed, 1 when it did not (or the device
 * has no single thin or pool target, or the ioctl failed), 2 on bad usage.
 * Built by the Makefile as build/dm-status; used by tests/vm/t-lvm-status.sh.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <libdevmapper.h>

static const char *prog = "dm-status";

static int is_pool_target(const char *type)
{
	return !strcmp(type, "thin-pool") || !strcmp(type, "thin-scal-pool");
}

static int is_thin_target(const char *type)
{
	return !strcmp(type, "thin") || !strcmp(type, "thin-scalable");
}

static const char *discards_name(dm_thin_discards_t d)
{
	switch (d) {
	case DM_THIN_DISCARDS_IGNORE:
		return "ignore";
	case DM_THIN_DISCARDS_NO_PASSDOWN:
		return "no_passdown";
	case DM_THIN_DISCARDS_PASSDOWN:
		return "passdown";
	}
	return "unknown";
}

/*
 * libdevmapper 1.02.185 (Debian 12) does not parse the held metadata
 * root: held_metadata_root stays 0 whatever the status says.
 */
static int print_pool(struct dm_pool *mem, const char *type, const char *params)
{
	struct dm_status_thin_pool *s;

	if (!dm_get_status_thin_pool(mem, params, &s)) {
		fprintf(stderr, "%s: dm_get_status_thin_pool cannot parse %s status '%s'\n",
			prog, type, params);
		return 1;
	}
	printf("target=%s\n", type);
	printf("transaction_id=%" PRIu64 "\n", s->transaction_id);
	printf("used_metadata_blocks=%" PRIu64 "\n", s->used_metadata_blocks);
	printf("total_metadata_blocks=%" PRIu64 "\n", s->total_metadata_blocks);
	printf("used_data_blocks=%" PRIu64 "\n", s->used_data_blocks);
	printf("total_data_blocks=%" PRIu64 "\n", s->total_data_blocks);
	printf("held_metadata_root=%" PRIu64 "\n", s->held_metadata_root);
	printf("read_only=%u\n", (unsigned int)s->read_only);
	printf("discards=%s\n", discards_name(s->discards));
	printf("fail=%u\n", (unsigned int)s->fail);
	printf("error_if_no_space=%u\n", (unsigned int)s->error_if_no_space);
	printf("out_of_data_space=%u\n", (unsigned int)s->out_of_data_space);
	printf("needs_check=%u\n", (unsigned int)s->needs_check);
	printf("error=%u\n", (unsigned int)s->error);
	return 0;
}

static int print_thin(struct dm_pool *mem, const char *type, const char *params)
{
	struct dm_status_thin *s;

	if (!dm_get_status_thin(mem, params, &s)) {
		fprintf(stderr, "%s: dm_get_status_thin cannot parse %s status '%s'\n",
			prog, type, params);
		return 1;
	}
	printf("target=%s\n", type);
	printf("mapped_sectors=%" PRIu64 "\n", s->mapped_sectors);
	printf("highest_mapped_sector=%" PRIu64 "\n", s->highest_mapped_sector);
	printf("fail=%u\n", (unsigned int)s->fail);
	return 0;
}

/* Parse <params> of a <type> target and print it; 0 if it parsed. */
static int parse_and_print(const char *type, const char *params)
{
	struct dm_pool *mem;
	int r;

	if (!is_pool_target(type) && !is_thin_target(type)) {
		fprintf(stderr, "%s: target '%s' is neither a thin pool nor a thin device\n",
			prog, type);
		return 1;
	}
	mem = dm_pool_create(prog, 1024);
	if (!mem) {
		fprintf(stderr, "%s: dm_pool_create failed\n", prog);
		return 1;
	}
	if (is_pool_target(type))
		r = print_pool(mem, type, params);
	else
		r = print_thin(mem, type, params);
	dm_pool_destroy(mem);
	return r;
}

/* The status of device <name> (one target) through DM_DEVICE_STATUS. */
static int status_of(const char *name, int noflush)
{
	struct dm_task *dmt;
	struct dm_info info;
	uint64_t start, length;
	char *type = NULL, *params = NULL;
	void *next;
	int r = 1;

	dmt = dm_task_create(DM_DEVICE_STATUS);
	if (!dmt) {
		fprintf(stderr, "%s: dm_task_create failed\n", prog);
		return 1;
	}
	if (!dm_task_set_name(dmt, name)) {
		fprintf(stderr, "%s: bad device name '%s'\n", prog, name);
		goto out;
	}
	if (noflush && !dm_task_no_flush(dmt)) {
		fprintf(stderr, "%s: dm_task_no_flush failed\n", prog);
		goto out;
	}
	if (!dm_task_run(dmt)) {
		fprintf(stderr, "%s: DM_DEVICE_STATUS of '%s' failed\n", prog, name);
		goto out;
	}
	if (!dm_task_get_info(dmt, &info) || !info.exists) {
		fprintf(stderr, "%s: no device '%s'\n", prog, name);
		goto out;
	}
	next = dm_get_next_target(dmt, NULL, &start, &length, &type, &params);
	if (!type) {
		fprintf(stderr, "%s: device '%s' has no live table\n", prog, name);
		goto out;
	}
	if (next) {
		fprintf(stderr, "%s: device '%s' has more than one target\n",
			prog, name);
		goto out;
	}
	r = parse_and_print(type, params ? params : "");
out:
	dm_task_destroy(dmt);
	return r;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: %s [--noflush] <dm device name>\n"
		"       %s --parse <target> <status params>\n",
		prog, prog);
}

int main(int argc, char **argv)
{
	int r;

	if (argc == 4 && !strcmp(argv[1], "--parse"))
		return parse_and_print(argv[2], argv[3]);

	if (argc == 3 && !strcmp(argv[1], "--noflush")) {
		r = status_of(argv[2], 1);
	} else if (argc == 2 && argv[1][0] != '-') {
		r = status_of(argv[1], 0);
	} else {
		usage();
		return 2;
	}
	dm_lib_release();
	return r;
}
