#!/bin/bash
# Guest side of tests/vm/run-suite: runs every tests/vm/t-*.sh (or the
# files named as arguments) inside the VM, one bash process each, and ends
# with "N passed, N failed". Non-zero exit if any test failed.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cd "$here" || exit 1

results=${VM_OUT:-/tmp}/results.txt
: >"$results"
export TSP_RESULTS_FILE=$results

if [ $# -gt 0 ]; then
	files=("$@")
else
	files=(t-*.sh)
fi

echo "=== kernel $(uname -r), $(nproc) cpus${VM_MODULE:+, module $VM_MODULE}"
t0=$EPOCHREALTIME
for f in "${files[@]}"; do
	f=${f#tests/vm/}
	[ -f "$f" ] || { echo "suite: no test file $f" >&2; echo "FAIL $(basename "$f" .sh):missing" >>"$results"; continue; }
	echo "=== $f"
	before=$(grep -c '^FAIL ' "$results" || true)
	bash "$f"
	rc=$?
	now=$(grep -c '^FAIL ' "$results" || true)
	if [ "$rc" != 0 ] && [ "$now" = "$before" ]; then
		# The file failed outside any test (syntax error, setup...).
		echo "FAIL $(basename "$f" .sh):file (exit $rc)"
		echo "FAIL $(basename "$f" .sh):file" >>"$results"
	fi
done

passed=$(grep -c '^PASS ' "$results" || true)
failed=$(grep -c '^FAIL ' "$results" || true)
skipped=$(grep -c '^SKIP ' "$results" || true)
echo "=== suite done in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')s"
if [ "$failed" != 0 ]; then
	echo "failed:"
	grep '^FAIL ' "$results" | sed 's/^FAIL /  /'
fi
s="$passed passed, $failed failed"
[ "$skipped" = 0 ] || s+=", $skipped skipped"
echo "$s"
[ "$failed" = 0 ] && [ "$passed" -gt 0 ]
