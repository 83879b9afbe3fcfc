// SPDX-License-Identifier: GPL-2.0-only
/*
 * btree.c - copy-on-write B+ trees in dm-thin's node format.
 *
 * Node layout (little-endian): a 32-byte header {csum, flags, blocknr,
 * nr_entries, max_entries, value_size, padding}, then max_entries keys,
 * then max_entries values.  Internal nodes hold child block numbers as
 * 8-byte values, leaves the tree's values.  max_entries is a multiple of
 * three and every node but the root is kept at least a third full, as
 * thin_check demands.
 *
 * Updates shadow every node on the path from the root (the transaction
 * manager copies a node the committed metadata can still see, and writes
 * a node already copied in this transaction in place).  Insert makes room
 * in a full node before descending into it, so it never has to go back
 * up; remove merges or rebalances an underfull child with a sibling on
 * the way back up.
 *
 * Density: a full child first hands entries to a sibling with room (the
 * left one, else the right one) and is split only when neither has
 * room.  The two usually end up evenly filled; but when the insert goes
 * past the child's last key (keys inserted in ascending order) the left
 * sibling is filled completely, and when it goes before the child's first
 * key (descending order) the right one is.  So a sequentially written
 * device packs its leaves full, where splitting alone would leave every
 * leaf half empty, and random inserts fill nodes further too.  A sibling
 * that is shared with another tree is left alone: copying it would cost
 * a block, as a split does.
 *
 * Reference counting: a node referenced by several parents (after a
 * snapshot) has a reference count above one.  Shadowing such a node gives
 * a private copy, and everything the copy points to gains a reference:
 * children for an internal node, values (through the value type) for a
 * leaf.  Deleting a reference to a node that drops it to zero deletes the
 * node's own references in turn.
 *
 * Batches: a cursor (tsp_btree_insert_at()) keeps the leaf of its last
 * insert write locked, with the range of keys the walk down routed to
 * it; a later insert into that tree of a key in the range goes straight
 * into the leaf while it has room.  Inserts of nearby keys, such as a
 * batch of new mappings, walk down from the root once per leaf.  Parked
 * between updates, a cursor keeps only the leaf's place, and locks it
 * again (in place) for the next insert into its range.
 *
 * Locking: none; the caller serialises all access to a transaction.
 * Every function may sleep.
 */
#define DM_MSG_PREFIX "thin-scalable metadata"

#include "btree.h"

#define BTREE_CSUM_XOR 121107
#define INTERNAL_NODE 1
#define LEAF_NODE 2
/* Deeper than any tree that fits a metadata device: a cycle. */
#define MAX_DEPTH 16

struct node_header {
	__le32 csum;
	__le32 flags;
	__le64 blocknr;
	__le32 nr_entries;
	__le32 max_entries;
	__le32 value_size;
	__le32 padding;
} __packed;

struct btree_node {
	struct node_header header;
	__le64 keys[];
} __packed;

static u32 nr_entries(struct btree_node *n)
{
	return le32_to_cpu(n->header.nr_entries);
}

static void set_nr_entries(struct btree_node *n, u32 nr)
{
	n->header.nr_entries = cpu_to_le32(nr);
}

static u32 max_entries(struct btree_node *n)
{
	return le32_to_cpu(n->header.max_entries);
}

static bool node_full(struct btree_node *n)
{
	return nr_entries(n) >= max_entries(n);
}

/*
 * An insert found node @b full where the tree's shape promises room:
 * its keys are out of order, which no node check on reading sees.
 */
static int full_node_error(struct tsp_block *b)
{
	DMERR("btree node %llu is full where it should have room: keys out of order",
	      (unsigned long long)tsp_block_location(b));
	return -EILSEQ;
}

static u32 value_size(struct btree_node *n)
{
	return le32_to_cpu(n->header.value_size);
}

static bool is_leaf(struct btree_node *n)
{
	return le32_to_cpu(n->header.flags) & LEAF_NODE;
}

static u64 key_at(struct btree_node *n, u32 i)
{
	return le64_to_cpu(n->keys[i]);
}

static void *value_at(struct btree_node *n, u32 i)
{
	return (char *)&n->keys[max_entries(n)] + (size_t)i * value_size(n);
}

static tsp_block_t child_at(struct btree_node *n, u32 i)
{
	__le64 v;

	memcpy(&v, value_at(n, i), sizeof(v));
	return le64_to_cpu(v);
}

static void set_child(struct btree_node *n, u32 i, tsp_block_t b)
{
	__le64 v = cpu_to_le64(b);

	memcpy(value_at(n, i), &v, sizeof(v));
}

static struct btree_node *node_of(struct tsp_block *b)
{
	return tsp_block_data(b);
}

/* Entries per node for a value size: the most that fit, rounded to 3. */
static u32 calc_max_entries(size_t vsize)
{
	size_t fit = (TSP_METADATA_BLOCK_SIZE - sizeof(struct node_header)) /
		     (sizeof(__le64) + vsize);

	return (u32)(fit / 3) * 3;
}

static void node_init(struct btree_node *n, bool leaf, u32 vsize)
{
	n->header.flags = cpu_to_le32(leaf ? LEAF_NODE : INTERNAL_NODE);
	n->header.nr_entries = 0;
	n->header.max_entries = cpu_to_le32(calc_max_entries(vsize));
	n->header.value_size = cpu_to_le32(vsize);
}

static void node_prepare_for_write(const struct tsp_block_validator *v,
				   struct tsp_block *b, size_t block_size)
{
	struct node_header *h = tsp_block_data(b);

	h->blocknr = cpu_to_le64(tsp_block_location(b));
	h->csum = cpu_to_le32(tsp_bm_checksum(&h->flags,
					      block_size - sizeof(__le32),
					      BTREE_CSUM_XOR));
}

static int node_check(const struct tsp_block_validator *v,
		      struct tsp_block *b, size_t block_size)
{
	struct btree_node *n = node_of(b);
	struct node_header *h = &n->header;
	u32 flags = le32_to_cpu(h->flags);
	u64 vsize = value_size(n);
	u32 csum;

