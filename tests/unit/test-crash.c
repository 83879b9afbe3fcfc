// SPDX-License-Identifier: GPL-2.0-only
/*
 * test-crash.c - crash consistency of the pool metadata: a transaction
 * interrupted at every write or flush boundary reopens as exactly a
 * committed state (the old one or the new one), and passes both our
 * checker and thin_check.
 *
 * How.  A base image is built once (devices, a snapshot, a few thousand
 * mappings) and committed: state A.  A transaction is a fixed sequence
 * of metadata calls ending in a commit; it is first run without a crash
 * on a copy of A, recording the state after every call that commits
 * (states S0 = A, S1, ..., Sn = B; tsp_pool_reserve_metadata_snap()
 * commits twice, so it may add two states; a commit that changes nothing
 * visible adds none).  A "state" is thin_dump's XML
 * of the image, plus thin_dump -m of the held metadata snapshot if there
 * is one.  Then, for every event k (each block write and each flush the
 * transaction issues, as counted by user/bufio.c, in volatile mode so
 * that unflushed writes are not on the file yet) and every crash mode:
 *
 *   restore A; open; crash the device at event k; run the transaction
 *   (everything fails with -EIO after the crash, as it should); close
 *   the metadata without committing (after an abort, in DROP mode);
 *   tsp_bdev_crash_apply(mode); reopen the image fresh
 *
 * and the reopened image must open, pass tsp_pool_check() and thin_check,
 * and be one of S0..Sn; and a new transaction on it (a copy, once per
 * distinct image) must commit and pass tsp_pool_check() again.  Calling
 * the state index found s(mode, k):
 *
 *   - s(DROP, k) never decreases with k, s(DROP, 0) = 0, and with no
 *     crash (k = E, the transaction's event count) it is n;
 *   - s(KEEP, k) = s(DROP, k + 1): keeping the writes before event k is
 *     the same as flushing them, because each commit's superblock write
 *     is immediately followed by its flush, and nothing is visible before
 *     the superblock is;
 *   - s(TEAR, k) = s(KEEP, k), except when event k is a superblock write
 *     (s(KEEP, k + 1) = s(KEEP, k) + 1), where the torn superblock may
 *     read as either (a real disk writes 512 bytes atomically and the
 *     superblock fits in them; here the tear keeps the first half);
 *   - so the new state of a commit shows only when its superblock write
 *     was issued before the crash, and is durable only once the flush
 *     after it completed (checked at the last commit: s(DROP, E - 1) =
 *     n - 1, s(KEEP, E - 2) = n - 1, s(KEEP, E - 1) = n).
 *
 * Each case runs in a child (a crash or sanitizer report fails that case
 * and the sweep goes on) which also checks that the library's allocation
 * counters come back to where they were, after the crashed session and
 * after the reopened one.  thin_check and thin_dump run in the parent,
 * once per distinct image (most crash points leave identical files).
 *
 * The block manager's cache is kept at its minimum (TSP_BUFIO_BUFFERS),
 * so the transactions, which dirty more blocks than it holds, also have
 * dirty blocks written back before their commit.
 *
 * Environment: TSP_CRASH_STRIDE=n tries every n-th event only (default
 * 1: all of them); TSP_KEEP_SCRATCH=1 keeps the images.
 */
#define DM_MSG_PREFIX "test-crash"
#include "tests/unit/helpers.h"

#define META_BLOCKS 1024		/* 4 MiB of metadata when formatted */
#define GROWN_BLOCKS 1536		/* the device, grown after the base */
#define NR_DATA 20000			/* two data space map bitmaps */
#define CASE_TIMEOUT 60

enum { MODE_DROP, MODE_KEEP, MODE_TEAR, NR_MODES };

static const enum tsp_crash_mode crash_modes[NR_MODES] = {
	TSP_CRASH_DROP_VOLATILE, TSP_CRASH_KEEP_VOLATILE, TSP_CRASH_TEAR_LAST,
};
static const char *const mode_names[NR_MODES] = { "drop", "keep", "tear" };

