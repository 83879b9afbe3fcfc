#!/bin/bash
# SPDX-License-Identifier: GPL-2.0-only
#
# tests/meta/bad-input.sh - thin-scalable-meta on bad input: it must fail
# with a message on stderr and a small exit code, never succeed, crash,
# hang or trip a sanitizer.
#
#   XML for restore: malformed, truncated, unknown elements and
#     attributes, each attribute missing or non-numeric, negative and
#     huge numbers, values out of range (dev id, time, data block, data
#     block size, version, flags), duplicate devices and mappings,
#     nesting errors, text, a DOCTYPE with entity expansion;
#   images for restore: missing, a directory, a character device, too
#     small for the dump;
#   images for dump and check: missing, empty, short, all zeroes,
#     truncated, and superblocks with a bad checksum, magic, version,
#     block size, location or roots (checksums resealed, so the values
#     themselves are what gets rejected); damaged btree nodes;
#   command lines: missing and unknown arguments.
# Then random damage (resealed) to every kind of block of two pools:
# check and dump may accept or refuse it, but must not crash.

source "$(dirname "$0")/lib.bash"
need_tools python3

corrupt="$TSP_TOP/tests/meta/corrupt.py"
nr_cases=0

# expect_fail DESC ARGS...: the tool must refuse, saying why.
expect_fail()
{
	local desc=$1 rc

	shift
	nr_cases=$((nr_cases + 1))
	timeout 60 "$TSP_META" "$@" >"$tmp/out" 2>"$tmp/err" </dev/null
	rc=$?
	if sanitizer_report "$tmp/err"; then
		cat "$tmp/err"
		fail "$desc: sanitizer report"
	fi
	case $rc in
	0)
		fail "$desc: accepted (exit code 0)" ;;
	124)
		fail "$desc: hung (killed after 60 s)" ;;
	198|199)
		cat "$tmp/err"
		fail "$desc: sanitizer exit code $rc" ;;
	esac
	[ $rc -ge 128 ] && fail "$desc: crashed (exit code $rc)"
	[ -s "$tmp/err" ] || fail "$desc: refused without a message"
	printf '  ok %-45s %s\n' "$desc" "$(tail -n 1 "$tmp/err" | cut -c1-110)"
}

# no_crash DESC ARGS...: any exit code below 128 will do.
no_crash()
{
	local desc=$1 rc

	shift
	nr_cases=$((nr_cases + 1))
	timeout 60 "$TSP_META" "$@" >/dev/null 2>"$tmp/err" </dev/null
	rc=$?
	if sanitizer_report "$tmp/err" || [ $rc -ge 124 ] ||
	   [ $rc = 198 ] || [ $rc = 199 ]; then
		tail -n 30 "$tmp/err"
		fail "$desc: exit code $rc"
	fi
	return $rc
}

# --- restore: bad XML ---------------------------------------------------

img="$tmp/meta.img"
truncate -s 16M "$img"

good="$tmp/good.xml"
cat >"$good" <<EOF
<superblock uuid="" time="2" transaction="5" flags="0" version="2" data_block_size="128" nr_data_blocks="100">
  <device dev_id="1" mapped_blocks="3" transaction="0" creation_time="0" snap_time="1">
    <range_mapping origin_begin="0" data_begin="10" length="2" time="0"/>
    <single_mapping origin_block="5" data_block="20" time="1"/>
  </device>
  <device dev_id="2" mapped_blocks="2" transaction="1" creation_time="1" snap_time="1">
    <range_mapping origin_begin="0" data_begin="10" length="2" time="0"/>
  </device>
</superblock>
EOF
"$TSP_META" restore -i "$good" -o "$img" ||
	fail "the good dump does not restore: the test is broken"

echo "restore, bad XML:"
n=0
# bad_xml DESC SED-SCRIPT: the good dump edited by SED-SCRIPT must fail.
bad_xml()
{
	n=$((n + 1))
	sed -e "$2" "$good" >"$tmp/bad$n.xml"
	cmp -s "$good" "$tmp/bad$n.xml" && fail "$1: the edit changed nothing (test bug)"
	expect_fail "$1" restore -i "$tmp/bad$n.xml" -o "$img"
}
# bad_doc DESC TEXT: a whole document.
bad_doc()
{
	n=$((n + 1))
	printf '%s' "$2" >"$tmp/bad$n.xml"
	expect_fail "$1" restore -i "$tmp/bad$n.xml" -o "$img"
}

