/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * tests/unit/helpers.h - what the metadata robustness tests (test-crash.c,
 * test-corrupt.c) share: check counters and report lines, leak counters,
 * image files, running thin_check / thin_dump on an image, running one
 * case in a child process with a time limit, and the on-disk layout
 * details a test needs to build or damage an image by hand.
 *
 * Everything is static (each test is its own program); functions a test
 * does not use are marked __maybe_unused.
 *
 * Locking: none, single threaded (children are forked, not threads).
 */
#ifndef TSP_TEST_HELPERS_H
#define TSP_TEST_HELPERS_H

#include "dm-thin-metadata.h"

#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* Checks and report lines                                             */
/* ------------------------------------------------------------------ */

static int failures;

#define CHECK(cond)							\
	({								\
		bool __ok = !!(cond);					\
		if (!__ok) {						\
			fprintf(stdout, "  FAIL %s:%d: %s\n", __FILE__,	\
				__LINE__, #cond);			\
			failures++;					\
		}							\
		__ok;							\
	})

/* A failure with a message; printf-like. */
static __maybe_unused __attribute__((format(printf, 1, 2)))
void fail(const char *fmt, ...)
{
	va_list ap;

	fputs("  FAIL ", stdout);
	va_start(ap, fmt);
	vfprintf(stdout, fmt, ap);
	va_end(ap);
	fputc('\n', stdout);
	fflush(stdout);
	failures++;
}

static __maybe_unused double now_seconds(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double last_report;

/*
 * One line per case group: "ok name" or "FAIL name", and the seconds
 * since the previous report line (or the first call of now_seconds()).
 */
static __maybe_unused __attribute__((format(printf, 2, 3)))
void report(int failures_before, const char *fmt, ...)
{
	double now = now_seconds();
	va_list ap;

	printf("%-4s ", failures == failures_before ? "ok" : "FAIL");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf(" [%.1fs]\n", last_report ? now - last_report : 0.0);
	last_report = now;
	fflush(stdout);
}

/* ------------------------------------------------------------------ */
/* Leak counters                                                       */
/* ------------------------------------------------------------------ */

struct live_counts {
	long user;	/* kmalloc & co, tsp_user_live_allocs() */
	long bufio;	/* user/bufio.c's own, tsp_bufio_live_allocs() */
};

static __maybe_unused struct live_counts live_now(void)
{
	struct live_counts c = {
		.user = tsp_user_live_allocs(),
		.bufio = tsp_bufio_live_allocs(),
	};

	return c;
}

static __maybe_unused bool live_same(struct live_counts a, struct live_counts b)
{
	return a.user == b.user && a.bufio == b.bufio;
}

/* ------------------------------------------------------------------ */
/* Files                                                               */
/* ------------------------------------------------------------------ */

static __maybe_unused int write_file(const char *path, const void *buf,
				     size_t len)
{
	const char *p = buf;
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

	if (fd < 0)
		return -errno;
	while (len) {
		ssize_t n = write(fd, p, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			close(fd);
			return -EIO;
		}
		p += n;
		len -= n;
	}
	return close(fd) ? -errno : 0;
}

/* Overwrite [off, off + len) of an existing file. */
static __maybe_unused int patch_file(const char *path, u64 off,
				     const void *buf, size_t len)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0)
		return -errno;
	n = pwrite(fd, buf, len, (off_t)off);
	close(fd);
	return n == (ssize_t)len ? 0 : -EIO;
}

/* The whole file in a malloc()ed buffer (NUL terminated); NULL on error. */
static __maybe_unused void *read_file(const char *path, size_t *len)
{
	struct stat st;
	char *buf;
	size_t got = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return NULL;
	if (fstat(fd, &st) || !(buf = malloc((size_t)st.st_size + 1))) {
		close(fd);
		return NULL;
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += n;
	}
	close(fd);
	if (got != (size_t)st.st_size) {
		free(buf);
		return NULL;
	}
	buf[got] = '\0';
	if (len)
		*len = got;
	return buf;
}

