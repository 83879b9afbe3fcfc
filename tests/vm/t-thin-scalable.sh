#!/bin/bash
# VM tests of our targets, thin-scal-pool and thin-scalable: basic IO
# and status lines, snapshots, discard and isolation, zeroing (with WRITE
# ZEROES, and in blocks too big for one bio), flush durability (after an
# abort too), pool messages, out of data space, concurrent IO with a
# snapshot.
#
# TSP_POOL_TARGET=thin-pool TSP_THIN_TARGET=thin run the same tests against
# the stock dm-thin (scripts/vm-run --env ...): the baseline that proves a
# test's expectations are dm-thin's.
# shellcheck source=tests/vm/lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=tests/vm/t-thin-scalable-common.sh
. "$(dirname "$0")/t-thin-scalable-common.sh"

# --- 1. basic IO, status and table lines ----------------------------------

test_basic() {
	local thin=/dev/mapper/tss-thin0 exp s mm dm pm hi
	need_targets
	make_pool 512 0
	check_pool_status tss-pool
	s=$(dm_status tss-pool)
	log "new pool: $s"
	# trans id 0, 64 MiB = 16384 metadata blocks, 8192 data blocks, none
	# used, no held root, rw, queue, no needs_check, metadata low water
	# min(1024, 16384 / 4).
	[[ $s =~ ^0\ [0-9]+/16384\ 0/8192\ -\ rw\ (discard_passdown|no_discard_passdown)\ queue_if_no_space\ -\ 1024\ ?$ ]] ||
		fail "status of a new pool: '$s'"
	mm=$(devno /dev/mapper/tss-meta)
	dm=$(devno /dev/mapper/tss-data)
	assert_eq "0 1048576 $POOL_T $mm $dm 128 $LOW_WATER 0 " "$(dmsetup table tss-pool)" "pool table line"

	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 $((256 * 2048)) $THIN_T /dev/mapper/tss-pool 0"
	pm=$(devno /dev/mapper/tss-pool)
	assert_eq "0 524288 $THIN_T $pm 0" "$(dmsetup table tss-thin0)" "thin table line"
	assert_eq "0 -" "$(dm_status tss-thin0)" "status of a new thin device"

	# A new thin device reads as zeroes and reading maps nothing.
	assert_eq "$(zero_sha 16)" "$(dev_sha $thin 0 16)" "new thin device reads zeroes"
	assert_eq 0 "$(pool_used tss-pool)" "data blocks used after reads"

	# 32 MiB of random data at 0.
	head -c 32M /dev/urandom >pat1
	write_file pat1 $thin 0
	assert_eq "$(file_sha pat1)" "$(dev_sha $thin 0 32)" "pattern read back"
	if ours; then
		# Blocks written in order are allocated in order: the fast path
		# maps a read over several of them as one bio, not one per block.
		local f0 f1 kb
		kb=$(cat /sys/dev/block/"$(devno $thin)"/queue/max_sectors_kb)
		f0=$(pool_stat fast_ios)
		dd if=$thin of=/dev/null bs=1M count=1 skip=3 iflag=direct status=none
		f1=$(pool_stat fast_ios)
		log "a 1 MiB read (max_sectors_kb $kb): $((f1 - f0)) fast IOs"
		[ $((f1 - f0)) -le $(((1024 + kb - 1) / kb)) ] ||
			fail "a 1 MiB read of 16 consecutive blocks took $((f1 - f0)) fast IOs"
	fi
	exp=512
	assert_eq $exp "$(pool_used tss-pool)" "data blocks used after 32 MiB"
	assert_eq "$((exp * 128)) $((exp * 128 - 1))" "$(dm_status tss-thin0)" "thin status after 32 MiB"

	# 1 MiB at 200 MiB: the highest mapped sector moves.
	head -c 1M /dev/urandom >pat2
	write_file pat2 $thin 200
	exp=$((exp + 16))
	hi=$((201 * 2048 - 1))
	assert_eq "$((exp * 128)) $hi" "$(dm_status tss-thin0)" "thin status after writing at 200 MiB"

	# A 4 KiB write in the middle of an unprovisioned block: the rest of
	# the block reads as zeroes.
	head -c 4096 /dev/urandom >pat3
	dd if=pat3 of=$thin bs=4096 seek=$((100 * 256 + 2)) oflag=direct conv=notrunc,fsync status=none
	exp=$((exp + 1))
	{ head -c 8192 /dev/zero; cat pat3; head -c $((65536 - 12288)) /dev/zero; } >blk3
	assert_eq "$(file_sha blk3)" \
		"$(dd if=$thin bs=64k skip=1600 count=1 iflag=direct status=none | md5sum | cut -d' ' -f1)" \
		"a partly written new block"

	# fio random 4k writes with crc32c verification over 64..80 MiB.
	run_fio verify1 --filename=$thin --offset=64M --size=16M --rw=randwrite --bs=4k \
		--iodepth=16 --verify=crc32c --verify_fatal=1 --do_verify=1
	exp=$((exp + 256))
	assert_eq $exp "$(pool_used tss-pool)" "data blocks used after fio"

	# Unprovisioned ranges still read as zeroes, and mapping nothing.
	assert_eq "$(zero_sha 16)" "$(dev_sha $thin 40 16)" "zeroes between the patterns"
	assert_eq "$(zero_sha 8)" "$(dev_sha $thin 150 8)" "zeroes at 150..158 MiB"
	assert_eq $exp "$(pool_used tss-pool)" "data blocks used after reading holes"
	assert_eq "$(file_sha pat1)" "$(dev_sha $thin 0 32)" "pattern 1 after everything"
	assert_eq "$(file_sha pat2)" "$(dev_sha $thin 200 1)" "pattern 2 after everything"

	# Reopen the thin device: the same data.
	dm_remove tss-thin0
	dm_create tss-thin0 "0 $((256 * 2048)) $THIN_T /dev/mapper/tss-pool 0"
	assert_eq "$(file_sha pat1)" "$(dev_sha $thin 0 32)" "pattern 1 after reopening"
	assert_eq "$((exp * 128)) $hi" "$(dm_status tss-thin0)" "thin status after reopening"
	check_pool_status tss-pool

	dm_remove tss-thin0
	dm_remove tss-pool
	check_meta /dev/mapper/tss-meta
	thin_dump /dev/mapper/tss-meta >dump.xml
	assert_eq 1 "$(grep -c '<device ' dump.xml)" "devices in thin_dump"
	grep -q "<device dev_id=\"0\" mapped_blocks=\"$exp\"" dump.xml ||
		fail "thin_dump: device 0 should map $exp blocks: $(grep '<device ' dump.xml)"
	# And the pool opens again with the same counts.
	dm_create tss-pool "0 1048576 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 0"
	assert_eq "$exp" "$(pool_used tss-pool)" "data blocks used after reopening the pool"
	dm_create tss-thin0 "0 $((256 * 2048)) $THIN_T /dev/mapper/tss-pool 0"
	assert_eq "$(file_sha pat1)" "$(dev_sha $thin 0 32)" "pattern 1 after reopening the pool"
	dm_remove tss-thin0
	teardown_pool
}

# --- 3. snapshots -------------------------------------------------------

test_snapshots() {
	local o=/dev/mapper/tss-thin0 s1=/dev/mapper/tss-snap1 s2=/dev/mapper/tss-snap2 used
	need_targets
	make_pool 512 0
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	head -c 16M /dev/urandom >a
	write_file a $o 0
	assert_eq 256 "$(pool_used tss-pool)" "blocks after writing the origin"

	# Snapshot of the suspended origin shares every block.
	dmsetup suspend tss-thin0
	dm_message tss-pool "create_snap 1 0"
	dmsetup resume tss-thin0
	dm_create tss-snap1 "0 131072 $THIN_T /dev/mapper/tss-pool 1"
	assert_eq "$(file_sha a)" "$(dev_sha $s1 0 16)" "snapshot reads the origin's data"
	assert_eq 256 "$(pool_used tss-pool)" "a snapshot shares its blocks"
	assert_eq "$((256 * 128)) $((256 * 128 - 1))" "$(dm_status tss-snap1)" "snapshot's thin status"

	# Diverge: origin 0..8 MiB, snapshot 8..12 MiB.
	head -c 8M /dev/urandom >b
	head -c 4M /dev/urandom >c
	write_file b $o 0
	write_file c $s1 8
	assert_eq "$(file_sha b)" "$(dev_sha $o 0 8)" "origin's new data"
	assert_eq "$(part_sha a 8 8)" "$(dev_sha $o 8 8)" "origin's old data"
	assert_eq "$(part_sha a 0 8)" "$(dev_sha $s1 0 8)" "snapshot keeps the old data"
	assert_eq "$(file_sha c)" "$(dev_sha $s1 8 4)" "snapshot's new data"
	assert_eq "$(part_sha a 12 4)" "$(dev_sha $s1 12 4)" "snapshot's untouched tail"
	used=$((256 + 128 + 64))
	assert_eq $used "$(pool_used tss-pool)" "blocks after breaking sharing"

	# A partial-block write to a shared block copies the rest of it.
	head -c 4096 /dev/urandom >d
	dd if=d of=$o bs=4096 seek=$((12 * 256 + 5)) oflag=direct conv=notrunc,fsync status=none
	used=$((used + 1))
	{ part a $((12 * 1024 * 1024)) 20480; cat d; part a $((12 * 1024 * 1024 + 24576)) $((65536 - 24576)); } >blk
	assert_eq "$(file_sha blk)" \
		"$(dd if=$o bs=64k skip=192 count=1 iflag=direct status=none | md5sum | cut -d' ' -f1)" \
		"a shared block after a 4k write"
	assert_eq "$(part_sha a 12 1)" "$(dev_sha $s1 12 1)" "the snapshot's copy of it"
	assert_eq $used "$(pool_used tss-pool)" "blocks after a partial write"

	# Snapshot of the snapshot.
	dmsetup suspend tss-snap1
	dm_message tss-pool "create_snap 2 1"
	dmsetup resume tss-snap1
	dm_create tss-snap2 "0 131072 $THIN_T /dev/mapper/tss-pool 2"
	local s1sha
	s1sha=$(dev_sha $s1 0 16)
	assert_eq "$s1sha" "$(dev_sha $s2 0 16)" "snapshot of snapshot reads the same"
	head -c 2M /dev/urandom >e
	write_file e $s2 2
	assert_eq "$s1sha" "$(dev_sha $s1 0 16)" "snapshot 1 after writing snapshot 2"
	assert_eq "$(file_sha e)" "$(dev_sha $s2 2 2)" "snapshot 2's new data"
	used=$((used + 32))
	assert_eq $used "$(pool_used tss-pool)" "blocks after writing snapshot 2"

	# Delete snapshot 1 (the origin of snapshot 2): snapshot 2 is intact,
	# and the one range only snapshot 1 held goes: a's blocks 32..63,
	# which snapshot 2 overwrote with e.
	dm_remove tss-snap1
	dm_message tss-pool "delete 1"
	used=$((used - 32))
	assert_eq $used "$(pool_used tss-pool)" "blocks after deleting snapshot 1"
	assert_eq "$(part_sha a 0 2)" "$(dev_sha $s2 0 2)" "snapshot 2 after deleting 1 (0..2)"
	assert_eq "$(file_sha e)" "$(dev_sha $s2 2 2)" "snapshot 2 after deleting 1 (2..4)"
	assert_eq "$(part_sha a 4 4)" "$(dev_sha $s2 4 4)" "snapshot 2 after deleting 1 (4..8)"
	assert_eq "$(file_sha c)" "$(dev_sha $s2 8 4)" "snapshot 2 after deleting 1 (8..12)"
	assert_eq "$(part_sha a 12 4)" "$(dev_sha $s2 12 4)" "snapshot 2 after deleting 1 (12..16)"
	# Delete snapshot 2: frees what only it held: a's blocks 0..31 and
	# 64..127 (the origin has b there), e (32), c (64) and a's block 192
	# (the origin has its own copy since the 4k write).
	dm_remove tss-snap2
	dm_message tss-pool "delete 2"
	used=$((used - 32 - 64 - 32 - 64 - 1))
	assert_eq 256 $used "blocks the origin maps"
	assert_eq $used "$(pool_used tss-pool)" "blocks after deleting snapshot 2"
	assert_eq "$(file_sha b)" "$(dev_sha $o 0 8)" "origin after deleting its snapshots"
	dm_remove tss-thin0
	teardown_pool
	# After teardown_pool's thin_check: the pool held only device 0.
}

