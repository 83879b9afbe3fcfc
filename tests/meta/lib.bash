# SPDX-License-Identifier: GPL-2.0-only
#
# tests/meta/lib.bash - what the metadata script tests share (sourced, not
# run): where the tool and thin-provisioning-tools are, a scratch
# directory cleaned up on exit, and running the tool with its sanitizer
# reports turned into failures.
#
# Environment: TSP_META (the asan build of thin-scalable-meta), TSP_TOP
# (the repository root); both default to this checkout's build.

set -u

TSP_TOP=${TSP_TOP:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
TSP_META=${TSP_META:-$TSP_TOP/build/asan/thin-scalable-meta}
export PATH="$PATH:/usr/sbin:/sbin"

# Sanitizer reports get exit codes no ordinary failure uses, and are
# looked for in the output as well.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}exitcode=199"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}print_stacktrace=1:exitcode=198"

# skip MESSAGE: this test cannot run here.
skip()
{
	echo "SKIP: $*"
	exit 77
}

fail()
{
	echo "FAIL: $*"
	exit 1
}

# need_tools TOOL...: skip unless each is installed.
need_tools()
{
	local t

	[ -x "$TSP_META" ] || skip "no $TSP_META (make tools)"
	for t in "$@"; do
		command -v "$t" >/dev/null || skip "$t is not installed"
	done
}

# A scratch directory, on tmpfs when there is one (the stress test
# flushes at every commit), removed on exit.
tmp=$(mktemp -d "${TSP_TMPDIR:-$( [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm || echo "${TMPDIR:-/tmp}")}/tsp-meta.XXXXXX") ||
	fail "mktemp"
trap 'rm -rf "$tmp"' EXIT

# sanitizer_report FILE: true if FILE holds a sanitizer or WARN report.
sanitizer_report()
{
	grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:|WARNING: .*WARN_ON|AddressSanitizer' "$1"
}

# meta ARGS...: run the tool; its stderr goes to $tmp/meta.err (and is
# shown); a sanitizer report or a crash fails the test.  Returns the
# tool's exit code.
meta()
{
	local rc

	"$TSP_META" "$@" 2>"$tmp/meta.err"
	rc=$?
	cat "$tmp/meta.err" >&2
	if sanitizer_report "$tmp/meta.err"; then
		fail "sanitizer report from: thin-scalable-meta $*"
	fi
	if [ $rc -ge 128 ] || [ $rc = 199 ] || [ $rc = 198 ]; then
		fail "thin-scalable-meta $* crashed (exit code $rc)"
	fi
	return $rc
}

# now: seconds since the epoch, with decimals.
now()
{
	date +%s.%N
}

# since START: seconds elapsed, one decimal.
since()
{
	awk -v s="$1" -v e="$(now)" 'BEGIN { printf "%.1f", e - s }'
}