/*
 * Read the whole file into *@buf, growing it (realloc) as needed; for
 * loops that read images over and over (each fresh 4 MiB malloc would
 * sit in ASan's quarantine and make every fork slower).  Returns the
 * length, or -1.
 */
static __maybe_unused ssize_t reread_file(const char *path, u8 **buf,
					  size_t *cap)
{
	struct stat st;
	size_t got = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return -1;
	if (fstat(fd, &st)) {
		close(fd);
		return -1;
	}
	if ((size_t)st.st_size + 1 > *cap) {
		u8 *p = realloc(*buf, (size_t)st.st_size + 1);

		if (!p) {
			close(fd);
			return -1;
		}
		*buf = p;
		*cap = (size_t)st.st_size + 1;
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = read(fd, *buf + got, (size_t)st.st_size - got);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += n;
	}
	close(fd);
	return got == (size_t)st.st_size ? (ssize_t)got : -1;
}

/* A zero-filled (sparse) file of @size bytes. */
static __maybe_unused int make_zero_file(const char *path, u64 size)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	int r = 0;

	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)size))
		r = -errno;
	close(fd);
	return r;
}

/* A scratch directory for the test's images; removed by rm_scratch(). */
static char scratch_dir[256];

/* In $TMPDIR, else /dev/shm (images are rewritten often), else /tmp. */
static __maybe_unused int make_scratch(const char *name)
{
	const char *base = getenv("TMPDIR");

	if (!base || !*base)
		base = access("/dev/shm", W_OK | X_OK) ? "/tmp" : "/dev/shm";
	snprintf(scratch_dir, sizeof(scratch_dir), "%s/tsp-%s-XXXXXX", base,
		 name);
	return mkdtemp(scratch_dir) ? 0 : -errno;
}

static __maybe_unused void scratch_path(char *buf, size_t len, const char *name)
{
	snprintf(buf, len, "%s/%s", scratch_dir, name);
}

static __maybe_unused void rm_scratch(void)
{
	char cmd[512];

	if (!scratch_dir[0] || getenv("TSP_KEEP_SCRATCH"))
		return;
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", scratch_dir);
	if (system(cmd))
		fprintf(stderr, "could not remove %s\n", scratch_dir);
}

/* 64-bit FNV-1a over 8-byte words (lengths are multiples of 8 here). */
static __maybe_unused u64 hash_bytes(const void *buf, size_t len)
{
	const u8 *p = buf;
	u64 h = 0xcbf29ce484222325ull, w;
	size_t i;

	for (i = 0; i + 8 <= len; i += 8) {
		memcpy(&w, p + i, 8);
		h = (h ^ w) * 0x100000001b3ull;
		h ^= h >> 29;
	}
	for (; i < len; i++)
		h = (h ^ p[i]) * 0x100000001b3ull;
	return h;
}

/* Deterministic pseudo random numbers (xorshift64*). */
static u64 rng_state = 0x9e3779b97f4a7c15ull;

/* Any seed: mixed (splitmix64), and never the all-zero state. */
static __maybe_unused void rng_seed(u64 seed)
{
	u64 z = seed + 0x9e3779b97f4a7c15ull;

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	rng_state = (z ^ (z >> 31)) | 1;
}

static __maybe_unused u64 rng(void)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545f4914f6cdd1dull;
}

/* ------------------------------------------------------------------ */
/* thin_check and thin_dump (thin-provisioning-tools, the oracle)     */
/* ------------------------------------------------------------------ */

/*
 * Run @argv with stdin from /dev/null, stdout into @out (a malloc()ed
 * NUL terminated string, if @out) and stderr into @err_path (or
 * /dev/null).  Returns the exit status, or -1 if it did not exit.
 */
