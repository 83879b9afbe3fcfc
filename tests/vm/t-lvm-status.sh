#!/bin/bash
# lvm2 reads our status lines: the status of thin-scal-pool and
# thin-scalable devices parsed by libdevmapper's dm_get_status_thin_pool
# and dm_get_status_thin (build/dm-status, tests/vm/dm-status.c) gives the
# same fields as the same layout on the stock thin-pool and thin: a new
# pool, written thin devices, a snapshot, a held metadata snapshot,
# read_only, error_if_no_space with no_discard_passdown, out of data space.
#
# Every parsed status is also checked against the raw status line, read
# field by field, so that a line libdevmapper's lenient parser (sscanf,
# then strstr for the flags) misreads fails even where both targets agree.
# used_metadata_blocks is compared with the raw line only: which metadata
# blocks a commit shadows is the implementation's business.
# libdevmapper 1.02.185 does not parse the held metadata root (always 0);
# the raw line's held root is checked instead.
# shellcheck source=tests/vm/lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=tests/vm/t-thin-scalable-common.sh
. "$(dirname "$0")/t-thin-scalable-common.sh"

DM_STATUS_BIN=$(cd "$TSP_LIBDIR/../.." && pwd)/build/dm-status

DATA_MIB=16		# 256 data blocks of 64 KiB
THIN_SECTORS=131072	# 64 MiB thin devices

need_dm_status() {
	[ -x "$DM_STATUS_BIN" ] ||
		fail "$DM_STATUS_BIN is missing: run 'make vm-helpers' (make check builds it)"
}

# parse <device> <out file>: libdevmapper's reading of the device's status
# into <out file>, the raw status (read right after, without a commit) into
# <out file>.raw; the two must agree.
parse() {
	local dev=$1 out=$2
	"$DM_STATUS_BIN" "$dev" >"$out" 2>"$out.err" ||
		{ cat "$out.err"; fail "libdevmapper cannot parse the status of $dev: '$(dm_status "$dev")'"; }
	dmsetup status --noflush "$dev" | cut -d' ' -f4- >"$out.raw"
	check_parsed "$out" "$(cat "$out.raw")" "$dev"
}

# What libdevmapper should have read from raw status <line> of a pool or
# thin device: the key=value lines dm-status prints, without target=.
expected_of_raw() { # <pool|thin> <line>
	awk -v kind="$1" '
	function bad(why) { print "unparsable status line (" why "): " $0 > "/dev/stderr"; exit 1 }
	kind == "thin" {
		if (NF != 2) bad("2 fields expected")
		if ($1 !~ /^[0-9]+$/ || $2 !~ /^([0-9]+|-)$/) bad("numbers expected")
		if ($2 == "-" && $1 != 0) bad("no highest mapped sector but mapped sectors")
		print "mapped_sectors=" $1
		print "highest_mapped_sector=" ($2 == "-" ? 0 : $2)
		print "fail=0"
		exit 0
	}
	kind == "pool" {
		if (NF != 9) bad("9 fields expected")
		if ($1 !~ /^[0-9]+$/) bad("transaction id")
		if (split($2, m, "/") != 2 || m[1] !~ /^[0-9]+$/ || m[2] !~ /^[0-9]+$/) bad("metadata blocks")
		if (split($3, d, "/") != 2 || d[1] !~ /^[0-9]+$/ || d[2] !~ /^[0-9]+$/) bad("data blocks")
		if ($4 !~ /^([0-9]+|-)$/) bad("held metadata root")
		if ($5 !~ /^(rw|ro|out_of_data_space)$/) bad("mode")
		if ($6 !~ /^(discard_passdown|no_discard_passdown|ignore_discard)$/) bad("discards")
		if ($7 !~ /^(queue_if_no_space|error_if_no_space)$/) bad("no space mode")
		if ($8 !~ /^(needs_check|-)$/) bad("needs_check")
		if ($9 !~ /^[0-9]+$/) bad("metadata low water mark")
		print "transaction_id=" $1
		print "used_metadata_blocks=" m[1]
		print "total_metadata_blocks=" m[2]
		print "used_data_blocks=" d[1]
		print "total_data_blocks=" d[2]
		print "held_metadata_root=0"
		print "read_only=" ($5 == "ro")
		print "discards=" ($6 == "discard_passdown" ? "passdown" : $6 == "no_discard_passdown" ? "no_passdown" : "ignore")
		print "fail=0"
		print "error_if_no_space=" ($7 == "error_if_no_space")
		print "out_of_data_space=" ($5 == "out_of_data_space")
		print "needs_check=" ($8 == "needs_check")
		print "error=0"
		exit 0
	}' <<<"$2"
}