static char base_path[300], work_path[300], log_path[300], tool_log[300];
static char reuse_path[300];
static u8 *base_img;
static size_t base_len;

/* ------------------------------------------------------------------ */
/* The transactions                                                    */
/* ------------------------------------------------------------------ */

/*
 * A transaction runs against @pmd and calls @committed (if set) after
 * every call that commits; @reserve says the call was
 * tsp_pool_reserve_metadata_snap(), which commits twice.  It returns the
 * first error, closing every thin device it opened.
 */
struct txn {
	const char *name;
	int (*run)(struct tsp_pool_metadata *pmd,
		   void (*committed)(bool reserve));
};

/* Overwrite @n mappings of @dev, @first, @first + @step, ...: remaps. */
static int remap_blocks(struct tsp_pool_metadata *pmd, tsp_thin_id dev,
			tsp_block_t first, tsp_block_t step, unsigned int n)
{
	return map_blocks(pmd, dev, first, step, n);
}

/*
 * Steps: each runs unless an earlier one failed, and counts itself in
 * txn_step, so a failure can be placed (and the clean run learns which
 * step is the first commit).
 */
static int txn_step;

#define STEP(call)					\
	do {						\
		if (!r) {				\
			txn_step++;			\
			r = (call);			\
		}					\
	} while (0)

#define COMMITTED(reserve)				\
	do {						\
		if (!r && committed)			\
			committed(reserve);		\
	} while (0)

/*
 * Transaction A: one commit.  Touches every leaf of device 1 (shared with
 * its snapshot 3, so they are all copied), removes a range, snapshots,
 * creates a device, deletes the old snapshot, bumps the transaction id.
 * It dirties more blocks than the block manager caches (64, with
 * TSP_BUFIO_BUFFERS=16), so dirty blocks are also written back before
 * the commit.
 */
static int txn_a(struct tsp_pool_metadata *pmd, void (*committed)(bool))
{
	int r = 0;

	STEP(remap_blocks(pmd, 1, 5, 20, 400));
	STEP(unmap_range(pmd, 2, 200, 700));
	STEP(tsp_pool_create_snap(pmd, 4, 2));
	STEP(map_blocks(pmd, 4, 4000, 1, 60));
	STEP(remap_blocks(pmd, 4, 0, 9, 40));
	STEP(tsp_pool_create_thin(pmd, 5));
	STEP(map_blocks(pmd, 5, 100, 2, 300));
	STEP(tsp_pool_delete_thin_device(pmd, 3));
	STEP(tsp_pool_set_metadata_transaction_id(pmd, 1, 2));
	STEP(tsp_pool_commit_metadata(pmd));
	COMMITTED(false);
	return r;
}

/*
 * Transaction B: several commits, through a metadata snapshot: changes,
 * reserve (commit, commit), a snapshot and changes under the held root,
 * commit, release, delete a device, commit.
 */
static int txn_b(struct tsp_pool_metadata *pmd, void (*committed)(bool))
{
	int r = 0;

	STEP(map_blocks(pmd, 2, 10000, 3, 100));
	STEP(tsp_pool_reserve_metadata_snap(pmd));
	COMMITTED(true);
	STEP(tsp_pool_create_snap(pmd, 6, 1));
	STEP(remap_blocks(pmd, 1, 1, 30, 100));
	STEP(unmap_range(pmd, 6, 0, 400));
	STEP(tsp_pool_commit_metadata(pmd));
	COMMITTED(false);
	STEP(tsp_pool_release_metadata_snap(pmd));
	STEP(tsp_pool_delete_thin_device(pmd, 2));
	STEP(tsp_pool_set_metadata_transaction_id(pmd, 1, 3));
	STEP(tsp_pool_commit_metadata(pmd));
	COMMITTED(false);
	return r;
}

/*
 * Transaction C: the first change after a reserve remaps blocks of an
 * existing device (its mapping tree is shared with the held root only
 * through the top-level tree), then commit and release.
 */
