#!/bin/bash
# lvm2 with our patch (lvm2/*.patch, built by scripts/build-lvm2) runs
# LVM thin pools on our targets: with activation/thin_scalable = 1 a pool,
# a thin LV and a thin snapshot are created and loaded as thin-scal-pool
# and thin-scalable; lvs reads their usage from our status lines; a pool
# resize and a snapshot removal go through; the pool moves to the stock
# thin-pool and back by deactivating it and changing the setting, with the
# same bytes; and a reload that would swap the target of an active pool
# fails without harm.  lvm runs thin_check at every pool activation, and
# the test runs it again on the deactivated pool's metadata.
#
# lvm2's other thin operations on our targets: metadata resize,
# error-when-full and discard settings by reload, snapshot merge,
# metadata repair, a thin LV with an external origin.
#
# And dmeventd, built with the patch, monitors a pool on our targets and
# extends it once its data usage passes thin_pool_autoextend_threshold.
# shellcheck source=tests/vm/lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=tests/vm/t-thin-scalable-common.sh
. "$(dirname "$0")/t-thin-scalable-common.sh"

LVM_BUILD=$(cd "$TSP_LIBDIR/../.." && pwd)/build/lvm2/src
LVM_BIN=$LVM_BUILD/tools/lvm
DMEVENTD_BIN=$LVM_BUILD/daemons/dmeventd/dmeventd
# The build's shared libraries: libdevmapper, libdevmapper-event, the
# dmeventd lvm2 plugin library and liblvm2cmd.
LVM_LIBS=$LVM_BUILD/libdm/ioctl:$LVM_BUILD/daemons/dmeventd:$LVM_BUILD/daemons/dmeventd/plugins/lvm2:$LVM_BUILD/tools
VG=tsslvm

need_lvm() {
	[ -x "$LVM_BIN" ] ||
		fail "$LVM_BIN is missing: run 'make lvm2' (make check builds it)"
}

lvm() {
	LD_LIBRARY_PATH=$LVM_LIBS LVM_SUPPRESS_FD_WARNINGS=1 "$LVM_BIN" "$@"
}

# lvm_config <thin_scalable> [<monitoring>]: an lvm.conf of our own, in
# the test's directory: only /dev/ram0, no udev, no backups, no daemons
# but dmeventd (with monitoring 1), and autoextend by half at 70%.
lvm_config() {
	export LVM_SYSTEM_DIR=$PWD/lvm
	mkdir -p "$LVM_SYSTEM_DIR/lock"
	cat >"$LVM_SYSTEM_DIR/lvm.conf" <<-EOF
	devices {
		scan = [ "/dev" ]
		filter = [ "a|^/dev/ram0\$|", "r|.*|" ]
		use_devicesfile = 0
		obtain_device_list_from_udev = 0
		external_device_info_source = "none"
		hints = "none"
	}
	global {
		locking_dir = "$LVM_SYSTEM_DIR/lock"
		thin_check_executable = "$(command -v thin_check)"
		thin_repair_executable = "$(command -v thin_repair)"
		event_activation = 0
	}
	activation {
		udev_sync = 0
		udev_rules = 0
		monitoring = ${2:-0}
		thin_scalable = $1
		thin_pool_autoextend_threshold = 70
		thin_pool_autoextend_percent = 50
	}
	dmeventd {
		executable = "$DMEVENTD_BIN"
		thin_library = "$LVM_BUILD/daemons/dmeventd/plugins/thin/libdevmapper-event-lvm2thin.so"
	}
	backup {
		backup = 0
		archive = 0
	}
	EOF
}

target_of() {
	dmsetup table "$1" | cut -d' ' -f3
}

lv_field() { # <lv> <field>
	lvm lvs --noheadings --nosuffix --units m -o "$2" "$VG/$1" | tr -d ' '
}

