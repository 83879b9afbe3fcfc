// SPDX-License-Identifier: GPL-2.0-only
/*
 * fuzz-open.c - feed corrupt pool metadata to the metadata layer.
 *
 * Input format (a "fuzz image"):
 *   byte 0          flags: bit 0 = after a clean check, also update the
 *                   pool, commit, reopen and check again; bit 1 = update,
 *                   commit and reopen also after a failed check
 *   bytes 1..64     one byte per metadata block 0..63: which checksum
 *                   to recompute after the input is laid out (0 none,
 *                   1 superblock, 2 btree node, 3 space map index,
 *                   4 space map bitmap), so that mutations get past the
 *                   checksums and reach the parsers behind them
 *   bytes 65..      the metadata device, block 0 first; shorter inputs
 *                   are padded with zeroes to 64 blocks (256 KiB)
 *
 * Each input is written to a memfd and run through:
 *   tsp_pool_metadata_open (no format) -> tsp_pool_get_info, reference
 *   counts of data blocks -> tsp_pool_check -> if clean: every device,
 *   every mapping, lookups of
 *   mapped and unmapped blocks, mapped ranges; if not clean: only
 *   lookups bounded by the tree depth (walks of a corrupt tree may
 *   legitimately take as long as the tree is large)
 *   -> [flags bit 0, clean check: create, snapshot, insert, remove,
 *   delete, commit; close; reopen; the check must pass again]
 *   -> [flags bit 1, failed check: the same updates on devices 0..3, as
 *   the kernel makes on metadata it does not check; close; reopen]
 *   -> tsp_pool_metadata_close.
 * Nothing may crash, trip a sanitizer, WARN, hold a block at close or
 * leak (kmalloc and bufio counters are checked after every input).
 *
 * Two builds:
 *   libFuzzer:   clang -fsanitize=fuzzer,address,undefined (see
 *                scripts/fuzz-meta); LLVMFuzzerTestOneInput below, and a
 *                custom mutator that aims half of the mutations at the
 *                fields of the blocks
 *   standalone:  any compiler with -DTSP_FUZZ_STANDALONE; main() runs
 *                inputs given as files (reproducing a crash without
 *                libFuzzer), and makes seed inputs:
 *       fuzz-open FILE...               run each input
 *       fuzz-open --pack IMAGE OUT [F]  a fuzz image from a metadata image
 *                                       (block types found from their
 *                                       checksums), flags F (default 1)
 *       fuzz-open --make KIND IMAGE     a 64-block pool made by our own
 *                                       library: empty, nodata (no data
 *                                       blocks), thin, snap, many
 *
 * The library's messages go to /dev/null unless TSP_FUZZ_VERBOSE=1:
 * stderr (the stdio stream, not fd 2, which sanitizer reports use) is
 * pointed there.
 *
 * Locking: single threaded.
 */
#define DM_MSG_PREFIX "fuzz-open"
#include "dm-thin-metadata.h"

#include <sys/mman.h>
#include <unistd.h>

#define FUZZ_BLOCKS 64
#define FUZZ_HEADER (1 + FUZZ_BLOCKS)
#define BS TSP_METADATA_BLOCK_SIZE
#define IMAGE_SIZE (FUZZ_BLOCKS * BS)

enum { T_NONE, T_SUPERBLOCK, T_NODE, T_INDEX, T_BITMAP, NR_TYPES };
static const u32 salts[NR_TYPES] = { 0, 160774, 121107, 160478, 240779 };

#define FLAG_UPDATE 1		/* update a pool that checks clean */
#define FLAG_UPDATE_CORRUPT 2	/* ... and one that does not */

static int fd = -1;
static char path[64];
static u8 *image;
static long allocs_base, bufio_base;
/* What the last input gave, for the standalone build to report. */
static int last_open = 1, last_check = 1;

static void __attribute__((noreturn)) die(const char *what)
{
	fprintf(stdout, "fuzz-open: BUG: %s\n", what);
	fflush(stdout);
	abort();
}

static void setup(void)
{
	if (image)
		return;
	if (!getenv("TSP_FUZZ_VERBOSE")) {
		FILE *null = fopen("/dev/null", "w");

		if (null)
			stderr = null;
	}
	setenv("TSP_QUIET", "1", 0);
	setenv("TSP_BUFIO_NOSYNC", "1", 0);
	fd = memfd_create("tsp-fuzz", 0);
	if (fd < 0 || ftruncate(fd, IMAGE_SIZE))
		die("memfd");
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	image = malloc(IMAGE_SIZE);
	if (!image)
		die("malloc");
	allocs_base = tsp_user_live_allocs();
	bufio_base = tsp_bufio_live_allocs();
}

