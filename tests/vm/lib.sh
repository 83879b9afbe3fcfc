# shellcheck shell=bash
# tests/vm/lib.sh: helpers for the guest-side test files tests/vm/t-*.sh.
# Runs inside the VM (scripts/vm-run), as root, with the host's tools.
#
# A test file:
#
#   #!/bin/bash
#   . "$(dirname "$0")/lib.sh"
#   test_something() {
#       brd_setup 2 64                   # /dev/ram0, /dev/ram1, 64 MiB each
#       dm_create tsp-x "0 2048 linear /dev/ram0 0"
#       [ "$(blockdev --getsz /dev/mapper/tsp-x)" = 2048 ] || fail "bad size"
#       dm_remove tsp-x
#   }
#   run_test something test_something
#   summary
#
# Each test function runs in a subshell with `set -e -o pipefail`, in a
# fresh temporary directory. The first failing command fails the test (and
# is reported with its line); fail "msg" fails it with a message, skip "why"
# skips it. After the function, run_test
#   - fails the test if it left dm devices behind that were not there before
#     (and removes them, so the next test starts clean),
#   - unloads brd if the test set up RAM disks (fails if still in use),
#   - fails the test if the kernel log gained a BUG/WARNING/Oops/leak/hang/
#     lockdep report while it ran,
# then prints "PASS name", "FAIL name" or "SKIP name". summary prints
# "N passed, N failed" and returns non-zero if anything failed.
#
# Environment:
#   TSP_TEST_FILTER   extended regex; only tests whose name matches run
#   TSP_RESULTS_FILE  if set, "PASS|FAIL|SKIP <file>:<name>" lines are
#                     appended to it (tests/vm/suite.sh tallies them)

set -uo pipefail
export DM_DISABLE_UDEV=1

# Kept in step with splat_re in scripts/vm-run.
TSP_SPLAT_RE='(^|[^A-Za-z_])(BUG|WARNING):|kernel BUG at|Oops|general protection fault|Kernel panic|unreferenced object|hung_task|blocked for more than|possible circular locking|inconsistent lock state|possible recursive locking|suspicious RCU usage|UBSAN:|KASAN:'

TSP_FILE=$(basename "$0" .sh)
# The directory of the test files, for fixtures.
export TSP_LIBDIR
TSP_LIBDIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TSP_PASSED=0
TSP_FAILED=0
TSP_SKIPPED=0
TSP_BEGIN_MARK=

# --- messages ------------------------------------------------------------

log() { echo "    $*"; }

# Fail the current test with a message.
fail() {
	echo "    FAIL: $*" >&2
	exit 1
}

# Skip the current test.
skip() {
	echo "    SKIP: $*"
	exit 77
}

# --- kernel log ----------------------------------------------------------

# Write a unique marker line into the kernel log and print it; pass it to
# dmesg_since to get what the kernel logged after it.
kmsg_mark() {
	local m="tsp-mark $TSP_FILE $BASHPID $EPOCHREALTIME${1:+ $1}"
	echo "<6>$m" >/dev/kmsg
	echo "$m"
}

# Kernel log lines after the marker line $1 (without timestamps).
dmesg_since() {
	dmesg | sed 's/^\[[ 0-9.]*\] //' | awk -v m="$1" 'seen { print } $0 == m { seen = 1 }'
}

# Kernel log since the current test began.
dmesg_since_test() {
	dmesg_since "$TSP_BEGIN_MARK"
}

# Succeed if the kernel log since marker $1 has a line matching ERE $2.
dmesg_has() {
	dmesg_since "$1" | grep -Eq -- "$2"
}

# --- assertions ----------------------------------------------------------

# assert_eq <expected> <actual> <what>
assert_eq() {
	[ "$1" = "$2" ] || fail "${3:-value}: expected '$1', got '$2'"
}