# check_parsed <parsed file> <raw line> <what>
check_parsed() {
	local kind=thin exp got
	grep -Eq '^target=(thin-pool|thin-scal-pool)$' "$1" && kind=pool
	exp=$(expected_of_raw $kind "$2") || fail "$3: raw status '$2' is not dm-thin's format"
	got=$(grep -v '^target=' "$1")
	[ "$exp" = "$got" ] ||
		fail "$3: libdevmapper read '$2' as: $(echo "$got" | tr '\n' ' ') (the line says: $(echo "$exp" | tr '\n' ' '))"
}

# expect_fields <parsed file> <key=value>...: the parsed status has these.
expect_fields() {
	local f=$1 kv
	shift
	for kv in "$@"; do
		grep -qx -- "$kv" "$f" ||
			fail "$(basename "$f"): expected $kv, got $(grep "^${kv%%=*}=" "$f") (status '$(cat "$f.raw")')"
	done
}

# layout <pool target> <thin target> <out dir>: build the same pool on
# fresh metadata with the given targets and record the parsed status at
# each stage as <out dir>/<stage>.<device>. pat0, pat1 are the data.
layout() {
	local pt=$1 tt=$2 out=$3 pool="0 $((DATA_MIB * 2048)) $1 /dev/mapper/tss-meta /dev/mapper/tss-data 128 $LOW_WATER"
	mkdir -p "$out"
	dd if=/dev/zero of=/dev/mapper/tss-meta bs=4096 count=1 oflag=direct status=none
	dd if=/dev/zero of=/dev/mapper/tss-data bs=1M count=$DATA_MIB oflag=direct status=none

	dm_create tss-pool "$pool 0"
	parse tss-pool "$out/new.pool"
	expect_fields "$out/new.pool" transaction_id=0 total_metadata_blocks=$((META_MIB * 256)) \
		used_data_blocks=0 total_data_blocks=256 read_only=0 \
		error_if_no_space=0 out_of_data_space=0 needs_check=0 fail=0

	dm_message tss-pool "create_thin 0"
	dm_message tss-pool "create_thin 1"
	dm_create tss-t0 "0 $THIN_SECTORS $tt /dev/mapper/tss-pool 0"
	dm_create tss-t1 "0 $THIN_SECTORS $tt /dev/mapper/tss-pool 1"
	parse tss-pool "$out/empty.pool"
	parse tss-t0 "$out/empty.t0"
	expect_fields "$out/empty.t0" mapped_sectors=0 highest_mapped_sector=0 fail=0

	# t0: 4 MiB at 0 (blocks 0..63), 4 KiB at 20 MiB + 8 KiB (block
	# 320), then 1 MiB at 1 MiB discarded (blocks 16..31); t1: 1 MiB at
	# 8 MiB (blocks 128..143).
	write_file pat0 /dev/mapper/tss-t0 0
	dd if=pat1 of=/dev/mapper/tss-t0 bs=4k count=1 seek=$((20 * 256 + 2)) \
		oflag=direct conv=notrunc,fsync status=none
	blkdiscard -o $((1 << 20)) -l $((1 << 20)) /dev/mapper/tss-t0
	dd if=pat1 of=/dev/mapper/tss-t1 bs=1M count=1 seek=8 oflag=direct conv=notrunc,fsync status=none
	dm_message tss-pool "set_transaction_id 0 5"
	parse tss-pool "$out/written.pool"
	parse tss-t0 "$out/written.t0"
	parse tss-t1 "$out/written.t1"
	expect_fields "$out/written.pool" transaction_id=5 used_data_blocks=65
	expect_fields "$out/written.t0" mapped_sectors=$((49 * 128)) highest_mapped_sector=$((321 * 128 - 1))
	expect_fields "$out/written.t1" mapped_sectors=$((16 * 128)) highest_mapped_sector=$((144 * 128 - 1))

	# Snapshot 2 of t0, then 1 MiB over t0's first blocks: 16 more.
	dmsetup suspend tss-t0
	dm_message tss-pool "create_snap 2 0"
	dmsetup resume tss-t0
	write_file pat1 /dev/mapper/tss-t0 0
	parse tss-pool "$out/snapshot.pool"
	parse tss-t0 "$out/snapshot.t0"
	expect_fields "$out/snapshot.pool" used_data_blocks=81
	expect_fields "$out/snapshot.t0" mapped_sectors=$((49 * 128))

	# A held metadata snapshot.
	dm_message tss-pool "reserve_metadata_snap"
	parse tss-pool "$out/held.pool"
	[[ $(cut -d' ' -f4 "$out/held.pool.raw") =~ ^[0-9]+$ ]] ||
		fail "$pt: no held root after reserve_metadata_snap: '$(cat "$out/held.pool.raw")'"

	# Read-only, the snapshot still held.
	dmsetup reload tss-pool --table "$pool 1 read_only"
	dmsetup resume tss-pool
	parse tss-pool "$out/ro.pool"
	parse tss-t0 "$out/ro.t0"
	parse tss-t1 "$out/ro.t1"
	expect_fields "$out/ro.pool" read_only=1 transaction_id=5 used_data_blocks=81
	[[ $(cut -d' ' -f4 "$out/ro.pool.raw") =~ ^[0-9]+$ ]] ||
		fail "$pt: held root gone in read-only mode: '$(cat "$out/ro.pool.raw")'"

	# Writable again by a reload, as lvm2 does it: error_if_no_space,
	# no_discard_passdown; then release the metadata snapshot.
	dmsetup reload tss-pool --table "$pool 2 error_if_no_space no_discard_passdown"
	dmsetup resume tss-pool
	[[ $(dm_status tss-pool | cut -d' ' -f4) =~ ^[0-9]+$ ]] ||
		fail "$pt: held root gone after the reload: '$(dm_status tss-pool)'"
	dm_message tss-pool "release_metadata_snap"
	parse tss-pool "$out/enospc.pool"
	expect_fields "$out/enospc.pool" read_only=0 error_if_no_space=1 discards=no_passdown
	assert_eq - "$(cut -d' ' -f4 "$out/enospc.pool.raw")" "$pt: held root after release_metadata_snap"

	# Out of data space: 64 KiB writes to t1 from 16 MiB, one block each;
	# 175 fit, the 176th fails.
	if dd if=/dev/zero of=/dev/mapper/tss-t1 bs=64k count=256 seek=256 \
		oflag=direct conv=notrunc status=none 2>dd.err; then
		fail "$pt: writing 256 blocks into 175 free ones succeeded"
	fi
	parse tss-pool "$out/full.pool"
	parse tss-t1 "$out/full.t1"
	expect_fields "$out/full.pool" out_of_data_space=1 used_data_blocks=256 error_if_no_space=1
	expect_fields "$out/full.t1" mapped_sectors=$((191 * 128)) highest_mapped_sector=$((431 * 128 - 1))

	dm_remove tss-t1
	dm_remove tss-t0
	dm_remove tss-pool
	check_meta /dev/mapper/tss-meta
}