/* Results that do not matter here: only crashes and leaks do. */
static void ignore(int r)
{
	(void)r;
}

static void seal(u8 *block, unsigned int type)
{
	__le32 csum = cpu_to_le32(tsp_bm_checksum(block + 4, BS - 4, salts[type]));

	memcpy(block, &csum, 4);
}

/* Lay the input out as a device image and fix the checksums it asks for. */
static u8 layout(const u8 *data, size_t size)
{
	unsigned int b, type;

	memset(image, 0, IMAGE_SIZE);
	if (size > FUZZ_HEADER)
		memcpy(image, data + FUZZ_HEADER,
		       min_t(size_t, size - FUZZ_HEADER, IMAGE_SIZE));
	for (b = 0; b < FUZZ_BLOCKS; b++) {
		type = 1 + b < size ? data[1 + b] : T_NONE;
		if (type > T_NONE && type < NR_TYPES)
			seal(image + (size_t)b * BS, type);
	}
	return size ? data[0] : 0;
}

/* ------------------------------------------------------------------ */
/* What runs on each image                                             */
/* ------------------------------------------------------------------ */

#define MAX_DEVS 32

struct devs {
	tsp_thin_id id[MAX_DEVS];
	unsigned int nr;
};

static int collect_dev(void *context, tsp_thin_id dev,
		       const struct tsp_thin_details *d)
{
	struct devs *devs = context;

	if (devs->nr < MAX_DEVS)
		devs->id[devs->nr++] = dev;
	return 0;
}

struct mappings {
	u64 nr;
	tsp_block_t first, last;
};

static int count_mapping(void *context, tsp_block_t virt, tsp_block_t data,
			 u32 time)
{
	struct mappings *m = context;

	if (!m->nr++)
		m->first = virt;
	m->last = virt;
	return 0;
}

/* Lookups only: each costs at most the tree's depth. */
static void poke_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev)
{
	struct tsp_thin_lookup_result res;
	struct tsp_thin_device *td;
	tsp_block_t b, count;
	u64 v;

	if (tsp_pool_open_thin_device(pmd, dev, &td))
		return;
	ignore(tsp_thin_get_mapped_count(td, &count));
	if (!tsp_thin_get_highest_mapped_block(td, &b))
		ignore(tsp_thin_find_block(td, b, &res));
	for (v = 0; v < 4; v++)
		ignore(tsp_thin_find_block(td, v, &res));
	ignore(tsp_thin_find_block(td, U64_MAX, &res));
	tsp_pool_close_thin_device(td);
}

/* The device checked clean: every mapping and range can be read. */
static void read_device(struct tsp_pool_metadata *pmd, tsp_thin_id dev)
{
	struct tsp_thin_lookup_result res;
	struct mappings m = { 0 };
	struct tsp_thin_device *td;
	tsp_block_t tb, te, pb, b, count;
	bool shared;
	int r;

	if (tsp_pool_open_thin_device(pmd, dev, &td))
		die("open of a device that the check passed");
	if (tsp_thin_walk_mappings(td, count_mapping, &m))
		die("walk of a device that the check passed");
	ignore(tsp_thin_get_mapped_count(td, &count));
	if (count != m.nr)
		die("mapped count differs from the mappings walked");
	if (m.nr) {
		if (tsp_thin_find_block(td, m.first, &res) ||
		    tsp_thin_find_block(td, m.last, &res))
			die("a walked mapping is not found");
		if (tsp_thin_get_highest_mapped_block(td, &b) || b != m.last)
			die("highest mapped block differs from the walk");
	}
	/* Ranges, from the start to past the end. */
	for (b = 0, r = 0; !r && m.nr && b <= m.last; b = te) {
		r = tsp_thin_find_mapped_range(td, b, m.last + 1, &tb, &te,
					       &pb, &shared);
		if (!r && (tb < b || te <= tb || te > m.last + 1))
			die("mapped range out of bounds");
	}
	tsp_pool_close_thin_device(td);
}

/*
 * Changes through the API, each allowed to fail (after a failure that
 * leaves the metadata failed, the rest return -EPERM), then a commit, or
 * an abort if that fails.  On a pool that checked clean, the commit must
 * leave it checking clean.
 */
