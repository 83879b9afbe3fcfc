// SPDX-License-Identifier: GPL-2.0-only
/*
 * tools/stress.c - "stress": a model-based random test of the metadata
 * library, with thin-provisioning-tools as the external oracle.
 *
 * A seeded PRNG drives a sequence of operations (create_thin,
 * create_snap, delete, data block allocation and insert, overwrite as
 * when breaking sharing, remove, remove_range, lookups, transaction id
 * changes, data device growth, metadata snapshots, commit, abort, close
 * and reopen, and calls that must fail with a given error) against the
 * library and, in step, against an in-memory model:
 *
 *   per device slot:  exists, creation/snapshot time, transaction id,
 *                     virtual block -> (data block, time)
 *   per pool:         time, transaction id, data device size, whether a
 *                     metadata snapshot is held
 *   per data block:   how many mappings refer to it (in the current
 *                     state, the committed one and the held snapshot)
 *
 * The model follows dm-thin's rules: a mapping takes the pool's time; a
 * snapshot bumps the time and gives origin and snapshot that time as
 * their snapshot time; a mapping is shared when its device's snapshot
 * time is later than its own time; a newly allocated data block is free
 * both now and in the committed state (and in a held snapshot).  Abort
 * puts the committed copy of the model back.
 *
 * After every commit, abort and reopen the library's whole view is
 * compared with the model (superblock fields, device list and details,
 * every lookup, walk and mapped count, data block reference counts and
 * the free count).  Data block reference counts are bounded, not exact:
 * a btree leaf shared by snapshots holds one reference for all of them,
 * so a block's count is at least 1 when anything maps it, at most the
 * number of mappings, and exactly 1 when one mapping refers to it.
 * Every Nth commit (--external-every) also runs tsp_pool_check, then
 * thin_check and thin_dump (and thin_dump -m while a metadata snapshot is
 * held) as processes on the image; their XML is parsed by xml-parse.c and
 * compared with the model, and our own dump must equal thin_dump's byte
 * for byte.
 *
 * The first divergence stops the run with the seed and the op number;
 * rerunning with the same arguments (add -v to trace) reproduces it.
 * --avoid NAME,... steps around a known divergence (see avoid_names[])
 * so that a run can look for further ones while it is being fixed.
 *
 * The op mix cycles through phases (fill, churn, drain) so that trees
 * grow tall and shrink again.  Insert, overwrite, remove and create and
 * delete of devices dominate; commit is about one op in 120, so a run
 * of 100,000 ops makes about 700 transactions.
 */
#define DM_MSG_PREFIX "thin-scalable-meta"

#include <fcntl.h>
#include <spawn.h>
#include <stdarg.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "tools/tsm.h"

extern char **environ;

#define NO_BLOCK UINT64_MAX

/* --- options ------------------------------------------------------- */

struct opts {
	u64 seed;
	u64 ops;
	const char *image;
	unsigned int devices;
	unsigned int external_every;
	u64 virt_blocks;
	u64 data_blocks;
	u64 max_data_blocks;
	u64 metadata_blocks;
	u32 data_block_size;
	u64 progress_every;
	bool verbose;
	unsigned int avoid;	/* AVOID_* */
};

/*
 * Known library divergences that --avoid can step around, so a run can
 * look for further bugs while one is being fixed.  Off by default.
 */
enum {
	AVOID_DUP_ID = 1,	/* create over an id made this transaction */
	AVOID_DEV_TRANS = 2,	/* new device's transaction id: pool's or 0 */
	AVOID_ENOSPC = 4,	/* data -ENOSPC fails the metadata */
	AVOID_HELD = 8,		/* changes lose a held snapshot's refs */
	AVOID_ABORT_OPEN = 16,	/* handle open across abort of its creation */
};

static const struct {
	const char *name;
	unsigned int bit;
} avoid_names[] = {
	{ "dup-id", AVOID_DUP_ID },
	{ "dev-trans", AVOID_DEV_TRANS },
	{ "enospc", AVOID_ENOSPC },
	{ "held", AVOID_HELD },
	{ "abort-open", AVOID_ABORT_OPEN },
};

/* --- the model ----------------------------------------------------- */

struct mentry {
	u64 data;	/* NO_BLOCK: unmapped */
	u32 time;
};

struct mdev {
	bool exists;
	bool created;		/* in the current transaction */
	u32 creation_time;
	u32 snap_time;
	u64 trans;
	u64 nr_mapped;
	struct mentry *map;	/* virt_blocks entries */
};

struct mstate {
	u32 time;
	u64 trans;
	u64 nr_data_blocks;
	bool held;
	u32 flags;		/* superblock flags: needs_check */
	struct mdev *devs;	/* one per slot */
	u32 *refs;		/* mappings per data block */
};

/* --- operations ---------------------------------------------------- */

enum op_kind {
	OP_CREATE_THIN,
	OP_CREATE_SNAP,
	OP_DELETE,
	OP_INSERT,
	OP_INSERT_RUN,
	OP_INSERT_BATCH,
	OP_OVERWRITE,
	OP_REMOVE,
	OP_REMOVE_RANGE,
	OP_LOOKUP,
	OP_FIND_RANGE,
	OP_SET_TRANS,
	OP_RESIZE,
	OP_COMMIT,
	OP_ABORT,
	OP_RESERVE,
	OP_RELEASE,
	OP_REOPEN,
	OP_NEGATIVE,
	OP_NEEDS_CHECK,
	NR_OPS
};

static const struct {
	const char *name;
	unsigned int weight;
} op_table[NR_OPS] = {
	[OP_CREATE_THIN] = { "create_thin", 6 },
	[OP_CREATE_SNAP] = { "create_snap", 6 },
	[OP_DELETE] = { "delete", 3 },
	[OP_INSERT] = { "insert", 300 },
	[OP_INSERT_RUN] = { "insert_run", 30 },
	[OP_INSERT_BATCH] = { "insert_batch", 30 },
	[OP_OVERWRITE] = { "overwrite", 60 },
	[OP_REMOVE] = { "remove", 200 },
	[OP_REMOVE_RANGE] = { "remove_range", 20 },
	[OP_LOOKUP] = { "lookup", 200 },
	[OP_FIND_RANGE] = { "find_range", 60 },
	[OP_SET_TRANS] = { "set_transaction_id", 10 },
	[OP_RESIZE] = { "resize_data", 3 },
	[OP_COMMIT] = { "commit", 8 },
	[OP_ABORT] = { "abort", 2 },
	[OP_RESERVE] = { "reserve_metadata_snap", 2 },
	[OP_RELEASE] = { "release_metadata_snap", 2 },
	[OP_REOPEN] = { "reopen", 1 },
	[OP_NEGATIVE] = { "expected_error", 20 },
	[OP_NEEDS_CHECK] = { "set_needs_check", 1 },
};

struct stress {
	struct opts o;
	u64 op;
	const char *op_name;
	u64 rng;
	struct block_device *bdev;
	struct tsp_pool_metadata *pmd;
	u64 *ids;		/* slot -> device id */
	struct tsp_thin_device **td;	/* slot -> handle kept open, or NULL */
	struct mstate cur, committed, snap;
	/*
	 * Data blocks allocated in this transaction: once freed, they must
	 * not come back before a commit (nor must any other freed block).
	 */
	u8 *allocated_now;
	u64 counts[NR_OPS];
	u64 nr_enospc, nr_verify, nr_external, nr_commits;
	const char *thin_check, *thin_dump;
};

/* --- helpers ------------------------------------------------------- */

/* A commit or an abort: a new transaction has allocated nothing yet. */
static void new_transaction(struct stress *s)
{
	memset(s->allocated_now, 0, s->o.max_data_blocks);
}

static int __attribute__((format(printf, 2, 3)))
diverge(struct stress *s, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "stress: DIVERGENCE at seed %llu, op %llu (%s): ",
		(unsigned long long)s->o.seed, (unsigned long long)s->op,
		s->op_name ? s->op_name : "setup");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return -1;
}

/* A library call returned @r where @want was due. */
#define EXPECT_RC(s, r, want, what, ...) do {				\
	int __r = (r);							\
	if (__r != (want))						\
		return diverge(s, what " returned %d (%s), expected %d", \
			       ##__VA_ARGS__, __r, strerror(-__r), want);	\
} while (0)

