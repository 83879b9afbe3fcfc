// SPDX-License-Identifier: GPL-2.0-only
/*
 * tools/thin-scalable-meta.c - the userspace metadata tool: command line
 * dispatch, the dump and check subcommands, and the helpers every
 * subcommand uses to look at and open a metadata image.
 *
 *   thin-scalable-meta restore -i DUMP.xml -o META.img    (xml-restore.c)
 *   thin-scalable-meta dump [-o OUT.xml] META.img         (xml-dump.c)
 *   thin-scalable-meta check META.img
 *   thin-scalable-meta stress --seed N --ops M --image META.img ...
 *                                                          (stress.c)
 *
 * Exit codes: 0 success, 1 failure (bad input, inconsistent metadata, a
 * divergence found by stress), 2 bad usage.  Every failure says why in
 * one line on stderr, after whatever the library itself printed.
 *
 * The library is linked in directly: these tools run the very code the
 * kernel module runs, over a file instead of dm-bufio.  Its allocations
 * are counted; a command that leaves any behind reports it and fails.
 */
#define DM_MSG_PREFIX "thin-scalable-meta"

#include <fcntl.h>
#include <stdarg.h>
#include <unistd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <linux/fs.h>

#include "tools/tsm.h"

void tsm_err(const char *fmt, ...)
{
	va_list ap;

	fputs("thin-scalable-meta: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

const char *tsm_strerror(int r)
{
	if (r == -EILSEQ)
		return "corrupt or unsupported metadata";
	if (r == -ENODATA)
		return "no pool metadata here";
	return strerror(-r);
}

int tsm_image_size(const char *path, u64 *bytes)
{
	struct stat st;
	int fd;

	if (stat(path, &st)) {
		tsm_err("%s: %s", path, strerror(errno));
		return -1;
	}
	if (S_ISREG(st.st_mode)) {
		*bytes = st.st_size;
		return 0;
	}
	if (!S_ISBLK(st.st_mode)) {
		tsm_err("%s: not a regular file or a block device", path);
		return -1;
	}
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		tsm_err("%s: %s", path, strerror(errno));
		return -1;
	}
	if (ioctl(fd, BLKGETSIZE64, bytes)) {
		tsm_err("%s: cannot get the device size: %s", path,
			strerror(errno));
		close(fd);
		return -1;
	}
	close(fd);
	return 0;
}

int tsm_image_zero_superblock(const char *path)
{
	static const char zero[TSP_METADATA_BLOCK_SIZE];
	ssize_t n;
	int fd;

	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0) {
		tsm_err("%s: %s", path, strerror(errno));
		return -1;
	}
	n = pwrite(fd, zero, sizeof(zero), 0);
	if (n != (ssize_t)sizeof(zero) || fsync(fd)) {
		tsm_err("%s: cannot clear the superblock: %s", path,
			n < 0 ? strerror(errno) : "short write");
		close(fd);
		return -1;
	}
	if (close(fd)) {
		tsm_err("%s: %s", path, strerror(errno));
		return -1;
	}
	return 0;
}

/*
 * A plainer message than the library's read error for an image too short
 * to hold even a superblock.
 */
static int check_image(const char *path)
{
	u64 size;

	if (tsm_image_size(path, &size))
		return -1;
	if (size < TSP_METADATA_BLOCK_SIZE) {
		tsm_err("%s: too small (%llu bytes) to hold pool metadata",
			path, (unsigned long long)size);
		return -1;
	}
	return 0;
}

int tsm_open_pool(const char *path, bool read_only, struct block_device **bdev,
		  struct tsp_pool_metadata **pmd)
{
	int r;

	if (check_image(path))
		return -1;
	*bdev = tsp_bdev_open(path, read_only);
	if (!*bdev) {
		tsm_err("%s: %s", path, strerror(errno));
		return -1;
	}
	/* Data block size 0: the one on disk. */
	r = tsp_pool_metadata_open(*bdev, 0, 0, false, pmd);
	if (r) {
		tsm_err("%s: cannot open the pool metadata: %s", path,
			tsm_strerror(r));
		tsp_bdev_close(*bdev);
		*bdev = NULL;
		return -1;
	}
	if (read_only)
		tsp_pool_metadata_read_only(*pmd);
	return 0;
}