static void update_pool(struct tsp_pool_metadata *pmd, const struct devs *devs)
{
	struct tsp_thin_device *td;
	tsp_block_t data, v;
	tsp_thin_id new_id = 1000;
	unsigned int i;

	ignore(tsp_pool_create_thin(pmd, new_id));
	for (i = 0; i < devs->nr && i < 3; i++)
		ignore(tsp_pool_create_snap(pmd, new_id + 1 + i, devs->id[i]));
	for (i = 0; i < devs->nr && i < 4; i++) {
		if (tsp_pool_open_thin_device(pmd, devs->id[i], &td))
			continue;
		for (v = 0; v < 8; v++)
			if (!tsp_pool_alloc_data_block(pmd, &data))
				ignore(tsp_thin_insert_block(td, v * 3 + i, data));
		ignore(tsp_thin_remove_range(td, 5, 13));
		ignore(tsp_thin_remove_block(td, 0));
		tsp_pool_close_thin_device(td);
	}
	if (devs->nr)
		ignore(tsp_pool_delete_thin_device(pmd, devs->id[devs->nr - 1]));
	if (tsp_pool_commit_metadata(pmd))
		ignore(tsp_pool_abort_metadata(pmd));
}

/* Reference counts of data blocks, in and out of range. */
static void poke_data_counts(struct tsp_pool_metadata *pmd)
{
	tsp_block_t n, probes[6];
	unsigned int i;
	u32 count;

	if (tsp_pool_get_data_block_count(pmd, &n))
		return;
	probes[0] = 0;
	probes[1] = n / 2;
	probes[2] = n - 1;
	probes[3] = n;
	probes[4] = 16320;
	probes[5] = n + 100000;
	for (i = 0; i < ARRAY_SIZE(probes); i++)
		ignore(tsp_pool_get_data_block_refcount(pmd, probes[i], &count));
}

static void run_image(u8 flags)
{
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	struct tsp_pool_space space;
	struct tsp_pool_info info;
	struct devs devs = { .nr = 0 };
	tsp_block_t snap, n;
	bool clean = false;
	unsigned int i;
	int r, round;

	if (pwrite(fd, image, IMAGE_SIZE, 0) != IMAGE_SIZE)
		die("pwrite");
	bdev = tsp_bdev_open(path, false);
	if (!bdev)
		die("tsp_bdev_open");

	for (round = 0; round < 2; round++) {
		r = tsp_pool_metadata_open(bdev, 0, 0, false, &pmd);
		if (!round)
			last_open = r;
		if (r) {
			if (clean)
				die("reopen after a clean check and commit failed");
			break;
		}
		ignore(tsp_pool_get_info(pmd, &info));
		ignore(tsp_pool_get_metadata_snap(pmd, &snap));
		ignore(tsp_pool_get_free_block_count(pmd, &n));
		ignore(tsp_pool_get_space(pmd, &space));
		ignore(tsp_pool_metadata_needs_check(pmd));
		poke_data_counts(pmd);

		r = tsp_pool_check(pmd);
		if (!round) {
			last_check = r;
			clean = !r;
		}
		if (r && clean)
			die("check failed after a clean check and our commit");
		devs.nr = 0;
		if (!r) {
			if (tsp_pool_walk_devices(pmd, collect_dev, &devs))
				die("device walk failed after a clean check");
			for (i = 0; i < devs.nr; i++)
				read_device(pmd, devs.id[i]);
		} else {
			/* Walks could take as long as the DAG is wide: lookups only. */
			for (i = 0; i < 4; i++) {
				poke_device(pmd, i);
				devs.id[devs.nr++] = i;
			}
		}

		/*
		 * The kernel does not check on open: a pool on corrupt metadata
		 * still allocates, maps and commits until something fails.
		 */
		if (round || !(flags & (clean ? FLAG_UPDATE : FLAG_UPDATE_CORRUPT))) {
			ignore(tsp_pool_metadata_close(pmd));
			break;
		}
		update_pool(pmd, &devs);
		r = tsp_pool_metadata_close(pmd);
		if (r && clean)
			die("close after a clean check failed");
	}
	tsp_bdev_close(bdev);

	if (tsp_user_live_allocs() != allocs_base)
		die("kmalloc leak");
	if (tsp_bufio_live_allocs() != bufio_base)
		die("bufio leak");
}

int LLVMFuzzerTestOneInput(const u8 *data, size_t size);

int LLVMFuzzerTestOneInput(const u8 *data, size_t size)
{
	setup();
	run_image(layout(data, size));
	return 0;
}

#ifndef TSP_FUZZ_STANDALONE
/* ------------------------------------------------------------------ */
/* libFuzzer: a mutator that knows where the fields are                */
/* ------------------------------------------------------------------ */

size_t LLVMFuzzerMutate(u8 *data, size_t size, size_t max_size);
size_t LLVMFuzzerCustomMutator(u8 *data, size_t size, size_t max_size,
			       unsigned int seed);

static u64 mut_rng;

