#!/bin/bash
# Smoke tests of the VM rig against the stock kernel's dm-thin (thin-pool /
# thin): they prove that RAM disks, dmsetup, fio, thin_check and the kernel
# log checks work end to end in the guest, and give the baseline behaviour
# our targets must match.
# shellcheck source=tests/vm/lib.sh
. "$(dirname "$0")/lib.sh"

BLOCK_SECTORS=128 # 64 KiB data blocks
BLOCK_KIB=$((BLOCK_SECTORS / 2))
META_MIB=64
THIN_MIB=256

# Field <n> (1-based, after "<start> <len> <target>") of a status line.
status_field() {
	dm_status "$1" | cut -d' ' -f"$2"
}

pool_used_blocks() { # used data blocks of a thin-pool
	local f
	f=$(status_field "$1" 3)
	echo "${f%/*}"
}

blocks_of_mib() {
	echo $(($1 * 1024 / BLOCK_KIB))
}

# Pool on brd: 64 MiB metadata (a linear slice of ram0, start zeroed) and
# all of ram1 as data.
make_pool() {
	brd_setup 2 512
	dm_create tsp-meta "0 $((META_MIB * 2048)) linear /dev/ram0 0"
	dd if=/dev/zero of=/dev/mapper/tsp-meta bs=4096 count=1 oflag=direct status=none
	dm_create tsp-pool "0 $(blockdev --getsz /dev/ram1) thin-pool /dev/mapper/tsp-meta /dev/ram1 $BLOCK_SECTORS 64"
}

test_thin_write_snapshot() {
	local thin=/dev/mapper/tsp-thin0 snap=/dev/mapper/tsp-snap1 exp mapped

	make_pool
	assert_eq "0" "$(pool_used_blocks tsp-pool)" "data blocks used by a new pool"
	dm_message tsp-pool "create_thin 0"
	dm_create tsp-thin0 "0 $((THIN_MIB * 2048)) thin /dev/mapper/tsp-pool 0"

	# A new thin device reads as zeroes and reading maps nothing.
	assert_eq "$(zero_sha 32)" "$(dev_sha $thin 0 32)" "sha of a new thin device"
	assert_eq "0" "$(pool_used_blocks tsp-pool)" "data blocks used after reads"

	# 32 MiB pattern at 0, read back.
	head -c 32M /dev/urandom >pat1
	write_file pat1 $thin 0
	assert_eq "$(file_sha pat1)" "$(dev_sha $thin 0 32)" "pattern 1 read back"
	exp=$(blocks_of_mib 32)
	assert_eq "$exp" "$(pool_used_blocks tsp-pool)" "data blocks used after 32 MiB"
	# What follows the written range is still zeroes.
	assert_eq "$(zero_sha 16)" "$(dev_sha $thin 32 16)" "sha after the pattern"

	# Random 4k writes with fio's own verification over 64..80 MiB: every
	# 64 KiB block in it gets written, so 16 MiB more get provisioned.
	fio --name=verify --filename=$thin --offset=64M --size=16M --rw=randwrite \
		--bs=4k --direct=1 --ioengine=libaio --iodepth=16 \
		--verify=crc32c --verify_fatal=1 --do_verify=1 \
		--eta=never --output=fio.log || { cat fio.log; fail "fio verify failed"; }
	exp=$((exp + $(blocks_of_mib 16)))
	assert_eq "$exp" "$(pool_used_blocks tsp-pool)" "data blocks used after fio"

	# Snapshot: the origin must be suspended for create_snap.
	dmsetup suspend tsp-thin0
	dm_message tsp-pool "create_snap 1 0"
	dmsetup resume tsp-thin0
	dm_create tsp-snap1 "0 $((THIN_MIB * 2048)) thin /dev/mapper/tsp-pool 1"
	assert_eq "$(file_sha pat1)" "$(dev_sha $snap 0 32)" "snapshot content"
	assert_eq "$exp" "$(pool_used_blocks tsp-pool)" "a snapshot shares all blocks"

	# Overwrite 8 MiB of the origin: the snapshot keeps the old data.
	head -c 8M /dev/urandom >pat2
	write_file pat2 $thin 0
	assert_eq "$(file_sha pat1)" "$(dev_sha $snap 0 32)" "snapshot after writing the origin"
	assert_eq "$(file_sha pat2)" "$(dev_sha $thin 0 8)" "origin's new data"
	assert_eq "$(tail -c +$((8 * 1048576 + 1)) pat1 | sha256sum | cut -d' ' -f1)" \
		"$(dev_sha $thin 8 24)" "origin's data after the overwrite"
	exp=$((exp + $(blocks_of_mib 8)))
	assert_eq "$exp" "$(pool_used_blocks tsp-pool)" "data blocks after breaking sharing"

	# And the other way: writing the snapshot leaves the origin alone.
	head -c 8M /dev/urandom >pat3
	write_file pat3 $snap 16
	assert_eq "$(file_sha pat3)" "$(dev_sha $snap 16 8)" "snapshot's new data"
	assert_eq "$(dd if=pat1 bs=1M skip=16 count=8 status=none | sha256sum | cut -d' ' -f1)" \
		"$(dev_sha $thin 16 8)" "origin after writing the snapshot"
	exp=$((exp + $(blocks_of_mib 8)))
	assert_eq "$exp" "$(pool_used_blocks tsp-pool)" "data blocks after writing the snapshot"

	# thin status: <mapped sectors> <highest mapped sector>
	mapped=$(status_field tsp-thin0 1)
	assert_eq "$((($(blocks_of_mib 32) + $(blocks_of_mib 16)) * BLOCK_SECTORS))" "$mapped" \
		"sectors mapped by the origin"

	dm_remove tsp-snap1
	dm_remove tsp-thin0
	# Deleting the snapshot frees what only it referenced: its own 8 MiB
	# and the origin's old 8 MiB.
	dm_message tsp-pool "delete 1"
	exp=$((exp - $(blocks_of_mib 16)))
	assert_eq "$exp" "$(pool_used_blocks tsp-pool)" "data blocks after deleting the snapshot"
	dm_remove tsp-pool

	# The metadata is clean and holds exactly device 0 with its blocks.
	thin_check /dev/mapper/tsp-meta >thin_check.log 2>&1 ||
		{ cat thin_check.log; fail "thin_check found problems"; }
	thin_dump /dev/mapper/tsp-meta >dump.xml
	assert_eq 1 "$(grep -c '<device ' dump.xml)" "devices in thin_dump"
	grep -q "<device dev_id=\"0\" mapped_blocks=\"$exp\"" dump.xml ||
		fail "thin_dump: device 0 should map $exp blocks: $(grep '<device ' dump.xml)"
	dm_remove tsp-meta
}