int tsm_close_pool(struct block_device *bdev, struct tsp_pool_metadata *pmd)
{
	int r = 0;

	if (pmd)
		r = tsp_pool_metadata_close(pmd);
	if (bdev)
		tsp_bdev_close(bdev);
	return r;
}

static int cmd_dump(int argc, char **argv)
{
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	const char *out_path = NULL, *image = NULL;
	FILE *out = stdout;
	int i, r, rc = 1;

	for (i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "-o") && i + 1 < argc) {
			out_path = argv[++i];
		} else if (argv[i][0] == '-' || image) {
			tsm_err("dump: unexpected argument '%s'", argv[i]);
			return 2;
		} else {
			image = argv[i];
		}
	}
	if (!image) {
		tsm_err("usage: thin-scalable-meta dump [-o OUT.xml] META.img");
		return 2;
	}
	if (tsm_open_pool(image, true, &bdev, &pmd))
		return 1;
	if (out_path) {
		out = fopen(out_path, "w");
		if (!out) {
			tsm_err("%s: %s", out_path, strerror(errno));
			tsm_close_pool(bdev, pmd);
			return 1;
		}
	}
	r = tsm_dump_pool(pmd, out);
	if (!r) {
		if (fflush(out) || ferror(out))
			tsm_err("dump: cannot write the output: %s",
				strerror(errno));
		else
			rc = 0;
	}
	if (out != stdout && fclose(out) && !rc) {
		tsm_err("%s: %s", out_path, strerror(errno));
		rc = 1;
	}
	if (tsm_close_pool(bdev, pmd) && !rc) {
		tsm_err("%s: closing the metadata failed", image);
		rc = 1;
	}
	return rc;
}

static int cmd_check(int argc, char **argv)
{
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	int r, rc = 0;

	if (argc != 2 || argv[1][0] == '-') {
		tsm_err("usage: thin-scalable-meta check META.img");
		return 2;
	}
	if (tsm_open_pool(argv[1], true, &bdev, &pmd))
		return 1;
	r = tsp_pool_check(pmd);
	if (r) {
		tsm_err("%s: the metadata is inconsistent: %s", argv[1],
			tsm_strerror(r));
		rc = 1;
	}
	if (tsm_close_pool(bdev, pmd) && !rc) {
		tsm_err("%s: closing the metadata failed", argv[1]);
		rc = 1;
	}
	return rc;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: thin-scalable-meta COMMAND ARGS\n"
		"  restore -i DUMP.xml -o META.img   write thin_dump XML into META.img\n"
		"  dump [-o OUT.xml] META.img          print the metadata as thin_dump XML\n"
		"  check META.img                      verify the metadata; exit 0 if clean\n"
		"  stress --seed N --ops M --image META.img [--devices K]\n"
		"         [--external-every N] [--virt-blocks V] [--data-blocks D]\n"
		"                                      model-based random test\n");
}

int main(int argc, char **argv)
{
	long allocs_before;
	int rc;

	/* The library's info lines are noise here; TSP_QUIET=0 shows them. */
	setenv("TSP_QUIET", "1", 0);

	if (argc < 2) {
		usage(stderr);
		return 2;
	}
	allocs_before = tsp_user_live_allocs();
	if (!strcmp(argv[1], "restore")) {
		rc = tsm_cmd_restore(argc - 1, argv + 1);
	} else if (!strcmp(argv[1], "dump")) {
		rc = cmd_dump(argc - 1, argv + 1);
	} else if (!strcmp(argv[1], "check")) {
		rc = cmd_check(argc - 1, argv + 1);
	} else if (!strcmp(argv[1], "stress")) {
		rc = tsm_cmd_stress(argc - 1, argv + 1);
	} else if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
		   !strcmp(argv[1], "help")) {
		usage(stdout);
		return 0;
	} else {
		tsm_err("unknown command '%s'", argv[1]);
		usage(stderr);
		return 2;
	}
	if (tsp_user_live_allocs() != allocs_before) {
		tsm_err("library bug: %ld allocations left behind",
			tsp_user_live_allocs() - allocs_before);
		return 1;
	}
	if (tsp_bufio_live_allocs()) {
		tsm_err("library bug: %ld bufio allocations left behind",
			tsp_bufio_live_allocs());
		return 1;
	}
	return rc;
}