static __maybe_unused int run_tool(char *const argv[], char **out,
				   const char *err_path)
{
	char out_path[300];
	int status, fd;
	pid_t pid;

	scratch_path(out_path, sizeof(out_path), "tool.out");
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid < 0)
		return -1;
	if (!pid) {
		fd = open("/dev/null", O_RDONLY);
		dup2(fd, 0);
		fd = open(out ? out_path : "/dev/null",
			  O_WRONLY | O_CREAT | O_TRUNC, 0600);
		dup2(fd, 1);
		fd = open(err_path ? err_path : "/dev/null",
			  O_WRONLY | O_CREAT | O_TRUNC, 0600);
		dup2(fd, 2);
		execvp(argv[0], argv);
		_exit(127);
	}
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			return -1;
	}
	if (out)
		*out = read_file(out_path, NULL);
	if (!WIFEXITED(status))
		return -1;
	return WEXITSTATUS(status);
}

/* 0 if thin_check accepts the image. */
static __maybe_unused int thin_check(const char *path, const char *err_path)
{
	char *argv[] = { "thin_check", "-q", (char *)path, NULL };

	return run_tool(argv, NULL, err_path);
}

/* thin_dump's XML of the image, or NULL if it fails. */
static __maybe_unused char *thin_dump(const char *path)
{
	char *argv[] = { "thin_dump", (char *)path, NULL };
	char *out = NULL;

	if (run_tool(argv, &out, NULL)) {
		free(out);
		return NULL;
	}
	return out;
}

/* thin_dump of the metadata snapshot at block @held. */
static __maybe_unused char *thin_dump_snap(const char *path, u64 held)
{
	char opt[64];
	char *argv[] = { "thin_dump", opt, (char *)path, NULL };
	char *out = NULL;

	snprintf(opt, sizeof(opt), "--metadata-snap=%llu",
		 (unsigned long long)held);
	if (run_tool(argv, &out, NULL)) {
		free(out);
		return NULL;
	}
	return out;
}

static __maybe_unused bool have_tools(void)
{
	char *argv[] = { "thin_check", "-V", NULL };

	return run_tool(argv, NULL, NULL) == 0;
}

/* ------------------------------------------------------------------ */
/* One case in a child process                                         */
/* ------------------------------------------------------------------ */

/*
 * A sanitizer report in a child's log: built with recovery (plain
 * -fsanitize=undefined), UBSan prints and goes on, so look for it.
 */
static __maybe_unused bool log_has_sanitizer_report(const char *path)
{
	char *log = read_file(path, NULL);
	bool found;

	if (!log)
		return false;
	found = strstr(log, "runtime error:") || strstr(log, "Sanitizer") ||
		strstr(log, "WARNING:");
	free(log);
	return found;
}

/*
 * Run @fn(@arg) in a child with stderr going to @log_path, killed after
 * @timeout seconds.  @fn writes @res_len bytes of result into @res
 * (passed back through a pipe).  Returns 0 if the child ran to completion,
 * delivered its whole result and logged no sanitizer report, else a
 * negative code: -ETIMEDOUT, or -ECHILD (died: signal, sanitizer exit,
 * short result, sanitizer report); @how describes it.
 */
static __maybe_unused int run_child(void (*fn)(void *arg, void *res),
				    void *arg, void *res, size_t res_len,
				    unsigned int timeout, const char *log_path,
				    char *how, size_t how_len)
{
	int p[2], status, fd;
	size_t got = 0;
	ssize_t n;
	pid_t pid;

	if (pipe(p))
		return -EIO;
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid < 0) {
		close(p[0]);
		close(p[1]);
		return -EIO;
	}
	if (!pid) {
		close(p[0]);
		fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		if (fd >= 0)
			dup2(fd, 2);
		alarm(timeout);
		fn(arg, res);
		n = write(p[1], res, res_len);
		_exit(n == (ssize_t)res_len ? 0 : 3);
	}
	close(p[1]);
	while (got < res_len) {
		n = read(p[0], (char *)res + got, res_len - got);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += n;
	}
	close(p[0]);
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			break;
	}
	if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
		snprintf(how, how_len, "timed out after %us", timeout);
		return -ETIMEDOUT;
	}
	if (WIFSIGNALED(status)) {
		snprintf(how, how_len, "killed by signal %d (%s)",
			 WTERMSIG(status), strsignal(WTERMSIG(status)));
		return -ECHILD;
	}
	if (!WIFEXITED(status) || WEXITSTATUS(status) || got != res_len) {
		snprintf(how, how_len, "exited with status %d",
			 WIFEXITED(status) ? WEXITSTATUS(status) : -1);
		return -ECHILD;
	}
	if (log_has_sanitizer_report(log_path)) {
		snprintf(how, how_len, "logged a sanitizer report or warning");
		return -ECHILD;
	}
	how[0] = '\0';
	return 0;
}