# --- 3b. external origin -----------------------------------------------------

# A thin device with an external origin of 10 MiB + 48 KiB (its last block
# is partial) reads the origin where it has nothing, zeroes past the
# origin's end; a partial write copies the origin's part of the block
# (zeroing the rest); a snapshot shares the origin; a discard makes a
# block read the origin again; the origin is never written.
test_external_origin() {
	local t=/dev/mapper/tss-thin0 s=/dev/mapper/tss-snap1 osz off
	need_targets
	TSS_RAM_DISKS=3 make_pool 64 0
	osz=$((10 * 2048 + 96))
	head -c $((osz * 512)) /dev/urandom >o
	dd if=o of=/dev/ram2 bs=1M oflag=direct status=none
	dm_create tss-origin "0 $osz linear /dev/ram2 0"
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 32768 $THIN_T /dev/mapper/tss-pool 0 /dev/mapper/tss-origin"
	assert_eq "0 32768 $THIN_T $(devno /dev/mapper/tss-pool) 0 $(devno /dev/mapper/tss-origin)" \
		"$(dmsetup table tss-thin0)" "thin table line with an external origin"

	cp o expect
	truncate -s 16M expect
	assert_eq "$(file_sha expect)" "$(dev_sha $t 0 16)" "reads: the origin, then zeroes"
	assert_eq 0 "$(pool_used tss-pool)" "reads provision nothing"

	# 4 KiB writes (KiB offsets): inside the origin, in the partial
	# block past the origin's end, past the origin; and a whole block.
	head -c 4096 /dev/urandom >w
	for off in $((3 * 64 + 8)) $((160 * 64 + 52)) $((200 * 64 + 12)); do
		dd if=w of=$t bs=1k seek=$off count=4 oflag=direct conv=notrunc status=none
		dd if=w of=expect bs=1k seek=$off count=4 conv=notrunc status=none
	done
	head -c 65536 /dev/urandom >b
	dd if=b of=$t bs=64k seek=5 count=1 oflag=direct conv=notrunc status=none
	dd if=b of=expect bs=64k seek=5 count=1 conv=notrunc status=none
	assert_eq 4 "$(pool_used tss-pool)" "blocks after the writes"
	assert_eq "$(file_sha expect)" "$(dev_sha $t 0 16)" "after partial and whole-block writes"
	assert_eq "$(file_sha o)" "$(file_sha /dev/mapper/tss-origin)" "the origin is unchanged"

	# A snapshot shares the origin and the blocks; its writes diverge.
	dmsetup suspend tss-thin0
	dm_message tss-pool "create_snap 1 0"
	dmsetup resume tss-thin0
	dm_create tss-snap1 "0 32768 $THIN_T /dev/mapper/tss-pool 1 /dev/mapper/tss-origin"
	assert_eq "$(file_sha expect)" "$(dev_sha $s 0 16)" "the snapshot reads the same"
	cp expect expect1
	dd if=w of=$s bs=1k seek=$((7 * 64 + 20)) count=4 oflag=direct conv=notrunc status=none
	dd if=w of=expect1 bs=1k seek=$((7 * 64 + 20)) count=4 conv=notrunc status=none
	dd if=w of=$s bs=1k seek=$((3 * 64 + 40)) count=4 oflag=direct conv=notrunc status=none
	dd if=w of=expect1 bs=1k seek=$((3 * 64 + 40)) count=4 conv=notrunc status=none
	assert_eq "$(file_sha expect1)" "$(dev_sha $s 0 16)" "the snapshot after its writes"
	assert_eq "$(file_sha expect)" "$(dev_sha $t 0 16)" "the origin thin after the snapshot's writes"

	# Discarding block 3 of thin 0: it reads the origin again.
	blkdiscard -o $((3 * 65536)) -l 65536 $t
	dd if=o of=expect bs=64k skip=3 seek=3 count=1 conv=notrunc status=none
	assert_eq "$(file_sha expect)" "$(dev_sha $t 0 16)" "a discarded block reads the origin"
	assert_eq "$(file_sha o)" "$(file_sha /dev/mapper/tss-origin)" "the origin is still unchanged"

	# The pool as its own origin is refused.
	expect_fail dmsetup create tss-bad --table "0 32768 $THIN_T /dev/mapper/tss-pool 0 /dev/mapper/tss-pool"
	dm_remove tss-snap1
	dm_remove tss-thin0
	dm_remove tss-origin
	teardown_pool
}

# --- 4. discard -----------------------------------------------------------

test_discard() {
	local t=/dev/mapper/tss-thin0 i n
	need_targets
	make_pool 512 0
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	head -c 16M /dev/urandom >a
	write_file a $t 0
	assert_eq 256 "$(pool_used tss-pool)" "blocks after 16 MiB"

	blkdiscard -o $((4 << 20)) -l $((8 << 20)) $t
	assert_eq "$(zero_sha 8)" "$(dev_sha $t 4 8)" "discarded range reads zeroes"
	assert_eq "$(part_sha a 0 4)" "$(dev_sha $t 0 4)" "data before the discarded range"
	assert_eq "$(part_sha a 12 4)" "$(dev_sha $t 12 4)" "data after the discarded range"
	assert_eq 128 "$(pool_used tss-pool)" "blocks after discarding 8 MiB"
	assert_eq "$((128 * 128))" "$(dm_status tss-thin0 | cut -d' ' -f1)" "mapped sectors after the discard"

	# A discard not aligned to blocks unmaps only the blocks inside it:
	# 12M+4K .. 16M-4K holds blocks 193..254.
	blkdiscard -o $(((12 << 20) + 4096)) -l $(((4 << 20) - 8192)) $t
	assert_eq 66 "$(pool_used tss-pool)" "blocks after an unaligned discard"
	assert_eq "$(part a $((12 << 20)) 4096 | md5sum | cut -d' ' -f1)" \
		"$(dd if=$t bs=4096 skip=$((12 * 256)) count=1 iflag=direct status=none | md5sum | cut -d' ' -f1)" \
		"the 4k before an unaligned discard"
	assert_eq "$(part a $(((16 << 20) - 4096)) 4096 | md5sum | cut -d' ' -f1)" \
		"$(dd if=$t bs=4096 skip=$((16 * 256 - 1)) count=1 iflag=direct status=none | md5sum | cut -d' ' -f1)" \
		"the 4k after an unaligned discard"
	assert_eq "$(zero_sha 2)" "$(dev_sha $t 13 2)" "blocks inside the unaligned discard"

	# Rewrite the discarded range: provisioned again, reads what we wrote.
	head -c 8M /dev/urandom >b
	write_file b $t 4
	assert_eq "$(file_sha b)" "$(dev_sha $t 4 8)" "rewritten range"
	assert_eq 194 "$(pool_used tss-pool)" "blocks after rewriting"
	blkdiscard $t
	if ours; then
		# A discarded block waits for the next commit before it is
		# allocated again: the status line's commits at once, the
		# waker's within a second (hence a few tries).
		for i in 1 2 3 4 5; do
			head -c 64K /dev/urandom >c
			write_file c $t 0
			dm_status tss-pool >/dev/null
			blkdiscard -l 65536 $t
			n=$(pool_stat freed_blocks_waiting)
			[[ $n == [01] ]] || fail "freed blocks waiting after discarding one: $n"
			[ "$n" = 0 ] || break
		done
		assert_eq 1 "$n" "freed blocks waiting after discarding one block, $i tries"
		dm_status tss-pool >/dev/null
		# Held until the passdown, if any, is done.
		eventually_eq 0 "freed blocks waiting after commit" pool_stat freed_blocks_waiting
	fi
	assert_eq 0 "$(pool_used tss-pool)" "blocks after discarding everything"
	assert_eq "0 -" "$(dm_status tss-thin0)" "thin status after discarding everything"
	dm_remove tss-thin0
	teardown_pool
}

queue_limit() { # <block device> <sysfs queue limit>
	cat "/sys/dev/block/$(devno "$1")/queue/$2"
}

# With ignore_discard neither the pool nor its thin devices take discards
# (as dm-thin's), and no reload changes a pool's discard support: its thin
# targets took theirs from it.
test_ignore_discard() {
	local t=/dev/mapper/tss-thin0
	local table="0 $((64 * 2048)) $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER"
	need_targets
	make_pool 64 1 ignore_discard
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	assert_eq 0 "$(queue_limit $t discard_max_bytes)" "thin discard_max_bytes with ignore_discard"
	assert_eq 0 "$(queue_limit /dev/mapper/tss-pool discard_max_bytes)" "pool discard_max_bytes with ignore_discard"
	head -c 1M /dev/urandom >a
	write_file a $t 0
	expect_fail blkdiscard -o 0 -l 1M $t
	assert_eq 16 "$(pool_used tss-pool)" "blocks after a refused discard"
	expect_fail dmsetup reload tss-pool --table "$table 0"
	dm_remove tss-thin0
	dm_remove tss-pool
	check_meta

	dm_create tss-pool "$table 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	[ "$(queue_limit $t discard_max_bytes)" -gt 0 ] || fail "thin device without discards"
	# A pool passing discards down has its data device's discard limits
	# (none, if the data device takes no discards).
	assert_eq "$(queue_limit /dev/mapper/tss-data discard_max_bytes)" \
		"$(queue_limit /dev/mapper/tss-pool discard_max_bytes)" \
		"pool discard_max_bytes passing discards down"
	expect_fail dmsetup reload tss-pool --table "$table 1 ignore_discard"
	assert_eq "$(file_sha a)" "$(dev_sha $t 0 1)" "data written before"
	blkdiscard -o 0 -l 1M $t
	assert_eq 0 "$(pool_used tss-pool)" "blocks after the discard"
	dm_remove tss-thin0
	teardown_pool
}