	if (le64_to_cpu(h->blocknr) != tsp_block_location(b)) {
		DMERR("btree node %llu claims to be block %llu",
		      (unsigned long long)tsp_block_location(b),
		      (unsigned long long)le64_to_cpu(h->blocknr));
		return -EILSEQ;
	}
	csum = tsp_bm_checksum(&h->flags, block_size - sizeof(__le32),
			       BTREE_CSUM_XOR);
	if (csum != le32_to_cpu(h->csum)) {
		DMERR("btree node %llu has a bad checksum",
		      (unsigned long long)tsp_block_location(b));
		return -EILSEQ;
	}
	if (flags != INTERNAL_NODE && flags != LEAF_NODE) {
		DMERR("btree node %llu has bad flags %u",
		      (unsigned long long)tsp_block_location(b), flags);
		return -EILSEQ;
	}
	if (!vsize || !max_entries(n) || max_entries(n) % 3 ||
	    sizeof(*h) + (sizeof(__le64) + vsize) * max_entries(n) > block_size ||
	    nr_entries(n) > max_entries(n)) {
		DMERR("btree node %llu has a bad size: %u of %u entries of %llu bytes",
		      (unsigned long long)tsp_block_location(b), nr_entries(n),
		      max_entries(n), (unsigned long long)vsize);
		return -EILSEQ;
	}
	return 0;
}

const struct tsp_block_validator tsp_btree_node_validator = {
	.name = "btree node",
	.prepare_for_write = node_prepare_for_write,
	.check = node_check,
};

/* A node's value size must be the tree's (leaf) or a block number's. */
static int check_value_size(struct tsp_btree_info *info, struct tsp_block *b)
{
	struct btree_node *n = node_of(b);
	u32 expected = is_leaf(n) ? info->vt.size : sizeof(__le64);

	if (value_size(n) == expected)
		return 0;

	DMERR("btree node %llu has values of %u bytes, expected %u",
	      (unsigned long long)tsp_block_location(b), value_size(n), expected);
	return -EILSEQ;
}

static int read_node(struct tsp_btree_info *info, tsp_block_t b,
		     struct tsp_block **result)
{
	int r = tsp_tm_read_lock(info->tm, b, &tsp_btree_node_validator, result);

	if (r)
		return r;
	r = check_value_size(info, *result);
	if (r)
		tsp_tm_unlock(info->tm, *result);
	return r;
}

/**
 * read_node_at - read a node met on a recursive descent
 * @info: tree description
 * @b: the node
 * @depth: its level below the root (0: the root)
 * @result: out, the node, read locked
 *
 * Refuses (-EILSEQ) a node deeper than MAX_DEPTH, which bounds the
 * recursion, and an empty node below the root: only a root may be
 * empty.  An empty node below the root, or keys that do not increase
 * along a walk, mean a corrupt tree; a node reachable by many paths (a
 * cycle or a "DAG bomb") is caught by one of the two before a walk can
 * take exponential time.
 */
static int read_node_at(struct tsp_btree_info *info, tsp_block_t b, int depth,
			struct tsp_block **result)
{
	int r;

	if (depth > MAX_DEPTH) {
		DMERR("btree is too deep at node %llu", (unsigned long long)b);
		return -EILSEQ;
	}
	r = read_node(info, b, result);
	if (r || !depth || nr_entries(node_of(*result)))
		return r;
	DMERR("btree node %llu below the root is empty", (unsigned long long)b);
	tsp_tm_unlock(info->tm, *result);
	return -EILSEQ;
}

/* A private copy now references everything the shared original did. */
static int inc_children(struct tsp_btree_info *info, struct btree_node *n)
{
	u32 i;
	int r;

	for (i = 0; i < nr_entries(n); i++) {
		if (!is_leaf(n))
			r = tsp_tm_inc(info->tm, child_at(n, i));
		else if (info->vt.inc)
			r = info->vt.inc(info->vt.context, value_at(n, i));
		else
			r = 0;
		if (r)
			return r;
	}
	return 0;
}

/* Write lock node @b for modification, copying it if it is shared. */
static int shadow_node(struct tsp_btree_info *info, tsp_block_t b,
		       struct tsp_block **result)
{
	bool inc;
	int r;

	r = tsp_tm_shadow_block(info->tm, b, &tsp_btree_node_validator,
				result, &inc);
	if (r)
		return r;

	r = check_value_size(info, *result);
	if (!r && inc)
		r = inc_children(info, node_of(*result));
	if (r)
		tsp_tm_unlock(info->tm, *result);
	return r;
}

static int new_node(struct tsp_btree_info *info, bool leaf,
		    struct tsp_block **result)
{
	int r = tsp_tm_new_block(info->tm, &tsp_btree_node_validator, result);

	if (!r)
		node_init(node_of(*result), leaf,
			  leaf ? info->vt.size : sizeof(__le64));
	return r;
}