# The pool's and thin1's data usage as lvs reports them.
assert_usage() { # <pool data%> <thin1 data%> <what>
	assert_eq "$1" "$(lv_field pool data_percent)" "pool data% $3"
	assert_eq "$2" "$(lv_field thin1 data_percent)" "thin1 data% $3"
}

# thin_check the metadata of the inactive pool, activated read-only as a
# component LV.
check_pool_metadata() {
	lvm lvchange -q -ay -y "$VG/pool_tmeta"
	check_meta "/dev/mapper/$VG-pool_tmeta"
	lvm lvchange -q -an "$VG/pool_tmeta"
}

# make_vg [<monitoring>]: on a fresh /dev/ram0, VG $VG with pool, a
# 64 MiB thin pool of 64 KiB blocks (1024), and thin1, a 128 MiB thin LV,
# on our targets unless the suite runs the stock ones; with monitoring 1,
# under dmeventd.
make_vg() {
	local scalable=0
	need_targets
	need_lvm
	if ours; then
		scalable=1
	fi
	brd_setup 1 256
	lvm_config $scalable "${1:-0}"
	if [ "${1:-0}" = 1 ]; then
		start_dmeventd
	fi
	lvm pvcreate -q /dev/ram0
	lvm vgcreate -q "$VG" /dev/ram0
	lvm lvcreate -q --type thin-pool -L 64m --chunksize 64k -n pool "$VG"
	lvm lvcreate -q -V 128m -T "$VG/pool" -n thin1
	assert_eq "$POOL_T" "$(target_of "$VG-pool-tpool")" "pool target"
	assert_eq "$THIN_T" "$(target_of "$VG-thin1")" "thin LV target"
}

remove_vg() {
	lvm vgremove -q -ff "$VG"
	lvm pvremove -q /dev/ram0
}

test_lvm2_thin_scalable() {
	local sha1
	make_vg
	log "pool: $(dmsetup table "$VG-pool-tpool")"

	head -c 16M /dev/urandom >p0
	write_file p0 "/dev/mapper/$VG-thin1" 0
	assert_usage 25.00 12.50 "after 16 MiB"

	lvm lvcreate -q -s -n snap1 "$VG/thin1"
	lvm lvchange -q -ay -K "$VG/snap1"
	assert_eq "$THIN_T" "$(target_of "$VG-snap1")" "snapshot target"
	head -c 1M /dev/urandom >p1
	write_file p1 "/dev/mapper/$VG-thin1" 0
	assert_eq "$(file_sha p0)" "$(dev_sha "/dev/mapper/$VG-snap1" 0 16)" "snapshot content"
	assert_eq "$(file_sha p1)" "$(dev_sha "/dev/mapper/$VG-thin1" 0 1)" "origin content"
	# 256 + 16 blocks broken out of the snapshot
	assert_usage 26.56 12.50 "after breaking sharing"

	lvm lvextend -q -L +32m "$VG/pool"
	assert_eq $((96 * 2048)) "$(dmsetup table "$VG-pool-tpool" | cut -d' ' -f2)" "pool length after lvextend"
	assert_usage 17.71 12.50 "after lvextend"
	lvm lvremove -q -y "$VG/snap1"
	assert_usage 16.67 12.50 "after removing the snapshot"
	sha1=$(dev_sha "/dev/mapper/$VG-thin1" 0 16)
	lvm vgchange -q -an "$VG"
	check_pool_metadata

	if ours; then
		switch_targets "$sha1"
	fi
	remove_vg
}

