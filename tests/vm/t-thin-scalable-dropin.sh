#!/bin/bash
# Drop-in both ways: a pool made and filled by the stock thin-pool loads
# unchanged as thin-scal-pool and reads back the same bytes; written
# through thin-scalable it loads back in thin-pool the same. Table and
# status lines are dm-thin's.
# shellcheck source=tests/vm/lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=tests/vm/t-thin-scalable-common.sh
. "$(dirname "$0")/t-thin-scalable-common.sh"

THIN_MIB=16
THIN_SECTORS=$((THIN_MIB * 2048))

# pool_up <pool target> <#features> [<feature>...]: tss-pool on tss-meta and
# tss-data (512 MiB).
pool_up() {
	local target=$1
	shift
	dm_create tss-pool "0 1048576 $target /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER $*"
}

thin_up() { # <thin target> <id>
	dm_create "tss-t$2" "0 $THIN_SECTORS $1 /dev/mapper/tss-pool $2"
}

snap() { # <new id> <origin id>: origin device tss-t<origin> is active
	dmsetup suspend "tss-t$2"
	dm_message tss-pool "create_snap $1 $2"
	dmsetup resume "tss-t$2"
}

# Table line and status of a device, the target's name replaced by X.
table_of() {
	dmsetup table "$1" | sed -E 's/^([0-9]+ [0-9]+) [^ ]+ /\1 X /'
}

# Pool status without the used metadata count (an implementation detail:
# which blocks a commit shadows).
pool_status_cmp() {
	dm_status "$1" | awk '{ split($2, m, "/"); $2 = "?/" m[2]; print }'
}

# write_at <file> <dev> <offset KiB>
write_at() {
	dd if="$1" of="$2" bs=4k seek=$(($3 / 4)) oflag=direct conv=notrunc,fsync status=none
}

# Record the checksum and status of every device in $@ into <prefix>.<id>.
record() {
	local prefix=$1 id
	shift
	for id in "$@"; do
		dev_sha "/dev/mapper/tss-t$id" 0 $THIN_MIB >"$prefix.sha.$id"
		dm_status "tss-t$id" >"$prefix.status.$id"
	done
}

# Compare the devices in $@ with what record <prefix> saw.
compare() {
	local prefix=$1 id
	shift
	for id in "$@"; do
		assert_eq "$(cat "$prefix.sha.$id")" "$(dev_sha "/dev/mapper/tss-t$id" 0 $THIN_MIB)" "content of device $id ($prefix)"
		assert_eq "$(cat "$prefix.status.$id")" "$(dm_status "tss-t$id")" "thin status of device $id ($prefix)"
	done
}

down() { # remove the thin devices in $@ and the pool, thin_check
	local id
	for id in "$@"; do
		dm_remove "tss-t$id"
	done
	dm_remove tss-pool
	check_meta /dev/mapper/tss-meta
}

setup_devs() {
	brd_setup 2 512
	dm_create tss-meta "0 $((META_MIB * 2048)) linear /dev/ram0 0"
	dd if=/dev/zero of=/dev/mapper/tss-meta bs=4096 count=1 oflag=direct status=none
	dm_create tss-data "0 1048576 linear /dev/ram1 0"
}

