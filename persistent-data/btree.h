/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * btree.h - copy-on-write B+ trees of u64 keys and fixed size values in
 * metadata blocks, dm-thin's on-disk node format.
 *
 * A tree is named by its root block.  Every update takes the current root
 * and returns the new one (the nodes on the path are shadowed).  Subtrees
 * may be shared between trees (snapshots): a shared node is copied on
 * write and the reference counts of what it points to are incremented.
 * Values may themselves reference things (data blocks, other trees); the
 * value type's inc/dec callbacks keep those reference counts right when
 * a value is copied, overwritten or dropped.
 *
 * Costs: lookup, insert and remove touch O(log n) blocks.  Every function
 * may sleep.  Locking: as the transaction manager (the caller serialises).
 *
 * Return codes: 0; -ENODATA when a key is not present; -ENOMEM; -ENOSPC
 * when out of metadata space; -EILSEQ for a corrupt node; IO errors.
 * In the transaction manager's no-wait mode, -EWOULDBLOCK from a lookup,
 * or from an insert of a key not yet in the tree, means the operation
 * needed IO or a new block, and changed nothing.
 */
#ifndef TSP_BTREE_H
#define TSP_BTREE_H

#include "transaction-manager.h"

/**
 * struct tsp_btree_value_type - what the values of a tree are
 * @context: passed to the callbacks
 * @size: bytes per value (little-endian, as on disk)
 * @inc: take one more reference on what @value references, or NULL
 * @dec: drop a reference on what @value references, or NULL
 */
struct tsp_btree_value_type {
	void *context;
	u32 size;
	int (*inc)(void *context, const void *value);
	int (*dec)(void *context, const void *value);
};

struct tsp_btree_info {
	struct tsp_tm *tm;
	struct tsp_btree_value_type vt;
};

/* Create an empty tree (one empty leaf). */
int __must_check tsp_btree_empty(struct tsp_btree_info *info, tsp_block_t *root);

/* Drop one reference to a tree; frees what nobody else references. */
int __must_check tsp_btree_del(struct tsp_btree_info *info, tsp_block_t root);

/* @value may be NULL to test for presence only. */
int __must_check tsp_btree_lookup(struct tsp_btree_info *info, tsp_block_t root,
				  u64 key, void *value);

/* The first key >= @key and its value; -ENODATA if none. */
int __must_check tsp_btree_lookup_next(struct tsp_btree_info *info,
				       tsp_block_t root, u64 key,
				       u64 *found_key, void *value);

/* The highest key; -ENODATA if the tree is empty. */
int __must_check tsp_btree_find_highest_key(struct tsp_btree_info *info,
					    tsp_block_t root, u64 *key);

/**
 * tsp_btree_insert - insert or overwrite
 * @info: tree description
 * @root: current root
 * @key: key
 * @value: the new value; the tree takes over the caller's reference
 * @new_root: out, the root after the insert
 * @inserted: out (may be NULL), false when an old value was overwritten
 *	(the old value is dec'ed: overwriting a value with itself leaves
 *	its reference count as it was)
 */
int __must_check tsp_btree_insert(struct tsp_btree_info *info, tsp_block_t root,
				  u64 key, const void *value,
				  tsp_block_t *new_root, bool *inserted);

/**
 * struct tsp_btree_cursor - a leaf kept between inserts into one tree
 * @info: tree description
 * @leaf: the leaf of the last insert, write locked; NULL when none, or
 *	while the cursor is parked
 * @root: the root the walk to @leaf returned
 * @lo: the highest separator key on the way down to @leaf: the keys from
 *	@lo up to @hi belong in @leaf; lower ones take a walk
 * @hi: the lowest separator key past @leaf on the way down, or U64_MAX
 *	(that key itself always takes a walk)
 * @parked: where the leaf is while the cursor is parked, else 0
 * @kept: @leaf is kept (tsp_btree_cursor_keep()): readers may share it
 * @hits: inserts that went straight into the leaf, without a walk
 *
 * Start with TSP_BTREE_CURSOR(info).  Release it before anything else
 * updates the cursor's tree or shares it (a snapshot: the leaf would be
 * changed in place under both), and before a commit: a walk that
 * reached the locked leaf would fail (-EILSEQ, the block manager takes
 * it for a cycle in the tree).  Other trees may change meanwhile: none
 * of them shares the nodes of the walk to @leaf.
 *
 * A cursor may instead be parked (tsp_btree_cursor_park()) between
 * updates: it unlocks the leaf and remembers where it is, so anything
 * may read the tree meanwhile.  A parked cursor too must be released
 * before anything else updates its tree or shares it: the next insert
 * checks only that the leaf itself is still private to this transaction
 * (tsp_tm_relock_shadow()), not what points to it, nor whether its
 * block was freed and used again.  Parked across the end of its
 * transaction, it finds the leaf committed and walks down instead.
 *
 * Or a cursor may be kept (tsp_btree_cursor_keep()) from one update to
 * the next, and on: its leaf stays write locked, which saves the next
 * insert the lock, but readers may read the tree in between, the leaf
 * too.  A kept cursor must be parked or released before anything else
 * updates its tree or shares it, and before a commit: it is written in
 * place whatever happened.
 */