test_lvm_status() {
	local f name diffs=0
	need_targets
	need_dm_status
	brd_setup 2 128
	dm_create tss-meta "0 $((META_MIB * 2048)) linear /dev/ram0 0"
	dm_create tss-data "0 $((DATA_MIB * 2048)) linear /dev/ram1 0"
	head -c 4M /dev/urandom >pat0
	head -c 1M /dev/urandom >pat1

	layout thin-pool thin stock
	layout "$POOL_T" "$THIN_T" ours

	for f in stock/*.pool stock/*.t[0-9]; do
		name=${f#stock/}
		[ -f "ours/$name" ] || fail "no ours/$name"
		log "$name: $(cat "stock/$name.raw") | $(cat "ours/$name.raw")"
		if ! diff <(grep -Ev '^(target|used_metadata_blocks)=' "$f") \
			<(grep -Ev '^(target|used_metadata_blocks)=' "ours/$name") >"$name.diff"; then
			echo "    $name: thin-pool/thin (<) and $POOL_T/$THIN_T (>) parse differently:" >&2
			sed 's/^/      /' "$name.diff" >&2
			diffs=$((diffs + 1))
		fi
	done
	[ "$diffs" = 0 ] || fail "$diffs statuses parse differently from the stock targets'"
	dm_remove tss-data
	dm_remove tss-meta
}

run_test thin_scalable_lvm_status test_lvm_status
summary