static int txn_c(struct tsp_pool_metadata *pmd, void (*committed)(bool))
{
	int r = 0;

	STEP(tsp_pool_reserve_metadata_snap(pmd));
	COMMITTED(true);
	STEP(remap_blocks(pmd, 2, 0, 3, 200));
	STEP(tsp_pool_commit_metadata(pmd));
	COMMITTED(false);
	STEP(tsp_pool_release_metadata_snap(pmd));
	STEP(tsp_pool_commit_metadata(pmd));
	COMMITTED(false);
	return r;
}

/*
 * Transaction D: grow the data space map by two bitmaps and the metadata
 * space map to the grown device, and use the new space.
 */
static int txn_d(struct tsp_pool_metadata *pmd, void (*committed)(bool))
{
	int r = 0;

	STEP(tsp_pool_resize_data_dev(pmd, 2 * NR_DATA));
	STEP(tsp_pool_resize_metadata_dev(pmd, GROWN_BLOCKS));
	STEP(tsp_pool_create_snap(pmd, 7, 2));
	STEP(remap_blocks(pmd, 7, 0, 3, 300));
	STEP(map_blocks(pmd, 1, 100000, 1, 300));
	STEP(tsp_pool_commit_metadata(pmd));
	COMMITTED(false);
	return r;
}

static const struct txn txns[] = {
	{ "one commit: remaps of shared leaves, snapshot, delete, create", txn_a },
	{ "four commits: reserve, changes under a held root, release", txn_b },
	{ "reserve, then remap an existing device first, release", txn_c },
	{ "grow the data and metadata space maps, use them", txn_d },
};

/* ------------------------------------------------------------------ */
/* States                                                              */
/* ------------------------------------------------------------------ */

/* The held root recorded in an image's superblock, 0 if unreadable. */
static u64 image_held_root(const char *path)
{
	u8 sb[MD_BLOCK];
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0)
		return 0;
	n = pread(fd, sb, sizeof(sb), 0);
	close(fd);
	return n == (ssize_t)sizeof(sb) ? get_le64(sb, SB_HELD_ROOT) : 0;
}

/*
 * The state key of an image: thin_dump, then thin_dump -m of the held
 * snapshot or "no metadata snapshot".  NULL if a dump fails.
 */
static char *state_key(const char *path)
{
	u64 held = image_held_root(path);
	char *dump, *snap = NULL, *key;

	dump = thin_dump(path);
	if (!dump)
		return NULL;
	if (held) {
		snap = thin_dump_snap(path, held);
		if (!snap) {
			free(dump);
			return NULL;
		}
	}
	if (asprintf(&key, "%s--- metadata snapshot ---\n%s", dump,
		     snap ? snap : "none\n") < 0)
		key = NULL;
	free(dump);
	free(snap);
	return key;
}

#define MAX_STATES 8

static char *states[MAX_STATES];
static int nr_states;
static int first_commit_step;	/* of the clean run */

/* Record a state, unless it is the same as the last one. */
static void add_state(char *key)
{
	if (nr_states && key && !strcmp(states[nr_states - 1], key)) {
		free(key);
		return;
	}
	if (nr_states == MAX_STATES || !key) {
		fail("cannot record state %d", nr_states);
		free(key);
		return;
	}
	states[nr_states++] = key;
}

static void free_states(void)
{
	while (nr_states)
		free(states[--nr_states]);
}

static int find_state(const char *key)
{
	int i;

	for (i = 0; key && i < nr_states; i++)
		if (!strcmp(states[i], key))
			return i;
	return -1;
}

/* tsp_pool_check() and thin_check on the image in @path; 0 if both pass. */
static int check_image(const char *path)
{
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev = tsp_bdev_open(path, true);
	int r;

	if (!bdev)
		return -errno;
	r = tsp_pool_metadata_open(bdev, 128, 0, false, &pmd);
	if (!r) {
		r = tsp_pool_check(pmd);
		if (tsp_pool_metadata_close(pmd) && !r)
			r = -EIO;
	}
	tsp_bdev_close(bdev);
	if (!r && thin_check(path, tool_log))
		r = -EUCLEAN;
	return r;
}