# Bad table lines are refused with a device-mapper error in the kernel log
# and leave no device behind; the same devices then make a working pool.
test_bad_tables_refused() {
	local line mark i=0
	local lines=(
		"0 131072 thin-pool /dev/ram0 /dev/ram1 7 0"
		"0 131072 thin-pool /dev/ram0 /dev/ram1"
		"0 131072 thin-pool /dev/ram0 /dev/ram1 128 0 1 no_such_feature"
		"0 131072 thin-pool /dev/ram0 /dev/ram1 128 0 2 skip_block_zeroing"
		"0 131072 thin-pool /dev/no-such-device /dev/ram1 128 0"
		"0 131072 thin-pool /dev/ram0 /dev/ram0 128 0"
		"0 131072 thin /dev/ram1 0"
		"0 131072 thin /dev/ram1"
	)
	brd_setup 2 64
	dd if=/dev/zero of=/dev/ram0 bs=4096 count=1 oflag=direct status=none

	for line in "${lines[@]}"; do
		i=$((i + 1))
		log "bad table $i: $line"
		mark=$(kmsg_mark "bad table $i")
		expect_fail dmsetup create tsp-bad --table "$line"
		! dm_exists tsp-bad || fail "bad table $i left device tsp-bad behind"
		dmesg_has "$mark" '^device-mapper: (table|ioctl): .*' ||
			fail "bad table $i: no device-mapper error in the kernel log"
		dmesg_since "$mark" | grep '^device-mapper: ' | sed 's/^/      k /'
	done

	dm_create tsp-pool "0 131072 thin-pool /dev/ram0 /dev/ram1 128 0"
	dm_message tsp-pool "create_thin 7"
	dm_create tsp-thin "0 8192 thin /dev/mapper/tsp-pool 7"
	# Messages that must be refused: a thin id in use, an unknown message.
	expect_fail dmsetup message tsp-pool 0 "create_thin 7"
	expect_fail dmsetup message tsp-pool 0 "no_such_message"
	dm_remove tsp-thin
	dm_remove tsp-pool
	thin_check /dev/ram0 >thin_check.log 2>&1 ||
		{ cat thin_check.log; fail "thin_check found problems"; }
}

run_test thin_write_snapshot test_thin_write_snapshot
run_test bad_tables_refused test_bad_tables_refused
summary