/* Print the last @lines lines of a log file, indented. */
static __maybe_unused void show_log_tail(const char *path, int lines)
{
	size_t len;
	char *buf = read_file(path, &len);
	char *p;
	int n = 0;

	if (!buf)
		return;
	for (p = buf + len; p > buf; p--) {
		if (p[-1] == '\n' && p != buf + len && ++n > lines)
			break;
	}
	for (; *p; ) {
		char *nl = strchr(p, '\n');

		printf("    | %.*s\n", (int)(nl ? nl - p : (long)strlen(p)), p);
		if (!nl)
			break;
		p = nl + 1;
	}
	free(buf);
}

/* ------------------------------------------------------------------ */
/* On-disk layout, for building and damaging images by hand            */
/* ------------------------------------------------------------------ */

#define MD_BLOCK 4096u

/* Superblock field offsets (dm-thin metadata v2). */
#define SB_CSUM			0
#define SB_FLAGS		4
#define SB_BLOCKNR		8
#define SB_UUID			16
#define SB_MAGIC		32
#define SB_VERSION		40
#define SB_TIME			44
#define SB_TRANS_ID		48
#define SB_HELD_ROOT		56
#define SB_DATA_SM_ROOT		64
#define SB_META_SM_ROOT		192
#define SB_MAPPING_ROOT		320
#define SB_DETAILS_ROOT		328
#define SB_DATA_BLOCK_SIZE	336
#define SB_META_BLOCK_SIZE	340
#define SB_META_NR_BLOCKS	344
#define SB_COMPAT		352
#define SB_COMPAT_RO		356
#define SB_INCOMPAT		360
/* Within a 128-byte space map root. */
#define SMR_NR_BLOCKS		0
#define SMR_NR_ALLOCATED	8
#define SMR_BITMAP_ROOT		16
#define SMR_REF_COUNT_ROOT	24

/* Btree node header. */
#define NODE_FLAGS		4
#define NODE_BLOCKNR		8
#define NODE_NR_ENTRIES		16
#define NODE_MAX_ENTRIES	20
#define NODE_VALUE_SIZE		24
#define NODE_KEYS		32
#define NODE_INTERNAL		1
#define NODE_LEAF		2

/* Checksum salts. */
#define SALT_SUPERBLOCK		160774
#define SALT_NODE		121107
#define SALT_INDEX		160478
#define SALT_BITMAP		240779

#define BITMAP_ENTRIES		((MD_BLOCK - 16) * 4)	/* 16320 */
#define INDEX_ENTRIES_OFF	16	/* metadata index: entries start */

static __maybe_unused u32 get_le32(const void *p, size_t off)
{
	u32 v;

	memcpy(&v, (const u8 *)p + off, 4);
	return le32toh(v);
}

static __maybe_unused u64 get_le64(const void *p, size_t off)
{
	u64 v;

	memcpy(&v, (const u8 *)p + off, 8);
	return le64toh(v);
}

static __maybe_unused void put_le32(void *p, size_t off, u32 v)
{
	v = htole32(v);
	memcpy((u8 *)p + off, &v, 4);
}

static __maybe_unused void put_le64(void *p, size_t off, u64 v)
{
	v = htole64(v);
	memcpy((u8 *)p + off, &v, 8);
}

/* Recompute a block's checksum (every kind sums bytes 4..4095). */
static __maybe_unused void reseal(void *block, u32 salt)
{
	put_le32(block, 0, tsp_bm_checksum((u8 *)block + 4, MD_BLOCK - 4, salt));
}