/* The first index whose key is >= @key (nr_entries if none). */
static u32 lower_bound(struct btree_node *n, u64 key)
{
	u32 lo = 0, hi = nr_entries(n);

	/* Keys that come in order (first writes, a restore) go last. */
	if (hi && key_at(n, hi - 1) < key)
		return hi;
	while (lo < hi) {
		u32 mid = lo + (hi - lo) / 2;

		if (key_at(n, mid) < key)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* The child whose key range holds @key; -1 if @key is below them all. */
static int child_index(struct btree_node *n, u64 key)
{
	u32 i = lower_bound(n, key);

	if (i < nr_entries(n) && key_at(n, i) == key)
		return i;
	return (int)i - 1;
}

/* Copy @count entries from @src at @si to @dst at @di (same layout). */
static void copy_entries(struct btree_node *dst, u32 di,
			 struct btree_node *src, u32 si, u32 count)
{
	memmove(&dst->keys[di], &src->keys[si], count * sizeof(__le64));
	memmove(value_at(dst, di), value_at(src, si),
		(size_t)count * value_size(src));
}

/* Open a gap at @i (shift entries right), or close one (shift left). */
static void shift_entries(struct btree_node *n, u32 i, int delta)
{
	u32 nr = nr_entries(n);

	if (delta > 0)
		copy_entries(n, i + delta, n, i, nr - i);
	else
		copy_entries(n, i, n, i - delta, nr - i + delta);
	set_nr_entries(n, nr + delta);
}

static void insert_entry(struct btree_node *n, u32 i, u64 key, const void *value)
{
	shift_entries(n, i, 1);
	n->keys[i] = cpu_to_le64(key);
	memcpy(value_at(n, i), value, value_size(n));
}

/* Copy a node's entries into a new node of the same kind. */
static int new_node_with(struct tsp_btree_info *info, struct btree_node *src,
			 u32 first, u32 count, struct tsp_block **result)
{
	int r = new_node(info, is_leaf(src), result);

	if (r)
		return r;
	copy_entries(node_of(*result), 0, src, first, count);
	set_nr_entries(node_of(*result), count);
	return 0;
}

/**
 * redistribute - move entries between two adjacent children
 * @n: their parent
 * @li: the index of the left one in @n
 * @l: the left child
 * @rn: the right child
 * @target: how many entries the left child is to hold
 *
 * Entries move from the head of @rn to the tail of @l, or from the tail
 * of @l to the head of @rn, and @n's key for @rn follows.  The caller
 * checks that both end up within max_entries.
 */
static void redistribute(struct btree_node *n, u32 li, struct btree_node *l,
			 struct btree_node *rn, u32 target)
{
	u32 nl = nr_entries(l);

	if (nl < target) {
		copy_entries(l, nl, rn, 0, target - nl);
		set_nr_entries(l, target);
		shift_entries(rn, 0, -(int)(target - nl));
	} else if (nl > target) {
		shift_entries(rn, 0, nl - target);
		copy_entries(rn, 0, l, target, nl - target);
		set_nr_entries(l, target);
	}
	n->keys[li + 1] = rn->keys[0];
}

/*
 * The root is full: move its entries into two new children, so the root
 * keeps its location (its parent need not change) and gains a level.
 */
static int split_beneath(struct tsp_btree_info *info, struct tsp_block *root)
{
	struct btree_node *n = node_of(root);
	struct tsp_block *left, *right;
	u32 nr = nr_entries(n), nr_left = nr / 2;
	int r;

	r = new_node_with(info, n, 0, nr_left, &left);
	if (r)
		return r;
	r = new_node_with(info, n, nr_left, nr - nr_left, &right);
	if (r) {
		/* Refused in no-wait mode, say: give the first one back. */
		tsp_block_t b = tsp_block_location(left);

		tsp_tm_unlock(info->tm, left);
		return tsp_tm_dec(info->tm, b) ?: r;
	}

	node_init(n, false, sizeof(__le64));
	n->keys[0] = node_of(left)->keys[0];
	set_child(n, 0, tsp_block_location(left));
	n->keys[1] = node_of(right)->keys[0];
	set_child(n, 1, tsp_block_location(right));
	set_nr_entries(n, 2);

	tsp_tm_unlock(info->tm, left);
	tsp_tm_unlock(info->tm, right);
	return 0;
}

/*
 * Child @i of @parent is full: move its upper half into a new sibling
 * inserted after it.  @parent has room (it was split before we came down),
 * unless its keys are out of order: that is refused.
 */
static int split_child(struct tsp_btree_info *info, struct tsp_block *parent,
		       u32 i, struct tsp_block *child,
		       struct tsp_block **sibling)
{
	struct btree_node *c = node_of(child);
	u32 nr = nr_entries(c), nr_left = nr / 2;
	__le64 loc;
	int r;

	if (node_full(node_of(parent)))
		return full_node_error(parent);
	r = new_node_with(info, c, nr_left, nr - nr_left, sibling);
	if (r)
		return r;
	set_nr_entries(c, nr_left);

	loc = cpu_to_le64(tsp_block_location(*sibling));
	insert_entry(node_of(parent), i + 1, key_at(node_of(*sibling), 0), &loc);
	return 0;
}

/* Free entries a sibling needs before a full child hands it some. */
#define SHARE_MIN_ROOM 8

/*
 * Siblings must agree on kind, value size and capacity before entries
 * move between them: corrupt metadata may put a leaf beside an internal
 * node, and copying one's values into the other would overrun it.
 */
static bool same_shape(struct btree_node *a, struct btree_node *b)
{
	return a->header.flags == b->header.flags &&
	       value_size(a) == value_size(b) &&
	       max_entries(a) == max_entries(b);
}

/**
 * share_with_sibling - make room in a full child by moving entries to a sibling
 * @info: tree description
 * @n: the parent, write locked
 * @i: the full child's index in @n
 * @s: the sibling's index in @n: i - 1 or i + 1
 * @key: the key being inserted
 * @child: in, the full child, write locked; out, the one of the two that
 *	@key now belongs in (it has room), write locked
 *
 * The sibling takes part only if it is not shared, has the child's
 * max_entries, is at least a third full (else the tree is corrupt) and
 * has at least SHARE_MIN_ROOM free entries.  The two are evened out, but
 * a left sibling is filled up when @key goes after the child's last key,
 * and a right one when @key goes before its first key.  Both keep at
 * least a third of max_entries (the child keeps at least the sibling's
 * old count), and the one @key belongs in has room.
 *
 * Returns 0 when room was made, 1 when the sibling could not take part
 * (nothing changed), or a negative errno (@child is then unlocked).
 */
static int share_with_sibling(struct tsp_btree_info *info, struct btree_node *n,
			      u32 i, u32 s, u64 key, struct tsp_block **child)
{
	struct btree_node *c = node_of(*child), *l, *rn;
	u32 max = max_entries(c), nr_sib, total, target, li = min(i, s);
	struct tsp_block *sib;
	bool in_right;
	u32 count;
	int r;

	r = tsp_tm_ref(info->tm, child_at(n, s), &count);
	if (!r && count > 1)
		return 1;
	if (!r)
		r = read_node(info, child_at(n, s), &sib);
	if (r) {
		tsp_tm_unlock(info->tm, *child);
		return r;
	}
	nr_sib = nr_entries(node_of(sib));
	r = !same_shape(node_of(sib), c) || nr_sib < max / 3 ||
	    nr_sib + SHARE_MIN_ROOM > max;
	tsp_tm_unlock(info->tm, sib);
	if (r)
		return 1;

	r = shadow_node(info, child_at(n, s), &sib);
	if (r) {
		tsp_tm_unlock(info->tm, *child);
		return r;
	}
	set_child(n, s, tsp_block_location(sib));

	total = max + nr_sib;
	if (s < i) {
		l = node_of(sib);
		rn = c;
		target = key > key_at(c, max - 1) ? max : total / 2;
	} else {
		l = c;
		rn = node_of(sib);
		target = key < key_at(c, 0) ? nr_sib : total / 2;
	}
	redistribute(n, li, l, rn, target);

	in_right = key >= key_at(n, li + 1);
	if (in_right != (rn == c))
		swap(*child, sib);
	tsp_tm_unlock(info->tm, sib);
	if (node_full(node_of(*child))) {
		r = full_node_error(*child);
		tsp_tm_unlock(info->tm, *child);
		return r;
	}
	return 0;
}

/**
 * make_room - make room in full child @i of @parent before descending into it
 * @info: tree description
 * @parent: the parent, write locked, with room for one more entry
 * @i: the child's index
 * @key: the key being inserted
 * @child: in, the full child, write locked; out, the node @key now
 *	belongs in, write locked and not full
 *
 * Tries the left sibling, then the right one (share_with_sibling()), and
 * splits the child only when neither takes part.  On error @child is
 * unlocked.
 */
static int make_room(struct tsp_btree_info *info, struct tsp_block *parent,
		     u32 i, u64 key, struct tsp_block **child)
{
	struct btree_node *n = node_of(parent);
	struct tsp_block *sibling;
	int r = 1;

	if (i > 0)
		r = share_with_sibling(info, n, i, i - 1, key, child);
	if (r > 0 && i + 1 < nr_entries(n))
		r = share_with_sibling(info, n, i, i + 1, key, child);
	if (r <= 0)
		return r;

	r = split_child(info, parent, i, *child, &sibling);
	if (r) {
		tsp_tm_unlock(info->tm, *child);
		return r;
	}
	if (key >= key_at(node_of(sibling), 0))
		swap(*child, sibling);
	tsp_tm_unlock(info->tm, sibling);
	return 0;
}

static int insert_into_leaf(struct tsp_btree_info *info, struct btree_node *n,
			    u64 key, const void *value, bool overwrite,
			    bool *inserted)
{
	u32 i = lower_bound(n, key);
	int r;

	if (i < nr_entries(n) && key_at(n, i) == key) {
		if (!overwrite)
			return -EEXIST;
		if (info->vt.dec) {
			r = info->vt.dec(info->vt.context, value_at(n, i));
			if (r)
				return r;
		}
		memcpy(value_at(n, i), value, value_size(n));
		*inserted = false;
		return 0;
	}

	insert_entry(n, i, key, value);
	*inserted = true;
	return 0;
}

/*
 * Insert @key, or overwrite it if @overwrite (else -EEXIST); see
 * tsp_btree_insert() and tsp_btree_insert_new_at().  *@new_root is set once
 * the root is shadowed (and split if it was full), so on -EEXIST too.
 *
 * With @cursor (which holds no leaf), the leaf is left write locked in it
 * after a successful insert, with the keys the walk routed to it.
 *
 * Cost: shadows one node per level, plus, per full node on the way
 * down, a sibling shadowed or a new node for a split.
 */
static int __insert(struct tsp_btree_info *info, tsp_block_t root, u64 key,
		    const void *value, bool overwrite, tsp_block_t *new_root,
		    bool *inserted, struct tsp_btree_cursor *cursor)
{
	struct tsp_block *blk, *child;
	struct btree_node *n;
	/* The keys every node so far routes to the current one. */
	u64 lo = 0, hi = U64_MAX;
	int depth, r;
	int i;

	r = shadow_node(info, root, &blk);
	if (r)
		return r;
	n = node_of(blk);
	if (node_full(n)) {
		r = split_beneath(info, blk);
		if (r)
			goto out;
	}
	*new_root = tsp_block_location(blk);

	for (depth = 0; !is_leaf(n); depth++) {
		if (depth > MAX_DEPTH) {
			DMERR("btree rooted at %llu is too deep", (unsigned long long)root);
			r = -EILSEQ;
			goto out;
		}
		if (!nr_entries(n)) {
			DMERR("internal btree node %llu is empty",
			      (unsigned long long)tsp_block_location(blk));
			r = -EILSEQ;
			goto out;
		}

		/*
		 * Nothing changes before the child is shadowed, which may
		 * refuse in the transaction manager's no-wait mode.
		 */
		i = child_index(n, key);
		r = shadow_node(info, child_at(n, max(i, 0)), &child);
		if (r)
			goto out;
		if (i < 0) {
			/* The new lowest key of this subtree. */
			i = 0;
			n->keys[0] = cpu_to_le64(key);
		}
		set_child(n, i, tsp_block_location(child));

		if (node_full(node_of(child))) {
			r = make_room(info, blk, i, key, &child);
			if (r)
				goto out;
			/* @key may now belong in a sibling. */
			i = child_index(n, key);
		}
		lo = max(lo, key_at(n, i));
		if ((u32)i + 1 < nr_entries(n))
			hi = min(hi, key_at(n, i + 1));

		tsp_tm_unlock(info->tm, blk);
		blk = child;
		n = node_of(blk);
	}

	r = insert_into_leaf(info, n, key, value, overwrite, inserted);
	if (!r && cursor) {
		cursor->leaf = blk;
		cursor->root = *new_root;
		cursor->lo = lo;
		cursor->hi = hi;
		return 0;
	}
out:
	tsp_tm_unlock(info->tm, blk);
	return r;
}

/**
 * tsp_btree_insert - insert or overwrite a key; see btree.h
 * @info: tree description
 * @root: current root
 * @key: key
 * @value: the value (the tree takes over the caller's reference)
 * @new_root: out, the root afterwards
 * @inserted: out, may be NULL
 */
int tsp_btree_insert(struct tsp_btree_info *info, tsp_block_t root, u64 key,
		     const void *value, tsp_block_t *new_root, bool *inserted)
{
	bool dummy;

	return __insert(info, root, key, value, true, new_root,
			inserted ? inserted : &dummy, NULL);
}

/* A kept leaf is no longer readable by others, before it is unlocked. */
static void take_back(struct tsp_btree_cursor *cursor)
{
	if (cursor->kept) {
		tsp_bm_unkeep(cursor->leaf);
		cursor->kept = false;
	}
}

/**
 * tsp_btree_cursor_release - unlock and forget a cursor's leaf
 * @cursor: the cursor
 */
void tsp_btree_cursor_release(struct tsp_btree_cursor *cursor)
{
	take_back(cursor);
	if (cursor->leaf) {
		tsp_tm_unlock(cursor->info->tm, cursor->leaf);
		cursor->leaf = NULL;
	}
	cursor->parked = 0;
}

/**
 * tsp_btree_cursor_park - unlock a cursor's leaf, keeping its place
 * @cursor: the cursor
 */
void tsp_btree_cursor_park(struct tsp_btree_cursor *cursor)
{
	take_back(cursor);
	if (cursor->leaf) {
		cursor->parked = tsp_block_location(cursor->leaf);
		tsp_tm_unlock(cursor->info->tm, cursor->leaf);
		cursor->leaf = NULL;
	}
}

/**
 * tsp_btree_cursor_keep - keep the cursor's leaf locked, readable by others
 * @cursor: the cursor
 */
void tsp_btree_cursor_keep(struct tsp_btree_cursor *cursor)
{
	if (cursor->leaf && !cursor->kept) {
		tsp_bm_keep(cursor->leaf);
		cursor->kept = true;
	}
}

/*
 * Lock a parked cursor's leaf again.  Its owner guarantees that the tree
 * has not changed but through the cursor, so the leaf still holds the
 * cursor's range; the transaction manager checks that it is still a
 * private shadow, writable in place.  Return: 0 with the leaf locked, 1
 * when it is not (a commit came in between), or a negative errno.
 */
static int unpark(struct tsp_btree_cursor *cursor)
{
	struct tsp_block *blk;
	int r;

	r = tsp_tm_relock_shadow(cursor->info->tm, cursor->parked,
				 &tsp_btree_node_validator, &blk);
	cursor->parked = 0;
	if (r)
		return r == -ESTALE ? 1 : r;
	if (is_leaf(node_of(blk))) {
		r = check_value_size(cursor->info, blk);
	} else {
		DMERR("btree cursor's leaf %llu is no longer a leaf",
		      (unsigned long long)tsp_block_location(blk));
		r = -EILSEQ;
	}
	if (r) {
		tsp_tm_unlock(cursor->info->tm, blk);
		return r;
	}
	cursor->leaf = blk;
	return 0;
}

/*
 * The leaf of @cursor, locked, if @key goes into it: the walk to it
 * started at @root and routed @key there, and it has room.  Return: 0
 * with *@leaf set, 1 when @key takes a walk (the cursor is released), or
 * a negative errno.
 */
static int cursor_leaf(struct tsp_btree_cursor *cursor, tsp_block_t root,
		       u64 key, struct btree_node **leaf)
{
	int r = 1;

	if (root == cursor->root && key >= cursor->lo && key < cursor->hi) {
		r = cursor->parked ? unpark(cursor) : !cursor->leaf;
		if (!r) {
			*leaf = node_of(cursor->leaf);
			r = node_full(*leaf);
		}
	}
	if (r)
		tsp_btree_cursor_release(cursor);
	return r;
}

/*
 * Insert @key through @cursor, or overwrite it if @overwrite (else
 * -EEXIST): straight into the cursor's leaf when @key goes there, else
 * by a walk down from @root, which keeps the new leaf in the cursor.
 */
static int insert_at(struct tsp_btree_cursor *cursor, tsp_block_t root,
		     u64 key, const void *value, bool overwrite,
		     tsp_block_t *new_root, bool *inserted)
{
	struct btree_node *leaf;
	int r = cursor_leaf(cursor, root, key, &leaf);

	if (r < 0)
		return r;
	if (r)
		return __insert(cursor->info, root, key, value, overwrite,
				new_root, inserted, cursor);
	*new_root = root;
	cursor->hits++;
	return insert_into_leaf(cursor->info, leaf, key, value, overwrite,
				inserted);
}

/**
 * tsp_btree_insert_at - tsp_btree_insert() through a cursor; see btree.h
 * @cursor: the cursor
 * @root: current root
 * @key: key
 * @value: the value (the tree takes over the caller's reference)
 * @new_root: out, the root afterwards
 * @inserted: out, false when an old value was overwritten
 *
 * The walk's bounds are those of the separator keys above the leaf, so a
 * key within them belongs in the leaf and inserting it changes no node
 * above.  A full leaf is left to a walk, which makes room.
 */
int tsp_btree_insert_at(struct tsp_btree_cursor *cursor, tsp_block_t root,
			u64 key, const void *value, tsp_block_t *new_root,
			bool *inserted)
{
	return insert_at(cursor, root, key, value, true, new_root, inserted);
}

/**
 * tsp_btree_insert_new_at - insert unless present, via a cursor; see btree.h
 * @cursor: the cursor
 * @root: current root
 * @key: key
 * @value: the value (the tree takes it over only if this returns 0)
 * @new_root: out, the root afterwards
 */
int tsp_btree_insert_new_at(struct tsp_btree_cursor *cursor,
			    tsp_block_t root, u64 key, const void *value,
			    tsp_block_t *new_root)
{
	bool inserted;

	return insert_at(cursor, root, key, value, false, new_root,
			 &inserted);
}

/*
 * Child @i of @n has fallen below a third full: merge it with a sibling,
 * or even out the entries of the two.  Unlocks @child.
 */
static int rebalance_child(struct tsp_btree_info *info, struct btree_node *n,
			   u32 i, struct tsp_block *child)
{
	struct tsp_block *left, *right, *sibling;
	struct btree_node *l, *rn;
	u32 li, nl, nr, total;
	int r;

	if (nr_entries(n) < 2) {
		/* A root with one child; tsp_btree_remove() collapses it. */
		tsp_tm_unlock(info->tm, child);
		return 0;
	}

	li = (i + 1 < nr_entries(n)) ? i : i - 1;
	r = shadow_node(info, child_at(n, li == i ? i + 1 : li), &sibling);
	if (r) {
		tsp_tm_unlock(info->tm, child);
		return r;
	}
	left = li == i ? child : sibling;
	right = li == i ? sibling : child;
	set_child(n, li, tsp_block_location(left));
	set_child(n, li + 1, tsp_block_location(right));

	l = node_of(left);
	rn = node_of(right);
	nl = nr_entries(l);
	nr = nr_entries(rn);
	total = nl + nr;

	if (!same_shape(l, rn)) {
		DMERR("btree nodes %llu and %llu are siblings of different shapes",
		      (unsigned long long)tsp_block_location(left),
		      (unsigned long long)tsp_block_location(right));
		r = -EILSEQ;
	} else if (total <= max_entries(l)) {
		/* Merge: the right node's references move to the left one. */
		copy_entries(l, nl, rn, 0, nr);
		set_nr_entries(l, total);
		shift_entries(n, li + 1, -1);
		tsp_tm_unlock(info->tm, left);
		tsp_tm_unlock(info->tm, right);
		return tsp_tm_dec(info->tm, tsp_block_location(right));
	} else {
		/* Both at most full, so half of them fits in either. */
		redistribute(n, li, l, rn, total / 2);
	}

	tsp_tm_unlock(info->tm, left);
	tsp_tm_unlock(info->tm, right);
	return r;
}

static int remove_from(struct tsp_btree_info *info, struct tsp_block *blk,
		       u64 key, int depth)
{
	struct btree_node *n = node_of(blk);
	struct tsp_block *child;
	struct btree_node *c;
	int i, r;

	if (depth > MAX_DEPTH) {
		DMERR("btree is too deep at node %llu",
		      (unsigned long long)tsp_block_location(blk));
		return -EILSEQ;
	}

	if (is_leaf(n)) {
		u32 pos = lower_bound(n, key);

		if (pos == nr_entries(n) || key_at(n, pos) != key)
			return -ENODATA;
		if (info->vt.dec) {
			r = info->vt.dec(info->vt.context, value_at(n, pos));
			if (r)
				return r;
		}
		shift_entries(n, pos, -1);
		return 0;
	}

	i = child_index(n, key);
	if (i < 0)
		return -ENODATA;
	r = shadow_node(info, child_at(n, i), &child);
	if (r)
		return r;
	set_child(n, i, tsp_block_location(child));

	r = remove_from(info, child, key, depth + 1);
	c = node_of(child);
	if (!r && nr_entries(c) < max_entries(c) / 3)
		return rebalance_child(info, n, i, child);

	tsp_tm_unlock(info->tm, child);
	return r;
}

/**
 * tsp_btree_remove - remove a key; see btree.h
 * @info: tree description
 * @root: current root
 * @key: the key
 * @new_root: out, the root afterwards
 *
 * Cost: one lookup, then one shadowed node per level plus at most one
 * sibling per level.  An absent key changes nothing.
 */
int tsp_btree_remove(struct tsp_btree_info *info, tsp_block_t root, u64 key,
		     tsp_block_t *new_root)
{
	struct tsp_block *blk;
	struct btree_node *n;
	tsp_block_t only_child;
	int r;

	r = tsp_btree_lookup(info, root, key, NULL);
	if (r)
		return r;

	r = shadow_node(info, root, &blk);
	if (r)
		return r;
	r = remove_from(info, blk, key, 0);

	n = node_of(blk);
	*new_root = tsp_block_location(blk);
	if (r || is_leaf(n) || nr_entries(n) != 1) {
		tsp_tm_unlock(info->tm, blk);
		return r;
	}

	/* A root with a single child: the child becomes the root. */
	only_child = child_at(n, 0);
	tsp_tm_unlock(info->tm, blk);
	r = tsp_tm_dec(info->tm, *new_root);
	*new_root = only_child;
	return r;
}

/**
 * tsp_btree_remove_range - remove every key in [@begin, @end)
 * @info: tree description
 * @root: current root
 * @begin: first key
 * @end: one past the last key
 * @new_root: out, the root afterwards
 * @nr_removed: out, how many keys were removed; may be NULL
 *
 * Cost: a lookup and a removal per key removed.
 */
int tsp_btree_remove_range(struct tsp_btree_info *info, tsp_block_t root,
			   u64 begin, u64 end, tsp_block_t *new_root,
			   u64 *nr_removed)
{
	u64 key, count = 0;
	int r = 0;

	*new_root = root;
	while (begin < end) {
		r = tsp_btree_lookup_next(info, *new_root, begin, &key, NULL);
		if (r == -ENODATA || (!r && key >= end)) {
			r = 0;
			break;
		}
		if (r)
			break;
		r = tsp_btree_remove(info, *new_root, key, new_root);
		if (r == -ENODATA) {
			/* Found by the lookup, not by the removal: corrupt. */
			DMERR("btree rooted at %llu lost key %llu",
			      (unsigned long long)*new_root, (unsigned long long)key);
			r = -EILSEQ;
		}
		if (r)
			break;
		count++;
		begin = key + 1;
	}

	if (nr_removed)
		*nr_removed = count;
	return r;
}

/**
 * tsp_btree_empty - create a tree with no keys
 * @info: tree description
 * @root: out, its root
 */
int tsp_btree_empty(struct tsp_btree_info *info, tsp_block_t *root)
{
	struct tsp_block *blk;
	int r = new_node(info, true, &blk);

	if (r)
		return r;
	*root = tsp_block_location(blk);
	tsp_tm_unlock(info->tm, blk);
	return 0;
}

static int del_node(struct tsp_btree_info *info, tsp_block_t b, int depth)
{
	struct tsp_block *blk;
	struct btree_node *n;
	u32 count, i;
	int r;

	if (depth > MAX_DEPTH) {
		DMERR("btree is too deep at node %llu", (unsigned long long)b);
		return -EILSEQ;
	}

	r = tsp_tm_ref(info->tm, b, &count);
	if (r)
		return r;
	if (!count) {
		DMERR("btree node %llu is referenced but free", (unsigned long long)b);
		return -EILSEQ;
	}
	if (count > 1)
		return tsp_tm_dec(info->tm, b);

	r = read_node(info, b, &blk);
	if (r)
		return r;
	n = node_of(blk);
	for (i = 0; !r && i < nr_entries(n); i++) {
		if (!is_leaf(n))
			r = del_node(info, child_at(n, i), depth + 1);
		else if (info->vt.dec)
			r = info->vt.dec(info->vt.context, value_at(n, i));
	}
	tsp_tm_unlock(info->tm, blk);

	return r ? r : tsp_tm_dec(info->tm, b);
}

/**
 * tsp_btree_del - drop one reference to a whole tree
 * @info: tree description
 * @root: its root
 *
 * Nodes still referenced from elsewhere (snapshots) survive.  Cost: every
 * node not shared is read.
 */
int tsp_btree_del(struct tsp_btree_info *info, tsp_block_t root)
{
	return del_node(info, root, 0);
}

/**
 * tsp_btree_lookup - find the value of a key
 * @info: tree description
 * @root: the root
 * @key: the key
 * @value: out, vt.size bytes; may be NULL
 *
 * Returns 0 or -ENODATA.  Cost: one node read per level.
 */
int tsp_btree_lookup(struct tsp_btree_info *info, tsp_block_t root, u64 key,
		     void *value)
{
	struct tsp_block *blk;
	struct btree_node *n;
	tsp_block_t b = root;
	int depth, i, r;

	for (depth = 0; depth <= MAX_DEPTH; depth++) {
		r = read_node(info, b, &blk);
		if (r)
			return r;
		n = node_of(blk);
		i = child_index(n, key);
		if (i < 0 || (is_leaf(n) && key_at(n, i) != key)) {
			r = -ENODATA;
		} else if (is_leaf(n)) {
			if (value)
				memcpy(value, value_at(n, i), info->vt.size);
			r = 0;
		} else {
			b = child_at(n, i);
			r = 1;
		}
		tsp_tm_unlock(info->tm, blk);
		if (r <= 0)
			return r;
	}

	DMERR("btree rooted at %llu is too deep", (unsigned long long)root);
	return -EILSEQ;
}

static int lookup_next_in(struct tsp_btree_info *info, tsp_block_t b, u64 key,
			  u64 *found_key, void *value, int depth)
{
	struct tsp_block *blk;
	struct btree_node *n;
	int i, r;

	r = read_node_at(info, b, depth, &blk);
	if (r)
		return r;
	n = node_of(blk);

	if (is_leaf(n)) {
		u32 pos = lower_bound(n, key);

		r = -ENODATA;
		if (pos < nr_entries(n)) {
			*found_key = key_at(n, pos);
			if (value)
				memcpy(value, value_at(n, pos), info->vt.size);
			r = 0;
		}
	} else {
		/*
		 * If the child holding @key's range has nothing at or after
		 * it, the next child's first key is the answer: two children
		 * at most, so a corrupt tree cannot make this exponential.
		 */
		int first = max(child_index(n, key), 0);

		r = -ENODATA;
		for (i = first; r == -ENODATA && i < (int)nr_entries(n) &&
		     i <= first + 1; i++)
			r = lookup_next_in(info, child_at(n, i), key, found_key,
					   value, depth + 1);
	}

	tsp_tm_unlock(info->tm, blk);
	return r;
}

/**
 * tsp_btree_lookup_next - the first key at or after @key
 * @info: tree description
 * @root: the root
 * @key: where to start
 * @found_key: out, the key found
 * @value: out, its value; may be NULL
 *
 * Returns 0 or -ENODATA.  Cost: O(log n) node reads.
 */
int tsp_btree_lookup_next(struct tsp_btree_info *info, tsp_block_t root,
			  u64 key, u64 *found_key, void *value)
{
	return lookup_next_in(info, root, key, found_key, value, 0);
}

/**
 * tsp_btree_find_highest_key - the largest key in the tree
 * @info: tree description
 * @root: the root
 * @key: out
 *
 * Returns 0, -ENODATA for an empty tree, or -EILSEQ for an empty node
 * below the root: only a corrupt tree has one, and there the key found
 * would not be the largest, which callers rely on.
 */
int tsp_btree_find_highest_key(struct tsp_btree_info *info, tsp_block_t root,
			       u64 *key)
{
	struct tsp_block *blk;
	struct btree_node *n;
	tsp_block_t b = root;
	int depth, r;

	for (depth = 0; depth <= MAX_DEPTH; depth++) {
		r = read_node_at(info, b, depth, &blk);
		if (r)
			return r;
		n = node_of(blk);
		if (!nr_entries(n)) {
			r = -ENODATA;
		} else if (is_leaf(n)) {
			*key = key_at(n, nr_entries(n) - 1);
			r = 0;
		} else {
			b = child_at(n, nr_entries(n) - 1);
			r = 1;
		}
		tsp_tm_unlock(info->tm, blk);
		if (r <= 0)
			return r;
	}

	DMERR("btree rooted at %llu is too deep", (unsigned long long)root);
	return -EILSEQ;
}

struct walk_args {
	struct tsp_btree_info *info;
	int (*fn)(void *context, u64 key, void *value);
	void *context;
	bool seen_any;
	u64 last_key;
};

static int walk_node(struct walk_args *a, tsp_block_t b, int depth)
{
	struct tsp_btree_info *info = a->info;
	struct tsp_block *blk;
	struct btree_node *n;
	u32 i;
	int r;

	r = read_node_at(info, b, depth, &blk);
	if (r)
		return r;
	n = node_of(blk);
	for (i = 0; !r && i < nr_entries(n); i++) {
		if (!is_leaf(n)) {
			r = walk_node(a, child_at(n, i), depth + 1);
			continue;
		}
		if (a->seen_any && key_at(n, i) <= a->last_key) {
			DMERR("btree node %llu: key %llu out of order",
			      (unsigned long long)b,
			      (unsigned long long)key_at(n, i));
			r = -EILSEQ;
			break;
		}
		a->seen_any = true;
		a->last_key = key_at(n, i);
		r = a->fn(a->context, key_at(n, i), value_at(n, i));
	}
	tsp_tm_unlock(info->tm, blk);
	return r;
}

/**
 * tsp_btree_walk - visit every key in order
 * @info: tree description
 * @root: the root
 * @fn: called with each key and value; non-zero stops the walk and is
 *	returned
 *
 * Returns -EILSEQ (after visiting a prefix) for keys that do not strictly
 * increase or an empty node below the root.
 * @context: for @fn
 */
int tsp_btree_walk(struct tsp_btree_info *info, tsp_block_t root,
		   int (*fn)(void *context, u64 key, void *value), void *context)
{
	struct walk_args a = { .info = info, .fn = fn, .context = context };

	return walk_node(&a, root, 0);
}

struct check_args {
	struct tsp_btree_info *info;
	int (*node_fn)(void *context, tsp_block_t b);
	int (*value_fn)(void *context, u64 key, void *value);
	void *context;
};

/*
 * A node checked already through another parent must also lie within
 * this parent's key range: its lowest key is its first (checked then),
 * its highest the last key of its rightmost leaf.
 */
static int check_shared_range(struct tsp_btree_info *info, tsp_block_t b,
			      u64 lo, u64 hi, bool has_hi)
{
	struct tsp_block *blk;
	struct btree_node *n;
	int depth, r = 0;
	bool first = true;

	for (depth = 0; depth <= MAX_DEPTH; depth++) {
		r = read_node(info, b, &blk);
		if (r)
			return r;
		n = node_of(blk);
		if (!nr_entries(n)) {
			tsp_tm_unlock(info->tm, blk);
			return 0;
		}
		if ((first && key_at(n, 0) < lo) ||
		    (is_leaf(n) && has_hi && key_at(n, nr_entries(n) - 1) >= hi)) {
			DMERR("shared btree node %llu is outside a parent's key range",
			      (unsigned long long)b);
			r = -EILSEQ;
		}
		first = false;
		if (!r && !is_leaf(n)) {
			b = child_at(n, nr_entries(n) - 1);
			r = 1;
		}
		tsp_tm_unlock(info->tm, blk);
		if (r <= 0)
			return r;
	}
	DMERR("btree is too deep at node %llu", (unsigned long long)b);
	return -EILSEQ;
}

static int check_node(struct check_args *a, tsp_block_t b, u64 lo, u64 hi,
		      bool has_hi, int depth)
{
	struct tsp_btree_info *info = a->info;
	struct tsp_block *blk;
	struct btree_node *n;
	u32 i, nr;
	int r;

	if (a->node_fn) {
		r = a->node_fn(a->context, b);
		if (r > 0)
			return check_shared_range(info, b, lo, hi, has_hi);
		if (r)
			return r;
	}

	r = read_node_at(info, b, depth, &blk);
	if (r)
		return r;
	n = node_of(blk);
	nr = nr_entries(n);

	if ((depth && nr < max_entries(n) / 3) || (!is_leaf(n) && !nr)) {
		DMERR("btree node %llu has too few entries (%u of %u)",
		      (unsigned long long)b, nr, max_entries(n));
		r = -EILSEQ;
		goto out;
	}

	for (i = 0; i < nr; i++) {
		u64 k = key_at(n, i);

		if (k < lo || (has_hi && k >= hi) || (i && k <= key_at(n, i - 1))) {
			DMERR("btree node %llu: key %llu out of order or range",
			      (unsigned long long)b, (unsigned long long)k);
			r = -EILSEQ;
			goto out;
		}
	}

	for (i = 0; !r && i < nr; i++) {
		if (!is_leaf(n)) {
			bool last = i + 1 == nr;

			r = check_node(a, child_at(n, i), key_at(n, i),
				       last ? hi : key_at(n, i + 1),
				       last ? has_hi : true, depth + 1);
		} else if (a->value_fn) {
			r = a->value_fn(a->context, key_at(n, i), value_at(n, i));
		}
	}
out:
	tsp_tm_unlock(info->tm, blk);
	return r;
}

/**
 * tsp_btree_check - verify a tree's structure; see btree.h
 * @info: tree description
 * @root: the root
 * @node_fn: called for every reference to a node; may be NULL
 * @value_fn: called for every value; may be NULL
 * @context: for the callbacks
 */
int tsp_btree_check(struct tsp_btree_info *info, tsp_block_t root,
		    int (*node_fn)(void *context, tsp_block_t b),
		    int (*value_fn)(void *context, u64 key, void *value),
		    void *context)
{
	struct check_args a = {
		.info = info,
		.node_fn = node_fn,
		.value_fn = value_fn,
		.context = context,
	};

	return check_node(&a, root, 0, 0, false, 0);
}