struct tsp_btree_cursor {
	struct tsp_btree_info *info;
	struct tsp_block *leaf;
	tsp_block_t root;
	u64 lo, hi;
	tsp_block_t parked;
	bool kept;
	u64 hits;
};

#define TSP_BTREE_CURSOR(btree_info) \
	((struct tsp_btree_cursor){ .info = (btree_info) })

/**
 * tsp_btree_insert_at - tsp_btree_insert() through a cursor
 * @cursor: the cursor; its tree is @cursor->info's
 * @root: current root
 * @key: key
 * @value: the new value; the tree takes over the caller's reference
 * @new_root: out, the root after the insert
 * @inserted: out, false when an old value was overwritten
 *
 * When @root is the cursor's and @key falls in its leaf's range, with
 * room in the leaf, @key goes straight into the leaf; otherwise this
 * walks down from @root as tsp_btree_insert() does and keeps the new
 * leaf.  Release the cursor after the last insert, failed or not.
 */
int __must_check tsp_btree_insert_at(struct tsp_btree_cursor *cursor,
				     tsp_block_t root, u64 key,
				     const void *value, tsp_block_t *new_root,
				     bool *inserted);

/**
 * tsp_btree_insert_new_at - insert through a cursor, unless the key is present
 * @cursor: the cursor; its tree is @cursor->info's
 * @root: current root
 * @key: key
 * @value: the new value; the tree takes over the caller's reference only
 *	if this returns 0
 * @new_root: out, the root afterwards, set on -EEXIST too: the way down
 *	may have shadowed or reshaped nodes before it found @key
 *
 * As tsp_btree_insert_at(), but a lookup and an insert in one: a present
 * key is left alone.
 *
 * Return: 0; -EEXIST if @key is present (its value is left as it was);
 * or another error, as tsp_btree_insert()'s.
 */
int __must_check tsp_btree_insert_new_at(struct tsp_btree_cursor *cursor,
					 tsp_block_t root, u64 key,
					 const void *value,
					 tsp_block_t *new_root);

/**
 * tsp_btree_cursor_release - unlock and forget the cursor's leaf
 * @cursor: the cursor, which may be used again afterwards
 */
void tsp_btree_cursor_release(struct tsp_btree_cursor *cursor);

/**
 * tsp_btree_cursor_park - unlock the cursor's leaf, but keep its place
 * @cursor: the cursor
 *
 * The next insert through the cursor into the leaf locks it again for
 * writing in place, without a walk down the tree; it walks down instead
 * if the leaf was committed meanwhile.  See struct tsp_btree_cursor for
 * what the owner must release it for.
 */
void tsp_btree_cursor_park(struct tsp_btree_cursor *cursor);

/**
 * tsp_btree_cursor_keep - keep the cursor's leaf write locked between inserts
 * @cursor: the cursor
 *
 * Readers may lock the leaf between inserts through the cursor, until it
 * is parked or released; see struct tsp_btree_cursor for what the owner
 * must park or release it for.  Keeping a kept cursor changes nothing.
 */
void tsp_btree_cursor_keep(struct tsp_btree_cursor *cursor);

/* Remove @key (dec'ing its value); -ENODATA if absent. */
int __must_check tsp_btree_remove(struct tsp_btree_info *info, tsp_block_t root,
				  u64 key, tsp_block_t *new_root);

/* Remove every key in [@begin, @end); @nr_removed may be NULL. */
int __must_check tsp_btree_remove_range(struct tsp_btree_info *info,
					tsp_block_t root, u64 begin, u64 end,
					tsp_block_t *new_root, u64 *nr_removed);

/* Call @fn for every key in order; a non-zero return stops the walk. */
int __must_check tsp_btree_walk(struct tsp_btree_info *info, tsp_block_t root,
				int (*fn)(void *context, u64 key, void *value),
				void *context);

/**
 * tsp_btree_check - verify a tree's structure
 * @info: tree description (value size)
 * @root: root block
 * @node_fn: called for every reference to a node (the root, and every
 *	child pointer), so counting calls gives reference counts; returns 0
 *	to descend into the node, 1 to skip it (already checked through
 *	another reference: only its key range is checked against this
 *	parent), or a negative errno to stop; may be NULL (descend always)
 * @value_fn: called for every value of every node descended into; may
 *	be NULL
 * @context: for the callbacks
 *
 * Checks checksums, locations, node flags, value size, entry counts
 * (non-root nodes at least a third full) and key order and ranges.
 * Returns 0 or -EILSEQ with a DMERR naming the block.
 */
int __must_check tsp_btree_check(struct tsp_btree_info *info, tsp_block_t root,
				 int (*node_fn)(void *context, tsp_block_t b),
				 int (*value_fn)(void *context, u64 key,
						 void *value),
				 void *context);

extern const struct tsp_block_validator tsp_btree_node_validator;

#endif /* TSP_BTREE_H */