# The inactive pool of test_lvm2_thin_scalable on the stock targets, then
# back on ours; thin1 reads <sha> throughout.
switch_targets() {
	local sha1=$1 other_pool=thin-pool

	lvm_config 0
	lvm vgchange -q -ay "$VG"
	assert_eq "$other_pool" "$(target_of "$VG-pool-tpool")" "pool target with thin_scalable = 0"
	assert_eq "$sha1" "$(dev_sha "/dev/mapper/$VG-thin1" 0 16)" "thin1 on the stock targets"

	# Reloading the active stock pool as ours is refused, and harmless.
	lvm_config 1
	expect_fail lvm lvextend -q -L +16m "$VG/pool"
	assert_eq "$other_pool" "$(target_of "$VG-pool-tpool")" "pool target after the refused reload"
	assert_usage 16.67 12.50 "read by lvm set for thin-scalable"
	lvm_config 0
	lvm vgchange -q -an "$VG"

	lvm_config 1
	lvm vgchange -q -ay "$VG"
	assert_eq "$POOL_T" "$(target_of "$VG-pool-tpool")" "pool target back on ours"
	assert_eq "$sha1" "$(dev_sha "/dev/mapper/$VG-thin1" 0 16)" "thin1 back on our targets"
	lvm vgchange -q -an "$VG"
	check_pool_metadata
}

# The pool's table line and status.
pool_table() {
	dmsetup table "$VG-pool-tpool"
}

pool_status() {
	dmsetup status "$VG-pool-tpool"
}

test_lvm2_operations() {
	local meta_before
	make_vg
	head -c 8M /dev/urandom >p0
	write_file p0 "/dev/mapper/$VG-thin1" 0

	# Metadata resize: the pool's status counts the new blocks.
	meta_before=$(lv_field pool lv_metadata_size | cut -d. -f1)
	lvm lvextend -q --poolmetadatasize +4m "$VG/pool"
	assert_eq $(((meta_before + 4) * 256)) "$(pool_status | cut -d' ' -f5 | cut -d/ -f2)" \
		"metadata blocks after lvextend --poolmetadatasize"

	# Features by reload.
	lvm lvchange -q --errorwhenfull y "$VG/pool"
	pool_table | grep -qw error_if_no_space || fail "no error_if_no_space: $(pool_table)"
	pool_status | grep -qw error_if_no_space || fail "status: $(pool_status)"
	lvm lvchange -q --discards nopassdown "$VG/pool"
	pool_table | grep -qw no_discard_passdown || fail "no no_discard_passdown: $(pool_table)"
	assert_eq "$(file_sha p0)" "$(dev_sha "/dev/mapper/$VG-thin1" 0 8)" "thin1 after the reloads"

	# A snapshot written, then merged back into its origin.
	lvm lvcreate -q -s -n snap1 "$VG/thin1"
	lvm lvchange -q -ay -K "$VG/snap1"
	head -c 2M /dev/urandom >p1
	write_file p1 "/dev/mapper/$VG-snap1" 2
	dd if=p1 of=p0 bs=1M seek=2 conv=notrunc status=none
	lvm lvconvert -q --merge "$VG/snap1"
	lvm lvchange -q -an "$VG/thin1"
	lvm lvchange -q -ay "$VG/thin1"
	dm_exists "$VG-snap1" && fail "snap1 still there after the merge"
	assert_eq "$(file_sha p0)" "$(dev_sha "/dev/mapper/$VG-thin1" 0 8)" "thin1 after the merge"

	# Repair: thin_repair into the spare metadata LV, swapped in.
	lvm vgchange -q -an "$VG"
	lvm lvconvert -q -y --repair "$VG/pool"
	lvm vgchange -q -ay "$VG"
	assert_eq "$POOL_T" "$(target_of "$VG-pool-tpool")" "pool target after the repair"
	assert_eq "$(file_sha p0)" "$(dev_sha "/dev/mapper/$VG-thin1" 0 8)" "thin1 after the repair"
	lvm lvremove -q -y "$VG/pool_meta0"

	# A linear LV turned into a thin LV of the pool with it as a
	# read-only external origin: writes go to the pool, the origin keeps
	# its bytes.
	lvm lvcreate -q -L 8m -n ext "$VG"
	head -c 8M /dev/urandom >p2
	write_file p2 "/dev/mapper/$VG-ext" 0
	lvm lvconvert -q -y --type thin --thinpool "$VG/pool" --originname extorig "$VG/ext"
	assert_eq "$THIN_T" "$(target_of "$VG-ext")" "target of the converted LV"
	assert_eq 6 "$(dmsetup table "$VG-ext" | awk '{ print NF }')" "thin table words with an external origin"
	assert_eq "$(file_sha p2)" "$(dev_sha "/dev/mapper/$VG-ext" 0 8)" "thin LV reading its external origin"
	head -c 1M /dev/urandom >p3
	write_file p3 "/dev/mapper/$VG-ext" 3
	lvm lvchange -q -ay -K "$VG/extorig"
	assert_eq "$(file_sha p2)" "$(dev_sha "/dev/mapper/$VG-extorig" 0 8)" "external origin after a write"
	dd if=p3 of=p2 bs=1M seek=3 conv=notrunc status=none
	assert_eq "$(file_sha p2)" "$(dev_sha "/dev/mapper/$VG-ext" 0 8)" "thin LV after a write"

	lvm vgchange -q -an "$VG"
	check_pool_metadata
	remove_vg
}

