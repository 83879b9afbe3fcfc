#!/bin/bash
# Helpers shared by the t-thin-scalable*.sh test files, sourced after
# lib.sh. Holds no tests: run as a test file (tests/vm/suite.sh runs every
# t-*.sh) it does nothing.
# shellcheck shell=bash
[[ ${BASH_SOURCE[0]} != "$0" ]] || exit 0

# The targets under test. TSP_POOL_TARGET=thin-pool TSP_THIN_TARGET=thin
# run the same tests against the stock dm-thin: the baseline.
# (The pool target is thin-scal-pool: dm ioctls carry target names in 16
# bytes, so "thin-scalable-pool" cannot be named in a table line.)
POOL_T=${TSP_POOL_TARGET:-thin-scal-pool}
THIN_T=${TSP_THIN_TARGET:-thin-scalable}
if [ "$POOL_T" = thin-pool ]; then
	TSS_MODULE=dm_thin_pool
else
	TSS_MODULE=dm_thin_scalable
fi
# shellcheck disable=SC2034 # used by the test files
NO_SPACE_TIMEOUT=/sys/module/$TSS_MODULE/parameters/no_space_timeout

# Pools made by the suite get a worker per CPU (pool_workers=0; the
# module's default is one), so that workers owning different regions run
# at the same time.  TSS_POOL_WORKERS=N for another count.
POOL_WORKERS=/sys/module/$TSS_MODULE/parameters/pool_workers
if [ -w "$POOL_WORKERS" ]; then
	echo "${TSS_POOL_WORKERS:-0}" >"$POOL_WORKERS"
fi
# And they hand the bios of every batch of two provisions or more to the
# CPUs that mapped them (handover_min_batch=2; the module's default is 64,
# which only oversubscribed runs reach), so that both ways of ending a
# batch's bios run, and both ways a worker provisions a first write
# without zeroing (a job, or mapped before the write in a pass of two
# bios or more).
HANDOVER_MIN_BATCH=/sys/module/$TSS_MODULE/parameters/handover_min_batch
if [ -w "$HANDOVER_MIN_BATCH" ]; then
	echo 2 >"$HANDOVER_MIN_BATCH"
fi
expected_workers() { # what the "stats" message should say
	local n=${TSS_POOL_WORKERS:-0} cpus
	cpus=$(getconf _NPROCESSORS_ONLN)
	{ [ "$n" = 0 ] || [ "$n" -gt "$cpus" ]; } && n=$cpus
	echo $((n > 64 ? 64 : n))
}
META_MIB=64
LOW_WATER=16

# TSS_TRACE=1: trace every command with a timestamp (where does the time go).
if [ -n "${TSS_TRACE:-}" ]; then
	PS4='+ ${EPOCHREALTIME} '
	set -x
fi

# lib.sh's checksums, with md5 instead of sha256: three times cheaper under
# TCG, and these only compare data with data.
dev_sha() { # <dev> <MiB offset> <MiB>
	dd if="$1" bs=1M skip="$2" count="$3" iflag=direct status=none | md5sum | cut -d' ' -f1
}
file_sha() {
	md5sum <"$1" | cut -d' ' -f1
}
zero_sha() { # <MiB>
	head -c "$(($1 * 1024 * 1024))" /dev/zero | md5sum | cut -d' ' -f1
}

# The pool target must be registered: a test skips only if the VM was
# started without our module (run-suite with TSP_MODULE=none).
need_targets() {
	dmsetup targets | grep -q "^$POOL_T " && dmsetup targets | grep -q "^$THIN_T " && return 0
	[ -n "${VM_MODULE:-}" ] || [ "$POOL_T" = thin-pool ] ||
		skip "targets $POOL_T/$THIN_T not registered (no module loaded)"
	fail "targets $POOL_T/$THIN_T not registered: $(dmsetup targets | tr '\n' ' ')"
}

ours() { [ "$POOL_T" != thin-pool ]; }

# major:minor of a block device, as table lines show it.
devno() {
	printf '%d:%d\n' "0x$(stat -L -c %t "$1")" "0x$(stat -L -c %T "$1")"
}

# make_pool <data MiB> <#features> [<feature>...]: RAM disks ram0 (64 MiB
# metadata slice tss-meta, first 4 KiB zeroed) and ram1 (data slice
# tss-data of <data MiB>), and the pool tss-pool on them, 64 KiB blocks.
# $TSS_RAM_DISKS (default 2) RAM disks of 512 MiB are made.
make_pool() {
	local mib=$1
	shift
	brd_setup "${TSS_RAM_DISKS:-2}" 512
	dm_create tss-meta "0 $((META_MIB * 2048)) linear /dev/ram0 0"
	dd if=/dev/zero of=/dev/mapper/tss-meta bs=4096 count=1 oflag=direct status=none
	dm_create tss-data "0 $((mib * 2048)) linear /dev/ram1 0"
	dm_create tss-pool "0 $((mib * 2048)) $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER $*"
}