bad_doc "empty file" ""
bad_doc "not XML" "this is not a dump"
bad_doc "only a declaration" '<?xml version="1.0"?>'
head -c 300 "$good" >"$tmp/trunc.xml"
expect_fail "truncated" restore -i "$tmp/trunc.xml" -o "$img"
bad_xml "unclosed device" '/<\/device>/d'
bad_xml "unknown element" 's/<single_mapping/<double_mapping/'
bad_xml "unknown top element" 's/superblock/pool/g'
bad_xml "unknown attribute" 's/snap_time="1">/snap_time="1" colour="red">/'
bad_xml "duplicate attribute" 's/time="0"\/>/time="0" time="0"\/>/'
bad_xml "device outside superblock" '$a <device dev_id="9" mapped_blocks="0" transaction="0" creation_time="0" snap_time="0"/>'
bad_xml "two superblocks" '1i <superblock uuid="" time="2" transaction="5" flags="0" version="2" data_block_size="128" nr_data_blocks="100"/>'
bad_xml "mapping outside device" '2i <single_mapping origin_block="50" data_block="50" time="0"/>'
bad_xml "device inside device" '3i <device dev_id="9" mapped_blocks="0" transaction="0" creation_time="0" snap_time="0"/>'
bad_xml "element inside mapping" 's/<single_mapping \(.*\)\/>/<single_mapping \1><device dev_id="7" mapped_blocks="0" transaction="0" creation_time="0" snap_time="0"\/><\/single_mapping>/'
bad_xml "text between elements" 's/<\/device>/hello<\/device>/'
bad_xml "DOCTYPE" '1i <!DOCTYPE superblock>'
n=$((n + 1))
{
	echo '<?xml version="1.0"?>'
	echo '<!DOCTYPE s [<!ENTITY a "1234567890"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;"><!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;"><!ENTITY e "&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;"><!ENTITY f "&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;"><!ENTITY g "&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;"><!ENTITY h "&g;&g;&g;&g;&g;&g;&g;&g;&g;&g;">]>'
	sed 's/uuid=""/uuid="\&h;"/' "$good"
} >"$tmp/bad$n.xml"
expect_fail "entity expansion (billion laughs)" restore -i "$tmp/bad$n.xml" -o "$img"

# Every attribute of every element, missing and then malformed.
for attr in uuid time transaction flags version data_block_size \
	    nr_data_blocks dev_id mapped_blocks creation_time snap_time \
	    origin_begin data_begin length origin_block data_block; do
	bad_xml "missing $attr" "0,/ $attr=\"[^\"]*\"/s/ $attr=\"[^\"]*\"//"
done
for attr in time transaction flags version data_block_size \
	    nr_data_blocks dev_id mapped_blocks creation_time snap_time \
	    origin_begin data_begin length origin_block data_block; do
	for v in "" abc -1 " 1" "1 " 0x10 1e3 +1 1.5 \
		 18446744073709551616 99999999999999999999999; do
		bad_xml "$attr=\"$v\"" "0,/ $attr=\"[^\"]*\"/s/ $attr=\"[^\"]*\"/ $attr=\"$v\"/"
	done
done

bad_xml "dev_id 2^24" 's/dev_id="2"/dev_id="16777216"/'
bad_xml "mapping time 2^24" 's/data_block="20" time="1"/data_block="20" time="16777216"/'
bad_xml "superblock time 2^24" 's/ time="2"/ time="16777216"/'
bad_xml "creation_time 2^32" 's/creation_time="1"/creation_time="4294967296"/'
bad_xml "data block = nr_data_blocks" 's/data_block="20"/data_block="100"/'
bad_xml "range past nr_data_blocks" 's/data_begin="10" length="2" time="0"\/>/data_begin="99" length="2" time="0"\/>/'
bad_xml "range of length 0" '0,/length="2"/s/length="2"/length="0"/'
bad_xml "virtual blocks overflow" '0,/origin_begin="0"/s/origin_begin="0"/origin_begin="18446744073709551615"/'
bad_xml "nr_data_blocks 2^40+1" 's/nr_data_blocks="100"/nr_data_blocks="1099511627777"/'
for dbs in 0 64 100 129 192 2097280 4194304; do
	bad_xml "data_block_size $dbs" "s/data_block_size=\"128\"/data_block_size=\"$dbs\"/"