/*
 * The clean run's callback: the image in work_path is now committed.
 * Check it (from a second, read-only open) and record its state.
 */
static void record_state(bool reserve)
{
	char *key = state_key(work_path);
	int r = check_image(work_path);

	if (!first_commit_step)
		first_commit_step = txn_step;
	if (r)
		fail("state %d of the clean run fails %s: %d", nr_states,
		     r == -EUCLEAN ? "thin_check" : "tsp_pool_check()", r);
	if (reserve && key) {
		/*
		 * The reserve's first commit: what was pending, no held
		 * root yet.  Same dump, no snapshot.
		 */
		char *dump = strdup(key), *cut = strstr(dump, "--- metadata snapshot ---\n");

		if (cut)
			strcpy(cut, "--- metadata snapshot ---\nnone\n");
		add_state(dump);
	}
	add_state(key);
}

/*
 * The recovered pool must be usable, not only consistent: on a copy of
 * the image, create a device, map blocks (reusing data and metadata
 * blocks the crashed transaction had taken), remap shared ones, commit,
 * then reopen and check.  Run once per distinct image (a new
 * transaction only reads blocks in use, and overwrites the others).
 */
struct reuse_res {
	int r;			/* the new transaction */
	int check_r;		/* tsp_pool_check() after it */
	bool leaked;
};

static void reuse_case(void *argp, void *resp)
{
	struct reuse_res *res = resp;
	struct live_counts live = live_now();
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	size_t len;
	void *img = read_file(work_path, &len);
	int r;

	memset(res, 0, sizeof(*res));
	r = img ? write_file(reuse_path, img, len) : -EIO;
	free(img);
	if (!r)
		r = pool_open(reuse_path, 0, false, &bdev, &pmd);
	if (r) {
		res->r = r;
		return;
	}
	r = tsp_pool_create_thin(pmd, 60);
	if (!r)
		r = map_blocks(pmd, 60, 0, 5, 200);
	if (!r)
		r = map_blocks(pmd, 1, 2, 25, 100);
	if (!r)
		r = tsp_pool_commit_metadata(pmd);
	if (pool_close(bdev, pmd) && !r)
		r = -EIO;
	res->r = r;
	if (!r) {
		res->check_r = pool_open(reuse_path, 0, false, &bdev, &pmd);
		if (!res->check_r) {
			res->check_r = tsp_pool_check(pmd);
			if (pool_close(bdev, pmd) && !res->check_r)
				res->check_r = -EIO;
		}
	}
	res->leaked = !live_same(live, live_now());
}

/* Verdicts on images, by content hash: thin_check and the state found. */
struct image_verdict {
	u64 hash;
	int thin_check;
	int state;
	char reuse[160];	/* what went wrong using it, "" if nothing */
};

#define VERDICT_CACHE 4096

static struct image_verdict verdicts[VERDICT_CACHE];
static int nr_verdicts, tool_runs;

static u8 *readback;
static size_t readback_cap;

static struct image_verdict *judge_image(const char *path)
{
	ssize_t len = reread_file(path, &readback, &readback_cap);
	struct image_verdict *v;
	char *key;
	u64 h;
	int i;

	/* Images that differ only in blocks nobody references are alike. */
	h = len >= 0 ? img_content_hash(readback, len) : 0;
	for (i = 0; i < nr_verdicts; i++)
		if (verdicts[i].hash == h)
			return &verdicts[i];

	v = &verdicts[nr_verdicts < VERDICT_CACHE ? nr_verdicts++ : 0];
	v->hash = h;
	v->thin_check = thin_check(path, tool_log);
	key = state_key(path);
	v->state = find_state(key);
	free(key);
	tool_runs++;