# dmeventd in the foreground, in the background: lvm registers the
# pools it activates with it.
start_dmeventd() {
	LD_LIBRARY_PATH=$LVM_LIBS "$DMEVENTD_BIN" -f -l -d >dmeventd.log 2>&1 &
	DMEVENTD_PID=$!
	# Not left running by a failed test (each runs in a subshell).
	trap stop_dmeventd EXIT
	local i
	for i in $(seq 50); do
		kill -0 "$DMEVENTD_PID" 2>/dev/null || break
		[ "$(cat /run/dmeventd.pid 2>/dev/null)" = "$DMEVENTD_PID" ] &&
			[ -p /run/dmeventd-server ] && return 0
		sleep 0.2
	done
	cat dmeventd.log
	fail "dmeventd did not start"
}

# dmeventd exits on SIGTERM only once nothing is monitored: unmonitor
# the VG first (a no-op once it is inactive), and kill it after 10 s.
stop_dmeventd() {
	local i
	kill -0 "$DMEVENTD_PID" 2>/dev/null || return 0
	lvm vgchange -q --monitor n "$VG" >/dev/null 2>&1 || true
	kill "$DMEVENTD_PID"
	for i in $(seq 100); do
		kill -0 "$DMEVENTD_PID" 2>/dev/null || break
		sleep 0.1
	done
	kill -KILL "$DMEVENTD_PID" 2>/dev/null || true
	wait "$DMEVENTD_PID" 2>/dev/null || true
}

test_lvm2_autoextend() {
	local i size
	make_vg 1
	assert_eq monitored "$(lv_field pool seg_monitor)" "pool monitoring"

	# 52 MiB of 64: 81%, past the threshold.  The pool's low water event
	# (at 70%) wakes dmeventd, which runs lvextend --use-policies: 96 MiB.
	head -c 52M /dev/urandom >p0
	write_file p0 "/dev/mapper/$VG-thin1" 0
	for i in $(seq 120); do
		size=$(lv_field pool lv_size)
		[ "$size" = 64.00 ] || break
		sleep 0.5
	done
	[ "$size" != 64.00 ] || { cat dmeventd.log; fail "dmeventd did not extend the pool"; }
	assert_eq 96.00 "$size" "pool size after autoextend"
	assert_eq $((96 * 2048)) "$(dmsetup table "$VG-pool-tpool" | cut -d' ' -f2)" "pool length after autoextend"
	assert_eq 54.17 "$(lv_field pool data_percent)" "pool data% after autoextend"
	assert_eq "$(file_sha p0)" "$(dev_sha "/dev/mapper/$VG-thin1" 0 52)" "thin1 content"

	lvm vgchange -q -an "$VG"
	stop_dmeventd
	check_pool_metadata
	remove_vg
}

run_test lvm2_thin_scalable test_lvm2_thin_scalable
run_test lvm2_operations test_lvm2_operations
run_test lvm2_autoextend test_lvm2_autoextend
summary