static __maybe_unused bool sealed_with(const void *block, u32 salt)
{
	return get_le32(block, 0) ==
	       tsp_bm_checksum((const u8 *)block + 4, MD_BLOCK - 4, salt);
}

/* Btree node accessors over a raw block. */
static __maybe_unused u32 node_nr(const void *n)
{
	return get_le32(n, NODE_NR_ENTRIES);
}

static __maybe_unused u32 node_max(const void *n)
{
	return get_le32(n, NODE_MAX_ENTRIES);
}

static __maybe_unused u32 node_vsize(const void *n)
{
	return get_le32(n, NODE_VALUE_SIZE);
}

static __maybe_unused u64 node_key(const void *n, u32 i)
{
	return get_le64(n, NODE_KEYS + 8 * (size_t)i);
}

static __maybe_unused size_t node_value_off(const void *n, u32 i)
{
	return NODE_KEYS + 8 * (size_t)node_max(n) + (size_t)i * node_vsize(n);
}

/* 2-bit count @i of a bitmap block (the first bit is the high one). */
static __maybe_unused unsigned int bitmap_count(const void *bm, u32 i)
{
	u64 w = get_le64(bm, 16 + 8 * (size_t)(i / 32));
	unsigned int bit = (i % 32) * 2;

	return (unsigned int)(((w >> bit) & 1) << 1 | ((w >> (bit + 1)) & 1));
}

static __maybe_unused void bitmap_set_count(void *bm, u32 i, unsigned int c)
{
	u64 w = get_le64(bm, 16 + 8 * (size_t)(i / 32));
	unsigned int bit = (i % 32) * 2;

	w &= ~(3ull << bit);
	w |= (u64)((c >> 1) & 1) << bit;
	w |= (u64)(c & 1) << (bit + 1);
	put_le64(bm, 16 + 8 * (size_t)(i / 32), w);
}

/* ------------------------------------------------------------------ */
/* An independent walk of a raw image                                  */
/* ------------------------------------------------------------------ */

/*
 * Every metadata block reachable from the superblock, with its kind and
 * the number of references to it, found by reading the image directly
 * (not through the library).  Used to pick blocks to damage, and to tell
 * whether two images hold the same metadata: blocks nothing references
 * are never read by anybody.
 */
enum blk_kind {
	BK_FREE, BK_SUPERBLOCK, BK_SNAP_SUPERBLOCK, BK_META_INDEX,
	BK_META_BITMAP, BK_DATA_BITMAP, BK_NODE, NR_BLK_KINDS,
};

enum tree_kind {
	TK_NONE, TK_TOP, TK_BOTTOM, TK_DETAILS, TK_DATA_INDEX, TK_DATA_REF,
	TK_META_REF, NR_TREE_KINDS,
};

static const char *const blk_kind_names[NR_BLK_KINDS] __maybe_unused = {
	"free", "superblock", "metadata snapshot superblock",
	"metadata space map index", "metadata space map bitmap",
	"data space map bitmap", "btree node",
};

static const char *const tree_kind_names[NR_TREE_KINDS] __maybe_unused = {
	"-", "mapping top level", "mapping bottom level", "device details",
	"data space map index", "data space map overflow",
	"metadata space map overflow",
};

struct img_block {
	u8 kind;	/* enum blk_kind */
	u8 tree;	/* enum tree_kind, for nodes */
	bool leaf;
	u8 depth;	/* of a node, first time reached */
	u8 from;	/* reached from: 1 the superblock, 2 the held copy */
	u32 refs;	/* references found */
	u32 sm_count;	/* the metadata space map's count */
};

struct img_map {
	const u8 *img;
	u64 nr_blocks;		/* in the image */
	u64 sm_nr_blocks;	/* in the metadata space map */
	struct img_block *b;
	u64 nr_in_use;
	u64 data_nr_blocks;
	u64 nr_shared_data;	/* data blocks referenced 3 times or more */
	u32 *data_refs;		/* references found per data block */
	u8 cur_from;		/* what the walk is under: 1 or 2 */
	int err;		/* first inconsistency: -EILSEQ */
	char why[160];
};