# eventually_eq <expected> <what> <command...>: assert_eq on the
# command's output, tried again for up to 20 s while it differs: for what
# the kernel finishes after the call that started it returned.
eventually_eq() {
	local want=$1 what=$2 got i
	shift 2
	for i in $(seq 200); do
		got=$("$@")
		[ "$got" = "$want" ] && return 0
		sleep 0.1
	done
	assert_eq "$want" "$got" "$what (after $i tries)"
}

# Run a command that must fail; its output is indented into the log.
expect_fail() {
	local rc=0 out
	out=$("$@" 2>&1) || rc=$?
	[ -z "$out" ] || printf '%s\n' "$out" | sed 's/^/      | /'
	[ "$rc" != 0 ] || fail "expected to fail but succeeded: $*"
}

# --- RAM disks -----------------------------------------------------------

# brd_setup <count> <MiB>: fresh, zeroed /dev/ram0 .. /dev/ram<count-1>.
# brd is unloaded again after the test.
brd_setup() {
	local n=$1 mib=$2 i
	if [ -e /sys/module/brd ]; then
		rmmod brd || fail "brd_setup: brd is in use, cannot reload it"
	fi
	modprobe brd rd_nr="$n" rd_size=$((mib * 1024)) max_part=0 ||
		fail "brd_setup: modprobe brd failed"
	for i in $(seq 0 $((n - 1))); do
		wait_for_block "/dev/ram$i"
	done
}

brd_teardown() {
	[ -e /sys/module/brd ] || return 0
	[ "$(cat /sys/module/brd/parameters/rd_nr 2>/dev/null)" != 0 ] || return 0
	local i
	for i in 1 2 3 4 5; do
		rmmod brd 2>/dev/null && return 0
		sleep 1
	done
	rmmod brd
}

wait_for_block() {
	local i
	for i in $(seq 50); do
		[ -b "$1" ] && return 0
		sleep 0.1
	done
	fail "block device $1 did not appear"
}

# --- device-mapper -------------------------------------------------------

# dm_create <name> <table line(s)>
dm_create() {
	dmsetup create "$1" --table "$2" || fail "dmsetup create $1 '$2' failed"
	wait_for_block "/dev/mapper/$1"
}

dm_remove() {
	dmsetup remove --retry "$1" || fail "dmsetup remove $1 failed"
}

# dm_message <device> <message...>
dm_message() {
	local dev=$1
	shift
	dmsetup message "$dev" 0 "$@" || fail "dmsetup message $dev 0 $* failed"
}

# Status line of a device without "<start> <length> <target>".
dm_status() {
	dmsetup status "$1" | cut -d' ' -f4-
}

dm_exists() {
	dmsetup info "$1" >/dev/null 2>&1
}

# Names of all dm devices, one a line.
dm_names() {
	dmsetup ls 2>/dev/null | awk '$0 != "No devices found" { print $1 }' | sort
}