# Isolation: blocks discarded from one device and provisioned again for
# another read as zeroes there. A full 256-block pool forces the reuse; no
# discard passdown, so the old data is still on the data device.
#
# The blocks a discard frees are free after the next commit: the first
# write after the discard finds the pool out of data space, and (in queue
# mode) waits for that commit, at most a second away (dm-thin: commit()
# -> check_for_data_space() -> write mode, requeue). A short
# no_space_timeout makes a pool that does not come back fail the test.
test_discard_isolation() {
	local a=/dev/mapper/tss-a b=/dev/mapper/tss-b i old_timeout
	need_targets
	old_timeout=$(cat "$NO_SPACE_TIMEOUT")
	# shellcheck disable=SC2064
	trap "echo $old_timeout >$NO_SPACE_TIMEOUT" EXIT
	echo 10 >"$NO_SPACE_TIMEOUT"
	make_pool 16 1 no_discard_passdown
	assert_eq 0 "$(queue_limit /dev/mapper/tss-pool discard_max_bytes)" \
		"pool discard_max_bytes with no_discard_passdown"
	dm_message tss-pool "create_thin 0"
	dm_message tss-pool "create_thin 1"
	dm_create tss-a "0 65536 $THIN_T /dev/mapper/tss-pool 0"
	dm_create tss-b "0 65536 $THIN_T /dev/mapper/tss-pool 1"
	head -c 16M /dev/urandom >pa
	write_file pa $a 0
	assert_eq "256/256" "$(dm_status tss-pool | cut -d' ' -f3)" "a full pool"

	# Discard half of A, and at once (no status, which would commit)
	# write 4 KiB at 8 KiB into each of 128 blocks of B (fio: 4k written,
	# 60k skipped), verified by fio.  Both sides of it must be zeroed.
	log "before the discard: $(dm_status tss-pool)"
	blkdiscard -o 0 -l $((8 << 20)) $a
	run_fio holes --filename=$b --rw=write:60k --bs=4k --offset=8k --size=8M \
		--verify=crc32c --verify_fatal=1 --do_verify=1
	sync
	assert_eq "256/256" "$(dm_status tss-pool | cut -d' ' -f3)" "the pool is full again"
	# The 8k before and 52k after each 4k written are zeroes, not A's
	# old data.
	dd if=$b of=b.img bs=1M count=8 iflag=direct status=none
	check_zeroed_around b.img 128 8192 ||
		fail "B's new blocks are not zeroed (data leaked from A?)"
	assert_eq "$(part_sha pa 8 8)" "$(dev_sha $a 8 8)" "A's remaining data"
	assert_eq "$(zero_sha 8)" "$(dev_sha $a 0 8)" "A's discarded half"
	check_pool_status tss-pool
	assert_eq rw "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode"
	dm_remove tss-a
	dm_remove tss-b
	teardown_pool
}

# Discards passed down reach the data device: here a stock thin volume,
# whose own pool counts the blocks it still maps.  They go down with the
# commit after the discard (after the IO grace period; dmsetup status
# commits), and only for blocks no other device still maps.
# passdown_pool <sectors> [<data table>]: our pool of <sectors>, with thin
# device 0, passing discards down to a stock thin volume (tss-lt, of the
# pool tss-lower), through a linear table or <data table> over it.
passdown_pool() {
	local sectors=$1
	brd_setup 3 512
	dm_create tss-lower "0 1048576 thin-pool /dev/ram1 /dev/ram2 128 0 0"
	dm_message tss-lower "create_thin 0"
	dm_create tss-lt "0 $sectors thin /dev/mapper/tss-lower 0"
	dm_create tss-data "${2:-0 $sectors linear /dev/mapper/tss-lt 0}"
	dm_create tss-meta "0 131072 linear /dev/ram0 0"
	dm_create tss-pool "0 $sectors $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 0"
	assert_eq discard_passdown "$(dm_status tss-pool | cut -d' ' -f6)" "passdown to a thin volume"
	dm_message tss-pool "create_thin 0"
}

teardown_passdown_pool() {
	teardown_pool
	dm_remove tss-lt
	dm_remove tss-lower
	check_meta /dev/ram1
}

test_discard_passdown() {
	local t=/dev/mapper/tss-thin0 before
	need_targets
	passdown_pool 524288
	dm_create tss-thin0 "0 65536 $THIN_T /dev/mapper/tss-pool 0"
	head -c 16M /dev/urandom >a
	write_file a $t 0
	# A snapshot shares the first 4 MiB: those blocks stay.
	dmsetup suspend tss-thin0
	dm_message tss-pool "create_snap 1 0"
	dmsetup resume tss-thin0
	dm_create tss-snap "0 65536 $THIN_T /dev/mapper/tss-pool 1"
	blkdiscard -o $((4 << 20)) -l $((12 << 20)) /dev/mapper/tss-snap
	assert_eq 256 "$(pool_used tss-lower)" "blocks the lower pool maps before the discards"

	blkdiscard -o 0 -l $((12 << 20)) $t
	dm_status tss-pool >/dev/null	# commits, and passes down without waiting
	assert_eq 128 "$(pool_used tss-pool)" "our blocks after the discards"
	eventually_eq 128 "blocks the lower pool maps after the discards" pool_used tss-lower
	assert_eq "$(part_sha a 0 4)" "$(dev_sha /dev/mapper/tss-snap 0 4)" "the snapshot's data"
	assert_eq "$(part_sha a 12 4)" "$(dev_sha $t 12 4)" "the origin's data after the discard"

	# 1024 discards of every other block of 128 MiB free as many runs of
	# one block: more than the pool keeps waiting for the commit, so the
	# discard that reaches the bound commits, which passes them down.
	dm_message tss-pool "create_thin 2"
	dm_create tss-thin2 "0 262144 $THIN_T /dev/mapper/tss-pool 2"
	head -c 128M /dev/urandom >b
	write_file b /dev/mapper/tss-thin2 0
	before=$(pool_used tss-lower)
	run_fio trims --filename=/dev/mapper/tss-thin2 --ioengine=psync --rw=trim:64k \
		--bs=64k --size=128M
	assert_eq $((128 + 1024)) "$(pool_used tss-pool)" "our blocks after 1024 discards"
	eventually_eq $((before - 1024)) "blocks the lower pool maps after 1024 discards" \
		pool_used tss-lower
	assert_eq "$(part b 65536 65536 | md5sum | cut -d' ' -f1)" \
		"$(dd if=/dev/mapper/tss-thin2 bs=64k skip=1 count=1 iflag=direct status=none | md5sum | cut -d' ' -f1)" \
		"a block between the discarded ones"
	dm_remove tss-thin2
	dm_remove tss-snap
	dm_remove tss-thin0
	teardown_passdown_pool
}

# The commit that passes discards down does not wait for them (dm-thin
# does not either): the blocks stay held back from allocation until they
# are done.  The data device delays writes, discards among them, by 10 s
# (dm-delay over a stock thin volume, which takes discards): right after
# the status line's commit the freed blocks still wait, and then go.
test_passdown_no_wait() {
	local t=/dev/mapper/tss-thin0 lower=/dev/mapper/tss-lt before
	local delay="0 524288 delay $lower 0 0 $lower 0"
	need_targets
	ours || skip "dm-thin passes discards down before their commit"
	modprobe dm-delay || skip "no dm-delay"
	passdown_pool 524288 "$delay 0 $lower 0 0"
	dm_create tss-thin0 "0 65536 $THIN_T /dev/mapper/tss-pool 0"
	head -c 4M /dev/urandom >a
	write_file a $t 0
	dm_status tss-pool >/dev/null	# commits
	before=$(pool_used tss-lower)

	dmsetup reload tss-data --table "$delay 10000 $lower 0 0"
	dmsetup suspend tss-data
	dmsetup resume tss-data
	blkdiscard -o 0 -l $((4 << 20)) $t
	dm_status tss-pool >/dev/null	# commits, passes down
	assert_eq 64 "$(pool_stat freed_blocks_waiting)" "blocks held while their discards wait"
	assert_eq "$before" "$(pool_used tss-lower)" "lower pool's blocks while the discards wait"
	eventually_eq 0 "blocks held once the discards are done" pool_stat freed_blocks_waiting
	assert_eq $((before - 64)) "$(pool_used tss-lower)" "lower pool's blocks after the discards"
	dm_remove tss-thin0
	teardown_passdown_pool
}

# A full pool whose writes wait for space gets it back from a discard
# passed down: the blocks are allocated again once their discards are
# done, and the waiting write goes through.  The data device is a stock
# thin volume, which takes discards.
test_passdown_frees_full_pool() {
	local t=/dev/mapper/tss-thin0 pid
	need_targets
	passdown_pool 32768
	dm_create tss-thin0 "0 65536 $THIN_T /dev/mapper/tss-pool 0"
	head -c 20M /dev/urandom >a
	dd if=a of=$t bs=1M count=16 oflag=direct conv=notrunc status=none ||
		fail "filling the pool failed"
	assert_eq "256/256" "$(dm_status tss-pool | cut -d' ' -f3)" "data blocks when full"

	dd if=a of=$t bs=1M skip=16 seek=16 count=4 oflag=direct conv=notrunc status=none &
	pid=$!
	eventually_eq out_of_data_space "pool mode with a write waiting" pool_mode tss-pool
	blkdiscard -o 0 -l $((8 << 20)) $t
	wait $pid || fail "the write waiting for space failed"
	assert_eq rw "$(pool_mode tss-pool)" "pool mode after the discard"
	assert_eq "$(part_sha a 8 12)" "$(dev_sha $t 8 12)" "data after the discard"
	assert_eq "$(zero_sha 8)" "$(dev_sha $t 0 8)" "the discarded range"
	dm_remove tss-thin0
	teardown_passdown_pool
}