test_dropin_both_ways() {
	local i held s1 s2
	need_targets
	setup_devs

	# --- made and filled by the stock thin-pool: device 0 (whole and
	# partly written blocks), 1 (4k in each of 64 blocks), 2 a snapshot
	# of 0, both written after it
	pool_up thin-pool 0
	for i in 0 1; do
		dm_message tss-pool "create_thin $i"
		thin_up thin $i
	done
	head -c 8M /dev/urandom >p0
	write_file p0 /dev/mapper/tss-t0 0
	head -c 2M /dev/urandom >p1
	write_file p1 /dev/mapper/tss-t0 12
	run_fio scatter --filename=/dev/mapper/tss-t0 --offset=8M --size=4M --rw=randwrite \
		--bs=4k --number_ios=300
	# 4k at 12k into each of 64 blocks of 128k (fio: 124k skipped).
	run_fio holes --filename=/dev/mapper/tss-t1 --offset=12k --size=8M --rw=write:124k --bs=4k
	snap 2 0
	thin_up thin 2
	head -c 2M /dev/urandom >p2
	write_file p2 /dev/mapper/tss-t0 0
	head -c 4096 /dev/urandom >p3
	write_file p2 /dev/mapper/tss-t2 6
	write_at p3 /dev/mapper/tss-t2 $((10 * 1024 + 8))
	dm_message tss-pool "set_transaction_id 0 7"
	dm_message tss-pool "reserve_metadata_snap"
	held=$(dm_status tss-pool | cut -d' ' -f4)
	[[ $held =~ ^[0-9]+$ ]] || fail "stock pool: no held root: $(dm_status tss-pool)"
	record stock1 0 1 2
	s1=$(pool_status_cmp tss-pool)
	table_of tss-pool >stock.table.pool
	table_of tss-t0 >stock.table.t0
	log "stock pool: $(dm_status tss-pool)"
	down 0 1 2

	# --- loaded unchanged as ours
	pool_up "$POOL_T" 0
	log "our pool: $(dm_status tss-pool)"
	check_pool_status tss-pool
	assert_eq "$s1" "$(pool_status_cmp tss-pool)" "pool status after loading the stock pool"
	assert_eq "$(cat stock.table.pool)" "$(table_of tss-pool)" "pool table line"
	for i in 0 1 2; do
		thin_up "$THIN_T" $i
	done
	assert_eq "$(cat stock.table.t0)" "$(table_of tss-t0)" "thin table line"
	compare stock1 0 1 2
	# The metadata snapshot the stock pool reserved is ours to release.
	dm_message tss-pool "release_metadata_snap"
	assert_eq - "$(dm_status tss-pool | cut -d' ' -f4)" "held root after release"

	# Written through ours: over the stock pool's partly written blocks,
	# a snapshot of its snapshot, a new device, the deletion of the
	# snapshot's origin, a new transaction id.
	head -c 2M /dev/urandom >q1
	write_file q1 /dev/mapper/tss-t1 1
	write_at p3 /dev/mapper/tss-t1 $((5 * 128 + 60))
	snap 3 2
	thin_up "$THIN_T" 3
	write_file q1 /dev/mapper/tss-t3 12
	write_at p3 /dev/mapper/tss-t3 $((3 * 1024 + 4))
	write_at p3 /dev/mapper/tss-t2 $((11 * 1024 + 4))
	dm_message tss-pool "create_thin 4"
	thin_up "$THIN_T" 4
	head -c 3M /dev/urandom >q3
	write_file q3 /dev/mapper/tss-t4 7
	write_at p3 /dev/mapper/tss-t4 $((14 * 1024 + 60))
	dm_remove tss-t2
	dm_message tss-pool "delete 2"
	dm_message tss-pool "set_transaction_id 7 8"
	record ours 0 1 3 4
	s2=$(pool_status_cmp tss-pool)
	log "our pool: $(dm_status tss-pool)"
	down 0 1 3 4
	thin_dump /dev/mapper/tss-meta >ours.xml
	assert_eq "0 1 3 4" "$(grep -o '<device dev_id="[0-9]*"' ours.xml | grep -o '[0-9]*' | sort -n | tr '\n' ' ' | sed 's/ $//')" \
		"devices in thin_dump after ours"

	# --- loaded back in the stock thin-pool
	pool_up thin-pool 0
	log "stock pool: $(dm_status tss-pool)"
	assert_eq "$s2" "$(pool_status_cmp tss-pool)" "stock pool status after ours"
	for i in 0 1 3 4; do
		thin_up thin $i
	done
	compare ours 0 1 3 4
	# And the stock pool can go on writing to it.
	write_file q1 /dev/mapper/tss-t4 12
	dm_remove tss-t3
	dm_message tss-pool "delete 3"
	record stock2 0 1 4
	down 0 1 4

	# --- and ours reads that again
	pool_up "$POOL_T" 0
	for i in 0 1 4; do
		thin_up "$THIN_T" $i
	done
	compare stock2 0 1 4
	down 0 1 4
	dm_remove tss-data
	dm_remove tss-meta
}

# Table and status lines for each feature set match the stock target's.
# Each target has its metadata (tss-meta, tss-meta2): this test does not
# depend on loading the other's.
test_table_status_lines() {
	local f t1 t2 s1 s2 meta
	local features=(
		"0"
		"2 error_if_no_space skip_block_zeroing"
		"4 skip_block_zeroing ignore_discard no_discard_passdown error_if_no_space"
		"2 read_only ignore_discard"
	)
	need_targets
	setup_devs
	dm_create tss-meta2 "0 $((META_MIB * 2048)) linear /dev/ram0 $((META_MIB * 2048))"
	dd if=/dev/zero of=/dev/mapper/tss-meta2 bs=4096 count=1 oflag=direct status=none
	for meta in tss-meta tss-meta2; do
		local pt=thin-pool tt=thin
		[ $meta = tss-meta ] || { pt=$POOL_T; tt=$THIN_T; }
		dm_create tss-pool "0 1048576 $pt /dev/mapper/$meta /dev/mapper/tss-data 128 $LOW_WATER 0"
		dm_message tss-pool "create_thin 1"
		dm_create tss-t1 "0 $THIN_SECTORS $tt /dev/mapper/tss-pool 1"
		dd if=/dev/urandom of=/dev/mapper/tss-t1 bs=64k count=3 seek=5 oflag=direct status=none
		dm_remove tss-t1
		dm_remove tss-pool
	done
	for f in "${features[@]}"; do
		dm_create tss-pool "0 1048576 thin-pool /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER $f"
		dm_create tss-t1 "0 $THIN_SECTORS thin /dev/mapper/tss-pool 1"
		t1="$(table_of tss-pool) | $(table_of tss-t1)"
		s1="$(pool_status_cmp tss-pool) | $(dm_status tss-t1)"
		dm_remove tss-t1
		dm_remove tss-pool
		dm_create tss-pool "0 1048576 $POOL_T /dev/mapper/tss-meta2 /dev/mapper/tss-data 128 $LOW_WATER $f"
		dm_create tss-t1 "0 $THIN_SECTORS $THIN_T /dev/mapper/tss-pool 1"
		# The metadata devices differ: compare with the stock's numbers.
		t2="$(table_of tss-pool | sed "s/^\(0 [0-9]* X \)$(devno /dev/mapper/tss-meta2) /\1$(devno /dev/mapper/tss-meta) /") | $(table_of tss-t1)"
		s2="$(pool_status_cmp tss-pool) | $(dm_status tss-t1)"
		dm_remove tss-t1
		dm_remove tss-pool
		log "features '$f': $t2 / $s2"
		assert_eq "$t1" "$t2" "table lines with features '$f'"
		assert_eq "$s1" "$s2" "status lines with features '$f'"
	done
	check_meta /dev/mapper/tss-meta
	check_meta /dev/mapper/tss-meta2
	dm_remove tss-meta2
	dm_remove tss-data
	dm_remove tss-meta
}