static void __attribute__((format(printf, 2, 3)))
trace(struct stress *s, const char *fmt, ...)
{
	va_list ap;

	if (!s->o.verbose)
		return;
	fprintf(stderr, "op %llu %s: ", (unsigned long long)s->op,
		s->op_name);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

/* splitmix64: small, fast, and the same everywhere. */
static u64 rnd64(struct stress *s)
{
	u64 z = (s->rng += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static u64 rnd(struct stress *s, u64 n)
{
	return n ? rnd64(s) % n : 0;
}

/* --- model state --------------------------------------------------- */

static int mstate_init(struct mstate *m, const struct opts *o)
{
	unsigned int i;
	u64 v;

	memset(m, 0, sizeof(*m));
	m->devs = calloc(o->devices, sizeof(*m->devs));
	m->refs = calloc(o->max_data_blocks, sizeof(*m->refs));
	if (!m->devs || !m->refs)
		return -1;
	for (i = 0; i < o->devices; i++) {
		m->devs[i].map = malloc(o->virt_blocks * sizeof(struct mentry));
		if (!m->devs[i].map)
			return -1;
		for (v = 0; v < o->virt_blocks; v++)
			m->devs[i].map[v].data = NO_BLOCK;
	}
	m->nr_data_blocks = o->data_blocks;
	return 0;
}

static void mstate_free(struct mstate *m, const struct opts *o)
{
	unsigned int i;

	if (m->devs)
		for (i = 0; i < o->devices; i++)
			free(m->devs[i].map);
	free(m->devs);
	free(m->refs);
	memset(m, 0, sizeof(*m));
}

static void mstate_copy(struct mstate *dst, const struct mstate *src,
			const struct opts *o)
{
	unsigned int i;

	dst->time = src->time;
	dst->trans = src->trans;
	dst->nr_data_blocks = src->nr_data_blocks;
	dst->held = src->held;
	dst->flags = src->flags;
	for (i = 0; i < o->devices; i++) {
		struct mentry *map = dst->devs[i].map;

		dst->devs[i] = src->devs[i];
		dst->devs[i].map = map;
		memcpy(map, src->devs[i].map,
		       o->virt_blocks * sizeof(struct mentry));
	}
	memcpy(dst->refs, src->refs, o->max_data_blocks * sizeof(u32));
}

static bool model_shared(const struct mdev *d, const struct mentry *e)
{
	return d->snap_time > e->time;
}

/* Data block references a metadata dump would count: live + held. */
static u64 model_refs(struct stress *s, u64 b)
{
	return s->cur.refs[b] + (s->cur.held ? s->snap.refs[b] : 0);
}

static void model_map(struct stress *s, unsigned int slot, u64 virt, u64 data)
{
	struct mdev *d = &s->cur.devs[slot];
	struct mentry *e = &d->map[virt];

	if (e->data == NO_BLOCK)
		d->nr_mapped++;
	else
		s->cur.refs[e->data]--;
	e->data = data;
	e->time = s->cur.time;
	s->cur.refs[data]++;
}

static void model_unmap(struct stress *s, unsigned int slot, u64 virt)
{
	struct mdev *d = &s->cur.devs[slot];
	struct mentry *e = &d->map[virt];

	if (e->data == NO_BLOCK)
		return;
	s->cur.refs[e->data]--;
	e->data = NO_BLOCK;
	d->nr_mapped--;
}

/* A random slot whose existence is @exists; -1 if there is none. */
static int pick_slot(struct stress *s, bool exists)
{
	unsigned int n = s->o.devices, start = rnd(s, n), i;

	for (i = 0; i < n; i++) {
		unsigned int slot = (start + i) % n;

		if (s->cur.devs[slot].exists == exists)
			return slot;
	}
	return -1;
}

/* A random virtual block of @slot that is (un)mapped; NO_BLOCK if none. */
static u64 pick_virt(struct stress *s, unsigned int slot, bool mapped)
{
	const struct mdev *d = &s->cur.devs[slot];
	u64 n = s->o.virt_blocks, start = rnd(s, n), i;

	if (mapped ? !d->nr_mapped : d->nr_mapped == n)
		return NO_BLOCK;
	for (i = 0; i < n; i++) {
		u64 v = (start + i) % n;

		if ((d->map[v].data != NO_BLOCK) == mapped)
			return v;
	}
	return NO_BLOCK;
}

/* --- library helpers ----------------------------------------------- */

/*
 * Thin device handles.  Some stay open across ops, commits, aborts and
 * transaction boundaries (as a live thin target's do): get_td() returns
 * the cached one or opens one, and caches half of those it opens;
 * put_td() closes uncached ones and now and then a cached one.
 */
static int get_td(struct stress *s, unsigned int slot,
		  struct tsp_thin_device **td)
{
	if (s->td[slot]) {
		*td = s->td[slot];
		return 0;
	}
	EXPECT_RC(s, tsp_pool_open_thin_device(s->pmd, s->ids[slot], td), 0,
		  "open_thin_device(%llu)", (unsigned long long)s->ids[slot]);
	if (tsp_thin_dev_id(*td) != s->ids[slot]) {
		tsp_pool_close_thin_device(*td);
		return diverge(s, "open_thin_device(%llu) gave device %llu",
			       (unsigned long long)s->ids[slot],
			       (unsigned long long)tsp_thin_dev_id(*td));
	}
	if (rnd(s, 2))
		s->td[slot] = *td;
	return 0;
}

static void drop_td(struct stress *s, unsigned int slot)
{
	if (s->td[slot])
		tsp_pool_close_thin_device(s->td[slot]);
	s->td[slot] = NULL;
}

static void put_td(struct stress *s, unsigned int slot,
		   struct tsp_thin_device *td)
{
	if (td != s->td[slot])
		tsp_pool_close_thin_device(td);
	else if (!rnd(s, 16))
		drop_td(s, slot);
}

static void drop_all_td(struct stress *s)
{
	unsigned int slot;

	if (s->td)
		for (slot = 0; slot < s->o.devices; slot++)
			drop_td(s, slot);
}

/* Look @virt up in the library and compare with the model. */
static int check_lookup(struct stress *s, struct tsp_thin_device *td,
			unsigned int slot, u64 virt)
{
	const struct mdev *d = &s->cur.devs[slot];
	struct tsp_thin_lookup_result res;
	int r;

	r = tsp_thin_find_block(td, virt, &res);
	if (virt >= s->o.virt_blocks || d->map[virt].data == NO_BLOCK) {
		if (r != -ENODATA)
			return diverge(s, "find_block(dev %llu, %llu) returned %d (block %llu), expected -ENODATA",
				       (unsigned long long)s->ids[slot],
				       (unsigned long long)virt, r,
				       (unsigned long long)(r ? 0 : res.block));
		return 0;
	}
	EXPECT_RC(s, r, 0, "find_block(dev %llu, %llu)",
		  (unsigned long long)s->ids[slot], (unsigned long long)virt);
	if (res.block != d->map[virt].data ||
	    res.shared != model_shared(d, &d->map[virt]))
		return diverge(s, "find_block(dev %llu, %llu) = block %llu shared %d, model: block %llu shared %d (time %u, snap_time %u)",
			       (unsigned long long)s->ids[slot],
			       (unsigned long long)virt,
			       (unsigned long long)res.block, res.shared,
			       (unsigned long long)d->map[virt].data,
			       model_shared(d, &d->map[virt]),
			       d->map[virt].time, d->snap_time);
	return 0;
}

static int check_mapped_count(struct stress *s, struct tsp_thin_device *td,
			      unsigned int slot)
{
	tsp_block_t count;

	EXPECT_RC(s, tsp_thin_get_mapped_count(td, &count), 0,
		  "get_mapped_count");
	if (count != s->cur.devs[slot].nr_mapped)
		return diverge(s, "dev %llu: mapped count %llu, model %llu",
			       (unsigned long long)s->ids[slot],
			       (unsigned long long)count,
			       (unsigned long long)s->cur.devs[slot].nr_mapped);
	return 0;
}

/* Allocate a data block and check the model allows it. */
static int alloc_block(struct stress *s, u64 *b, bool *enospc)
{
	tsp_block_t block;
	u64 i, avail = 0;
	int r;

	*enospc = false;
	r = tsp_pool_alloc_data_block(s->pmd, &block);
	if (r == -ENOSPC) {
		for (i = 0; i < s->cur.nr_data_blocks; i++)
			if (!model_refs(s, i) && !s->committed.refs[i] &&
			    !s->allocated_now[i])
				avail++;
		if (avail)
			return diverge(s, "alloc_data_block: -ENOSPC but %llu blocks are free now and when committed",
				       (unsigned long long)avail);
		trace(s, "alloc: -ENOSPC (as the model expects)");
		s->nr_enospc++;
		*enospc = true;
		if (s->o.avoid & AVOID_ENOSPC) {
			EXPECT_RC(s, tsp_pool_abort_metadata(s->pmd), 0,
				  "abort after -ENOSPC");
			mstate_copy(&s->cur, &s->committed, &s->o);
			new_transaction(s);
		}
		return 0;
	}
	EXPECT_RC(s, r, 0, "alloc_data_block");
	if (block >= s->cur.nr_data_blocks)
		return diverge(s, "alloc_data_block gave %llu beyond the %llu data blocks",
			       (unsigned long long)block,
			       (unsigned long long)s->cur.nr_data_blocks);
	if (model_refs(s, block) || s->committed.refs[block] ||
	    s->allocated_now[block])
		return diverge(s, "alloc_data_block gave %llu, in use or freed in this transaction (%llu refs now, %u committed, %sallocated in this transaction)",
			       (unsigned long long)block,
			       (unsigned long long)model_refs(s, block),
			       s->committed.refs[block],
			       s->allocated_now[block] ? "" : "not ");
	s->allocated_now[block] = 1;
	*b = block;
	return 0;
}

/* Map @virt of @slot to a new block; @done false if out of space. */
static int insert_one(struct stress *s, struct tsp_thin_device *td,
		      unsigned int slot, u64 virt, bool *done)
{
	bool enospc;
	u64 b = 0;

	*done = false;
	if (alloc_block(s, &b, &enospc))
		return -1;
	if (enospc)
		return 0;
	EXPECT_RC(s, tsp_thin_insert_block(td, virt, b), 0,
		  "insert_block(dev %llu, %llu -> %llu)",
		  (unsigned long long)s->ids[slot], (unsigned long long)virt,
		  (unsigned long long)b);
	trace(s, "dev %llu: %llu -> %llu", (unsigned long long)s->ids[slot],
	      (unsigned long long)virt, (unsigned long long)b);
	model_map(s, slot, virt, b);
	if (!tsp_thin_changed_this_transaction(td))
		return diverge(s, "insert left the device unchanged this transaction");
	*done = true;
	return check_lookup(s, td, slot, virt);
}

/* --- external tools ------------------------------------------------ */

/*
 * Run @argv; its stdout into *@out (if @out), its stderr (and stdout if
 * not captured) into *@msg.  Returns the exit code, or -1 (message
 * printed) if it could not run or died of a signal.
 */
static int run_tool(char *const argv[], char **out, size_t *out_len,
		    char **msg)
{
	posix_spawn_file_actions_t fa;
	FILE *errf = tmpfile();
	int pipefd[2] = { -1, -1 }, status, rc = -1;
	size_t len = 0, alloc = 0;
	char *buf = NULL;
	pid_t pid;

	*msg = NULL;
	if (out)
		*out = NULL;
	if (!errf) {
		tsm_err("stress: tmpfile: %s", strerror(errno));
		return -1;
	}
	if (out && pipe2(pipefd, O_CLOEXEC)) {
		tsm_err("stress: pipe: %s", strerror(errno));
		fclose(errf);
		return -1;
	}
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, out ? pipefd[1] : fileno(errf), 1);
	posix_spawn_file_actions_adddup2(&fa, fileno(errf), 2);
	errno = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	if (out)
		close(pipefd[1]);
	if (errno) {
		tsm_err("stress: cannot run %s: %s", argv[0], strerror(errno));
		if (out)
			close(pipefd[0]);
		fclose(errf);
		return -1;
	}
	if (out) {
		for (;;) {
			ssize_t n;

			if (alloc - len < 65536) {
				char *nb = realloc(buf, alloc + (1 << 20));

				if (!nb)
					break;
				buf = nb;
				alloc += 1 << 20;
			}
			n = read(pipefd[0], buf + len, alloc - len - 1);
			if (n < 0 && errno == EINTR)
				continue;
			if (n <= 0)
				break;
			len += n;
		}
		close(pipefd[0]);
		if (buf)
			buf[len] = '\0';
	}
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	/* Keep what it said, up to 4 KiB. */
	{
		long size = ftell(errf);
		char *m = malloc(4097);

		if (m && size >= 0) {
			size_t n;

			rewind(errf);
			n = fread(m, 1, 4096, errf);
			m[n] = '\0';
			*msg = m;
		} else {
			free(m);
		}
	}
	fclose(errf);
	if (WIFEXITED(status)) {
		rc = WEXITSTATUS(status);
	} else {
		tsm_err("stress: %s died of signal %d", argv[0],
			WTERMSIG(status));
		rc = -1;
	}
	if (out) {
		*out = buf;
		*out_len = len;
	} else {
		free(buf);
	}
	return rc;
}

/* Compare a parsed dump with a model state. */
static int compare_xml(struct stress *s, const struct tsm_xml *x,
		       const struct mstate *m, bool metadata_snap,
		       const char *what)
{
	/* A metadata snapshot has no data space map: thin_dump -m says 0. */
	u64 nr_data = metadata_snap ? 0 : m->nr_data_blocks;
	/* The held copy's flags mean nothing to anyone: not compared. */
	u32 flags = metadata_snap ? x->flags : m->flags;
	unsigned int slot;
	size_t di = 0;

	if (x->time != m->time || x->transaction != m->trans ||
	    x->nr_data_blocks != nr_data ||
	    x->data_block_size != s->o.data_block_size ||
	    x->version != 2 || x->flags != flags)
		return diverge(s, "%s: superblock time %u transaction %llu nr_data_blocks %llu data_block_size %u version %u flags %u; model: %u %llu %llu %u 2 %u",
			       what, x->time,
			       (unsigned long long)x->transaction,
			       (unsigned long long)x->nr_data_blocks,
			       x->data_block_size, x->version, x->flags,
			       m->time, (unsigned long long)m->trans,
			       (unsigned long long)nr_data,
			       s->o.data_block_size, flags);

	/* Slots in id order: the dump lists devices sorted by id. */
	for (;;) {
		const struct tsm_xml_device *xd;
		const struct mdev *d;
		u64 best = NO_BLOCK, v = 0;
		int best_slot = -1;
		size_t i;

		for (slot = 0; slot < s->o.devices; slot++) {
			if (!m->devs[slot].exists)
				continue;
			if ((di == 0 || s->ids[slot] > x->devs[di - 1].dev_id) &&
			    s->ids[slot] < best) {
				best = s->ids[slot];
				best_slot = slot;
			}
		}
		if (best_slot < 0) {
			if (di != x->nr_devs)
				return diverge(s, "%s: device %llu is not in the model",
					       what,
					       (unsigned long long)x->devs[di].dev_id);
			break;
		}
		if (di == x->nr_devs || x->devs[di].dev_id != best)
			return diverge(s, "%s: device %llu missing (found %llu)",
				       what, (unsigned long long)best,
				       di == x->nr_devs ? 0ULL :
				       (unsigned long long)x->devs[di].dev_id);
		xd = &x->devs[di++];
		d = &m->devs[best_slot];
		if (xd->mapped_blocks != d->nr_mapped ||
		    xd->nr_blocks != d->nr_mapped ||
		    xd->creation_time != d->creation_time ||
		    xd->snap_time != d->snap_time ||
		    xd->transaction != d->trans)
			return diverge(s, "%s: device %llu: mapped_blocks %llu (%llu listed) creation_time %u snap_time %u transaction %llu; model: %llu %u %u %llu",
				       what, (unsigned long long)best,
				       (unsigned long long)xd->mapped_blocks,
				       (unsigned long long)xd->nr_blocks,
				       xd->creation_time, xd->snap_time,
				       (unsigned long long)xd->transaction,
				       (unsigned long long)d->nr_mapped,
				       d->creation_time, d->snap_time,
				       (unsigned long long)d->trans);
		/* Walk the model's mapped blocks beside the expanded runs. */
		for (i = 0; i < xd->nr_maps; i++) {
			const struct tsm_xml_mapping *xm = &xd->maps[i];
			u64 j;

			for (j = 0; j < xm->length; j++) {
				u64 xv = xm->origin + j;

				while (v < s->o.virt_blocks &&
				       d->map[v].data == NO_BLOCK)
					v++;
				if (v >= s->o.virt_blocks || v != xv ||
				    d->map[v].data != xm->data + j ||
				    d->map[v].time != xm->time)
					return diverge(s, "%s: device %llu: block %llu -> %llu time %u (line %lu); model next: %llu -> %llu time %u",
						       what, (unsigned long long)best,
						       (unsigned long long)xv,
						       (unsigned long long)(xm->data + j),
						       xm->time, xm->line,
						       (unsigned long long)v,
						       v < s->o.virt_blocks ? (unsigned long long)d->map[v].data : 0ULL,
						       v < s->o.virt_blocks ? d->map[v].time : 0);
				v++;
			}
		}
	}
	return 0;
}

static int external_dump(struct stress *s, bool metadata_snap,
			 const struct mstate *m, const char *our_dump)
{
	char *argv[4], *out, *msg;
	const char *what = metadata_snap ? "thin_dump -m" : "thin_dump";
	char err[512];
	struct tsm_xml x;
	size_t len;
	int rc, n = 0;

	argv[n++] = (char *)s->thin_dump;
	if (metadata_snap)
		argv[n++] = "-m";
	argv[n++] = (char *)s->o.image;
	argv[n] = NULL;
	rc = run_tool(argv, &out, &len, &msg);
	if (rc) {
		diverge(s, "%s exited with %d: %s", what, rc,
			msg ? msg : "");
		free(out);
		free(msg);
		return -1;
	}
	free(msg);
	if (!out)
		return diverge(s, "%s: out of memory reading its output", what);
	if (our_dump && strcmp(out, our_dump)) {
		const char *a = out, *b = our_dump;
		unsigned long line = 1;

		while (*a && *a == *b) {
			if (*a == '\n')
				line++;
			a++;
			b++;
		}
		diverge(s, "our dump differs from thin_dump at line %lu: thin_dump '%.80s' ours '%.80s'",
			line, a, b);
		free(out);
		return -1;
	}
	rc = tsm_xml_parse_buffer(out, len, metadata_snap, &x, err,
				  sizeof(err));
	free(out);
	if (rc)
		return diverge(s, "%s: cannot parse its output: %s", what, err);
	rc = compare_xml(s, &x, m, metadata_snap, what);
	tsm_xml_free(&x);
	return rc;
}

/* After a commit: the library's checker, thin_check and thin_dump. */
static int external_check(struct stress *s)
{
	char *argv[] = { (char *)s->thin_check, (char *)s->o.image, NULL };
	char *msg, *ours = NULL;
	size_t ours_len = 0;
	FILE *f;
	int rc;

	s->nr_external++;
	EXPECT_RC(s, tsp_pool_check(s->pmd), 0, "tsp_pool_check");

	rc = run_tool(argv, NULL, NULL, &msg);
	if (rc) {
		diverge(s, "thin_check exited with %d: %s", rc,
			msg ? msg : "");
		free(msg);
		return -1;
	}
	free(msg);

	f = open_memstream(&ours, &ours_len);
	if (!f)
		return diverge(s, "open_memstream: %s", strerror(errno));
	rc = tsm_dump_pool(s->pmd, f);
	fclose(f);
	if (rc) {
		free(ours);
		return diverge(s, "our dump failed: %d", rc);
	}
	rc = external_dump(s, false, &s->cur, ours);
	free(ours);
	if (rc)
		return rc;
	if (s->cur.held)
		return external_dump(s, true, &s->snap, NULL);
	return 0;
}

/* --- verification through the library ------------------------------ */

struct walk_ctx {
	struct stress *s;
	const struct mdev *d;
	u64 id;
	u64 next;	/* next model virt to expect */
	int bad;
	u64 ndevs;	/* for the device walk */
};

static int walk_map_fn(void *context, tsp_block_t virt, tsp_block_t data,
		       u32 time)
{
	struct walk_ctx *w = context;
	const struct mdev *d = w->d;
	u64 nv = w->s->o.virt_blocks;

	while (w->next < nv && d->map[w->next].data == NO_BLOCK)
		w->next++;
	if (virt >= nv || w->next != virt || d->map[virt].data != data ||
	    d->map[virt].time != time) {
		diverge(w->s, "walk_mappings(dev %llu): %llu -> %llu time %u; model next %llu -> %llu time %u",
			(unsigned long long)w->id, (unsigned long long)virt,
			(unsigned long long)data, time,
			(unsigned long long)w->next,
			w->next < nv ? (unsigned long long)d->map[w->next].data : 0ULL,
			w->next < nv ? d->map[w->next].time : 0);
		w->bad = 1;
		return -EINVAL;
	}
	w->next++;
	return 0;
}

static int walk_dev_fn(void *context, tsp_thin_id dev,
		       const struct tsp_thin_details *det)
{
	struct walk_ctx *w = context;
	struct stress *s = w->s;
	unsigned int slot;

	for (slot = 0; slot < s->o.devices; slot++)
		if (s->ids[slot] == dev)
			break;
	if (slot == s->o.devices || !s->cur.devs[slot].exists) {
		diverge(s, "walk_devices: device %llu is not in the model",
			(unsigned long long)dev);
		w->bad = 1;
		return -EINVAL;
	}
	if (w->ndevs && dev <= w->id) {
		diverge(s, "walk_devices: %llu after %llu: not in id order",
			(unsigned long long)dev, (unsigned long long)w->id);
		w->bad = 1;
		return -EINVAL;
	}
	w->id = dev;
	w->ndevs++;
	w->d = &s->cur.devs[slot];
	if (det->mapped_blocks != w->d->nr_mapped ||
	    det->creation_time != w->d->creation_time ||
	    det->snapshotted_time != w->d->snap_time ||
	    det->transaction_id != w->d->trans) {
		diverge(s, "walk_devices: device %llu: mapped %llu creation %u snap %u transaction %llu; model %llu %u %u %llu",
			(unsigned long long)dev,
			(unsigned long long)det->mapped_blocks,
			det->creation_time, det->snapshotted_time,
			(unsigned long long)det->transaction_id,
			(unsigned long long)w->d->nr_mapped,
			w->d->creation_time, w->d->snap_time,
			(unsigned long long)w->d->trans);
		w->bad = 1;
		return -EINVAL;
	}
	return 0;
}

#define LOOKUP_SAMPLE 128

static int verify_device(struct stress *s, unsigned int slot)
{
	const struct mdev *d = &s->cur.devs[slot];
	struct walk_ctx w = { .s = s, .d = d, .id = s->ids[slot] };
	struct tsp_thin_device *td;
	tsp_block_t highest;
	u64 v, last = NO_BLOCK;
	int r;

	if (get_td(s, slot, &td))
		return -1;
	r = check_mapped_count(s, td, slot);
	if (r)
		goto out;
	r = tsp_thin_walk_mappings(td, walk_map_fn, &w);
	if (w.bad) {
		r = -1;
		goto out;
	}
	if (r) {
		r = diverge(s, "walk_mappings(dev %llu) returned %d",
			    (unsigned long long)w.id, r);
		goto out;
	}
	while (w.next < s->o.virt_blocks && d->map[w.next].data == NO_BLOCK)
		w.next++;
	if (w.next < s->o.virt_blocks) {
		r = diverge(s, "walk_mappings(dev %llu) missed block %llu",
			    (unsigned long long)w.id,
			    (unsigned long long)w.next);
		goto out;
	}
	/*
	 * The walk compared every mapping; look up every block of one
	 * device in turn and a sample of the others (sharing, misses).
	 */
	for (v = 0; v < s->o.virt_blocks; v++) {
		if (d->map[v].data != NO_BLOCK)
			last = v;
		if (slot != s->nr_verify % s->o.devices &&
		    rnd(s, s->o.virt_blocks) >= LOOKUP_SAMPLE)
			continue;
		r = check_lookup(s, td, slot, v);
		if (r)
			goto out;
	}
	r = check_lookup(s, td, slot, s->o.virt_blocks + rnd(s, 1000));
	if (r)
		goto out;
	r = tsp_thin_get_highest_mapped_block(td, &highest);
	if (last == NO_BLOCK ? r != -ENODATA : r || highest != last) {
		r = diverge(s, "get_highest_mapped_block(dev %llu) returned %d, %llu; model %llu",
			    (unsigned long long)w.id, r,
			    (unsigned long long)(r ? 0 : highest),
			    (unsigned long long)last);
		goto out;
	}
	r = 0;
out:
	put_td(s, slot, td);
	return r;
}

/* The library's whole view against the model; after commit or abort. */
static int verify(struct stress *s)
{
	struct tsp_pool_info info;
	struct walk_ctx w = { .s = s };
	tsp_block_t count, nfree, snap;
	u64 b, used = 0, ndevs = 0, trans;
	unsigned int slot;
	int r;

	s->nr_verify++;
	EXPECT_RC(s, tsp_pool_get_info(s->pmd, &info), 0, "get_info");
	if (info.time != s->cur.time || info.transaction_id != s->cur.trans ||
	    info.nr_data_blocks != s->cur.nr_data_blocks ||
	    info.data_block_size != s->o.data_block_size ||
	    info.version != 2 || info.flags != s->cur.flags ||
	    tsp_pool_metadata_needs_check(s->pmd) != !!(s->cur.flags & 1) ||
	    !info.metadata_snap != !s->cur.held)
		return diverge(s, "get_info: time %u transaction %llu nr_data_blocks %llu data_block_size %u version %u flags %u metadata_snap %llu; model: %u %llu %llu %u 2 %u %s",
			       info.time,
			       (unsigned long long)info.transaction_id,
			       (unsigned long long)info.nr_data_blocks,
			       info.data_block_size, info.version, info.flags,
			       (unsigned long long)info.metadata_snap,
			       s->cur.time, (unsigned long long)s->cur.trans,
			       (unsigned long long)s->cur.nr_data_blocks,
			       s->o.data_block_size, s->cur.flags,
			       s->cur.held ? "held" : "none");
	EXPECT_RC(s, tsp_pool_get_metadata_snap(s->pmd, &snap), 0,
		  "get_metadata_snap");
	if (snap != info.metadata_snap)
		return diverge(s, "get_metadata_snap %llu, get_info says %llu",
			       (unsigned long long)snap,
			       (unsigned long long)info.metadata_snap);
	EXPECT_RC(s, tsp_pool_get_metadata_transaction_id(s->pmd, &trans), 0,
		  "get_metadata_transaction_id");
	if (trans != s->cur.trans)
		return diverge(s, "transaction id %llu, model %llu",
			       (unsigned long long)trans,
			       (unsigned long long)s->cur.trans);
	if (tsp_pool_changed_this_transaction(s->pmd))
		return diverge(s, "pool changed this transaction right after commit/abort");

	r = tsp_pool_walk_devices(s->pmd, walk_dev_fn, &w);
	if (w.bad)
		return -1;
	EXPECT_RC(s, r, 0, "walk_devices");
	for (slot = 0; slot < s->o.devices; slot++) {
		if (!s->cur.devs[slot].exists)
			continue;
		ndevs++;
		if (verify_device(s, slot))
			return -1;
	}
	if (ndevs != w.ndevs)
		return diverge(s, "walk_devices listed %llu devices, model has %llu",
			       (unsigned long long)w.ndevs,
			       (unsigned long long)ndevs);

	EXPECT_RC(s, tsp_pool_get_data_block_count(s->pmd, &count), 0,
		  "get_data_block_count");
	if (count != s->cur.nr_data_blocks)
		return diverge(s, "data block count %llu, model %llu",
			       (unsigned long long)count,
			       (unsigned long long)s->cur.nr_data_blocks);
	for (b = 0; b < s->cur.nr_data_blocks; b++) {
		u64 want = model_refs(s, b);
		u32 got;

		EXPECT_RC(s, tsp_pool_get_data_block_refcount(s->pmd, b, &got),
			  0, "get_data_block_refcount(%llu)",
			  (unsigned long long)b);
		if (!got != !want || got > want || (want == 1 && got != 1))
			return diverge(s, "data block %llu: refcount %u, model: %llu mappings (%u live%s)",
				       (unsigned long long)b, got,
				       (unsigned long long)want, s->cur.refs[b],
				       s->cur.held ? " + held snapshot" : "");
		used += !!want;
	}
	EXPECT_RC(s, tsp_pool_get_free_block_count(s->pmd, &nfree), 0,
		  "get_free_block_count");
	if (nfree != s->cur.nr_data_blocks - used)
		return diverge(s, "free data blocks %llu, model %llu",
			       (unsigned long long)nfree,
			       (unsigned long long)(s->cur.nr_data_blocks - used));
	return 0;
}

/* --- the operations ------------------------------------------------ */

static void clear_created(struct stress *s)
{
	unsigned int i;

	for (i = 0; i < s->o.devices; i++)
		s->cur.devs[i].created = false;
}

static int do_commit(struct stress *s, bool external)
{
	EXPECT_RC(s, tsp_pool_commit_metadata(s->pmd), 0, "commit");
	s->nr_commits++;
	clear_created(s);
	mstate_copy(&s->committed, &s->cur, &s->o);
	new_transaction(s);
	if (verify(s))
		return -1;
	if (external && s->o.external_every &&
	    s->nr_commits % s->o.external_every == 0)
		return external_check(s);
	return 0;
}

static int op_create_thin(struct stress *s)
{
	int slot = pick_slot(s, false);
	struct mdev *d;

	if (slot < 0)
		return 0;
	EXPECT_RC(s, tsp_pool_create_thin(s->pmd, s->ids[slot]), 0,
		  "create_thin(%llu)", (unsigned long long)s->ids[slot]);
	trace(s, "dev %llu", (unsigned long long)s->ids[slot]);
	d = &s->cur.devs[slot];
	d->exists = true;
	d->creation_time = s->cur.time;
	d->snap_time = s->cur.time;
	d->trans = (s->o.avoid & AVOID_DEV_TRANS) ? 0 : s->cur.trans;
	d->created = true;
	d->nr_mapped = 0;
	return 0;
}

static int op_create_snap(struct stress *s)
{
	int slot = pick_slot(s, false), origin = pick_slot(s, true);
	struct mdev *d, *o;
	u64 v;

	if (slot < 0 || origin < 0)
		return 0;
	EXPECT_RC(s, tsp_pool_create_snap(s->pmd, s->ids[slot],
					  s->ids[origin]), 0,
		  "create_snap(%llu of %llu)", (unsigned long long)s->ids[slot],
		  (unsigned long long)s->ids[origin]);
	trace(s, "dev %llu of %llu", (unsigned long long)s->ids[slot],
	      (unsigned long long)s->ids[origin]);
	d = &s->cur.devs[slot];
	o = &s->cur.devs[origin];
	s->cur.time++;
	o->snap_time = s->cur.time;
	d->exists = true;
	d->creation_time = s->cur.time;
	d->snap_time = s->cur.time;
	d->trans = (s->o.avoid & AVOID_DEV_TRANS) ? 0 : s->cur.trans;
	d->created = true;
	d->nr_mapped = o->nr_mapped;
	memcpy(d->map, o->map, s->o.virt_blocks * sizeof(*d->map));
	for (v = 0; v < s->o.virt_blocks; v++)
		if (d->map[v].data != NO_BLOCK)
			s->cur.refs[d->map[v].data]++;
	return 0;
}

static int op_delete(struct stress *s)
{
	int slot = pick_slot(s, true);
	u64 v;

	if (slot < 0)
		return 0;
	if (s->td[slot] && !rnd(s, 4))
		EXPECT_RC(s, tsp_pool_delete_thin_device(s->pmd, s->ids[slot]),
			  -EBUSY, "delete(%llu) while open",
			  (unsigned long long)s->ids[slot]);
	drop_td(s, slot);
	EXPECT_RC(s, tsp_pool_delete_thin_device(s->pmd, s->ids[slot]), 0,
		  "delete(%llu)", (unsigned long long)s->ids[slot]);
	trace(s, "dev %llu", (unsigned long long)s->ids[slot]);
	for (v = 0; v < s->o.virt_blocks; v++)
		model_unmap(s, slot, v);
	s->cur.devs[slot].exists = false;
	return 0;
}

/* Insert @n blocks from a random start, skipping mapped ones. */
static int op_insert(struct stress *s, bool overwrite, u64 n)
{
	struct tsp_thin_device *td;
	int slot = pick_slot(s, true);
	u64 v, i;
	bool done;
	int r = 0;

	if (slot < 0)
		return op_create_thin(s);
	v = pick_virt(s, slot, overwrite);
	if (v == NO_BLOCK)
		return 0;
	if (get_td(s, slot, &td))
		return -1;
	for (i = 0; i < n && v + i < s->o.virt_blocks; i++) {
		if (!overwrite && s->cur.devs[slot].map[v + i].data != NO_BLOCK)
			continue;
		r = insert_one(s, td, slot, v + i, &done);
		if (r || !done)
			break;
	}
	if (!r)
		r = check_mapped_count(s, td, slot);
	put_td(s, slot, td);
	return r;
}

#define MAX_BATCH 16

/*
 * Map up to MAX_BATCH unmapped blocks, of random devices, in one update;
 * give back some of the blocks allocated for them instead, as the pool
 * does when a new block's data write fails.
 * The model maps each block as it is allocated, so that the next pick
 * and alloc_block()'s check see it.  A device in the batch more than
 * once is opened (get_td) by its first entry only, which also puts it.
 */
static int op_insert_batch(struct stress *s)
{
	struct tsp_new_mapping m[MAX_BATCH];
	unsigned int slots[MAX_BATCH], n, i, j, nr_inserted, nr_mapped;
	bool opened[MAX_BATCH], enospc = false;
	LIST_HEAD(batch);
	int r = 0, slot;
	u64 v, b;

	for (n = 0; n < 1 + rnd(s, MAX_BATCH); n++) {
		slot = pick_slot(s, true);
		if (slot < 0)
			break;
		v = pick_virt(s, slot, false);
		if (v == NO_BLOCK)
			break;
		r = alloc_block(s, &b, &enospc);
		if (r || enospc)
			break;
		m[n].td = NULL;
		for (j = 0; j < n; j++)
			if (slots[j] == (unsigned int)slot)
				m[n].td = m[j].td;
		opened[n] = !m[n].td;
		if (opened[n]) {
			r = get_td(s, slot, &m[n].td);
			if (r)
				break;
		}
		slots[n] = slot;
		m[n].virt = v;
		m[n].data = b;
		list_add_tail(&m[n].list, &batch);
		trace(s, "batch: dev %llu: %llu -> %llu",
		      (unsigned long long)s->ids[slot], (unsigned long long)v,
		      (unsigned long long)b);
		model_map(s, slot, v, b);
	}
	/* alloc_block() aborted the transaction (and reset the model). */
	if (enospc && (s->o.avoid & AVOID_ENOSPC))
		INIT_LIST_HEAD(&batch);

	/*
	 * Some of the blocks' data writes "fail": the pool gives those
	 * blocks back instead of mapping them.
	 */
	nr_mapped = n;
	for (i = 0; !r && !list_empty(&batch) && i < n; i++) {
		if (rnd(s, 8))
			continue;
		list_del(&m[i].list);
		nr_mapped--;
		r = tsp_pool_release_data_block(s->pmd, m[i].data);
		if (r)
			r = diverge(s, "release_data_block(%llu) returned %d",
				    (unsigned long long)m[i].data, r);
		trace(s, "batch: dev %llu: %llu -> %llu failed, released",
		      (unsigned long long)s->ids[slots[i]],
		      (unsigned long long)m[i].virt,
		      (unsigned long long)m[i].data);
		model_unmap(s, slots[i], m[i].virt);
	}

	if (!r && !list_empty(&batch)) {
		r = tsp_pool_insert_mappings(s->pmd, &batch, &nr_inserted);
		if (r || nr_inserted != nr_mapped)
			r = diverge(s, "insert_mappings of %u: %d, %u inserted",
				    nr_mapped, r, nr_inserted);
		for (i = 0; !r && i < n; i++)
			r = check_lookup(s, m[i].td, slots[i], m[i].virt);
		for (i = 0; !r && i < n; i++)
			r = check_mapped_count(s, m[i].td, slots[i]);
	}
	for (i = 0; i < n; i++)
		if (opened[i])
			put_td(s, slots[i], m[i].td);
	return r;
}

static int op_remove(struct stress *s)
{
	struct tsp_thin_device *td;
	int slot = pick_slot(s, true);
	u64 v;
	int r;

	if (slot < 0)
		return 0;
	v = pick_virt(s, slot, true);
	if (v == NO_BLOCK)
		return op_insert(s, false, 1);
	if (get_td(s, slot, &td))
		return -1;
	r = tsp_thin_remove_block(td, v);
	if (r) {
		put_td(s, slot, td);
		EXPECT_RC(s, r, 0, "remove_block(dev %llu, %llu)",
			  (unsigned long long)s->ids[slot],
			  (unsigned long long)v);
	}
	trace(s, "dev %llu: %llu", (unsigned long long)s->ids[slot],
	      (unsigned long long)v);
	model_unmap(s, slot, v);
	r = check_lookup(s, td, slot, v);
	if (!r)
		r = check_mapped_count(s, td, slot);
	put_td(s, slot, td);
	return r;
}

static int op_remove_range(struct stress *s)
{
	struct tsp_thin_device *td;
	int slot = pick_slot(s, true);
	u64 nv = s->o.virt_blocks, b, e, v;
	int r;

	if (slot < 0)
		return 0;
	b = rnd(s, nv);
	e = rnd(s, 4) ? b + 1 + rnd(s, nv / 8) : b + 1 + rnd(s, 2 * nv);
	if (get_td(s, slot, &td))
		return -1;
	r = tsp_thin_remove_range(td, b, e);
	if (r) {
		put_td(s, slot, td);
		EXPECT_RC(s, r, 0, "remove_range(dev %llu, %llu, %llu)",
			  (unsigned long long)s->ids[slot],
			  (unsigned long long)b, (unsigned long long)e);
	}
	trace(s, "dev %llu: [%llu, %llu)", (unsigned long long)s->ids[slot],
	      (unsigned long long)b, (unsigned long long)e);
	for (v = b; v < e && v < nv; v++)
		model_unmap(s, slot, v);
	r = check_mapped_count(s, td, slot);
	if (!r && b < nv)
		r = check_lookup(s, td, slot, b);
	put_td(s, slot, td);
	return r;
}

static int op_lookup(struct stress *s)
{
	struct tsp_thin_device *td;
	int slot = pick_slot(s, true), r;
	u64 v;

	if (slot < 0)
		return 0;
	v = rnd(s, 2) ? pick_virt(s, slot, true) : NO_BLOCK;
	if (v == NO_BLOCK)
		v = rnd(s, s->o.virt_blocks + 16);
	if (get_td(s, slot, &td))
		return -1;
	r = check_lookup(s, td, slot, v);
	put_td(s, slot, td);
	return r;
}

static int op_find_range(struct stress *s)
{
	struct tsp_thin_device *td;
	int slot = pick_slot(s, true), r;
	const struct mdev *d;
	u64 nv = s->o.virt_blocks, b, e, v, end;
	tsp_block_t tb, te, pb;
	bool shared, want_shared;

	if (slot < 0)
		return 0;
	d = &s->cur.devs[slot];
	b = rnd(s, nv);
	e = b + 1 + rnd(s, 64);
	if (get_td(s, slot, &td))
		return -1;
	r = tsp_thin_find_mapped_range(td, b, e, &tb, &te, &pb, &shared);
	put_td(s, slot, td);

	for (v = b; v < e && v < nv && d->map[v].data == NO_BLOCK; v++)
		;
	if (v >= e || v >= nv) {
		if (r != -ENODATA)
			return diverge(s, "find_mapped_range(dev %llu, %llu, %llu) returned %d, expected -ENODATA",
				       (unsigned long long)s->ids[slot],
				       (unsigned long long)b,
				       (unsigned long long)e, r);
		return 0;
	}
	want_shared = model_shared(d, &d->map[v]);
	for (end = v + 1; end < e && end < nv; end++) {
		const struct mentry *m = &d->map[end];

		if (m->data != d->map[v].data + (end - v) ||
		    model_shared(d, m) != want_shared)
			break;
	}
	if (r || tb != v || te != end || pb != d->map[v].data ||
	    shared != want_shared)
		return diverge(s, "find_mapped_range(dev %llu, %llu, %llu) returned %d [%llu, %llu) -> %llu shared %d; model [%llu, %llu) -> %llu shared %d",
			       (unsigned long long)s->ids[slot],
			       (unsigned long long)b, (unsigned long long)e,
			       r, (unsigned long long)(r ? 0 : tb),
			       (unsigned long long)(r ? 0 : te),
			       (unsigned long long)(r ? 0 : pb), r ? 0 : shared,
			       (unsigned long long)v, (unsigned long long)end,
			       (unsigned long long)d->map[v].data, want_shared);
	return 0;
}

static int op_set_trans(struct stress *s)
{
	u64 next = s->cur.trans + 1 + rnd(s, 3);

	EXPECT_RC(s, tsp_pool_set_metadata_transaction_id(s->pmd, s->cur.trans,
							  next), 0,
		  "set_metadata_transaction_id(%llu, %llu)",
		  (unsigned long long)s->cur.trans, (unsigned long long)next);
	trace(s, "%llu -> %llu", (unsigned long long)s->cur.trans,
	      (unsigned long long)next);
	s->cur.trans = next;
	return 0;
}

static int op_resize(struct stress *s)
{
	u64 room = s->o.max_data_blocks - s->cur.nr_data_blocks, n;

	if (!room)
		return 0;
	n = s->cur.nr_data_blocks + 1 + rnd(s, min(room, (u64)4096));
	EXPECT_RC(s, tsp_pool_resize_data_dev(s->pmd, n), 0,
		  "resize_data_dev(%llu)", (unsigned long long)n);
	trace(s, "%llu -> %llu", (unsigned long long)s->cur.nr_data_blocks,
	      (unsigned long long)n);
	s->cur.nr_data_blocks = n;
	return 0;
}

/* Sets the flag and commits; nothing clears it again. */
static int op_needs_check(struct stress *s)
{
	EXPECT_RC(s, tsp_pool_metadata_set_needs_check(s->pmd), 0,
		  "set_needs_check");
	s->cur.flags |= 1;
	return do_commit(s, true);
}

static int op_abort(struct stress *s)
{
	unsigned int slot;

	if (s->o.avoid & AVOID_ABORT_OPEN)
		drop_all_td(s);
	EXPECT_RC(s, tsp_pool_abort_metadata(s->pmd), 0, "abort");
	mstate_copy(&s->cur, &s->committed, &s->o);
	new_transaction(s);
	/* Handles of devices the abort undid go (a target's would too). */
	for (slot = 0; slot < s->o.devices; slot++)
		if (!s->cur.devs[slot].exists)
			drop_td(s, slot);
	return verify(s);
}

/* Reserve and release commit at once: the held root is then durable. */
static int op_reserve(struct stress *s)
{
	if (s->o.avoid & AVOID_HELD)
		return 0;
	if (s->cur.held) {
		EXPECT_RC(s, tsp_pool_reserve_metadata_snap(s->pmd), -EBUSY,
			  "reserve_metadata_snap while one is held");
		return 0;
	}
	EXPECT_RC(s, tsp_pool_reserve_metadata_snap(s->pmd), 0,
		  "reserve_metadata_snap");
	/* It commits first: the snapshot is the state of this moment. */
	mstate_copy(&s->snap, &s->cur, &s->o);
	s->snap.held = false;
	s->cur.held = true;
	return do_commit(s, true);
}

static int op_release(struct stress *s)
{
	if (!s->cur.held) {
		EXPECT_RC(s, tsp_pool_release_metadata_snap(s->pmd), -EINVAL,
			  "release_metadata_snap with none held");
		return 0;
	}
	EXPECT_RC(s, tsp_pool_release_metadata_snap(s->pmd), 0,
		  "release_metadata_snap");
	s->cur.held = false;
	return do_commit(s, true);
}

static int pool_open(struct stress *s, bool format)
{
	int r;

	s->bdev = tsp_bdev_open(s->o.image, false);
	if (!s->bdev)
		return diverge(s, "cannot open %s: %s", s->o.image,
			       strerror(errno));
	r = tsp_pool_metadata_open(s->bdev, s->o.data_block_size,
				   s->cur.nr_data_blocks, format, &s->pmd);
	if (r) {
		s->pmd = NULL;
		return diverge(s, "pool_metadata_open(format=%d) returned %d (%s)",
			       format, r, strerror(-r));
	}
	return 0;
}

static int pool_close(struct stress *s)
{
	unsigned int slot;
	int r = 0;

	for (slot = 0; s->pmd && slot < s->o.devices; slot++) {
		if (s->td[slot] && !rnd(s, 4)) {
			r = tsp_pool_metadata_close(s->pmd);
			if (r != -EBUSY)
				return diverge(s, "pool_metadata_close with device %llu open returned %d, expected -EBUSY",
					       (unsigned long long)s->ids[slot], r);
			break;
		}
	}
	drop_all_td(s);
	r = 0;
	if (s->pmd)
		r = tsp_pool_metadata_close(s->pmd);
	s->pmd = NULL;
	if (s->bdev)
		tsp_bdev_close(s->bdev);
	s->bdev = NULL;
	return r;
}

static int op_reopen(struct stress *s)
{
	/* Close commits. */
	EXPECT_RC(s, pool_close(s), 0, "pool_metadata_close");
	clear_created(s);
	mstate_copy(&s->committed, &s->cur, &s->o);
	new_transaction(s);
	s->nr_commits++;
	if (pool_open(s, false))
		return -1;
	return verify(s);
}

/* Calls that must fail, and must leave the metadata usable. */
static int op_negative(struct stress *s)
{
	int slot = pick_slot(s, true), free_slot = pick_slot(s, false);
	struct tsp_thin_device *td;
	u64 v;
	int r;

	switch (rnd(s, 8)) {
	case 0:
		if (slot < 0 || ((s->o.avoid & AVOID_DUP_ID) &&
				 s->cur.devs[slot].created))
			return 0;
		EXPECT_RC(s, tsp_pool_create_thin(s->pmd, s->ids[slot]),
			  -EEXIST, "create_thin(%llu) of an existing id",
			  (unsigned long long)s->ids[slot]);
		return 0;
	case 1:
		if (slot < 0 || ((s->o.avoid & AVOID_DUP_ID) &&
				 s->cur.devs[slot].created))
			return 0;
		EXPECT_RC(s, tsp_pool_create_snap(s->pmd, s->ids[slot],
						  s->ids[slot]), -EEXIST,
			  "create_snap(%llu) onto an existing id",
			  (unsigned long long)s->ids[slot]);
		return 0;
	case 2:
		if (free_slot < 0)
			return 0;
		EXPECT_RC(s, tsp_pool_delete_thin_device(s->pmd,
							 s->ids[free_slot]),
			  -ENODATA, "delete(%llu) of no device",
			  (unsigned long long)s->ids[free_slot]);
		return 0;
	case 3:
		if (free_slot < 0)
			return 0;
		r = tsp_pool_open_thin_device(s->pmd, s->ids[free_slot], &td);
		if (!r)
			tsp_pool_close_thin_device(td);
		EXPECT_RC(s, r, -ENODATA, "open_thin_device(%llu) of no device",
			  (unsigned long long)s->ids[free_slot]);
		return 0;
	case 4:
		if (slot < 0)
			return 0;
		v = pick_virt(s, slot, false);
		if (v == NO_BLOCK)
			return 0;
		if (get_td(s, slot, &td))
			return -1;
		r = tsp_thin_remove_block(td, v);
		put_td(s, slot, td);
		EXPECT_RC(s, r, -ENODATA, "remove_block(dev %llu, %llu) of an unmapped block",
			  (unsigned long long)s->ids[slot],
			  (unsigned long long)v);
		return 0;
	case 5:
		EXPECT_RC(s, tsp_pool_set_metadata_transaction_id(s->pmd,
				s->cur.trans + 1, s->cur.trans + 2), -EINVAL,
			  "set_metadata_transaction_id with a wrong current id");
		return 0;
	case 6:
		if (s->cur.nr_data_blocks < 2)
			return 0;
		EXPECT_RC(s, tsp_pool_resize_data_dev(s->pmd,
						      s->cur.nr_data_blocks - 1),
			  -EINVAL, "resize_data_dev shrinking");
		return 0;
	default:
		if (free_slot < 0)
			return 0;
		EXPECT_RC(s, tsp_pool_create_snap(s->pmd, s->ids[free_slot],
			  s->ids[free_slot]), -ENODATA,
			  "create_snap(%llu) of a missing origin",
			  (unsigned long long)s->ids[free_slot]);
		return 0;
	}
}

static int do_op(struct stress *s, enum op_kind k)
{
	switch (k) {
	case OP_CREATE_THIN:
		return op_create_thin(s);
	case OP_CREATE_SNAP:
		return op_create_snap(s);
	case OP_DELETE:
		return op_delete(s);
	case OP_INSERT:
		return op_insert(s, false, 1);
	case OP_INSERT_RUN:
		/* now and then a long run: deep trees, long range_mappings */
		return op_insert(s, false, 2 + (rnd(s, 8) ? rnd(s, 31) :
						rnd(s, 512)));
	case OP_INSERT_BATCH:
		return op_insert_batch(s);
	case OP_OVERWRITE:
		return op_insert(s, true, 1 + (rnd(s, 4) ? 0 : rnd(s, 8)));
	case OP_REMOVE:
		return op_remove(s);
	case OP_REMOVE_RANGE:
		return op_remove_range(s);
	case OP_LOOKUP:
		return op_lookup(s);
	case OP_FIND_RANGE:
		return op_find_range(s);
	case OP_SET_TRANS:
		return op_set_trans(s);
	case OP_RESIZE:
		return op_resize(s);
	case OP_COMMIT:
		return do_commit(s, true);
	case OP_ABORT:
		return op_abort(s);
	case OP_RESERVE:
		return op_reserve(s);
	case OP_RELEASE:
		return op_release(s);
	case OP_REOPEN:
		return op_reopen(s);
	case OP_NEGATIVE:
		return op_negative(s);
	case OP_NEEDS_CHECK:
		return op_needs_check(s);
	case NR_OPS:
		break;
	}
	return diverge(s, "bad op %d", k);
}

/*
 * The mix moves through phases of PHASE_OPS ops, so that trees both grow
 * deep (splits, new levels) and shrink again (merges, emptied leaves):
 * fill (inserts x4, removes / 4), churn (as in op_table), drain
 * (inserts / 4, removes x4).
 */
#define PHASE_OPS 3000

static unsigned int op_weight(struct stress *s, unsigned int i)
{
	unsigned int w = op_table[i].weight;
	bool grow = i == OP_INSERT || i == OP_INSERT_RUN;
	bool shrink = i == OP_REMOVE || i == OP_REMOVE_RANGE;

	switch ((s->op / PHASE_OPS) % 3) {
	case 0:
		return grow ? w * 4 : shrink ? w / 4 : w;
	case 2:
		return grow ? w / 4 : shrink ? w * 4 : w;
	default:
		return w;
	}
}

static enum op_kind pick_op(struct stress *s)
{
	unsigned int total = 0, i, x;

	for (i = 0; i < NR_OPS; i++)
		total += op_weight(s, i);
	x = rnd(s, total);
	for (i = 0; i < NR_OPS; i++) {
		if (x < op_weight(s, i))
			return i;
		x -= op_weight(s, i);
	}
	return OP_LOOKUP;
}

/* --- setup and the main loop --------------------------------------- */

static int prepare_image(struct stress *s)
{
	struct stat st;
	int fd;

	if (!stat(s->o.image, &st) && S_ISBLK(st.st_mode)) {
		/* use the device as it is */
	} else {
		fd = open(s->o.image, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
		if (fd < 0) {
			tsm_err("%s: %s", s->o.image, strerror(errno));
			return -1;
		}
		if (ftruncate(fd, 0) ||
		    ftruncate(fd, s->o.metadata_blocks * TSP_METADATA_BLOCK_SIZE)) {
			tsm_err("%s: %s", s->o.image, strerror(errno));
			close(fd);
			return -1;
		}
		close(fd);
	}
	return tsm_image_zero_superblock(s->o.image);
}

static void assign_ids(struct stress *s)
{
	unsigned int i, j;

	for (i = 0; i < s->o.devices; i++) {
		u64 id;

		if (i == 0)
			id = 0;
		else if (i == 1)
			id = TSP_THIN_MAX_DEV_ID;
		else
			id = (i * 2654435761ULL) % TSP_THIN_MAX_DEV_ID;
again:
		for (j = 0; j < i; j++) {
			if (s->ids[j] == id) {
				id = (id + 1) % TSP_THIN_MAX_DEV_ID;
				goto again;
			}
		}
		s->ids[i] = id;
	}
}

static const char *find_tool(const char *env, const char *name,
			     const char *sbin)
{
	const char *p = getenv(env);

	if (p && *p)
		return p;
	if (!access(sbin, X_OK))
		return sbin;
	return name;
}

static void summary(struct stress *s, double secs)
{
	unsigned int i;
	u64 devs = 0, mapped = 0, used = 0, b;

	for (i = 0; i < s->o.devices; i++) {
		if (s->cur.devs[i].exists) {
			devs++;
			mapped += s->cur.devs[i].nr_mapped;
		}
	}
	for (b = 0; b < s->cur.nr_data_blocks; b++)
		used += !!s->cur.refs[b];
	printf("stress: seed %llu: %llu ops in %.1f s: %llu commits, %llu full verifications, %llu external checks, %llu -ENOSPC\n",
	       (unsigned long long)s->o.seed, (unsigned long long)s->op,
	       secs, (unsigned long long)s->nr_commits,
	       (unsigned long long)s->nr_verify,
	       (unsigned long long)s->nr_external,
	       (unsigned long long)s->nr_enospc);
	printf("stress: now %llu devices, %llu mappings, %llu of %llu data blocks in use, time %u\n",
	       (unsigned long long)devs, (unsigned long long)mapped,
	       (unsigned long long)used,
	       (unsigned long long)s->cur.nr_data_blocks, s->cur.time);
	printf("stress: ops:");
	for (i = 0; i < NR_OPS; i++)
		printf(" %s=%llu", op_table[i].name,
		       (unsigned long long)s->counts[i]);
	printf("\n");
}

static void progress(struct stress *s)
{
	unsigned int i;
	u64 devs = 0, mapped = 0;

	for (i = 0; i < s->o.devices; i++) {
		if (s->cur.devs[i].exists) {
			devs++;
			mapped += s->cur.devs[i].nr_mapped;
		}
	}
	printf("stress: op %llu/%llu: %llu commits, %llu external checks, %llu devices, %llu mappings\n",
	       (unsigned long long)s->op, (unsigned long long)s->o.ops,
	       (unsigned long long)s->nr_commits,
	       (unsigned long long)s->nr_external,
	       (unsigned long long)devs, (unsigned long long)mapped);
	fflush(stdout);
}

static int run(struct stress *s)
{
	struct timespec t0, t1;
	int r;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (pool_open(s, true))
		return -1;
	if (verify(s))
		return -1;
	if (s->o.external_every && external_check(s))
		return -1;

	for (s->op = 0; s->op < s->o.ops; s->op++) {
		enum op_kind k = pick_op(s);

		s->op_name = op_table[k].name;
		s->counts[k]++;
		if (k == OP_COMMIT || k == OP_ABORT || k == OP_RESERVE ||
		    k == OP_RELEASE || k == OP_REOPEN)
			trace(s, "%s", "start");
		r = do_op(s, k);
		if (r)
			return r;
		if (s->o.progress_every && s->op &&
		    s->op % s->o.progress_every == 0)
			progress(s);
	}
	s->op_name = "final commit";
	if (do_commit(s, false) || (s->o.external_every && external_check(s)))
		return -1;
	s->op_name = "final close";
	EXPECT_RC(s, pool_close(s), 0, "pool_metadata_close");
	clock_gettime(CLOCK_MONOTONIC, &t1);
	summary(s, (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
	return 0;
}

static int parse_u64_arg(const char *opt, const char *val, u64 lo, u64 hi,
			 u64 *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	if (!val || !*val || *val == '-' ||
	    (v = strtoull(val, &end, 0), errno) || *end || v < lo || v > hi) {
		tsm_err("stress: %s needs a number in %llu..%llu", opt,
			(unsigned long long)lo, (unsigned long long)hi);
		return -1;
	}
	*out = v;
	return 0;
}

/* --avoid NAME[,NAME...] */
static int parse_avoid(struct stress *s, const char *v)
{
	char *list, *tok, *save = NULL;
	unsigned int i;

	if (!v) {
		tsm_err("stress: --avoid needs a value");
		return -1;
	}
	list = strdup(v);
	if (!list)
		return -1;
	for (tok = strtok_r(list, ",", &save); tok;
	     tok = strtok_r(NULL, ",", &save)) {
		for (i = 0; i < ARRAY_SIZE(avoid_names); i++)
			if (!strcmp(tok, avoid_names[i].name))
				break;
		if (i == ARRAY_SIZE(avoid_names)) {
			tsm_err("stress: --avoid: unknown '%s' (dup-id, dev-trans, enospc, held, abort-open)",
				tok);
			free(list);
			return -1;
		}
		s->o.avoid |= avoid_names[i].bit;
	}
	free(list);
	return 0;
}

int tsm_cmd_stress(int argc, char **argv)
{
	struct stress *s;
	u64 devices = 8, every = 1, dbs = 128, virt = 2048, data = 0;
	u64 meta = 4096, prog = 0, seed = 0, ops = 0, maxdata = 0;
	bool have_seed = false, have_ops = false;
	const char *avoid_arg = NULL;
	unsigned int i;
	int rc = 1;

	s = calloc(1, sizeof(*s));
	if (!s) {
		tsm_err("stress: out of memory");
		return 1;
	}
	for (i = 1; i < (unsigned int)argc; i++) {
		const char *a = argv[i], *v = i + 1 < (unsigned int)argc ?
					      argv[i + 1] : NULL;
		int bad = 0;

		if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
			s->o.verbose = true;
			continue;
		}
		if (!strcmp(a, "--avoid")) {
			avoid_arg = v;
			if (parse_avoid(s, v))
				goto out_usage;
			i++;
			continue;
		}
		if (!strcmp(a, "--seed"))
			bad = parse_u64_arg(a, v, 0, UINT64_MAX, &seed), have_seed = true;
		else if (!strcmp(a, "--ops"))
			bad = parse_u64_arg(a, v, 0, UINT64_MAX, &ops), have_ops = true;
		else if (!strcmp(a, "--image"))
			s->o.image = v, bad = !v;
		else if (!strcmp(a, "--devices"))
			bad = parse_u64_arg(a, v, 2, 256, &devices);
		else if (!strcmp(a, "--external-every"))
			bad = parse_u64_arg(a, v, 0, UINT32_MAX, &every);
		else if (!strcmp(a, "--virt-blocks"))
			bad = parse_u64_arg(a, v, 16, 1 << 20, &virt);
		else if (!strcmp(a, "--data-blocks"))
			bad = parse_u64_arg(a, v, 1, 1 << 24, &data);
		else if (!strcmp(a, "--max-data-blocks"))
			bad = parse_u64_arg(a, v, 1, 1 << 24, &maxdata);
		else if (!strcmp(a, "--metadata-blocks"))
			bad = parse_u64_arg(a, v, 64, TSP_TM_MAX_BLOCKS, &meta);
		else if (!strcmp(a, "--data-block-size"))
			bad = parse_u64_arg(a, v, TSP_DATA_BLOCK_SIZE_MIN_SECTORS,
					    TSP_DATA_BLOCK_SIZE_MAX_SECTORS, &dbs);
		else if (!strcmp(a, "--progress"))
			bad = parse_u64_arg(a, v, 0, UINT64_MAX, &prog);
		else {
			tsm_err("stress: unknown option '%s'", a);
			goto out_usage;
		}
		if (bad) {
			if (!v)
				tsm_err("stress: %s needs a value", a);
			goto out_usage;
		}
		i++;
	}
	if (!have_seed || !have_ops || !s->o.image) {
		tsm_err("usage: thin-scalable-meta stress --seed N --ops M --image META.img [--devices K] [--external-every N] [--virt-blocks V] [--data-blocks D] [--max-data-blocks D] [--metadata-blocks B] [--data-block-size S] [--progress N] [--avoid dup-id,dev-trans,enospc,held,abort-open] [-v]");
		goto out_usage;
	}
	if (dbs % TSP_DATA_BLOCK_SIZE_MIN_SECTORS) {
		tsm_err("stress: --data-block-size must be a multiple of %u",
			TSP_DATA_BLOCK_SIZE_MIN_SECTORS);
		goto out_usage;
	}
	if (devices * virt > (1 << 22)) {
		tsm_err("stress: --devices times --virt-blocks is at most %u",
			1 << 22);
		goto out_usage;
	}
	if (!data)
		data = devices * virt / 2;
	if (!maxdata)
		maxdata = 2 * data;
	if (maxdata < data) {
		tsm_err("stress: --max-data-blocks is below --data-blocks");
		goto out_usage;
	}
	s->o.seed = seed;
	s->o.ops = ops;
	s->o.devices = devices;
	s->o.external_every = every;
	s->o.virt_blocks = virt;
	s->o.data_blocks = data;
	s->o.max_data_blocks = maxdata;
	s->o.metadata_blocks = meta;
	s->o.data_block_size = dbs;
	s->o.progress_every = prog ? prog : (ops >= 10 ? ops / 10 : 0);
	s->rng = seed;
	s->thin_check = find_tool("TSP_THIN_CHECK", "thin_check",
				  "/usr/sbin/thin_check");
	s->thin_dump = find_tool("TSP_THIN_DUMP", "thin_dump",
				 "/usr/sbin/thin_dump");

	s->ids = calloc(devices, sizeof(*s->ids));
	s->td = calloc(devices, sizeof(*s->td));
	s->allocated_now = calloc(s->o.max_data_blocks, 1);
	if (!s->ids || !s->td || !s->allocated_now ||
	    mstate_init(&s->cur, &s->o) ||
	    mstate_init(&s->committed, &s->o) ||
	    mstate_init(&s->snap, &s->o)) {
		tsm_err("stress: out of memory");
		goto out;
	}
	assign_ids(s);
	printf("stress: seed %llu, %llu ops, %u device ids, %llu virtual blocks each, %llu data blocks (up to %llu), %llu metadata blocks, external checks every %u commits\n",
	       (unsigned long long)seed, (unsigned long long)ops,
	       s->o.devices, (unsigned long long)virt,
	       (unsigned long long)data, (unsigned long long)maxdata,
	       (unsigned long long)meta, s->o.external_every);
	fflush(stdout);
	if (prepare_image(s))
		goto out;
	if (!run(s))
		rc = 0;
	else
		fprintf(stderr, "stress: reproduce with: thin-scalable-meta stress --seed %llu --ops %llu --image IMG --devices %u --external-every %u --virt-blocks %llu --data-blocks %llu --max-data-blocks %llu --metadata-blocks %llu --data-block-size %u%s%s -v\n",
			(unsigned long long)seed, (unsigned long long)ops,
			s->o.devices, s->o.external_every,
			(unsigned long long)virt, (unsigned long long)data,
			(unsigned long long)maxdata, (unsigned long long)meta,
			s->o.data_block_size, avoid_arg ? " --avoid " : "",
			avoid_arg ? avoid_arg : "");
out:
	if (s->pmd) {
		drop_all_td(s);
		/* Leave the image as last committed, for a post mortem. */
		tsp_pool_metadata_read_only(s->pmd);
		tsp_pool_metadata_close(s->pmd);
	}
	if (s->bdev)
		tsp_bdev_close(s->bdev);
	mstate_free(&s->cur, &s->o);
	mstate_free(&s->committed, &s->o);
	mstate_free(&s->snap, &s->o);
	free(s->ids);
	free(s->td);
	free(s->allocated_now);
	free(s);
	return rc;
out_usage:
	rc = 2;
	goto out;
}