# reload_pool <data MiB> <#features> [<feature>...]: a new table for tss-pool.
reload_pool() {
	local mib=$1
	shift
	dmsetup reload tss-pool --table "0 $((mib * 2048)) $POOL_T /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER $*" ||
		fail "reloading the pool failed"
	dmsetup resume tss-pool || fail "resuming the reloaded pool failed"
}

# grow_pool <data MiB> <#features> [<feature>...]: grow tss-data, then
# reload the pool with the new length.
grow_pool() {
	local mib=$1
	dmsetup reload tss-data --table "0 $((mib * 2048)) linear /dev/ram1 0"
	dmsetup resume tss-data
	reload_pool "$@"
}

# shellcheck disable=SC2120 # the device is optional
check_meta() { # [device]: thin_check clean
	local dev=${1:-/dev/mapper/tss-meta}
	thin_check "$dev" >thin_check.log 2>&1 || { cat thin_check.log; fail "thin_check $dev found problems"; }
}

# Remove tss-pool, thin_check its metadata, remove the slices.
teardown_pool() {
	dm_remove tss-pool
	check_meta /dev/mapper/tss-meta
	dm_remove tss-data
	dm_remove tss-meta
}

# The pool's status line has dm-thin's format.
check_pool_status() {
	local s
	s=$(dm_status "$1")
	[[ $s =~ ^[0-9]+\ [0-9]+/[0-9]+\ [0-9]+/[0-9]+\ (-|[0-9]+)\ (rw|ro|out_of_data_space)\ (discard_passdown|no_discard_passdown|ignore_discard)\ (queue_if_no_space|error_if_no_space)\ (needs_check|-)\ [0-9]+\ ?$ ]] ||
		fail "status of pool $1 does not parse: '$s'"
}

pool_used() { # used data blocks
	dm_status "$1" | awk '{ split($3, a, "/"); print a[1] }'
}

# pool_stat <counter>: that counter of tss-pool's stats message (ours
# only).  In a test (set -e), "v=$(pool_stat x)" fails it if there is none.
pool_mode() { # <pool>: rw, ro or out_of_data_space
	dm_status "$1" | cut -d' ' -f5
}

pool_stat() {
	local s
	s=$(dmsetup message tss-pool 0 stats) || fail "the stats message failed"
	[[ $s =~ (^|\ )$1\ ([0-9]+) ]] || fail "stats: no $1: '$s'"
	echo "${BASH_REMATCH[2]}"
}

# part <file> <byte offset> <bytes>
part() {
	dd if="$1" bs=64k skip="$2" count="$3" iflag=skip_bytes,count_bytes status=none
}

# part_sha <file> <MiB offset> <MiB>
part_sha() {
	dd if="$1" bs=1M skip="$2" count="$3" status=none | md5sum | cut -d' ' -f1
}

# run_fio <name> <fio options...>: direct libaio job; fails with its log.
run_fio() {
	local name=$1
	shift
	fio --name="$name" --direct=1 --ioengine=libaio --eta=never --output="$name.log" "$@" ||
		{ cat "$name.log"; fail "fio $name failed"; }
}

# check_zeroed_around <image> <blocks> <offset> [<block bytes>]: each
# block of <image> (64 KiB unless given) has data in its 4 KiB at byte
# <offset> and zeroes around it (a first write to a new block, zeroing
# on); prints each bad block.
check_zeroed_around() {
	perl -e '
		my ($img, $n, $off, $bs) = @ARGV;
		$bs //= 65536;
		open(my $f, "<:raw", $img) or die "$img: $!";
		my $bad = 0;
		for my $i (0 .. $n - 1) {
			read($f, my $blk, $bs) == $bs or die "short read";
			if (substr($blk, 0, $off) =~ /[^\0]/) { print "block $i: not zeroes before the 4k written\n"; $bad++; }
			if (substr($blk, $off, 4096) =~ /^\0*$/) { print "block $i: the 4k written read as zeroes\n"; $bad++; }
			if (substr($blk, $off + 4096) =~ /[^\0]/) { print "block $i: not zeroes after the 4k written\n"; $bad++; }
		}
		exit($bad ? 1 : 0);' "$@"
}
