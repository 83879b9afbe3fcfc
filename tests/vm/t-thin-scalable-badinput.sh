#!/bin/bash
# Bad input for our targets: malformed table lines for both targets and
# malformed pool messages are each refused (non-zero exit) with a
# device-mapper error in the kernel log, leave no device or inactive table
# behind and no splat; the pool keeps working; at the end the module
# unloads (and is loaded again for the test files after this one).
# shellcheck source=tests/vm/lib.sh
. "$(dirname "$0")/lib.sh"
# shellcheck source=tests/vm/t-thin-scalable-common.sh
. "$(dirname "$0")/t-thin-scalable-common.sh"

BAD=()      # what went wrong, reported together at the end
TRIED=0     # bad inputs tried
TABLES=0    # of them table lines
WHAT=()     # WHAT[n]: bad input n, refused; its kernel log follows the
            # line "tss-input n" (checked at the end: one dmesg, not one
            # an input, which is slow under TCG)

# refused <what> <command...>: the command must fail, and the kernel must
# log a device-mapper error for it.
refused() {
	local what=$1 rc=0 out
	shift
	TRIED=$((TRIED + 1))
	echo "<6>tss-input $TRIED" >/dev/kmsg
	out=$("$@" 2>&1) || rc=$?
	if [ "$rc" = 0 ]; then
		log "ACCEPTED: $what"
		BAD+=("accepted: $what")
		return 0
	fi
	WHAT[TRIED]=$what
}

