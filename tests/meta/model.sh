#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
#
# tests/meta/model.sh - the metadata library against a model, with
# thin_check and thin_dump as the oracle after every commit
# (thin-scalable-meta stress; see tools/stress.c for what is compared).
#
# Three runs:
#   main      100,000 ops over 10 device ids, plenty of space;
#   enospc    15,000 ops with a small data device: allocation runs out,
#             the data device grows, commits go on;
#   deep      12,000 ops over 2 devices with 100,000 virtual blocks each:
#             long runs make tall trees, drains empty them again.
# Each checks the library after every commit and abort, and runs
# tsp_pool_check, thin_check and thin_dump (compared with the model and
# byte for byte with our dump) after every commit.  About 2 minutes with
# the ASan build on 2 cores.
#
# Environment: TSP_STRESS_SEED (default 1) picks another sequence;
# TSP_STRESS_AVOID is passed as --avoid (known library divergences to
# step around while they are being fixed; empty by default).

source "$(dirname "$0")/lib.bash"
need_tools thin_check thin_dump

seed=${TSP_STRESS_SEED:-1}
avoid=()
[ -n "${TSP_STRESS_AVOID:-}" ] && avoid=(--avoid "$TSP_STRESS_AVOID")

# run NAME ARGS...: one stress run on its own image.
run()
{
	local name=$1 start rc

	shift
	start=$(now)
	echo "== $name: stress --seed $seed $* ${avoid[*]}"
	# The library logs the errors the op mix provokes on purpose; show
	# its log only when something went wrong.
	"$TSP_META" stress --seed "$seed" --image "$tmp/$name.img" \
		--external-every 1 "${avoid[@]}" "$@" 2>"$tmp/$name.err"
	rc=$?
	if [ $rc != 0 ] || sanitizer_report "$tmp/$name.err"; then
		tail -n 40 "$tmp/$name.err"
		fail "$name: exit code $rc: the library diverged from the model (seed $seed)"
	fi
	echo "== $name passed in $(since "$start") s ($(wc -l <"$tmp/$name.err") library messages for provoked errors)"
	rm -f "$tmp/$name.img"
}

run main --ops 100000 --devices 10
run enospc --ops 15000 --devices 8 --virt-blocks 1024 \
	--data-blocks 600 --max-data-blocks 1500
run deep --ops 12000 --devices 2 --virt-blocks 100000 \
	--metadata-blocks 8192

echo "model: all runs passed"
