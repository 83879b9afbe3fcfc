#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
#
# tests/meta/interop.sh - our metadata and thin-provisioning-tools' must
# be interchangeable, in both directions.
#
# For each generated dump (gen-xml.py: many devices, snapshots sharing
# data blocks at different times, ranges and singles; several seeds and
# sizes, one of about 100k mapped blocks mostly as single_mappings):
#   (a) thin_restore -> thin_dump and our dump print the same bytes, and
#       our check finds it clean;
#   (b) our restore -> thin_check is clean and thin_dump prints the input
#       normalized (as thin_dump would print it);
#   (c) our restore -> our check is clean and our dump prints the same.
# Plus hand-written edge cases: no devices, an empty device, the
# needs_check flag, the largest device id and time.

source "$(dirname "$0")/lib.bash"
need_tools thin_restore thin_dump thin_check python3

gen="$TSP_TOP/tests/meta/gen-xml.py"

# check_xml NAME FILE: run (a), (b) and (c) on FILE.
check_xml()
{
	local name=$1 in=$2 d="$tmp/$1" start

	start=$(now)
	mkdir -p "$d"
	python3 "$gen" normalize "$in" >"$d/canon.xml" ||
		fail "$name: normalize"

	# (a) their metadata, our reader
	truncate -s 64M "$d/a.img"
	thin_restore -q -i "$in" -o "$d/a.img" >/dev/null ||
		fail "$name: thin_restore refused the generated dump"
	thin_dump "$d/a.img" >"$d/a.thin.xml" || fail "$name: thin_dump (a)"
	cmp -s "$d/a.thin.xml" "$d/canon.xml" ||
		fail "$name: gen-xml.py normalize disagrees with thin_dump (test bug)"
	meta dump "$d/a.img" >"$d/a.ours.xml" ||
		fail "$name: (a) our dump of thin_restore's metadata failed"
	if ! cmp -s "$d/a.thin.xml" "$d/a.ours.xml"; then
		diff "$d/a.thin.xml" "$d/a.ours.xml" | head -20
		fail "$name: (a) our dump differs from thin_dump"
	fi
	meta check "$d/a.img" ||
		fail "$name: (a) our check rejects thin_restore's metadata"

	# (b) our metadata, their reader
	truncate -s 64M "$d/b.img"
	meta restore -i "$in" -o "$d/b.img" 2>/dev/null ||
		fail "$name: (b) our restore failed"
	if ! thin_check "$d/b.img" >"$d/b.check" 2>&1; then
		cat "$d/b.check"
		fail "$name: (b) thin_check rejects our restore"
	fi
	thin_dump "$d/b.img" >"$d/b.thin.xml" || fail "$name: thin_dump (b)"
	if ! cmp -s "$d/b.thin.xml" "$d/canon.xml"; then
		diff "$d/canon.xml" "$d/b.thin.xml" | head -20
		fail "$name: (b) thin_dump of our restore differs from the input"
	fi

	# (c) our metadata, our reader
	meta check "$d/b.img" || fail "$name: (c) our check rejects our restore"
	meta dump "$d/b.img" >"$d/b.ours.xml" || fail "$name: (c) our dump"
	cmp -s "$d/b.ours.xml" "$d/canon.xml" ||
		fail "$name: (c) our dump of our restore differs from the input"

	echo "ok $name: $(grep -c '<device' "$d/canon.xml") devices, $(grep -c '_mapping' "$d/canon.xml") mapping lines ($(since "$start") s)"
	rm -rf "$d"
}

# gen_case NAME GEN-ARGS...
gen_case()
{
	local name=$1

	shift
	python3 "$gen" gen "$@" >"$tmp/$name.xml" || fail "$name: gen-xml.py"
	check_xml "$name" "$tmp/$name.xml"
}

gen_case seed1 --seed 1
gen_case seed2-noncanonical --seed 2 --noncanonical
gen_case seed3-runs --seed 3 --devices 20 --mappings 8000 --max-run 300
for s in 11 12 13 14 15 16; do
	gen_case "small$s" --seed $s --devices 3 --mappings 300
done
gen_case seed4-many-devices --seed 4 --devices 120 --mappings 30000 --max-run 8 --noncanonical
gen_case seed5-100k --seed 5 --devices 24 --mappings 100000 --max-run 2

# Edge cases by hand.
cat >"$tmp/nodev.xml" <<EOF
<superblock uuid="" time="0" transaction="0" flags="0" version="2" data_block_size="128" nr_data_blocks="1000">
</superblock>
EOF
check_xml no-devices "$tmp/nodev.xml"

# A pool with no data blocks at all (thin_dump -m prints such dumps).
cat >"$tmp/nodata.xml" <<EOF
<superblock uuid="" time="0" transaction="0" flags="0" version="2" data_block_size="128" nr_data_blocks="0">
  <device dev_id="1" mapped_blocks="0" transaction="0" creation_time="0" snap_time="0">
  </device>
</superblock>
EOF
check_xml no-data-blocks "$tmp/nodata.xml"

cat >"$tmp/edges.xml" <<EOF
<superblock uuid="" time="16777215" transaction="18446744073709551615" flags="1" version="2" data_block_size="2097152" nr_data_blocks="100000">
  <device dev_id="0" mapped_blocks="0" transaction="18446744073709551615" creation_time="4294967295" snap_time="4294967295">
  </device>
  <device dev_id="16777215" mapped_blocks="3" transaction="0" creation_time="0" snap_time="16777215">
    <single_mapping origin_block="0" data_block="99999" time="16777215"/>
    <range_mapping origin_begin="18446744073709551613" data_begin="0" length="2" time="0"/>
  </device>
</superblock>
EOF
check_xml edges "$tmp/edges.xml"

echo "interop: all cases passed"