static u64 mut_rnd(void)
{
	u64 z = (mut_rng += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/*
 * Random byte mutations mostly land in zeroes nobody reads (free bitmap
 * entries, unused node slots).  Half of the time, overwrite a field
 * instead: a 1, 2, 4 or 8 byte aligned value in a block's header, its
 * first keys or values, or anywhere, with a boundary value, a small
 * number (block numbers, counts, flags), the old value +-1, a copy of
 * another field, or random bits; sometimes change which checksum the
 * harness fixes.  The other half, libFuzzer's own mutations.
 */
size_t LLVMFuzzerCustomMutator(u8 *data, size_t size, size_t max_size,
			       unsigned int seed)
{
	static const u64 special[] = { 0, 1, 2, 3, 4, 0x7f, 0x80, 0xff, 0xffff,
				       0xffffffffULL, 0x80000000ULL, ~0ULL,
				       ~0ULL >> 1, 16320, 255, 126, 252, 336 };
	size_t nr_blocks, off, n, i;
	unsigned int width;
	u64 v, old;

	mut_rng = seed;
	if (size < FUZZ_HEADER + 64 || mut_rnd() % 2)
		return LLVMFuzzerMutate(data, size, max_size);

	nr_blocks = DIV_ROUND_UP(size - FUZZ_HEADER, BS);
	n = 1 + mut_rnd() % 3;
	for (i = 0; i < n; i++) {
		size_t b = mut_rnd() % nr_blocks, base = FUZZ_HEADER + b * BS;
		unsigned int where = mut_rnd() % 100;

		if (where < 5) {
			data[mut_rnd() % 2 ? 0 : 1 + b] = mut_rnd() % (NR_TYPES + 1);
			continue;
		}
		width = 1u << (mut_rnd() % 4);
		if (where < 55)
			off = mut_rnd() % 64;			/* headers */
		else if (where < 85)
			off = 32 + 8 * (mut_rnd() % 64);	/* keys, entries */
		else
			off = mut_rnd() % BS;
		off = base + (off & ~(size_t)(width - 1));
		if (off + width > size)
			continue;

		old = 0;
		memcpy(&old, data + off, width);	/* little-endian host */
		switch (mut_rnd() % 6) {
		case 0:
		case 1:
			v = special[mut_rnd() % ARRAY_SIZE(special)];
			break;
		case 2:
			v = mut_rnd() % 80;		/* a block number */
			break;
		case 3:
			v = old + (mut_rnd() % 2 ? 1 : -1);
			break;
		case 4: {
			size_t from = FUZZ_HEADER + mut_rnd() % (size - FUZZ_HEADER - 8);

			memcpy(&v, data + (from & ~(size_t)7), 8);
			break;
		}
		default:
			v = mut_rnd();
			break;
		}
		memcpy(data + off, &v, width);
	}
	return size;
}
#endif /* !TSP_FUZZ_STANDALONE */

#ifdef TSP_FUZZ_STANDALONE
/* ------------------------------------------------------------------ */
/* Standalone: run inputs, make seeds                                  */
/* ------------------------------------------------------------------ */

static u8 *read_file(const char *name, size_t *size)
{
	FILE *f = fopen(name, "rb");
	size_t cap = 1 << 16, n = 0;
	u8 *buf = malloc(cap);

	if (!f || !buf) {
		perror(name);
		exit(2);
	}
	for (;;) {
		n += fread(buf + n, 1, cap - n, f);
		if (n < cap)
			break;
		buf = realloc(buf, cap *= 2);
		if (!buf)
			exit(2);
	}
	fclose(f);
	*size = n;
	return buf;
}

static void write_file(const char *name, const void *data, size_t size)
{
	FILE *f = fopen(name, "wb");

	if (!f || fwrite(data, 1, size, f) != size || fclose(f)) {
		perror(name);
		exit(2);
	}
}

/* The checksum type a block already has, T_NONE if none fits. */
static unsigned int block_type(const u8 *block)
{
	u32 crc = tsp_bm_checksum(block + 4, BS - 4, 0);
	unsigned int t;
	__le32 csum;

	memcpy(&csum, block, 4);
	for (t = T_SUPERBLOCK; t < NR_TYPES; t++)
		if ((crc ^ salts[t]) == le32_to_cpu(csum))
			return t;
	return T_NONE;
}

static int pack(const char *in, const char *out, u8 flags)
{
	size_t size, last = 0, b;
	u8 *img = read_file(in, &size), *fz;

	if (size > IMAGE_SIZE) {
		fprintf(stdout, "%s: only the first %d blocks are used\n", in,
			FUZZ_BLOCKS);
		size = IMAGE_SIZE;
	}
	fz = calloc(1, FUZZ_HEADER + IMAGE_SIZE);
	if (!fz)
		exit(2);
	fz[0] = flags;
	for (b = 0; b * BS < size; b++) {
		const u8 *blk = img + b * BS;
		size_t i;

		if (size - b * BS < BS)
			break;
		fz[1 + b] = (u8)block_type(blk);
		for (i = 0; i < BS; i++)
			if (blk[i])
				last = b * BS + i + 1;
	}
	memcpy(fz + FUZZ_HEADER, img, size);
	write_file(out, fz, FUZZ_HEADER + last);
	free(img);
	free(fz);
	return 0;
}

/* Pools made by our own library, committed and closed. */
static int make(const char *kind, const char *out)
{
	struct tsp_pool_metadata *pmd = NULL;
	struct tsp_thin_device *td;
	struct block_device *bdev;
	tsp_block_t data, v;
	tsp_thin_id dev;
	int r;

	setup();
	memset(image, 0, IMAGE_SIZE);
	if (pwrite(fd, image, IMAGE_SIZE, 0) != IMAGE_SIZE)
		die("pwrite");
	bdev = tsp_bdev_open(path, false);
	r = tsp_pool_metadata_open(bdev, 128, strcmp(kind, "nodata") ? 20000 : 0,
				   true, &pmd);
	if (!r && strcmp(kind, "empty") && strcmp(kind, "nodata")) {
		r = tsp_pool_create_thin(pmd, 1);
		r = r ?: tsp_pool_open_thin_device(pmd, 1, &td);
		for (v = 0; !r && v < 300; v++) {
			r = tsp_pool_alloc_data_block(pmd, &data);
			r = r ?: tsp_thin_insert_block(td, v < 200 ? v : v * 7, data);
		}
		if (!r)
			tsp_pool_close_thin_device(td);
		r = r ?: tsp_pool_set_metadata_transaction_id(pmd, 0, 7);
	}
	if (!r && (!strcmp(kind, "snap") || !strcmp(kind, "many"))) {
		r = tsp_pool_commit_metadata(pmd);
		r = r ?: tsp_pool_create_snap(pmd, 2, 1);
		r = r ?: tsp_pool_create_snap(pmd, 3, 1);
		r = r ?: tsp_pool_open_thin_device(pmd, 2, &td);
		for (v = 0; !r && v < 20; v++) {
			r = tsp_pool_alloc_data_block(pmd, &data);
			r = r ?: tsp_thin_insert_block(td, v * 10, data);
		}
		if (!r)
			tsp_pool_close_thin_device(td);
		r = r ?: tsp_pool_reserve_metadata_snap(pmd);
	}
	for (dev = 10; !r && !strcmp(kind, "many") && dev < 26; dev++)
		r = tsp_pool_create_thin(pmd, dev);
	if (r)
		fprintf(stdout, "make %s: %d\n", kind, r);
	if (pmd)
		r = tsp_pool_metadata_close(pmd) ?: r;
	tsp_bdev_close(bdev);
	if (r) {
		fprintf(stdout, "make %s: %d\n", kind, r);
		return 1;
	}
	if (pread(fd, image, IMAGE_SIZE, 0) != IMAGE_SIZE)
		die("pread");
	write_file(out, image, IMAGE_SIZE);
	return 0;
}

int main(int argc, char **argv)
{
	size_t size;
	u8 *data;
	int i;

	if (argc >= 4 && !strcmp(argv[1], "--pack"))
		return pack(argv[2], argv[3],
			    argc > 4 ? (u8)strtoul(argv[4], NULL, 0) : FLAG_UPDATE);
	if (argc == 4 && !strcmp(argv[1], "--make"))
		return make(argv[2], argv[3]);
	if (argc < 2 || argv[1][0] == '-') {
		fprintf(stdout, "usage: %s FILE... | --pack IMAGE OUT [FLAGS] | "
			"--make empty|nodata|thin|snap|many IMAGE\n", argv[0]);
		return 2;
	}
	for (i = 1; i < argc; i++) {
		data = read_file(argv[i], &size);
		fprintf(stdout, "%s: %zu bytes: ", argv[i], size);
		fflush(stdout);
		last_open = last_check = 1;
		LLVMFuzzerTestOneInput(data, size);
		fprintf(stdout, "open %d", last_open);
		if (!last_open)
			fprintf(stdout, ", check %d", last_check);
		fprintf(stdout, "\n");
		free(data);
	}
	fprintf(stdout, "fuzz-open: %d inputs ran clean\n", argc - 1);
	return 0;
}
#endif /* TSP_FUZZ_STANDALONE */