static __maybe_unused __attribute__((format(printf, 2, 3)))
void img_error(struct img_map *m, const char *fmt, ...)
{
	va_list ap;

	if (m->err)
		return;
	m->err = -EILSEQ;
	va_start(ap, fmt);
	vsnprintf(m->why, sizeof(m->why), fmt, ap);
	va_end(ap);
}

static __maybe_unused const u8 *img_block(struct img_map *m, u64 b)
{
	return m->img + b * MD_BLOCK;
}

/* Count a reference to @b as @kind; true the first time (descend). */
static __maybe_unused bool img_ref(struct img_map *m, u64 b, enum blk_kind kind,
				   u32 salt)
{
	struct img_block *ib;

	if (b >= m->nr_blocks) {
		img_error(m, "reference to block %llu beyond the image",
			  (unsigned long long)b);
		return false;
	}
	ib = &m->b[b];
	ib->from |= m->cur_from;
	if (ib->refs++) {
		if (ib->kind != kind)
			img_error(m, "block %llu is both %s and %s",
				  (unsigned long long)b,
				  blk_kind_names[ib->kind], blk_kind_names[kind]);
		return false;
	}
	ib->kind = kind;
	if (!sealed_with(img_block(m, b), salt) ||
	    get_le64(img_block(m, b), 8) != b) {
		img_error(m, "%s %llu has a bad checksum or location",
			  blk_kind_names[kind], (unsigned long long)b);
		return false;
	}
	m->nr_in_use++;
	return true;
}

static __maybe_unused void img_walk_tree(struct img_map *m, u64 b,
					 enum tree_kind tree, u32 vsize,
					 int depth);

static __maybe_unused void img_leaf_value(struct img_map *m, enum tree_kind tree,
					  const u8 *n, u32 i, int depth)
{
	size_t off = node_value_off(n, i);
	u64 v = get_le64(n, off);

	switch (tree) {
	case TK_TOP:
		img_walk_tree(m, v, TK_BOTTOM, 8, 0);
		break;
	case TK_BOTTOM:
		v >>= 24;
		if (v >= m->data_nr_blocks)
			img_error(m, "mapping to data block %llu beyond the pool",
				  (unsigned long long)v);
		else if (++m->data_refs[v] == 3)
			m->nr_shared_data++;
		break;
	case TK_DATA_INDEX:
		img_ref(m, v, BK_DATA_BITMAP, SALT_BITMAP);
		break;
	case TK_META_REF:
		if (node_key(n, i) < m->nr_blocks)
			m->b[node_key(n, i)].sm_count = get_le32(n, off);
		break;
	default:
		break;
	}
}

static __maybe_unused void img_walk_tree(struct img_map *m, u64 b,
					 enum tree_kind tree, u32 vsize,
					 int depth)
{
	const u8 *n;
	u32 i, nr;
	bool leaf;

	if (depth > 16) {
		img_error(m, "tree too deep at %llu", (unsigned long long)b);
		return;
	}
	if (!img_ref(m, b, BK_NODE, SALT_NODE) || m->err)
		return;
	n = img_block(m, b);
	leaf = get_le32(n, NODE_FLAGS) == NODE_LEAF;
	m->b[b].tree = tree;
	m->b[b].leaf = leaf;
	m->b[b].depth = depth;
	nr = node_nr(n);
	if ((!leaf && get_le32(n, NODE_FLAGS) != NODE_INTERNAL) ||
	    nr > node_max(n) || node_vsize(n) != (leaf ? vsize : 8) ||
	    NODE_KEYS + (8 + (size_t)node_vsize(n)) * node_max(n) > MD_BLOCK) {
		img_error(m, "btree node %llu has a bad header",
			  (unsigned long long)b);
		return;
	}
	for (i = 0; i < nr && !m->err; i++) {
		if (leaf)
			img_leaf_value(m, tree, n, i, depth);
		else
			img_walk_tree(m, get_le64(n, node_value_off(n, i)),
				      tree, vsize, depth + 1);
	}
}