# The other way first: a pool made and filled by ours loads in the stock
# thin-pool with the same bytes, and the stock pool's changes load in
# ours again.
test_dropin_ours_first() {
	local i s1
	need_targets
	setup_devs
	pool_up "$POOL_T" 0
	for i in 0 1; do
		dm_message tss-pool "create_thin $i"
		thin_up "$THIN_T" $i
	done
	head -c 8M /dev/urandom >p0
	write_file p0 /dev/mapper/tss-t0 0
	head -c 4096 /dev/urandom >p3
	run_fio holes --filename=/dev/mapper/tss-t1 --offset=8k --size=4M --rw=write:252k --bs=4k
	snap 2 0
	thin_up "$THIN_T" 2
	head -c 2M /dev/urandom >p1
	write_file p1 /dev/mapper/tss-t0 4
	write_at p3 /dev/mapper/tss-t2 $((14 * 1024 + 4))
	dm_message tss-pool "set_transaction_id 0 3"
	record ours1 0 1 2
	s1=$(pool_status_cmp tss-pool)
	log "our pool: $(dm_status tss-pool)"
	down 0 1 2

	pool_up thin-pool 0
	log "stock pool: $(dm_status tss-pool)"
	assert_eq "$s1" "$(pool_status_cmp tss-pool)" "stock pool status after ours"
	for i in 0 1 2; do
		thin_up thin $i
	done
	compare ours1 0 1 2
	write_file p1 /dev/mapper/tss-t1 12
	snap 3 2
	thin_up thin 3
	write_at p3 /dev/mapper/tss-t3 8
	dm_message tss-pool "set_transaction_id 3 4"
	record stock1 0 1 2 3
	s1=$(pool_status_cmp tss-pool)
	down 0 1 2 3

	pool_up "$POOL_T" 0
	assert_eq "$s1" "$(pool_status_cmp tss-pool)" "our pool status after the stock pool's changes"
	for i in 0 1 2 3; do
		thin_up "$THIN_T" $i
	done
	compare stock1 0 1 2 3
	down 0 1 2 3
	dm_remove tss-data
	dm_remove tss-meta
}

# Neither pool target replaces the other's live table: both are
# immutable targets, so dm core refuses the load.  Otherwise two pools
# would have the same metadata in core, and the one resumed last would
# write back stale roots.
test_no_live_target_swap() {
	local live other id=0
	need_targets
	ours || skip "the pool target is the stock one"
	setup_devs
	for live in thin-pool "$POOL_T"; do
		other=thin-pool
		[ "$live" != thin-pool ] || other=$POOL_T
		pool_up "$live" 0
		[ "$(dmsetup table tss-pool | cut -d' ' -f3)" = "$live" ] || fail "pool target"
		dm_message tss-pool "create_thin $id"
		if [ "$live" = thin-pool ]; then thin_up thin $id; else thin_up "$THIN_T" $id; fi
		head -c 4M /dev/urandom >p0
		write_file p0 "/dev/mapper/tss-t$id" 0
		expect_fail dmsetup reload tss-pool --table \
			"0 1048576 $other /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER 0"
		dmesg_since_test | grep -q "can't replace immutable target type $live" ||
			fail "no refusal of $other over $live in the kernel log"
		assert_eq "$live" "$(dmsetup table tss-pool | cut -d' ' -f3)" "pool target after the refused reload"
		assert_eq "$(file_sha p0)" "$(dev_sha "/dev/mapper/tss-t$id" 0 4)" "thin device content"
		down $id
		id=$((id + 1))
	done
	dm_remove tss-data
	dm_remove tss-meta
}

run_test thin_scalable_dropin_both_ways test_dropin_both_ways
run_test thin_scalable_dropin_ours_first test_dropin_ours_first
run_test thin_scalable_table_status_lines test_table_status_lines
run_test thin_scalable_no_live_target_swap test_no_live_target_swap
summary