	v->reuse[0] = '\0';
	if (!v->thin_check && v->state >= 0) {
		struct reuse_res res;
		char how[128];

		if (run_child(reuse_case, NULL, &res, sizeof(res), CASE_TIMEOUT,
			      log_path, how, sizeof(how)))
			snprintf(v->reuse, sizeof(v->reuse), "the case %s", how);
		else if (res.leaked)
			snprintf(v->reuse, sizeof(v->reuse), "allocations leaked");
		else if (res.r)
			snprintf(v->reuse, sizeof(v->reuse), "it fails: %d", res.r);
		else if (res.check_r)
			snprintf(v->reuse, sizeof(v->reuse),
				 "tsp_pool_check() fails after it: %d", res.check_r);
	}
	return v;
}

/* ------------------------------------------------------------------ */
/* The base image and the clean run                                    */
/* ------------------------------------------------------------------ */

static int build_base(void)
{
	struct live_counts live = live_now();
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	int r;

	r = make_zero_file(base_path, (u64)META_BLOCKS * MD_BLOCK);
	if (!r)
		r = pool_open(base_path, NR_DATA, true, &bdev, &pmd);
	if (r)
		return r;
	r = tsp_pool_create_thin(pmd, 1);
	if (!r)
		r = tsp_pool_create_thin(pmd, 2);
	if (!r)
		r = map_blocks(pmd, 1, 0, 1, 8000);
	if (!r)
		r = map_blocks(pmd, 2, 0, 3, 1500);
	if (!r)
		r = tsp_pool_set_metadata_transaction_id(pmd, 0, 1);
	if (!r)
		r = tsp_pool_create_snap(pmd, 3, 1);
	if (!r)
		r = remap_blocks(pmd, 3, 0, 7, 100);
	if (!r)
		r = tsp_pool_commit_metadata(pmd);
	if (pool_close(bdev, pmd) && !r)
		r = -EIO;
	if (!r && !live_same(live, live_now()))
		r = -ENOTRECOVERABLE;
	/* The device grows (an lvextend); the metadata does not, yet. */
	if (!r && truncate(base_path, (off_t)GROWN_BLOCKS * MD_BLOCK))
		r = -errno;
	if (!r) {
		base_img = read_file(base_path, &base_len);
		r = base_img ? 0 : -EIO;
	}
	return r;
}

/* Run @t cleanly on a copy of the base, recording its states. */
static int clean_run(const struct txn *t)
{
	struct live_counts live = live_now();
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	int r;

	free_states();
	first_commit_step = 0;
	txn_step = 0;
	r = write_file(work_path, base_img, base_len);
	if (r)
		return r;
	add_state(state_key(work_path));
	r = pool_open(work_path, 0, false, &bdev, &pmd);
	if (r)
		return r;
	r = t->run(pmd, record_state);
	if (pool_close(bdev, pmd) && !r)
		r = -EIO;
	if (!r && !live_same(live, live_now()))
		r = -ENOTRECOVERABLE;
	if (!r && thin_check(work_path, tool_log))
		r = -EILSEQ;
	return r;
}

/* ------------------------------------------------------------------ */
/* One crash case (in a child)                                         */
/* ------------------------------------------------------------------ */

struct crash_arg {
	const struct txn *t;
	u64 k;			/* crash at this event of the transaction */
	int mode;
};

struct crash_res {
	int open_r;		/* opening the base */
	int txn_r;		/* the transaction */
	int txn_step;		/* the step it failed in */
	int abort_r;		/* tsp_pool_abort_metadata(), DROP mode only */
	int close_r;		/* closing after the crash */
	int apply_r;		/* tsp_bdev_crash_apply() */
	int reopen_r;		/* opening what the crash left */
	int check_r;		/* tsp_pool_check() on it */
	int reclose_r;
	bool crashed;
	u64 events;		/* events the transaction issued */
	bool leak_crashed;	/* allocations left by the crashed session */
	bool leak_reopened;	/* ... by the reopened one */
};