# Remove the given dm devices, users before what they sit on.
dm_remove_all() {
	local n left=("$@")
	for n in "${left[@]}"; do
		# A device left suspended would hold up IO and removal.
		if dmsetup info "$n" 2>/dev/null | grep -q '^State: *SUSPENDED'; then
			dmsetup resume "$n" 2>/dev/null || true
		fi
	done
	for _ in 1 2 3 4 5; do
		local still=()
		for n in "${left[@]}"; do
			dm_exists "$n" || continue
			dmsetup remove "$n" >/dev/null 2>&1 || still+=("$n")
		done
		left=("${still[@]}")
		[ ${#left[@]} -gt 0 ] || return 0
		sleep 1
	done
	for n in "${left[@]}"; do
		dmsetup remove --force --retry "$n" || true
	done
	for n in "${left[@]}"; do
		! dm_exists "$n" || return 1
	done
}

# --- data ----------------------------------------------------------------

# sha256 of <count> MiB of <dev> from MiB <offset>, read with O_DIRECT.
dev_sha() {
	dd if="$1" bs=1M skip="$2" count="$3" iflag=direct status=none | sha256sum | cut -d' ' -f1
}

file_sha() {
	sha256sum <"$1" | cut -d' ' -f1
}

# write_file <file> <dev> <offset MiB>: write a file to a device with
# O_DIRECT and flush.
write_file() {
	dd if="$1" of="$2" bs=1M seek="$3" oflag=direct conv=fsync,notrunc status=none
}

zero_sha() { # sha256 of <n> MiB of zeroes
	head -c "$(($1 * 1024 * 1024))" /dev/zero | sha256sum | cut -d' ' -f1
}

# --- running tests -------------------------------------------------------

_tsp_record() { # <PASS|FAIL|SKIP> <name>
	echo "$1 $2"
	if [ -n "${TSP_RESULTS_FILE:-}" ]; then
		echo "$1 $TSP_FILE:$2" >>"$TSP_RESULTS_FILE"
	fi
}

_tsp_err() { # ERR trap inside a test
	echo "    error: '$2' failed (exit $1) at $3:$4" >&2
}

# run_test <name> <function> [args...]
run_test() {
	local name=$1 fn=${2:-$1} rc=0 t0 dt bad before after left=() tmp n
	shift 2 || shift $#
	if [ -n "${TSP_TEST_FILTER:-}" ] && ! [[ $name =~ $TSP_TEST_FILTER ]]; then
		return 0
	fi
	echo "--- $name"
	before=$(dm_names)
	TSP_BEGIN_MARK=$(kmsg_mark "begin $name")
	tmp=$(mktemp -d /tmp/tsp-test.XXXXXX)
	t0=$EPOCHREALTIME

	(
		cd "$tmp" || exit 1
		set -eE -o pipefail
		trap '_tsp_err $? "$BASH_COMMAND" "${BASH_SOURCE[0]##*/}" "$LINENO"' ERR
		"$fn" "$@"
	)
	rc=$?

	# Devices the test made and did not remove: a failure in itself
	# (unless the test failed already), and they must go.
	after=$(dm_names)
	while IFS= read -r n; do
		[ -n "$n" ] && left+=("$n")
	done < <(comm -13 <(echo "$before") <(echo "$after"))
	if [ ${#left[@]} -gt 0 ]; then
		echo "    left dm devices behind: ${left[*]}" >&2
		[ "$rc" != 0 ] && [ "$rc" != 77 ] || rc=1
		if ! dm_remove_all "${left[@]}"; then
			echo "    could not remove: $(comm -13 <(echo "$before") <(dm_names) | tr '\n' ' ')" >&2
			rc=1
		fi
	fi
	if ! brd_teardown; then
		echo "    brd still in use after the test" >&2
		rc=1
	fi
	rm -rf "$tmp"

	bad=$(dmesg_since_test | grep -E "$TSP_SPLAT_RE" || true)
	if [ -n "$bad" ]; then
		echo "    the kernel log gained problems during the test:" >&2
		dmesg_since_test | grep -E -A 25 "$TSP_SPLAT_RE" | head -n 80 | sed 's/^/      | /' >&2
		rc=1
	fi
	kmsg_mark "end $name rc=$rc" >/dev/null

	dt=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
	echo "    (${dt}s)"
	case $rc in
	0) TSP_PASSED=$((TSP_PASSED + 1)); _tsp_record PASS "$name" ;;
	77) TSP_SKIPPED=$((TSP_SKIPPED + 1)); _tsp_record SKIP "$name" ;;
	*) TSP_FAILED=$((TSP_FAILED + 1)); _tsp_record FAIL "$name" ;;
	esac
	return 0
}

# Closing line; non-zero if anything failed.
summary() {
	local s="$TSP_PASSED passed, $TSP_FAILED failed"
	[ "$TSP_SKIPPED" = 0 ] || s+=", $TSP_SKIPPED skipped"
	echo "$s"
	[ "$TSP_FAILED" = 0 ]
}