done
bad_xml "version 3" 's/version="2"/version="3"/'
bad_xml "version 0" 's/version="2"/version="0"/'
bad_xml "flags 2" 's/flags="0"/flags="2"/'
bad_xml "duplicate device" 's/dev_id="2"/dev_id="1"/'
bad_xml "duplicate single mapping" 's/\(.*<single_mapping.*\)/\1\n\1/'
bad_xml "single inside a range" 's/origin_block="5"/origin_block="1"/'
bad_xml "overlapping ranges" '3a <range_mapping origin_begin="1" data_begin="50" length="5" time="0"/>'

echo "restore, bad files:"
expect_fail "input missing" restore -i "$tmp/nonexistent.xml" -o "$img"
expect_fail "input is a directory" restore -i "$tmp" -o "$img"
expect_fail "output missing" restore -i "$good" -o "$tmp/nonexistent.img"
expect_fail "output is a directory" restore -i "$good" -o "$tmp"
expect_fail "output is a character device" restore -i "$good" -o /dev/null
truncate -s 0 "$tmp/empty.img"
expect_fail "output empty" restore -i "$good" -o "$tmp/empty.img"
truncate -s 16K "$tmp/small.img"
expect_fail "output 16 KiB" restore -i "$good" -o "$tmp/small.img"
truncate -s 256K "$tmp/small.img"
python3 "$TSP_TOP/tests/meta/gen-xml.py" gen --seed 1 --devices 40 --mappings 60000 --max-run 1 >"$tmp/big.xml"
expect_fail "output too small for the dump" restore -i "$tmp/big.xml" -o "$tmp/small.img"
chmod 0444 "$tmp/small.img"
if [ "$(id -u)" != 0 ]; then
	expect_fail "output read only" restore -i "$good" -o "$tmp/small.img"
fi

echo "command lines:"
expect_fail "no command" 
expect_fail "unknown command" frobnicate
expect_fail "restore without -o" restore -i "$good"
expect_fail "restore without -i" restore -o "$img"
expect_fail "restore -i without value" restore -o "$img" -i
expect_fail "restore unknown option" restore -i "$good" -o "$img" -x
expect_fail "dump without image" dump
expect_fail "dump two images" dump "$img" "$img"
expect_fail "check without image" check
expect_fail "check unknown option" check -q "$img"
expect_fail "stress without --image" stress --seed 1 --ops 1
expect_fail "stress bad --ops" stress --seed 1 --ops lots --image "$tmp/s.img"
expect_fail "stress bad --avoid" stress --seed 1 --ops 1 --image "$tmp/s.img" --avoid everything

# --- dump and check: bad images -------------------------------------------

echo "dump and check, bad images:"
# bad_image DESC: $tmp/bad.img must be refused by both.
bad_image()
{
	expect_fail "check: $1" check "$tmp/bad.img"
	expect_fail "dump: $1" dump "$tmp/bad.img"
}
fresh()
{
	rm -f "$tmp/bad.img"
	cp "$img" "$tmp/bad.img"
}
# set_sb OFFSET FMT VALUE: change a superblock field, checksum resealed.
set_sb()
{
	fresh
	python3 "$corrupt" set "$tmp/bad.img" 0 "$1" "$2" "$3" ||
		fail "corrupt.py set"
}

"$TSP_META" check "$img" || fail "the good image does not check: the test is broken"

rm -f "$tmp/bad.img"
bad_image "missing"
: >"$tmp/bad.img"
bad_image "empty"
head -c 100 "$img" >"$tmp/bad.img"
bad_image "100 bytes"
truncate -s 4M "$tmp/zero.img" && mv "$tmp/zero.img" "$tmp/bad.img"
bad_image "all zeroes"
head -c 4096 "$img" >"$tmp/bad.img"
bad_image "only the superblock"
head -c 65536 "$img" >"$tmp/bad.img"
bad_image "truncated to 64 KiB"
mkdir "$tmp/bad.img" 2>/dev/null || true
rm -f "$tmp/bad.img"; mkdir "$tmp/bad.img"
bad_image "a directory"
rmdir "$tmp/bad.img"