static void crash_case(void *argp, void *resp)
{
	struct crash_arg *a = argp;
	struct crash_res *res = resp;
	struct live_counts live = live_now();
	struct tsp_pool_metadata *pmd;
	struct block_device *bdev;
	u64 e0;

	memset(res, 0, sizeof(*res));
	bdev = tsp_bdev_open(work_path, false);
	if (!bdev) {
		res->open_r = -errno;
		return;
	}
	res->open_r = tsp_pool_metadata_open(bdev, 128, 0, false, &pmd);
	if (res->open_r) {
		tsp_bdev_close(bdev);
		return;
	}
	tsp_bdev_set_volatile(bdev, true);
	e0 = tsp_bdev_events(bdev);
	tsp_bdev_crash_at(bdev, e0 + a->k);

	txn_step = 0;
	res->txn_r = a->t->run(pmd, NULL);
	res->txn_step = txn_step;
	res->events = tsp_bdev_events(bdev) - e0;
	res->crashed = tsp_bdev_crashed(bdev);

	/* What a pool does after a failed update: abort, then shut down. */
	if (res->txn_r && a->mode == MODE_DROP)
		res->abort_r = tsp_pool_abort_metadata(pmd);
	res->close_r = tsp_pool_metadata_close(pmd);
	res->apply_r = tsp_bdev_crash_apply(bdev, crash_modes[a->mode]);
	tsp_bdev_close(bdev);
	res->leak_crashed = !live_same(live, live_now());

	bdev = tsp_bdev_open(work_path, false);
	if (!bdev) {
		res->reopen_r = -errno;
		return;
	}
	res->reopen_r = tsp_pool_metadata_open(bdev, 128, 0, false, &pmd);
	if (!res->reopen_r) {
		res->check_r = tsp_pool_check(pmd);
		res->reclose_r = tsp_pool_metadata_close(pmd);
	}
	tsp_bdev_close(bdev);
	res->leak_reopened = !live_same(live, live_now());
}

/*
 * Run one case; returns the state index found, or -1 (after reporting a
 * failure).  @nr_events is the transaction's event count, ~0 while it is
 * not known yet; @events_out gets the count of this run.
 */
static int run_crash_case(const struct txn *t, u64 k, int mode, u64 nr_events,
			  u64 *events_out, int *step_out)
{
	struct crash_arg a = { .t = t, .k = k, .mode = mode };
	struct image_verdict *v;
	struct crash_res res;
	bool crash = nr_events != ~0ull && k < nr_events;
	char how[128], what[96];
	int r, f0 = failures;

	snprintf(what, sizeof(what), "crash at event %llu, %s",
		 (unsigned long long)k, mode_names[mode]);
	if (write_file(work_path, base_img, base_len)) {
		fail("%s: cannot restore the base image", what);
		return -1;
	}
	r = run_child(crash_case, &a, &res, sizeof(res), CASE_TIMEOUT,
		      log_path, how, sizeof(how));
	if (r) {
		fail("%s: the case %s", what, how);
		show_log_tail(log_path, 30);
		return -1;
	}
	if (events_out)
		*events_out = res.events;
	if (step_out)
		*step_out = res.txn_step;

	if (res.open_r)
		fail("%s: opening the base image failed: %d", what, res.open_r);
	if (crash && !res.crashed)
		fail("%s: the device did not crash (%llu events)", what,
		     (unsigned long long)res.events);
	if (crash && !res.txn_r)
		fail("%s: the transaction succeeded through a crash", what);
	if (!crash && (res.crashed || res.txn_r || res.close_r))
		fail("%s: no crash expected, got transaction %d close %d",
		     what, res.txn_r, res.close_r);
	if (!crash && nr_events != ~0ull && res.events != nr_events)
		fail("%s: %llu events, the first run had %llu (not deterministic)",
		     what, (unsigned long long)res.events,
		     (unsigned long long)nr_events);
	if (res.apply_r)
		fail("%s: tsp_bdev_crash_apply() = %d", what, res.apply_r);
	if (res.leak_crashed)
		fail("%s: the crashed session leaked allocations", what);
	if (res.leak_reopened)
		fail("%s: the reopened session leaked allocations", what);
	if (res.reopen_r)
		fail("%s: the image does not reopen: %d", what, res.reopen_r);
	else if (res.check_r)
		fail("%s: tsp_pool_check() = %d", what, res.check_r);
	else if (res.reclose_r)
		fail("%s: closing the reopened image = %d", what, res.reclose_r);
	if (failures != f0) {
		show_log_tail(log_path, 20);
		return -1;
	}

	v = judge_image(work_path);
	if (v->thin_check) {
		fail("%s: thin_check fails (%d)", what, v->thin_check);
		show_log_tail(tool_log, 10);
	}
	if (v->state < 0)
		fail("%s: the image is none of the %d committed states", what,
		     nr_states);
	if (v->reuse[0]) {
		fail("%s: a new transaction on the recovered pool: %s", what,
		     v->reuse);
		show_log_tail(log_path, 20);
	}
	return failures == f0 ? v->state : -1;
}