# Each refused input has a device-mapper error in the kernel log.
check_kernel_said() {
	local n line
	declare -A said=()
	while IFS=$'\t' read -r n line; do
		said[$n]=$line
	done < <(dmesg_since_test | awk '
		/^tss-input [0-9]+$/ { cur = $2; next }
		cur != "" && /^device-mapper: / && !($0 ~ /^device-mapper: ioctl: error adding target to table$/ && (cur in last)) { last[cur] = $0 }
		END { for (k in last) print k "\t" last[k] }')
	for n in "${!WHAT[@]}"; do
		if [ -n "${said[$n]:-}" ]; then
			log "refused: ${WHAT[$n]}: ${said[$n]}"
		else
			log "refused: ${WHAT[$n]}: (no device-mapper message)"
			BAD+=("no device-mapper error in the kernel log for: ${WHAT[$n]}")
		fi
	done
}

# bad_table <line>: dmsetup create must be refused; the names are unique,
# and check_left looks for leftovers at the end.
bad_table() {
	TABLES=$((TABLES + 1))
	refused "table '$1'" dmsetup create "tss-bad$TABLES" --table "$1"
	if [ -z "${WHAT[TRIED]:-}" ]; then
		# Accepted: it must go now, it may hold devices the next need.
		dmsetup remove --force "tss-bad$TABLES" >/dev/null 2>&1 || true
	fi
}

check_left() {
	local n
	for n in $(dm_names | grep '^tss-bad' || true); do
		BAD+=("device $n left behind")
		dmsetup remove --force "$n" >/dev/null 2>&1 || true
	done
}

# bad_reload <device> <line>: the reload must be refused, leaving no
# inactive table.
bad_reload() {
	TABLES=$((TABLES + 1))
	refused "reload of $1 with '$2'" dmsetup reload "$1" --table "$2"
	if dmsetup info "$1" | grep -q 'Tables present:.*INACTIVE'; then
		BAD+=("inactive table left on $1 by '$2'")
		dmsetup clear "$1" >/dev/null 2>&1 || true
	fi
}

bad_message() { # <message>
	refused "message '$1'" dmsetup message tss-pool 0 "$1"
}

test_bad_input() {
	local P=$POOL_T T=$THIN_T D="/dev/ram0 /dev/ram1" line lines=() m i
	need_targets
	brd_setup 5 64
	dd if=/dev/zero of=/dev/ram0 bs=4096 count=1 oflag=direct status=none

	# A pool formats ram0 with 64 KiB blocks, then goes.
	dm_create tss-pool "0 131072 $P $D 128 0"
	dm_message tss-pool "create_thin 1"
	dm_remove tss-pool

	# --- pool table lines
	lines=(
		"0 131072 $P"
		"0 131072 $P /dev/ram0"
		"0 131072 $P /dev/ram0 /dev/ram1"
		"0 131072 $P /dev/ram0 /dev/ram1 128"
		"0 131072 $P $D 0 0"
		"0 131072 $P $D 127 0"
		"0 131072 $P $D 129 0"
		"0 131072 $P $D 64 0"
		"0 131072 $P $D 192x 0"
		"0 131072 $P $D 2147483648 0"
		"0 131072 $P $D 2097280 0"
		"0 131072 $P $D 4194304 0"
		"0 131072 $P $D 18446744073709551616 0"
		"0 131072 $P $D abc 0"
		"0 131072 $P $D -128 0"
		"0 131072 $P $D 0x80 0"
		"0 131072 $P $D 128 abc"
		"0 131072 $P $D 128 -1"
		"0 131072 $P $D 128 1k"
		"0 131072 $P $D 128 18446744073709551616"
		"0 131072 $P $D 128 0 1"
		"0 131072 $P $D 128 0 1 no_such_feature"
		"0 131072 $P $D 128 0 1 skip-block-zeroing"
		"0 131072 $P $D 128 0 2 skip_block_zeroing"
		"0 131072 $P $D 128 0 2 skip_block_zeroing no_such_feature"
		"0 131072 $P $D 128 0 3 skip_block_zeroing ignore_discard"
		"0 131072 $P $D 128 0 5 skip_block_zeroing ignore_discard no_discard_passdown read_only error_if_no_space"
		"0 131072 $P $D 128 0 x skip_block_zeroing"
		"0 131072 $P $D 128 0 -1"
		"0 131072 $P /dev/no-such-device /dev/ram1 128 0"
		"0 131072 $P /dev/ram0 /dev/no-such-device 128 0"
		"0 131072 $P 259:12345 /dev/ram1 128 0"
		"0 131072 $P /dev/ram0 259:12345 128 0"
		"0 131072 $P /dev/ram0 /dev/ram0 128 0"
		"0 131072 $P /dev/ram1 /dev/ram1 128 0"
		"0 99999999 $P $D 128 0"
		"0 131072 $P $D 256 0"
	)
	if ours; then
		# The same device by another name (the stock thin-pool compares
		# the names and takes this).
		lines+=("0 131072 $P /dev/ram0 $(devno /dev/ram0) 128 0")
	fi
	for line in "${lines[@]}"; do
		bad_table "$line"
	done

	# Garbage where the superblock should be.
	dd if=/dev/urandom of=/dev/ram4 bs=64k count=16 oflag=direct status=none
	bad_table "0 131072 $P /dev/ram4 /dev/ram1 128 0"
	# Zeroed metadata and read_only: it cannot be formatted.
	dd if=/dev/zero of=/dev/ram4 bs=64k count=16 oflag=direct status=none
	bad_table "0 131072 $P /dev/ram4 /dev/ram1 128 0 1 read_only"
	# Metadata of one 4 KiB block.
	dm_create tss-tiny "0 8 linear /dev/ram4 0"
	bad_table "0 131072 $P /dev/mapper/tss-tiny /dev/ram1 128 0"
	dm_remove tss-tiny
	# Zeroed metadata and a pool longer than its data device: refused
	# after the constructor has formatted the metadata, whose size must
	# not come from that table: the right length then loads and resumes.
	dd if=/dev/zero of=/dev/ram4 bs=64k count=16 oflag=direct status=none
	bad_table "0 99999999 $P /dev/ram4 /dev/ram1 128 0"
	dm_create tss-fresh "0 131072 $P /dev/ram4 /dev/ram1 128 0"
	assert_eq 1024 "$(dm_status tss-fresh | cut -d' ' -f3 | cut -d/ -f2)" \
		"data blocks of a pool formatted after a refused table"
	dm_remove tss-fresh
	check_meta /dev/ram4

	# --- with the pool up: a second pool on its metadata, reloads that
	# would swap its devices or block size, thin lines
	dm_create tss-pool "0 131072 $P $D 128 0"
	dm_create tss-thin "0 8192 $T /dev/mapper/tss-pool 1"
	dm_create tss-lin "0 8192 linear /dev/ram4 0"
	dd if=/dev/zero of=/dev/ram2 bs=4096 count=1 oflag=direct status=none
	if ours; then
		dm_create tss-other "0 131072 thin-pool /dev/ram2 /dev/ram3 128 0"
	elif dmsetup targets | grep -q '^thin-scal-pool '; then
		dm_create tss-other "0 131072 thin-scal-pool /dev/ram2 /dev/ram3 128 0"
	fi
	bad_table "0 131072 $P /dev/ram0 /dev/ram4 128 0"
	bad_reload tss-pool "0 131072 $P /dev/ram4 /dev/ram1 128 0"
	bad_reload tss-pool "0 131072 $P /dev/ram0 /dev/ram4 128 0"
	if ours; then
		# A new block size (the stock thin-pool ignores it).
		bad_reload tss-pool "0 131072 $P /dev/ram0 /dev/ram1 256 0"
	fi

	lines=(
		"0 8192 $T"
		"0 8192 $T /dev/mapper/tss-pool"
		"0 8192 $T /dev/mapper/tss-pool 1 /dev/ram4 extra"
		"0 8192 $T /dev/mapper/tss-pool abc"
		"0 8192 $T /dev/mapper/tss-pool -1"
		"0 8192 $T /dev/mapper/tss-pool 1x"
		"0 8192 $T /dev/mapper/tss-pool 0x1"
		"0 8192 $T /dev/mapper/tss-pool 16777216"
		"0 8192 $T /dev/mapper/tss-pool 18446744073709551617"
		"0 8192 $T /dev/mapper/tss-pool 99"
		"0 8192 $T /dev/mapper/tss-pool 16777215"
		"0 8192 $T /dev/no-such-device 1"
		"0 8192 $T 259:12345 1"
		"0 8192 $T /dev/ram1 1"
		"0 8192 $T $(devno /dev/ram1) 1"
		"0 8192 $T /dev/mapper/tss-lin 1"
		"0 8192 $T /dev/mapper/tss-thin 1"
		"0 0 $T /dev/mapper/tss-pool 1"
	)
	if dm_exists tss-other; then
		lines+=("0 8192 $T /dev/mapper/tss-other 1")
	fi
	# External origins: the pool itself, a device that does not exist.
	lines+=("0 8192 $T /dev/mapper/tss-pool 1 /dev/mapper/tss-pool"
		"0 8192 $T /dev/mapper/tss-pool 1 /dev/no-such-device")
	for line in "${lines[@]}"; do
		bad_table "$line"
	done

	# --- messages
	local msgs=(
		"no_such_message"
		"create_thin"
		"create_thin 2 3"
		"create_thin abc"
		"create_thin -1"
		"create_thin 2x"
		"create_thin 16777216"
		"create_thin 1"
		"create_snap"
		"create_snap 5"
		"create_snap 5 99"
		"create_snap 1 1"
		"create_snap x 1"
		"create_snap 5 y"
		"create_snap 5 1 1"
		"delete"
		"delete 99"
		"delete abc"
		"delete 1"
		"delete 1 2"
		"set_transaction_id"
		"set_transaction_id 0"
		"set_transaction_id 5 6"
		"set_transaction_id a b"
		"set_transaction_id 0 1 2"
		"reserve_metadata_snap now"
		"release_metadata_snap"
		"release_metadata_snap x"
		"stats extra"
	)
	for m in "${msgs[@]}"; do
		bad_message "$m"
	done
	assert_eq 0 "$(dm_status tss-pool | cut -d' ' -f1)" "transaction id after the refused messages"

	# The pool works: the refused messages created nothing, the thin
	# device reads and writes.
	check_pool_status tss-pool
	assert_eq rw "$(dm_status tss-pool | cut -d' ' -f5)" "pool mode after bad input"
	for i in 2 5; do
		dm_message tss-pool "create_thin $i"
		dm_message tss-pool "delete $i"
	done
	dm_message tss-pool "create_snap 5 1"
	dm_message tss-pool "delete 5"
	head -c 1M /dev/urandom >p
	write_file p /dev/mapper/tss-thin 1
	assert_eq "$(file_sha p)" "$(dev_sha /dev/mapper/tss-thin 1 1)" "the thin device after bad input"

	! dm_exists tss-other || dm_remove tss-other
	dm_remove tss-lin
	dm_remove tss-thin
	dm_remove tss-pool
	check_meta /dev/ram0

	check_left
	check_kernel_said
	log "$TRIED bad inputs ($TABLES table lines), ${#WHAT[@]} refused"
	if [ ${#BAD[@]} -gt 0 ]; then
		printf '    BAD: %s\n' "${BAD[@]}" >&2
		fail "${#BAD[@]} bad inputs were not handled as they should be"
	fi
	[ "$TABLES" -ge 50 ] || fail "only $TABLES bad table lines tried"
}

# The module unloads once nothing uses it, and loads again (for the test
# files after this one).
test_module_unload() {
	ours || skip "the module under test is not ours"
	[ -n "${VM_MODULE:-}" ] || skip "no module loaded"
	need_targets
	# A pool used and gone first: nothing of it may pin the module.
	brd_setup 2 64
	dd if=/dev/zero of=/dev/ram0 bs=4096 count=1 oflag=direct status=none
	dm_create tss-pool "0 131072 $POOL_T /dev/ram0 /dev/ram1 128 0"
	dm_message tss-pool "create_thin 0"
	dm_create tss-thin "0 8192 $THIN_T /dev/mapper/tss-pool 0"
	dd if=/dev/urandom of=/dev/mapper/tss-thin bs=64k count=8 oflag=direct status=none
	dm_remove tss-thin
	dm_remove tss-pool
	rmmod dm_thin_scalable || fail "rmmod dm_thin_scalable failed"
	[ ! -e /sys/module/dm_thin_scalable ] || fail "the module is still there after rmmod"
	! dmsetup targets | grep -q '^thin-scal' || fail "targets still registered after rmmod"
	insmod "$VM_MODULE" || fail "insmod $VM_MODULE failed again"
	need_targets
	check_meta /dev/ram0
}

run_test thin_scalable_bad_input test_bad_input
run_test thin_scalable_module_unload test_module_unload
summary