fresh; python3 "$corrupt" flip "$tmp/bad.img" 0 200
bad_image "superblock checksum"
set_sb 32 Q 27022011;	bad_image "superblock magic"
set_sb 8 Q 5;		bad_image "superblock location"
set_sb 40 I 3;		bad_image "version 3"
set_sb 40 I 0;		bad_image "version 0"
set_sb 340 I 16;	bad_image "metadata block size 16"
set_sb 336 I 0;		bad_image "data block size 0"
set_sb 336 I 100;	bad_image "data block size 100"
set_sb 360 I 1;		bad_image "incompat flags"
set_sb 320 Q 999999999;	bad_image "mapping root beyond the device"
set_sb 328 Q 999999999;	bad_image "details root beyond the device"
set_sb 320 Q 0;		bad_image "mapping root is the superblock"
set_sb 64 Q 3;		bad_image "data space map: 3 blocks, mappings beyond"
set_sb 192 Q 999999999;	bad_image "metadata space map bigger than the device"
set_sb 208 Q 999999999;	bad_image "metadata space map index beyond the device"
# dump does not need the data space map (thin_dump neither): check only
set_sb 88 Q 999999999
expect_fail "check: data space map index beyond the device" check "$tmp/bad.img"

# Damaged live btree nodes (resealed): entries beyond max, bad value
# size, bad flags, and a bad checksum.
btree=$(python3 "$corrupt" kinds "$img" | awk '$2 == "btree" { print $1 }')
for b in $btree; do
	fresh; python3 "$corrupt" set "$tmp/bad.img" "$b" 16 I 100000
	no_crash "node $b: nr_entries 100000" check "$tmp/bad.img" &&
		fail "check accepts node $b with 100000 entries"
	# (dump reads only the mapping and details trees: any exit will do)
	no_crash "node $b: nr_entries 100000 (dump)" dump "$tmp/bad.img"
	fresh; python3 "$corrupt" set "$tmp/bad.img" "$b" 24 I 3
	no_crash "node $b: value size 3" check "$tmp/bad.img" &&
		fail "check accepts node $b with value size 3"
	fresh; python3 "$corrupt" set "$tmp/bad.img" "$b" 4 I 7
	no_crash "node $b: flags 7" check "$tmp/bad.img" &&
		fail "check accepts node $b with flags 7"
	fresh; python3 "$corrupt" flip "$tmp/bad.img" "$b" 100
	no_crash "node $b: bad checksum" check "$tmp/bad.img" &&
		fail "check accepts node $b with a bad checksum"
	nr_cases=$((nr_cases - 1))
done
echo "  ok damaged btree nodes" $btree

# --- random damage ---------------------------------------------------------

# A second pool with deeper trees, snapshots and perhaps a held metadata
# snapshot, made by stress.  Judging the library is model.sh's job: here
# whatever stress last committed will do, if it checks clean.
bases=("$img")
"$TSP_META" stress --seed 3 --ops 3000 --image "$tmp/stress.img" \
	--metadata-blocks 2048 --external-every 0 >/dev/null 2>&1
if "$TSP_META" check "$tmp/stress.img" >/dev/null 2>&1; then
	bases+=("$tmp/stress.img")
else
	echo "note: the stress pool does not check clean; fuzzing one pool only"
fi

accepted=0
refused=0
for base in "${bases[@]}"; do
	for seed in $(seq 1 60); do
		rm -f "$tmp/bad.img"; cp "$base" "$tmp/bad.img"
		what=$(python3 "$corrupt" fuzz-all "$tmp/bad.img" "$seed" $((1 + seed % 6)))
		if no_crash "fuzz $seed ($what): check" check "$tmp/bad.img"; then
			accepted=$((accepted + 1))
			# what check accepts, dump must be able to print
			no_crash "fuzz $seed ($what): dump" dump "$tmp/bad.img" ||
				fail "fuzz $seed ($what): check accepts it but dump fails"
		else
			refused=$((refused + 1))
			no_crash "fuzz $seed ($what): dump" dump "$tmp/bad.img" || true
		fi
	done
done
echo "random damage: $refused refused, $accepted accepted (harmless bytes), no crash"

echo "bad-input: $nr_cases cases refused cleanly"