/* ------------------------------------------------------------------ */
/* The sweep                                                           */
/* ------------------------------------------------------------------ */

static void sweep(const struct txn *t)
{
	int f0 = failures, mode, last = -1, r, first_io_step = 0;
	u64 nr_events = ~0ull, k, stride = 1, nr_cases = 0;
	int *s[NR_MODES];
	const char *env = getenv("TSP_CRASH_STRIDE");

	if (env && strtoull(env, NULL, 0) > 0)
		stride = strtoull(env, NULL, 0);

	alarm(120);
	r = clean_run(t);
	alarm(0);
	if (r || nr_states < 2) {
		fail("the clean run of the transaction failed: %d (%d states)",
		     r, nr_states);
		report(f0, "crash: %s", t->name);
		return;
	}

	/* Count the events: a case whose crash point is never reached. */
	r = run_crash_case(t, ~0ull >> 1, MODE_KEEP, ~0ull, &nr_events, NULL);
	if (r != nr_states - 1) {
		fail("without a crash the transaction does not reach its last state (%d)",
		     r);
		report(f0, "crash: %s", t->name);
		return;
	}

	for (mode = 0; mode < NR_MODES; mode++) {
		s[mode] = calloc(nr_events + 2, sizeof(int));
		if (!s[mode])
			abort();
		for (k = 0; k <= nr_events + 1; k++)
			s[mode][k] = -2;	/* not tried */
	}

	/*
	 * Every event (or every stride-th, always with the last few: the
	 * final superblock write and flush), in every mode.
	 */
	for (k = 0; k <= nr_events; k++) {
		if (k % stride && k + 3 < nr_events)
			continue;
		for (mode = 0; mode < NR_MODES; mode++) {
			s[mode][k] = run_crash_case(t, k, mode, nr_events, NULL,
						    k ? NULL : &first_io_step);
			nr_cases++;
		}
		if (failures - f0 > 20) {
			fail("too many failures, giving up on this transaction");
			break;
		}
	}

	/* The ordering rules (see the top of the file). */
	for (k = 0; k <= nr_events; k++) {
		int d = s[MODE_DROP][k], kp = s[MODE_KEEP][k], tr = s[MODE_TEAR][k];
		int d1 = k < nr_events ? s[MODE_DROP][k + 1] : nr_states - 1;
		int kp1 = k < nr_events ? s[MODE_KEEP][k + 1] : nr_states - 1;

		if (d < 0)
			continue;
		if (d < last)
			fail("drop at %llu: state %d after state %d earlier",
			     (unsigned long long)k, d, last);
		last = d;
		if (kp >= 0 && d1 >= 0 && kp != d1)
			fail("keep at %llu: state %d, but drop at %llu gives %d",
			     (unsigned long long)k, kp, (unsigned long long)k + 1,
			     d1);
		if (kp >= 0 && kp != d && kp != d + 1)
			fail("keep at %llu: state %d, drop gives %d",
			     (unsigned long long)k, kp, d);
		/* Unless event k + 1 was not tried: then either will do. */
		if (tr >= 0 && kp >= 0 && tr != kp &&
		    !((kp1 == kp + 1 || kp1 == -2) && tr == kp + 1))
			fail("tear at %llu: state %d, keep gives %d",
			     (unsigned long long)k, tr, kp);
	}
	if (s[MODE_DROP][0] >= 0 && s[MODE_DROP][0] != 0)
		fail("a crash at the first event leaves state %d, not the old one",
		     s[MODE_DROP][0]);
	if (s[MODE_DROP][nr_events] != nr_states - 1)
		fail("no crash leaves state %d, not the last", s[MODE_DROP][nr_events]);
	if (nr_events >= 2) {
		if (s[MODE_DROP][nr_events - 1] != nr_states - 2)
			fail("a crash at the last flush leaves state %d: durable before its flush?",
			     s[MODE_DROP][nr_events - 1]);
		if (s[MODE_KEEP][nr_events - 2] != nr_states - 2)
			fail("a crash at the last superblock write (kept) leaves state %d",
			     s[MODE_KEEP][nr_events - 2]);
		if (s[MODE_KEEP][nr_events - 1] != nr_states - 1)
			fail("a crash at the last flush (writes kept) leaves state %d",
			     s[MODE_KEEP][nr_events - 1]);
	}
	/* Every committed state shows up somewhere in drop mode. */
	for (r = 0; r < nr_states; r++) {
		bool seen = false;

		for (k = 0; k <= nr_events; k++)
			seen |= s[MODE_DROP][k] == r;
		if (!seen && stride == 1)
			fail("state %d never seen in drop mode", r);
	}

	for (mode = 0; mode < NR_MODES; mode++)
		free(s[mode]);
	report(f0, "crash: %s (%llu events, the first in step %d, the first "
	       "commit is step %d; %llu cases, %d states)",
	       t->name, (unsigned long long)nr_events, first_io_step,
	       first_commit_step, (unsigned long long)nr_cases, nr_states);
}