/* Walk the trees hanging off a superblock (or its snapshot copy). */
static __maybe_unused void img_walk_roots(struct img_map *m, const u8 *sb)
{
	img_walk_tree(m, get_le64(sb, SB_MAPPING_ROOT), TK_TOP, 8, 0);
	img_walk_tree(m, get_le64(sb, SB_DETAILS_ROOT), TK_DETAILS, 24, 0);
}

static __maybe_unused void img_free(struct img_map *m)
{
	free(m->b);
	free(m->data_refs);
	m->b = NULL;
	m->data_refs = NULL;
}

/*
 * Walk image @img of @len bytes into @m (img_free() it after).  Returns
 * 0 if every reference is sound and every metadata block's space map
 * count matches the references found, else -EILSEQ with m->why.
 */
static __maybe_unused int img_walk(const u8 *img, size_t len, struct img_map *m)
{
	const u8 *sb = img, *mi;
	u64 b, held, nr_bitmaps, i;

	memset(m, 0, sizeof(*m));
	m->img = img;
	m->nr_blocks = len / MD_BLOCK;
	if (!m->nr_blocks || get_le64(sb, SB_MAGIC) != 27022010) {
		img_error(m, "no superblock");
		return m->err;
	}
	m->b = calloc(m->nr_blocks, sizeof(*m->b));
	m->sm_nr_blocks = get_le64(sb, SB_META_SM_ROOT + SMR_NR_BLOCKS);
	m->data_nr_blocks = get_le64(sb, SB_DATA_SM_ROOT + SMR_NR_BLOCKS);
	if (m->data_nr_blocks > (1ull << 26) || m->sm_nr_blocks > m->nr_blocks) {
		img_error(m, "implausible space map sizes");
		return m->err;
	}
	m->data_refs = calloc(m->data_nr_blocks + 1, sizeof(*m->data_refs));
	if (!m->b || !m->data_refs)
		abort();
	m->cur_from = 1;

	img_ref(m, 0, BK_SUPERBLOCK, SALT_SUPERBLOCK);

	/* Metadata space map: index, bitmaps, overflow tree. */
	b = get_le64(sb, SB_META_SM_ROOT + SMR_BITMAP_ROOT);
	nr_bitmaps = (m->sm_nr_blocks + BITMAP_ENTRIES - 1) / BITMAP_ENTRIES;
	if (img_ref(m, b, BK_META_INDEX, SALT_INDEX)) {
		mi = img_block(m, b);
		for (i = 0; i < nr_bitmaps && i < 255; i++)
			img_ref(m, get_le64(mi, INDEX_ENTRIES_OFF + 16 * i),
				BK_META_BITMAP, SALT_BITMAP);
	}
	img_walk_tree(m, get_le64(sb, SB_META_SM_ROOT + SMR_REF_COUNT_ROOT),
		      TK_META_REF, 4, 0);

	/* Data space map: index tree (and its bitmaps), overflow tree. */
	img_walk_tree(m, get_le64(sb, SB_DATA_SM_ROOT + SMR_BITMAP_ROOT),
		      TK_DATA_INDEX, 16, 0);
	img_walk_tree(m, get_le64(sb, SB_DATA_SM_ROOT + SMR_REF_COUNT_ROOT),
		      TK_DATA_REF, 4, 0);

	img_walk_roots(m, sb);
	held = get_le64(sb, SB_HELD_ROOT);
	m->cur_from = 2;
	if (held && img_ref(m, held, BK_SNAP_SUPERBLOCK, SALT_SUPERBLOCK))
		img_walk_roots(m, img_block(m, held));
	if (m->err)
		return m->err;

	/* Every count in the metadata space map against what we found. */
	mi = img_block(m, get_le64(sb, SB_META_SM_ROOT + SMR_BITMAP_ROOT));
	for (b = 0; b < m->nr_blocks && !m->err; b++) {
		u32 c = 0;

		if (b < m->sm_nr_blocks) {
			u64 bmb = get_le64(mi, INDEX_ENTRIES_OFF +
					   16 * (b / BITMAP_ENTRIES));

			if (bmb >= m->nr_blocks || b / BITMAP_ENTRIES >= 255) {
				img_error(m, "no bitmap for block %llu",
					  (unsigned long long)b);
				break;
			}
			c = bitmap_count(img_block(m, bmb), b % BITMAP_ENTRIES);
			if (c < 3)
				m->b[b].sm_count = c;
			else if (m->b[b].sm_count < 3)
				img_error(m, "block %llu: count 3 without overflow entry",
					  (unsigned long long)b);
		}
		if (m->b[b].refs != m->b[b].sm_count)
			img_error(m, "block %llu: %u references, space map count %u",
				  (unsigned long long)b, m->b[b].refs,
				  m->b[b].sm_count);
	}
	return m->err;
}