# A data device that offers WRITE ZEROES gets the rest of each new block
# zeroed with it, not with written pages (stock dm-thin 6.1 writes them).
# A loop device over a tmpfs file offers it by punching holes: the file
# loses the 60k around each 4k written.  The file starts all 0xff, so a
# block left unzeroed shows.
test_zeroing_offload() {
	local t=/dev/mapper/tss-t loop before after
	need_targets
	ours || skip "stock dm-thin writes its zeroes"
	modprobe loop || skip "no loop module"
	mkdir wz
	mount -t tmpfs -o size=80m none wz
	perl -e 'print "\xff" x 1048576 for 1 .. 64' >wz/data
	loop=$(losetup -f --show wz/data)
	[ "$(cat "/sys/block/${loop#/dev/}/queue/write_zeroes_max_bytes")" -gt 0 ] ||
		skip "the loop device offers no WRITE ZEROES"
	brd_setup 1 64
	dd if=/dev/zero of=/dev/ram0 bs=4096 count=1 oflag=direct status=none
	dm_create tss-pool "0 131072 $POOL_T /dev/ram0 $loop 128 $LOW_WATER 0"
	dm_message tss-pool "create_thin 0"
	dm_create tss-t "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	before=$(du -k wz/data | cut -f1)
	run_fio holes --filename=$t --rw=write:60k --bs=4k --offset=8k --size=32M \
		--verify=crc32c --verify_fatal=1 --do_verify=1
	after=$(du -k wz/data | cut -f1)
	log "data file: $before KiB allocated, $after KiB after 512 first writes"
	[ $((before - after)) -ge $((512 * 60)) ] ||
		fail "new blocks were not zeroed with WRITE ZEROES ($before -> $after KiB)"
	dd if=$t of=t.img bs=1M count=32 iflag=direct status=none
	check_zeroed_around t.img 512 8192 || fail "new blocks not zeroed"
	dm_remove tss-t
	dm_remove tss-pool
	check_meta /dev/ram0
	losetup -d "$loop"
	umount wz
}

# A data device that offers WRITE ZEROES and refuses it: a loop device
# over a file of a FAT file system, which cannot punch holes (loop turns
# WRITE ZEROES into one).  First writes still succeed, zeroed by writing
# (as blkdev_issue_zeroout() falls back), and the pool says so once.
test_zeroing_offload_refused() {
	local t=/dev/mapper/tss-t loop
	need_targets
	ours || skip "stock dm-thin writes its zeroes"
	command -v mkfs.vfat >/dev/null || skip "no mkfs.vfat"
	modprobe loop && modprobe vfat || skip "no loop or vfat module"
	mkdir wz fat
	mount -t tmpfs -o size=80m none wz
	truncate -s 72M wz/fat.img
	mkfs.vfat wz/fat.img >/dev/null
	mount -t vfat -o loop wz/fat.img fat
	perl -e 'print "\xff" x 1048576 for 1 .. 64' >fat/data
	if fallocate -p -o 0 -l 4096 fat/data 2>/dev/null; then
		umount fat
		umount wz
		skip "the file system punches holes"
	fi
	loop=$(losetup -f --show fat/data)
	[ "$(cat "/sys/block/${loop#/dev/}/queue/write_zeroes_max_bytes")" -gt 0 ] ||
		fail "the loop device offers no WRITE ZEROES"
	brd_setup 1 64
	dd if=/dev/zero of=/dev/ram0 bs=4096 count=1 oflag=direct status=none
	dm_create tss-pool "0 131072 $POOL_T /dev/ram0 $loop 128 $LOW_WATER 0"
	dm_message tss-pool "create_thin 0"
	dm_create tss-t "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	run_fio holes --filename=$t --rw=write:60k --bs=4k --offset=8k --size=8M \
		--verify=crc32c --verify_fatal=1 --do_verify=1
	dd if=$t of=t.img bs=1M count=8 iflag=direct status=none
	check_zeroed_around t.img 128 8192 || fail "new blocks not zeroed"
	assert_eq 128 "$(pool_used tss-pool)" "blocks after 128 first writes"
	assert_eq 1 "$(dmesg_since_test | grep -c "WRITE ZEROES failed.*writing zeroes instead")" \
		"warnings of the refused WRITE ZEROES"
	dm_remove tss-t
	dm_remove tss-pool
	check_meta /dev/ram0
	losetup -d "$loop"
	umount fat
	umount wz
}

# zeroing_around <block sectors> <blocks written whole>: first writes to
# parts of new blocks read back with zeroes around their data.  A block
# that fits in one bio with the data is written whole in one bio, a
# bigger one beside zeroing bios (blocks_written_whole in the stats
# message counts the former: all 9 or none).  4k at 8k into each of
# eight blocks (fio, verified), then 1536 bytes at sector 17 of the
# ninth, which ends no page.  The data device starts all 0xff, so a
# block left unzeroed shows.
zeroing_around() {
	local t=/dev/mapper/tss-t bs=$(($1 * 512)) whole=$2 mib n
	mib=$(((10 * bs >> 20) > 64 ? 10 * bs >> 20 : 64))
	need_targets
	brd_setup 2 "$mib"
	perl -e 'print "\xff" x 1048576 for 1 .. '"$mib" |
		dd of=/dev/ram1 bs=1M iflag=fullblock oflag=direct status=none
	dd if=/dev/zero of=/dev/ram0 bs=4096 count=1 oflag=direct status=none
	dm_create tss-pool "0 $((mib * 2048)) $POOL_T /dev/ram0 /dev/ram1 $1 $LOW_WATER 0"
	dm_message tss-pool "create_thin 0"
	dm_create tss-t "0 $((mib * 2048)) $THIN_T /dev/mapper/tss-pool 0"
	run_fio holes --filename=$t --rw=write:$((bs / 1024 - 4))k --bs=4k --offset=8k \
		--size=$((8 * bs)) --verify=crc32c --verify_fatal=1 --do_verify=1
	dd if=$t of=t.img bs="$bs" count=8 iflag=direct status=none
	check_zeroed_around t.img 8 8192 "$bs" || fail "new blocks of $bs bytes not zeroed"
	rm -f t.img
	head -c 1536 /dev/urandom >piece
	dd if=piece of=$t bs=512 seek=$((8 * $1 + 17)) oflag=direct status=none ||
		fail "writing 1536 bytes at sector 17 of a new block failed"
	{ head -c $((17 * 512)) /dev/zero; cat piece; head -c $((bs - 17 * 512 - 1536)) /dev/zero; } |
		cmp -s - <(dd if=$t bs="$bs" skip=8 count=1 iflag=direct status=none) ||
		fail "a new block is not 1536 bytes of data at sector 17 with zeroes around"
	if ours; then
		n=$(pool_stat blocks_written_whole)
		log "blocks written whole in one bio: $n of 9"
		[ "$n" = "$whole" ] ||
			fail "$n of 9 new blocks of $bs bytes written whole, not $whole"
	fi
	dm_remove tss-t
	dm_remove tss-pool
	check_meta /dev/ram0
}

test_zeroing_around() {
	zeroing_around 128 9
}

# 2 MiB blocks: more pages than a bio holds, but 32 vectors of zeroes.
test_zeroing_big_blocks() {
	zeroing_around 4096 9
}

# 32 MiB blocks: more vectors of zeroes than a bio holds.
test_zeroing_huge_blocks() {
	zeroing_around 65536 0
}

# --- 4c. a commit that fails passes nothing down ----------------------------

# Blocks that discards free are passed down only once the commit that
# frees them has succeeded.  When it fails, the pool's last committed
# metadata maps them still, and their data must be there.  (Stock dm-thin
# passes them down before the commit: not tested there.)
test_passdown_failed_commit() {
	local t=/dev/mapper/tss-thin0 used s
	local meta_line="0 131072 linear /dev/ram0 0"
	local pool_line="0 524288 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 0"
	need_targets
	ours || skip "dm-thin passes discards down before their commit"
	passdown_pool 524288
	dm_create tss-thin0 "0 65536 $THIN_T /dev/mapper/tss-pool 0"
	head -c 4M /dev/urandom >a
	write_file a $t 0
	dm_status tss-pool >/dev/null	# commits
	used=$(pool_used tss-lower)

	# Fail the metadata device's IO, then discard it all: the discard
	# works in the metadata in core, and the commit that would free its
	# blocks (the next, whether the waker's or the status line's) fails.
	dmsetup reload tss-meta --table "0 131072 error"
	dmsetup resume tss-meta
	blkdiscard -o 0 -l $((4 << 20)) $t || fail "the discard failed"
	# Unmapped, or failed already: the waker's commit, which came since,
	# found the discard's change (it commits only a changed transaction).
	# Error: the commit has failed and the pool is not in fail mode yet
	# (its abort, which fails too, is under way), as with dm-thin.
	s=$(dm_status tss-thin0)
	[[ $s == "0 -" || $s == Fail || $s == Error ]] ||
		fail "thin status after the discard: '$s'"
	dm_status tss-pool >/dev/null
	[ "$(dm_status tss-pool | cut -d' ' -f2)" = Fail ] ||
		fail "the pool did not fail with its metadata device: $(dm_status tss-pool)"
	assert_eq "$used" "$(pool_used tss-lower)" "blocks the lower pool maps after a failed commit"
	dm_remove tss-thin0
	dm_remove tss-pool
	dmsetup reload tss-meta --table "$meta_line"
	dmsetup resume tss-meta
	check_meta

	dm_create tss-pool "$pool_line"
	dm_create tss-thin0 "0 65536 $THIN_T /dev/mapper/tss-pool 0"
	assert_eq "$(file_sha a)" "$(dev_sha $t 0 4)" "data of blocks whose discard was rolled back"
	dm_remove tss-thin0
	teardown_passdown_pool
}

# --- 4b. data device errors --------------------------------------------------

# set_data_table <table>: swap tss-data's table under the live pool.
set_data_table() {
	dmsetup suspend tss-data &&
		dmsetup load tss-data --table "$1" &&
		dmsetup resume tss-data || fail "swapping tss-data's table to '$1' failed"
}

# A first write whose data IO fails (a partial write with zeroing, a
# whole-block write, a break of sharing) fails with EIO and leaves the
# block unmapped: the data block allocated for it is given back, so the
# pool's used count does not move (dm-thin keeps them allocated).
test_data_write_error() {
	local t=/dev/mapper/tss-t s=/dev/mapper/tss-s used
	need_targets
	make_pool 64 0
	dm_message tss-pool "create_thin 0"
	dm_create tss-t "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	dd if=/dev/urandom of=$t bs=64k count=1 oflag=direct status=none
	dm_message tss-pool "create_snap 1 0"
	dm_create tss-s "0 131072 $THIN_T /dev/mapper/tss-pool 1"
	used=$(pool_used tss-pool)

	set_data_table "0 $((64 * 2048)) error"
	! dd if=/dev/urandom of=$t bs=4k seek=33 count=1 oflag=direct status=none 2>/dev/null ||
		fail "a partial first write to a failing data device succeeded"
	! dd if=/dev/urandom of=$t bs=64k seek=5 count=1 oflag=direct status=none 2>/dev/null ||
		fail "a whole-block first write to a failing data device succeeded"
	! dd if=/dev/urandom of=$s bs=4k seek=1 count=1 oflag=direct status=none 2>/dev/null ||
		fail "breaking sharing on a failing data device succeeded"
	set_data_table "0 $((64 * 2048)) linear /dev/ram1 0"

	if ours; then
		[ "$(pool_used tss-pool)" = "$used" ] ||
			fail "failed first writes left data blocks allocated: $used used before, $(pool_used tss-pool) after"
	else
		log "stock dm-thin keeps the blocks: $used used before, $(pool_used tss-pool) after"
	fi
	[ "$(dev_sha $t 0 1)" = "$(dev_sha $s 0 1)" ] ||
		fail "the snapshot changed after a failed write broke sharing"
	dd if=$t bs=64k skip=5 count=1 iflag=direct status=none | cmp -s - <(head -c 65536 /dev/zero) ||
		fail "a block whose first write failed does not read as zeroes"
	dm_status tss-pool | grep -qw rw || fail "the pool left write mode: $(dm_status tss-pool)"
	run_fio again --filename=$t --rw=write --bs=4k --offset=2M --size=256k \
		--verify=crc32c --verify_fatal=1 --do_verify=1
	dm_remove tss-s
	dm_remove tss-t
	teardown_pool
}

# The last commit of a pool being removed flushes the data device first,
# as every commit does.  With the data device failing flushes (dm-flakey
# erroring writes, over a loop device: a device without a write cache,
# such as brd, never sees a flush), a transaction that unmapped a block
# must be dropped, not committed by the metadata's close behind data that
# may not be on disk.  dm-thin's close flushes too.
test_teardown_failed_flush() {
	local t=/dev/mapper/tss-thin0 loop flakey pool
	need_targets
	modprobe loop || skip "no loop module"
	modprobe dm-flakey 2>/dev/null || true
	dmsetup targets | grep -q '^flakey ' || skip "no dm-flakey"
	mkdir tf
	mount -t tmpfs -o size=80m none tf
	truncate -s 64M tf/data
	loop=$(losetup -f --show tf/data)
	[ "$(cat "/sys/block/${loop#/dev/}/queue/write_cache")" = "write back" ] ||
		skip "the loop device has no write cache: no flush would reach dm-flakey"
	flakey="0 131072 flakey $loop 0"
	brd_setup 1 64
	dm_create tss-meta "0 131072 linear /dev/ram0 0"
	dd if=/dev/zero of=/dev/mapper/tss-meta bs=4096 count=1 oflag=direct status=none
	dm_create tss-data "$flakey 3600 0"	# up for an hour
	pool="0 131072 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data"
	dm_create tss-pool "$pool 128 $LOW_WATER 1 no_discard_passdown"
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	# FUA: blocks 0 to 3 mapped and committed.
	dd if=/dev/urandom of=$t bs=64k count=4 oflag=direct,sync status=none
	set_data_table "$flakey 0 3600 1 error_writes"	# down: writes fail
	blkdiscard -o 0 -l 65536 $t || fail "the discard failed"
	dm_remove tss-thin0
	dm_remove tss-pool
	check_meta
	thin_dump /dev/mapper/tss-meta >d.xml
	assert_eq 4 "$(dump_mapped_in d.xml 0 0 4)" \
		"blocks mapped after a removal whose data device flush failed"
	dm_remove tss-data
	dm_remove tss-meta
	losetup -d "$loop"
	umount tf
}

# --- 5. flush and durability ------------------------------------------------

# Data blocks of device <id> mapped in thin_dump output <file> within
# virtual blocks [<begin>, <end>).
dump_mapped_in() {
	awk -v id="$2" -v b="$3" -v e="$4" '
		/<device / { match($0, /dev_id="[0-9]+"/); cur = substr($0, RSTART + 8, RLENGTH - 9) }
		/<\/device>/ { cur = "" }
		cur == id && /<single_mapping / {
			match($0, /origin_block="[0-9]+"/); o = substr($0, RSTART + 14, RLENGTH - 15) + 0
			if (o >= b && o < e) n++
		}
		cur == id && /<range_mapping / {
			match($0, /origin_begin="[0-9]+"/); o = substr($0, RSTART + 14, RLENGTH - 15) + 0
			match($0, /length="[0-9]+"/); l = substr($0, RSTART + 8, RLENGTH - 9) + 0
			lo = o > b ? o : b; hi = o + l < e ? o + l : e
			if (hi > lo) n += hi - lo
		}
		END { print n + 0 }' "$1"
}

# Freeze the metadata device and copy what is on it now (the last
# committed transaction and whatever has been written since) to /dev/ram2
# (thin_check wants O_DIRECT: no file on tmpfs), and thin_dump it to <file>.
meta_image() {
	dmsetup suspend tss-meta
	dd if=/dev/ram0 of=/dev/ram2 bs=1M count=$META_MIB iflag=direct oflag=direct status=none
	dmsetup resume tss-meta
	thin_check /dev/ram2 >check.log 2>&1 || { cat check.log; fail "thin_check of the metadata image ($1)"; }
	thin_dump /dev/ram2 >"$1"
}

test_flush_durability() {
	local t=/dev/mapper/tss-thin0 TSS_RAM_DISKS=3
	need_targets
	make_pool 512 0
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"

	# FUA: O_DIRECT|O_SYNC writes. When dd returns, the mappings of the
	# 8 MiB at 0 (blocks 0..127) must be committed.
	head -c 8M /dev/urandom >a
	dd if=a of=$t bs=1M oflag=direct,sync conv=notrunc status=none
	meta_image d1.xml
	assert_eq 128 "$(dump_mapped_in d1.xml 0 0 128)" "committed blocks after FUA writes"

	# Flush: O_DIRECT writes then fsync (an empty flush).
	head -c 4M /dev/urandom >b
	dd if=b of=$t bs=1M seek=16 oflag=direct conv=notrunc,fsync status=none
	meta_image d2.xml
	assert_eq 64 "$(dump_mapped_in d2.xml 0 256 320)" "committed blocks after a flush"

	# Buffered writes plus fdatasync through the page cache.
	head -c 2M /dev/urandom >c
	dd if=c of=$t bs=1M seek=32 conv=notrunc,fdatasync status=none
	meta_image d3.xml
	assert_eq 32 "$(dump_mapped_in d3.xml 0 512 544)" "committed blocks after fdatasync"

	# No explicit commit: suspend and remove everything, then the
	# metadata holds every mapping.
	dmsetup suspend tss-thin0
	dmsetup suspend tss-pool
	dm_remove tss-thin0
	dm_remove tss-pool
	check_meta /dev/mapper/tss-meta
	thin_dump /dev/mapper/tss-meta >d4.xml
	grep -q '<device dev_id="0" mapped_blocks="224"' d4.xml ||
		fail "thin_dump after removal: $(grep '<device ' d4.xml)"
	# And the data comes back.
	dm_create tss-pool "0 1048576 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	assert_eq "$(file_sha a)" "$(dev_sha $t 0 8)" "FUA data after reopening"
	assert_eq "$(file_sha b)" "$(dev_sha $t 16 4)" "flushed data after reopening"
	assert_eq "$(file_sha c)" "$(dev_sha $t 32 2)" "fdatasync'd data after reopening"
	dm_remove tss-thin0
	teardown_pool
}

# leaf_blocks <device> <first key> <min entries>: the metadata blocks on
# <device> that are btree leaves of 8-byte values (mapping tree leaves)
# whose first key is <first key> and that hold at least <min entries>.
leaf_blocks() {
	python3 - "$@" <<'EOF'
import struct, sys
dev, first, least = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(dev, 'rb') as f:
    data = f.read()
for b in range(len(data) // 4096):
    off = b * 4096
    flags, blocknr, nr, max_entries, value_size = struct.unpack_from('<IQIII', data, off + 4)
    if (flags & 2 and blocknr == b and value_size == 8 and least <= nr <= max_entries
            and struct.unpack_from('<Q', data, off + 32)[0] == first):
        print(b)
EOF
}

# Writes to thin 0 complete, then, before any commit, an update fails and
# the transaction is aborted: the pool goes read-only.  Returns 1 if a
# commit came in between after all (the waker's), which made the writes
# durable.
abort_after_write() {
	local m=/dev/mapper/tss-meta pool_line leaves b commits
	pool_line="0 $((512 * 2048)) $POOL_T $m /dev/mapper/tss-data 128 $LOW_WATER 0"
	make_pool 512 0
	dm_message tss-pool "create_thin 0"
	dm_message tss-pool "create_thin 1"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	dm_create tss-thin1 "0 131072 $THIN_T /dev/mapper/tss-pool 1"
	write_file a /dev/mapper/tss-thin0 0
	# Thin 1 maps blocks 256..575: two leaves at least.
	head -c 20M /dev/urandom >b
	write_file b /dev/mapper/tss-thin1 16
	# A new pool has no node cached; opening thin 1 reads its last leaf.
	dm_remove tss-thin0
	dm_remove tss-thin1
	dm_remove tss-pool
	dm_create tss-pool "$pool_line"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	dm_create tss-thin1 "0 131072 $THIN_T /dev/mapper/tss-pool 1"

	# Corrupt thin 1's first leaf (and any old copy), kept for the end.
	leaves=$(leaf_blocks $m 256 100)
	[ -n "$leaves" ] || fail "no leaf of thin 1's mappings found"
	for b in $leaves; do
		dd if=$m of="leaf.$b" bs=4096 skip="$b" count=1 iflag=direct status=none
		printf 'corrupt!' |
			dd of=$m bs=8 seek=$((b * 512 + 100)) conv=notrunc,fsync status=none
	done

	commits=$(pool_stat commits)
	# 1 MiB at 8 MiB written, then a discard that reads the corrupt leaf
	# fails: one process, so that the waker's commit is unlikely to come
	# in between.
	python3 - <<'EOF' || fail "the write then discard failed: $?"
import fcntl, mmap, os, struct, sys
buf = mmap.mmap(-1, 1 << 20)
with open('a', 'rb') as f:
    buf.write(f.read(1 << 20))
thin0 = os.open('/dev/mapper/tss-thin0', os.O_WRONLY | os.O_DIRECT)
thin1 = os.open('/dev/mapper/tss-thin1', os.O_WRONLY)
if os.pwrite(thin0, buf, 8 << 20) != 1 << 20:
    sys.exit(2)
try:
    fcntl.ioctl(thin1, 0x1277, struct.pack('QQ', 16 << 20, 1 << 20))  # BLKDISCARD
except OSError:
    sys.exit(0)
sys.exit(3)
EOF
	assert_eq ro "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode after the abort"
	[ "$(pool_stat commits)" = "$commits" ]
}

# Remove the devices of abort_after_write, and put the leaves it
# corrupted back.
remove_after_abort() {
	local f
	dm_remove tss-thin0
	dm_remove tss-thin1
	dm_remove tss-pool
	for f in leaf.*; do
		dd if="$f" of=/dev/mapper/tss-meta bs=4096 seek="${f#leaf.}" conv=notrunc \
			oflag=direct status=none
		rm "$f"
	done
}

# An abort dropped writes to a thin device that had completed: every
# flush of the device fails from then on (no flush makes them durable),
# until it is closed; then a new opener's flushes succeed.  dm-thin fails
# such flushes too, but goes on failing them for a new opener while the
# device stays in its core, and aborts nothing for a failed discard.
test_flush_after_abort() {
	local t=/dev/mapper/tss-thin0 try
	need_targets
	ours || skip "dm-thin does not abort the transaction for a failed discard"
	head -c 4M /dev/urandom >a
	for try in 1 2 3 4; do
		[ "$try" != 4 ] || fail "a commit came between the write and the abort every time"
		abort_after_write && break
		remove_after_abort
		dm_remove tss-data
		dm_remove tss-meta
	done

	expect_fail sync $t
	expect_fail sync $t
	dmesg_since_test | grep -q "flush failed: an aborted metadata transaction dropped writes" ||
		fail "no DMERR for the failed flush: $(dmesg_since_test | tail -n 5)"
	assert_eq "$(file_sha a)" "$(dev_sha $t 0 4)" "committed data after the abort"
	dm_remove tss-thin0
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	sync $t || fail "a flush of the reopened device failed"

	remove_after_abort
	check_meta
	thin_dump /dev/mapper/tss-meta >d.xml
	grep -q '<device dev_id="0" mapped_blocks="64"' d.xml ||
		fail "thin 0's mappings after the abort: $(grep '<device ' d.xml)"
	dm_remove tss-data
	dm_remove tss-meta
}

# --- 6. messages ------------------------------------------------------------

test_messages() {
	local held out
	need_targets
	make_pool 512 0
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 65536 $THIN_T /dev/mapper/tss-pool 0"
	head -c 4M /dev/urandom >a
	write_file a /dev/mapper/tss-thin0 0

	# set_transaction_id <current> <new>: compare and swap.
	assert_eq 0 "$(dm_status tss-pool | cut -d' ' -f1)" "initial transaction id"
	dm_message tss-pool "set_transaction_id 0 1"
	assert_eq 1 "$(dm_status tss-pool | cut -d' ' -f1)" "transaction id after 0 -> 1"
	expect_fail dmsetup message tss-pool 0 "set_transaction_id 0 2"
	assert_eq 1 "$(dm_status tss-pool | cut -d' ' -f1)" "transaction id after a refused swap"
	dm_message tss-pool "set_transaction_id 1 77"
	assert_eq 77 "$(dm_status tss-pool | cut -d' ' -f1)" "transaction id after 1 -> 77"

	# Metadata snapshot: held root in the status, thin_dump -m works on
	# the live metadata device.
	dm_message tss-pool "reserve_metadata_snap"
	check_pool_status tss-pool
	held=$(dm_status tss-pool | cut -d' ' -f4)
	[[ $held =~ ^[0-9]+$ ]] || fail "held metadata root after reserve_metadata_snap: '$held'"
	expect_fail dmsetup message tss-pool 0 "reserve_metadata_snap"
	# Changes after the reservation are not in the snapshot.
	dm_message tss-pool "create_thin 5"
	thin_dump -m /dev/mapper/tss-meta >snap.xml 2>dump.err ||
		{ cat dump.err; fail "thin_dump -m on the live metadata device failed"; }
	grep -q '<device dev_id="0" mapped_blocks="64"' snap.xml ||
		fail "thin_dump -m: device 0 with 64 blocks expected: $(grep '<device ' snap.xml)"
	! grep -q '<device dev_id="5"' snap.xml || fail "thin_dump -m shows a device created after the reservation"
	grep -q 'transaction="77"' snap.xml || fail "thin_dump -m: transaction 77 expected: $(grep '<superblock' snap.xml)"
	thin_dump -m"$held" /dev/mapper/tss-meta >snap2.xml 2>dump.err ||
		{ cat dump.err; fail "thin_dump -m$held failed"; }
	dm_message tss-pool "release_metadata_snap"
	assert_eq - "$(dm_status tss-pool | cut -d' ' -f4)" "held root after release"
	expect_fail dmsetup message tss-pool 0 "release_metadata_snap"
	# Reserve and release again.
	dm_message tss-pool "reserve_metadata_snap"
	dm_message tss-pool "release_metadata_snap"
	dm_message tss-pool "delete 5"

	# A device that does not exist: ENODATA, as dm-thin's, which lvm2
	# takes for "already deleted" when it replays its messages.
	for m in "delete 42" "create_snap 43 42"; do
		if out=$(dmsetup message tss-pool 0 "$m" 2>&1); then
			fail "message '$m' on a missing device succeeded"
		fi
		[[ $out == *"No data available"* ]] || fail "message '$m': ENODATA expected: $out"
	done
	# An id wider than 24 bits is invalid.
	if out=$(dmsetup message tss-pool 0 "delete 16777216" 2>&1); then
		fail "deleting device 16777216 succeeded"
	fi
	[[ $out == *"Invalid argument"* ]] || fail "delete 16777216: EINVAL expected: $out"

	# The extra stats message (ours only).
	if ours; then
		# Read the mapped blocks twice: the second time from the cache.
		dd if=/dev/mapper/tss-thin0 of=/dev/null bs=64k count=64 iflag=direct status=none
		dd if=/dev/mapper/tss-thin0 of=/dev/null bs=64k count=64 iflag=direct status=none
		out=$(dmsetup message tss-pool 0 stats) || fail "the stats message failed"
		log "stats: $out"
		[[ $out =~ fast_ios\ ([0-9]+) ]] || fail "stats: no fast_ios counter: '$out'"
		[ "${BASH_REMATCH[1]}" -gt 0 ] || fail "stats: no fast IOs after reading mapped blocks: '$out'"
		[[ $out =~ deferred_ios\ ([0-9]+) ]] || fail "stats: no deferred_ios counter: '$out'"
		[ "${BASH_REMATCH[1]}" -gt 0 ] || fail "stats: no deferred IOs after provisioning: '$out'"
		[[ $out =~ commits\ ([0-9]+) ]] || fail "stats: no commits counter: '$out'"
		[ "${BASH_REMATCH[1]}" -gt 0 ] || fail "stats: no commits: '$out'"
		[[ $out =~ provisioned_blocks\ ([0-9]+) ]] || fail "stats: no provisioned_blocks: '$out'"
		assert_eq 64 "${BASH_REMATCH[1]}" "stats: provisioned_blocks"
		[[ $out =~ workers\ ([0-9]+) ]] || fail "stats: no workers: '$out'"
		assert_eq "$(expected_workers)" "${BASH_REMATCH[1]}" "stats: workers"
		[[ $out =~ worker_passes\ ([0-9]+) ]] || fail "stats: no worker_passes: '$out'"
		[ "${BASH_REMATCH[1]}" -gt 0 ] || fail "stats: no worker passes after provisioning: '$out'"
	fi

	check_pool_status tss-pool
	dm_remove tss-thin0
	teardown_pool
}

# A message whose metadata update fails half way (here deleting a device,
# which must read its mapping tree, from a metadata device that fails every
# IO) aborts the transaction, as a failed update in the IO path does: the
# pool goes to fail mode, as the abort cannot read the superblock again.
# Nothing of the delete reaches the disk.  (Stock dm-thin only warns, and
# stays in write mode on metadata in doubt: not tested there.)
test_failed_message() {
	local pool_line meta_line
	pool_line="0 $((512 * 2048)) $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data"
	pool_line+=" 128 $LOW_WATER 0"
	need_targets
	ours || skip "dm-thin stays in write mode after a failed message"
	make_pool 512 0
	meta_line=$(dmsetup table tss-meta)
	dm_message tss-pool "create_thin 1"
	dm_create tss-thin1 "0 65536 $THIN_T /dev/mapper/tss-pool 1"
	head -c 4M /dev/urandom >a
	write_file a /dev/mapper/tss-thin1 0
	dm_remove tss-thin1
	# A new pool on the metadata: none of its btree nodes are cached.
	dm_remove tss-pool
	dm_create tss-pool "$pool_line"

	dmsetup reload tss-meta --table "0 $((META_MIB * 2048)) error"
	dmsetup resume tss-meta
	expect_fail dmsetup message tss-pool 0 "delete 1"
	assert_eq Fail "$(dm_status tss-pool)" "pool status after the failed message"
	dmesg_since_test | grep -q "metadata operation 'delete' failed" ||
		fail "no DMERR for the failed delete: $(dmesg_since_test | tail -n 5)"
	dm_remove tss-pool
	dmsetup reload tss-meta --table "$meta_line"
	dmsetup resume tss-meta
	check_meta

	dm_create tss-pool "$pool_line"
	dm_create tss-thin1 "0 65536 $THIN_T /dev/mapper/tss-pool 1"
	assert_eq "$(file_sha a)" "$(dev_sha /dev/mapper/tss-thin1 0 4)" \
		"data of the device whose delete failed"
	dm_remove tss-thin1
	teardown_pool
}

# --- 7. out of data space ---------------------------------------------------

# wait_gone <pid> <tenths of a second>: succeed if the process ended.
wait_gone() {
	local i
	for i in $(seq "$2"); do
		kill -0 "$1" 2>/dev/null || return 0
		sleep 0.1
	done
	! kill -0 "$1" 2>/dev/null
}

test_no_space() {
	local t=/dev/mapper/tss-thin0 t0 dt old_timeout pid events
	need_targets
	[ -w "$NO_SPACE_TIMEOUT" ] || fail "no module parameter $NO_SPACE_TIMEOUT"
	old_timeout=$(cat "$NO_SPACE_TIMEOUT")
	# shellcheck disable=SC2064
	trap "echo $old_timeout >$NO_SPACE_TIMEOUT" EXIT

	# 8 MiB of data (128 blocks), error_if_no_space.
	make_pool 8 1 error_if_no_space
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	head -c 64M /dev/urandom >a
	t0=$SECONDS
	if dd if=a of=$t bs=1M count=16 oflag=direct conv=notrunc status=none 2>dd.err; then
		fail "writing 16 MiB to a pool of 8 MiB succeeded"
	fi
	dt=$((SECONDS - t0))
	log "error_if_no_space: dd failed after ${dt}s: $(cat dd.err)"
	[ $dt -le 20 ] || fail "error_if_no_space: the write took ${dt}s to fail"
	check_pool_status tss-pool
	assert_eq out_of_data_space "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode when full"
	assert_eq "128/128" "$(dm_status tss-pool | cut -d' ' -f3)" "data blocks when full"
	assert_eq "$(part_sha a 0 8)" "$(dev_sha $t 0 8)" "what fitted"
	# Overwrites of mapped blocks still work.
	dd if=a of=$t bs=1M skip=20 seek=0 count=1 oflag=direct conv=notrunc status=none ||
		fail "overwriting a mapped block of a full pool failed"
	assert_eq "$(part_sha a 20 1)" "$(dev_sha $t 0 1)" "overwritten block of a full pool"
	dd if=a of=$t bs=1M count=1 oflag=direct conv=notrunc status=none

	# Resize: grow the data device, reload the pool with the new length.
	grow_pool 32 1 error_if_no_space
	check_pool_status tss-pool
	assert_eq rw "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode after the resize"
	assert_eq "128/512" "$(dm_status tss-pool | cut -d' ' -f3)" "data blocks after the resize"
	dd if=a of=$t bs=1M skip=8 seek=8 count=8 oflag=direct conv=notrunc,fsync status=none ||
		fail "writing after the resize failed"
	assert_eq "$(part_sha a 0 16)" "$(dev_sha $t 0 16)" "data written before and after the resize"

	# Queue mode with a 2 s no_space_timeout: a write beyond the space
	# waits, then fails.
	echo 2 >"$NO_SPACE_TIMEOUT"
	reload_pool 32 0
	assert_eq queue_if_no_space "$(dm_status tss-pool | cut -d' ' -f7)" "queue mode after reload"
	t0=$EPOCHREALTIME
	if dd if=a of=$t bs=1M skip=16 seek=16 count=24 oflag=direct conv=notrunc status=none 2>dd.err; then
		fail "writing 24 MiB into 16 MiB of space succeeded"
	fi
	dt=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
	log "queue, no_space_timeout 2: dd failed after ${dt}s: $(cat dd.err)"
	awk -v d="$dt" 'BEGIN { exit !(d >= 1.5 && d <= 40) }' ||
		fail "with no_space_timeout 2 the write failed after ${dt}s"
	assert_eq out_of_data_space "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode when full (queue)"
	assert_eq "$(part_sha a 16 16)" "$(dev_sha $t 16 16)" "what fitted (queue)"

	# Reloaded in queue mode while still full: a new write waits again for
	# no_space_timeout, then fails.  (4 s: the resume arms it, and the
	# event count must be read before it expires.)
	echo 4 >"$NO_SPACE_TIMEOUT"
	reload_pool 32 0
	assert_eq queue_if_no_space "$(dm_status tss-pool | cut -d' ' -f7)" "queue mode after the second reload"
	events=$(dmsetup info -c --noheadings -o events tss-pool)
	dd if=a of=$t bs=1M skip=40 seek=40 count=1 oflag=direct conv=notrunc status=none 2>dd.err &
	pid=$!
	if ! wait_gone $pid 200; then
		# Error the write before failing, or nothing can be removed.
		log "pool: $(dm_status tss-pool)"
		reload_pool 32 1 error_if_no_space
		wait_gone $pid 200 || true
		fail "a write to a full pool reloaded in queue mode was not errored within 20 s (no_space_timeout 2)"
	fi
	if wait $pid; then
		fail "a write to a full pool reloaded in queue mode succeeded"
	fi
	log "queued write after reload failed: $(cat dd.err)"
	# The timeout changed the status line: an event for dmeventd.
	assert_eq error_if_no_space "$(dm_status tss-pool | cut -d' ' -f7)" "no-space mode after the timeout"
	[ "$(dmsetup info -c --noheadings -o events tss-pool)" -gt "$events" ] ||
		fail "no event when the no-space timeout expired"

	# Queue mode, and the pool grows while a write waits: the write
	# completes.
	echo 60 >"$NO_SPACE_TIMEOUT"
	reload_pool 32 0
	dd if=a of=$t bs=1M skip=32 seek=32 count=8 oflag=direct conv=notrunc,fsync status=none 2>dd.err &
	pid=$!
	if wait_gone $pid 20; then
		wait $pid || true
		fail "a write to a full pool in queue mode ended at once: $(cat dd.err)"
	fi
	assert_eq out_of_data_space "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode with a queued write"
	# A noflush suspend of the thin device hands the queued write back
	# to dm core, which submits it again on resume: it waits on.
	dmsetup suspend --noflush tss-thin0 ||
		fail "a noflush suspend of a device with a queued write failed"
	dmsetup resume tss-thin0
	if wait_gone $pid 20; then
		wait $pid || true
		fail "a queued write ended across a noflush suspend: $(cat dd.err)"
	fi
	grow_pool 64 0
	if ! wait_gone $pid 200; then
		log "pool: $(dm_status tss-pool)"
		reload_pool 64 1 error_if_no_space
		wait_gone $pid 200 || true
		fail "the queued write did not complete within 20 s of the resize"
	fi
	wait $pid || fail "the queued write failed after the resize: $(cat dd.err)"
	check_pool_status tss-pool
	assert_eq rw "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode after the second resize"
	assert_eq "$(part_sha a 32 8)" "$(dev_sha $t 32 8)" "the queued write's data"
	assert_eq "$(part_sha a 0 32)" "$(dev_sha $t 0 32)" "data before it"

	# The timeout ends a time out of space by erroring writes; once a
	# discard frees blocks the pool is back in write mode, and the next
	# time out of space queues writes for the full timeout again.
	echo 2 >"$NO_SPACE_TIMEOUT"
	dm_message tss-pool "create_thin 1"
	dm_create tss-thin1 "0 131072 $THIN_T /dev/mapper/tss-pool 1"
	if dd if=a of=/dev/mapper/tss-thin1 bs=1M count=32 oflag=direct status=none 2>dd.err; then
		fail "writing 32 MiB into 24 MiB of space succeeded"
	fi
	assert_eq out_of_data_space "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode when full again"
	blkdiscard -o 0 -l 8M /dev/mapper/tss-thin1 || fail "discarding 8 MiB failed"
	for _ in $(seq 50); do
		[ "$(dm_status tss-pool | cut -d' ' -f5)" = rw ] && break
		sleep 0.1
	done
	assert_eq rw "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode after a discard freed blocks"
	dd if=a of=/dev/mapper/tss-thin1 bs=1M seek=32 count=8 oflag=direct conv=fsync status=none ||
		fail "filling the 8 MiB the discard freed failed"
	t0=$EPOCHREALTIME
	dd if=a of=/dev/mapper/tss-thin1 bs=1M seek=40 count=1 oflag=direct status=none 2>dd.err &
	pid=$!
	if ! wait_gone $pid 200; then
		reload_pool 64 1 error_if_no_space
		wait_gone $pid 200 || true
		fail "out of space again after the timeout, a write was not errored within 20 s (no_space_timeout 2)"
	fi
	dt=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
	if wait $pid; then
		fail "a write to a full pool succeeded"
	fi
	log "out of space again after the timeout: dd failed after ${dt}s: $(cat dd.err)"
	awk -v d="$dt" 'BEGIN { exit !(d >= 1.5) }' ||
		fail "out of space again after the timeout, the write failed after ${dt}s, not queued"
	dm_remove tss-thin1
	dm_remove tss-thin0
	teardown_pool
}

# --- 7a. the pool's devices, as dm-thin checks them -------------------------

test_pool_devices() {
	local mark meta_sectors=$((META_MIB * 2048)) pool_line d
	need_targets
	TSS_RAM_DISKS=3 make_pool 64 0
	dm_message tss-pool "create_thin 1"
	dm_remove tss-pool
	pool_line="0 131072 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 0"

	# No thin device before the pool's first resume: until then the pool
	# has no table bound (nor its zeroing feature).  (The device must be
	# live to be opened: here with another target's table.)
	dm_create tss-pool "0 131072 zero"
	dmsetup load tss-pool --table "$pool_line" || fail "loading the pool failed"
	mark=$(kmsg_mark)
	expect_fail dmsetup create tss-thin1 --table "0 2048 $THIN_T /dev/mapper/tss-pool 1"
	dmesg_has "$mark" "while pool is suspended" ||
		fail "no 'pool is suspended' error for a thin device before the pool's resume"
	! dm_exists tss-thin1 || dm_remove tss-thin1
	dmsetup resume tss-pool || fail "resuming the pool failed"
	dm_create tss-thin1 "0 2048 $THIN_T /dev/mapper/tss-pool 1"
	dm_remove tss-thin1

	# A metadata device that shrank is refused on resume; grown back, the
	# pool resumes.
	dmsetup suspend tss-pool
	dmsetup reload tss-meta --table "0 $((meta_sectors / 2)) linear /dev/ram0 0"
	dmsetup resume tss-meta
	expect_fail dmsetup resume tss-pool
	dmsetup reload tss-meta --table "0 $meta_sectors linear /dev/ram0 0"
	dmsetup resume tss-meta
	dmsetup resume tss-pool || fail "resuming the pool with its metadata device back failed"

	# A smaller data table is refused in read-only mode too.
	dmsetup reload tss-pool --table "0 65536 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 1 read_only"
	expect_fail dmsetup resume tss-pool
	dmsetup reload tss-pool --table "$pool_line"
	dmsetup resume tss-pool || fail "resuming the pool at its own size failed"
	check_pool_status tss-pool
	dm_remove tss-pool

	# A read-only pool works on a read-only metadata device and writes
	# nothing to it (6.1 lets such a write through with a warning, which
	# must not appear).
	blockdev --setro /dev/mapper/tss-meta
	mark=$(kmsg_mark)
	dm_create tss-pool "0 131072 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 1 read_only"
	assert_eq ro "$(dm_status tss-pool | cut -d' ' -f5)" "mode of a pool on a read-only metadata device"
	dm_create tss-thin1 "0 2048 $THIN_T /dev/mapper/tss-pool 1"
	assert_eq "$(zero_sha 1)" "$(dev_sha /dev/mapper/tss-thin1 0 1)" "an unprovisioned thin device of a read-only pool"
	dm_remove tss-thin1
	dm_remove tss-pool
	blockdev --setrw /dev/mapper/tss-meta
	! dmesg_has "$mark" "write to read-only" || fail "a read-only pool wrote to its metadata device"

	# A data device striped in two 64 KiB chunks: io_opt 128 KiB, a
	# multiple of the 64 KiB block, stays; io_min is the block.
	dm_remove tss-data
	dm_create tss-data "0 131072 striped 2 128 /dev/ram1 0 /dev/ram2 0"
	dm_create tss-pool "$pool_line"
	dm_create tss-thin1 "0 2048 $THIN_T /dev/mapper/tss-pool 1"
	for d in tss-pool tss-thin1; do
		assert_eq 65536 "$(queue_limit /dev/mapper/$d minimum_io_size)" "minimum_io_size of $d"
		assert_eq 131072 "$(queue_limit /dev/mapper/$d optimal_io_size)" "optimal_io_size of $d"
	done
	dm_remove tss-thin1
	teardown_pool
}

# --- 7b. a pool outlives its table while its thin devices hold it ----------

# A pool whose table is replaced (here by an error table) lives on with
# its thin devices, suspended, and keeps its metadata and data devices
# open until it goes: neither can be removed (and its device number
# reused) under it.  A pool table loaded again finds it, and its thin
# devices go on.  (Stock dm-thin keeps raw pointers to the devices
# instead: not tested there.)
unbind_pool() { # replace tss-pool's table with an error table
	dmsetup reload tss-pool --table "0 131072 error" ||
		fail "loading an error table for the pool failed"
	dmsetup resume tss-pool || fail "resuming the pool's error table failed"
}

test_pool_outlives_table() {
	local t=/dev/mapper/tss-thin0 pool_line d
	need_targets
	make_pool 64 0
	pool_line=$(dmsetup table tss-pool)
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	head -c 8M /dev/urandom >a
	write_file a $t 0
	unbind_pool
	if ours; then
		for d in tss-meta tss-data; do
			assert_eq 1 "$(dmsetup info -c --noheadings -o open $d)" "open count of $d under a pool without a table"
			expect_fail dmsetup remove $d
		done
	fi
	dmsetup reload tss-pool --table "$pool_line" || fail "reloading the pool table failed"
	dmsetup resume tss-pool || fail "resuming the pool table failed"
	assert_eq "$(part_sha a 0 4)" "$(dev_sha $t 0 4)" "data written before the pool's table was replaced"
	dd if=a of=$t bs=1M skip=4 seek=4 count=4 oflag=direct conv=notrunc status=none ||
		fail "writing after the pool table came back failed"
	assert_eq "$(file_sha a)" "$(dev_sha $t 0 8)" "data written after the pool table came back"

	# The pool goes with its last thin device while it has no table: it
	# lets go of its devices then (teardown_pool removes them).
	unbind_pool
	dm_remove tss-thin0
	teardown_pool
}

# --- 8a. a pool's suspend suspends its thin devices ------------------------

# As dm-thin's does: a thin device's IO waits while its pool is suspended
# (a reload, say), and no thin device is activated meanwhile.
test_pool_suspend() {
	local t=/dev/mapper/tss-thin0 pid
	need_targets
	make_pool 64 0
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	head -c 4M /dev/urandom >a
	dmsetup suspend tss-pool || fail "suspending the pool failed"
	dd if=a of=$t bs=1M count=4 oflag=direct status=none 2>dd.err &
	pid=$!
	if wait_gone $pid 30; then
		dmsetup resume tss-pool
		fail "a write to a thin device completed while its pool was suspended"
	fi
	expect_fail dmsetup create tss-thin1 --table "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	dm_exists tss-thin1 && fail "a failed activation left tss-thin1 behind"
	dmsetup resume tss-pool || fail "resuming the pool failed"
	wait_gone $pid 200 || fail "the write did not complete within 20 s of the pool's resume"
	wait $pid || fail "the write failed after the pool's resume: $(cat dd.err)"
	assert_eq "$(file_sha a)" "$(dev_sha $t 0 4)" "data written across the pool's suspend"

	# A table loaded but not yet live is a thin target of the pool too,
	# suspended with it.  Cleared before the pool resumes, it must not
	# leave the device suspended (stock dm-thin does: not tested there).
	if [ "$POOL_T" != thin-pool ]; then
		dmsetup load tss-thin0 --table "0 131072 $THIN_T /dev/mapper/tss-pool 0" ||
			fail "loading a second table for tss-thin0 failed"
		dmsetup suspend tss-pool || fail "suspending the pool failed"
		dmsetup clear tss-thin0 || fail "clearing the inactive table failed"
		dmsetup resume tss-pool || fail "resuming the pool failed"
		dd if=a of=$t bs=1M seek=4 count=4 oflag=direct status=none 2>dd.err &
		pid=$!
		wait_gone $pid 200 || fail "tss-thin0 stayed suspended after its inactive table was cleared"
		wait $pid || fail "writing after the pool's resume failed: $(cat dd.err)"
		assert_eq "$(file_sha a)" "$(dev_sha $t 4 4)" "data written after the pool's resume"
	fi
	dm_remove tss-thin0
	teardown_pool
}

# --- 8b. read-only by table reload, and back -------------------------------

# lvm2 switches a pool between read-only and writable by reloading it.
test_read_only_reload() {
	local t=/dev/mapper/tss-thin0
	need_targets
	make_pool 64 0
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	head -c 4M /dev/urandom >a
	write_file a $t 0
	reload_pool 64 1 read_only
	assert_eq ro "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode after reloading read_only"
	expect_fail dmsetup message tss-pool 0 "create_thin 1"
	expect_fail dd if=a of=$t bs=1M seek=8 count=1 oflag=direct conv=notrunc status=none
	assert_eq "$(file_sha a)" "$(dev_sha $t 0 4)" "data of a read-only pool"
	reload_pool 64 0
	assert_eq rw "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode after reloading writable"
	dm_message tss-pool "create_thin 1"
	dd if=a of=$t bs=1M seek=8 count=4 oflag=direct conv=notrunc status=none ||
		fail "provisioning after the pool became writable again failed"
	assert_eq "$(file_sha a)" "$(dev_sha $t 8 4)" "data written after the pool became writable"
	assert_eq 128 "$(pool_used tss-pool)" "blocks used"
	dm_remove tss-thin0
	teardown_pool
}

# --- 9. concurrency and integrity -------------------------------------------

# concurrent_fio_snapshot <#features> [<feature>...]: the pool's features.
concurrent_fio_snapshot() {
	local pid s n
	need_targets
	make_pool 512 "$@"
	dm_message tss-pool "create_thin 0"
	dm_message tss-pool "create_thin 1"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	dm_create tss-thin1 "0 131072 $THIN_T /dev/mapper/tss-pool 1"

	# Two jobs per device, each its own 32 MiB, random 4k writes each
	# block once, then fio verifies them.
	local fio_args=(--rw=randwrite --bs=4k --size=32M --offset_increment=32M --numjobs=2
		--iodepth=8 --verify=crc32c --verify_fatal=1 --group_reporting)
	fio --name=d0 --filename=/dev/mapper/tss-thin0 --direct=1 --ioengine=libaio "${fio_args[@]}" \
		--name=d1 --filename=/dev/mapper/tss-thin1 --direct=1 --ioengine=libaio "${fio_args[@]}" \
		--eta=never --output=fio.log &
	pid=$!
	# Snapshot device 0 while fio runs.
	sleep 2
	kill -0 $pid 2>/dev/null || log "fio finished before the snapshot was taken"
	dmsetup suspend tss-thin0
	dm_message tss-pool "create_snap 2 0"
	dmsetup resume tss-thin0
	wait $pid || { cat fio.log; fail "fio with verify failed"; }
	grep -E 'err=|WRITE:|READ:' fio.log | sed 's/^/      /'
	if ours && [ "$1" = 0 ]; then
		# Batches of provisions ended on their submitters' CPUs.
		n=$(pool_stat handed_over_ios)
		log "bios ended on their submitters' CPUs: $n"
		[ "$n" -gt 0 ] || fail "no bio was handed over: '$(dmsetup message tss-pool 0 stats)'"
	elif ours; then
		# Without zeroing, blocks provisioned in map and by the workers.
		n=$(pool_stat provisioned_in_map)
		log "blocks provisioned in map: $n"
		[ "$n" -gt 0 ] || fail "no block was provisioned in map: '$(dmsetup message tss-pool 0 stats)'"
	fi

	# Full verify pass again, reading only.
	fio --name=d0 --filename=/dev/mapper/tss-thin0 --direct=1 --ioengine=libaio "${fio_args[@]}" --verify_only \
		--name=d1 --filename=/dev/mapper/tss-thin1 --direct=1 --ioengine=libaio "${fio_args[@]}" --verify_only \
		--eta=never --output=fio2.log || { cat fio2.log; fail "fio verify-only pass failed"; }

	# Each 4k block was written once: the snapshot's block is either still
	# zero (written after the snapshot) or the origin's final one.
	dm_create tss-snap2 "0 131072 $THIN_T /dev/mapper/tss-pool 2"
	dd if=/dev/mapper/tss-snap2 of=snap.img bs=1M count=64 iflag=direct status=none
	dd if=/dev/mapper/tss-thin0 of=orig.img bs=1M count=64 iflag=direct status=none
	s=$(perl -e '
		open(my $s, "<:raw", $ARGV[0]) or die; open(my $o, "<:raw", $ARGV[1]) or die;
		my ($z, $eq, $bad, $zero) = (0, 0, 0, "\0" x 4096);
		while (read($s, my $a, 4096)) {
			read($o, my $b, 4096);
			if ($a eq $zero) { $z++ } elsif ($a eq $b) { $eq++ } else { $bad++ }
		}
		print "$z $eq $bad\n";' snap.img orig.img)
	log "snapshot 4k blocks: zero, same as the origin, other: $s"
	[ "${s##* }" = 0 ] || fail "the snapshot has ${s##* } blocks that are neither zero nor the origin's"
	rm -f snap.img orig.img
	dm_remove tss-snap2
	dm_remove tss-thin0
	dm_remove tss-thin1
	teardown_pool
}

test_concurrent_fio_snapshot() {
	concurrent_fio_snapshot 0
}

# Without zeroing, writes to new blocks are also provisioned in map.
test_concurrent_fio_snapshot_nozero() {
	concurrent_fio_snapshot 1 skip_block_zeroing
}

# Four jobs write the sixteen 4k pieces of every 64 KiB block between
# them, side by side (job i the pieces i, i+4, i+8 and i+12), so that the
# first writes to a block race: in map against each other, and against
# the worker that owns the block.  None of the pieces is lost (with
# zeroing, none is zeroed by the write that fills its block for
# another), and each block is mapped once.  Every pass of a worker
# counts as long (handover_min_batch=1), so the worker maps the first
# writes without zeroing that reach it before they are written, as map
# does.  With zeroing, the first piece to reach a block is written with
# the zeroes around it in one bio while the others wait for its job.
# concurrent_first_writes_one_block <#features> [<feature>...]
concurrent_first_writes_one_block() {
	local used n old_batch
	need_targets
	if ours; then
		old_batch=$(cat "$HANDOVER_MIN_BATCH")
		# shellcheck disable=SC2064 # expanded now, on purpose
		trap "echo $old_batch >$HANDOVER_MIN_BATCH" EXIT
		echo 1 >"$HANDOVER_MIN_BATCH"
	fi
	make_pool 128 "$@"
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 131072 $THIN_T /dev/mapper/tss-pool 0"
	run_fio pieces --filename=/dev/mapper/tss-thin0 --iodepth=8 --numjobs=4 \
		--rw=write:12k --bs=4k --size=60M --io_size=15M --offset_increment=4k \
		--verify=crc32c --verify_fatal=1 --group_reporting
	grep -E 'err=|WRITE:|READ:' pieces.log | sed 's/^/      /'
	used=$(pool_used tss-pool)
	[ "$used" = 960 ] || fail "960 blocks written, $used data blocks used"
	if ours && [ "$1" = 0 ]; then
		n=$(pool_stat blocks_written_whole)
		log "blocks written whole in one bio: $n of 960"
		[ "$n" -gt 0 ] || fail "no block was written whole: '$(dmsetup message tss-pool 0 stats)'"
	elif ours; then
		n=$(pool_stat provisioned_in_map)
		log "blocks provisioned in map: $n of 960"
		# The first allocation after the pool's creation copies a
		# space map bitmap, which map refuses: its worker maps it.
		n=$(pool_stat mapped_before_write)
		log "blocks the worker mapped before their write: $n"
		[ "$n" -gt 0 ] || fail "no block was mapped before its write by the worker: '$(dmsetup message tss-pool 0 stats)'"
	fi
	dm_remove tss-thin0
	teardown_pool
}

test_concurrent_first_writes_one_block() {
	concurrent_first_writes_one_block 1 skip_block_zeroing
}

test_concurrent_first_writes_one_block_zeroing() {
	concurrent_first_writes_one_block 0
}

# --- 10. out of metadata space ----------------------------------------------

# A 1 MiB metadata device (256 blocks) in front of a 4 GiB data device that
# stores nothing (the zero target: this test is about metadata only).
# Writing one 4 KiB piece into each 64 KiB block fills the metadata: the
# pool sends the metadata low water event, switches to out-of-metadata-space
# mode (status "ro", messages refused, provisioning writes fail) and, after
# the metadata device grows, back to write mode.
#
# Not a baseline test: stock dm-thin (6.1) ends this in fail mode, as an
# insert in flight when it makes the metadata read-only fails and the
# abort that follows cannot lock the superblock.  Ours keeps the metadata
# writable out of metadata space, so the work in flight lands in the
# reserve.
test_metadata_space() {
	local t=/dev/mapper/tss-thin0 s events used total mapped
	need_targets
	ours || skip "stock dm-thin ends this scenario in fail mode"
	brd_setup 1 8
	dm_create tss-meta "0 2048 linear /dev/ram0 0"
	dd if=/dev/zero of=/dev/mapper/tss-meta bs=4096 count=1 oflag=direct status=none
	dm_create tss-data "0 8388608 zero"
	dm_create tss-pool "0 8388608 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 0 1 skip_block_zeroing"
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin0 "0 8388608 $THIN_T /dev/mapper/tss-pool 0"
	s=$(dm_status tss-pool)
	log "empty: $s"
	# dm-thin's metadata low water mark: a quarter of 256 blocks.
	assert_eq 64 "$(echo "$s" | awk '{ print $NF }')" "metadata low water mark in the status line"
	events=$(dmsetup info -c --noheadings -o events tss-pool)

	if fio --name=fill --filename=$t --direct=1 --ioengine=libaio --iodepth=8 \
		--rw=write:60k --bs=4k --size=4g --eta=never --output=fill.log; then
		fail "4 GiB of provisioning writes fitted in 1 MiB of metadata"
	fi
	s=$(dm_status tss-pool)
	log "full: $s"
	check_pool_status tss-pool
	assert_eq ro "$(echo "$s" | cut -d' ' -f5)" "pool mode out of metadata space"
	used=$(echo "$s" | cut -d' ' -f2)
	total=${used#*/}
	used=${used%/*}
	assert_eq 256 "$total" "metadata blocks"
	# Only the reserve (a tenth) is left: used counts it, as dm-thin's.
	[ "$used" -ge 230 ] || fail "out of metadata space with $used of 256 blocks used"
	[ "$(dmsetup info -c --noheadings -o events tss-pool)" -gt "$events" ] ||
		fail "no event from the pool"
	dmesg_since_test | grep -q "reached low water mark for metadata device" ||
		fail "no metadata low water mark message"
	dmesg_since_test | grep -Eq "switching pool to (out-of-metadata-space|read-only) mode" ||
		fail "no switch to out-of-metadata-space mode"
	expect_fail dmsetup message tss-pool 0 "create_thin 1"
	mapped=$(dm_status tss-thin0 | cut -d' ' -f1)
	[ "$mapped" -gt 0 ] || fail "nothing mapped"
	# A write to a new block fails; one to a mapped block does not.
	expect_fail dd if=/dev/zero of=$t bs=4k seek=$(((1 << 20) - 16)) count=1 oflag=direct status=none
	dd if=/dev/zero of=$t bs=4k count=1 oflag=direct status=none ||
		fail "overwriting a mapped block out of metadata space failed"

	# Grow the metadata device to 4 MiB: the pool is writable again.
	dmsetup suspend tss-thin0
	dmsetup reload tss-meta --table "0 8192 linear /dev/ram0 0"
	dmsetup resume tss-meta
	dmsetup reload tss-pool --table "0 8388608 $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 0 1 skip_block_zeroing"
	dmsetup resume tss-pool
	dmsetup resume tss-thin0
	s=$(dm_status tss-pool)
	log "grown: $s"
	assert_eq rw "$(echo "$s" | cut -d' ' -f5)" "pool mode after growing the metadata"
	assert_eq 1024 "$(echo "$s" | cut -d' ' -f2 | cut -d/ -f2)" "metadata blocks after growing"
	dd if=/dev/zero of=$t bs=4k seek=$(((1 << 20) - 16)) count=1 oflag=direct status=none ||
		fail "provisioning after growing the metadata failed"
	dm_message tss-pool "create_thin 1"
	assert_eq "$((mapped + 128))" "$(dm_status tss-thin0 | cut -d' ' -f1)" "mapped sectors after growing"
	dm_remove tss-thin0
	teardown_pool
}

run_test thin_scalable_basic test_basic
run_test thin_scalable_snapshots test_snapshots
run_test thin_scalable_external_origin test_external_origin
run_test thin_scalable_discard test_discard
run_test thin_scalable_ignore_discard test_ignore_discard
run_test thin_scalable_discard_isolation test_discard_isolation
run_test thin_scalable_discard_passdown test_discard_passdown
run_test thin_scalable_passdown_failed_commit test_passdown_failed_commit
run_test thin_scalable_passdown_no_wait test_passdown_no_wait
run_test thin_scalable_passdown_frees_full_pool test_passdown_frees_full_pool
run_test thin_scalable_zeroing_offload test_zeroing_offload
run_test thin_scalable_zeroing_offload_refused test_zeroing_offload_refused
run_test thin_scalable_zeroing_around test_zeroing_around
run_test thin_scalable_zeroing_big_blocks test_zeroing_big_blocks
run_test thin_scalable_zeroing_huge_blocks test_zeroing_huge_blocks
run_test thin_scalable_data_write_error test_data_write_error
run_test thin_scalable_flush_durability test_flush_durability
run_test thin_scalable_flush_after_abort test_flush_after_abort
run_test thin_scalable_teardown_failed_flush test_teardown_failed_flush
run_test thin_scalable_messages test_messages
run_test thin_scalable_failed_message test_failed_message
run_test thin_scalable_no_space test_no_space
run_test thin_scalable_pool_devices test_pool_devices
run_test thin_scalable_pool_outlives_table test_pool_outlives_table
run_test thin_scalable_pool_suspend test_pool_suspend
run_test thin_scalable_read_only_reload test_read_only_reload
run_test thin_scalable_concurrent_fio_snapshot test_concurrent_fio_snapshot
run_test thin_scalable_concurrent_fio_snapshot_nozero test_concurrent_fio_snapshot_nozero
run_test thin_scalable_concurrent_first_writes_one_block test_concurrent_first_writes_one_block
run_test thin_scalable_concurrent_first_writes_one_block_zeroing test_concurrent_first_writes_one_block_zeroing
run_test thin_scalable_metadata_space test_metadata_space
summary