int main(void)
{
	double t0 = now_seconds();
	unsigned int i;
	int f0, r;

	setvbuf(stdout, NULL, _IOLBF, 0);
	last_report = t0;
	setenv("TSP_BUFIO_NOSYNC", "1", 1);
	setenv("TSP_QUIET", "1", 1);
	/* The smallest cache: dirty blocks get written back mid-transaction. */
	setenv("TSP_BUFIO_BUFFERS", "16", 1);
	if (!have_tools()) {
		printf("SKIP: thin_check (thin-provisioning-tools) is not installed\n");
		return 77;
	}
	if (make_scratch("crash")) {
		perror("mkdtemp");
		return 1;
	}
	scratch_path(base_path, sizeof(base_path), "base.img");
	scratch_path(work_path, sizeof(work_path), "work.img");
	scratch_path(reuse_path, sizeof(reuse_path), "reuse.img");
	scratch_path(log_path, sizeof(log_path), "case.log");
	scratch_path(tool_log, sizeof(tool_log), "tool.log");

	/* The in-process phases (base, clean runs) must not hang either. */
	alarm(300);
	f0 = failures;
	r = build_base();
	if (r)
		fail("building the base image: %d", r);
	else if (thin_check(base_path, tool_log))
		fail("thin_check rejects the base image");
	alarm(0);
	report(f0, "crash: base image (%u metadata blocks on a %u block device, "
	       "%u data blocks)", META_BLOCKS, GROWN_BLOCKS, NR_DATA);

	for (i = 0; !r && i < ARRAY_SIZE(txns); i++)
		sweep(&txns[i]);

	free_states();
	free(base_img);
	free(readback);
	rm_scratch();
	printf("%s: %d failure%s, %d thin_check/thin_dump image verdicts, %.1fs\n",
	       failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s",
	       tool_runs, now_seconds() - t0);
	return failures ? 1 : 0;
}