/*
 * A hash of what an image holds for anybody reading it: the blocks in
 * use (number and contents).  Falls back to the whole image when the
 * walk finds it inconsistent.
 */
static __maybe_unused u64 img_content_hash(const u8 *img, size_t len)
{
	struct img_map m;
	u64 h = len, b;

	if (img_walk(img, len, &m)) {
		img_free(&m);
		return hash_bytes(img, len) ^ ~len;
	}
	for (b = 0; b < m.nr_blocks; b++) {
		if (!m.b[b].refs)
			continue;
		h = (h ^ b) * 0x100000001b3ull;
		h ^= hash_bytes(img + b * MD_BLOCK, MD_BLOCK);
		h *= 0x9e3779b97f4a7c15ull;
	}
	img_free(&m);
	return h;
}

/* ------------------------------------------------------------------ */
/* Pools                                                               */
/* ------------------------------------------------------------------ */

/*
 * Open (formatting if empty) the pool in @path.  Returns 0 only after
 * setting *@bdevp and *@pmdp, else a negative errno (never 0, even if
 * the failure left errno clear).
 */
static __maybe_unused int pool_open(const char *path, tsp_block_t nr_data,
				    bool format, struct block_device **bdevp,
				    struct tsp_pool_metadata **pmdp)
{
	struct block_device *bdev = tsp_bdev_open(path, false);
	int r;

	if (!bdev)
		return errno ? -errno : -EIO;
	r = tsp_pool_metadata_open(bdev, 128, nr_data, format, pmdp);
	if (r) {
		tsp_bdev_close(bdev);
		return r;
	}
	*bdevp = bdev;
	return 0;
}

static __maybe_unused int pool_close(struct block_device *bdev,
				     struct tsp_pool_metadata *pmd)
{
	int r = tsp_pool_metadata_close(pmd);

	tsp_bdev_close(bdev);
	return r;
}

/* Map @n virtual blocks first, first + step, ... to new data blocks. */
static __maybe_unused int map_blocks(struct tsp_pool_metadata *pmd,
				     tsp_thin_id dev, tsp_block_t first,
				     tsp_block_t step, unsigned int n)
{
	struct tsp_thin_device *td;
	tsp_block_t data;
	unsigned int i;
	int r;

	r = tsp_pool_open_thin_device(pmd, dev, &td);
	if (r)
		return r;
	for (i = 0; !r && i < n; i++) {
		r = tsp_pool_alloc_data_block(pmd, &data);
		if (!r)
			r = tsp_thin_insert_block(td, first + i * step, data);
	}
	tsp_pool_close_thin_device(td);
	return r;
}

/* Unmap [@begin, @end) of @dev. */
static __maybe_unused int unmap_range(struct tsp_pool_metadata *pmd,
				      tsp_thin_id dev, tsp_block_t begin,
				      tsp_block_t end)
{
	struct tsp_thin_device *td;
	int r;

	r = tsp_pool_open_thin_device(pmd, dev, &td);
	if (r)
		return r;
	r = tsp_thin_remove_range(td, begin, end);
	tsp_pool_close_thin_device(td);
	return r;
}

#endif /* TSP_TEST_HELPERS_H */
