#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-only
"""tests/bench/report.py - the report of scripts/bench.

Reads what scripts/bench-guest left in the VM's out dir (runs.tsv,
info.env, stats.tsv), and
  - prints a table: per job and target the median IOPS over the rounds
    with min and max, and the ratios to linear and to thin-pool;
  - writes the JSON (--json) with every run and the summary;
  - writes the same table as Markdown beside the JSON (.md);
  - draws a PNG (--png) with gnuplot: median IOPS per job and target
    (log scale, min-max bars) and the ratio to linear.

Ratios are taken round by round (a target's IOPS over linear's IOPS in the
same round, which ran next to it) and then summarised (median, min, max):
what the host does between rounds cancels out.  Within a round a target
runs slower the later its place (session 33 in the README), and a run
may depend on the run before it (session 41), so a round's ratio depends
on the places of the two targets, which the rotation moves from round to
round (and the reversed order, after as many rounds as targets, runs
each pair the other way round).  The balanced ratio takes the median of
each kind of round (each pair of places) and then their geometric mean:
a slowdown by place that slows every target by the same factor cancels
out of it (one that differs by target is averaged over the places).
Standard library only.
"""

import argparse
import collections
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

TARGETS = ["raw", "linear", "thin-pool", "thin-scalable"]
TARGET_LABELS = {
    "raw": "raw (brd)",
    "linear": "linear",
    "thin-pool": "thin-pool",
    "thin-scalable": "thin-scalable",
}
JOBS = {
    "randread": "4k random read, fully provisioned (the reports' job)",
    "randwrite": "4k random write, fully provisioned",
    "seqread": "512k sequential read",
    "seqwrite": "512k sequential write",
    "snapwrite": "4k random write right after a snapshot (breaking sharing)",
    "firstwrite": "4k write to a new block each (provisioning, zeroing)",
    "firstwrite-nozero": "4k write to a new block each (skip_block_zeroing)",
}


def read_env(path):
    env = {}
    try:
        with open(path) as f:
            for line in f:
                line = line.rstrip("\n")
                if "=" in line:
                    k, v = line.split("=", 1)
                    env[k] = v
    except OSError:
        pass
    return env


def num(s):
    try:
        v = float(s)
    except ValueError:
        return None
    return None if math.isnan(v) else v


def read_runs(path):
    runs = []
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        for line in f:
            fields = line.rstrip("\n").split("\t")
            fields += [""] * (len(header) - len(fields))
            r = dict(zip(header, fields))
            runs.append({
                "job": r["job"],
                "round": int(r["round"]),
                "target": r["target"],
                "iops": num(r["iops"]),
                "bw_bytes": num(r["bw_bytes"]),
                "lat_mean_us": num(r["lat_mean_us"]),
                "runtime_ms": num(r["runtime_ms"]),
                "io_kib": num(r["io_kib"]),
                "error": r["error"] or None,
                "place": int(r["place"]) if r.get("place") else None,
            })
    return runs


def parse_stats(line):
    """'fast_ios 12 deferred_ios 3 ...' -> {'fast_ios': 12, ...}"""
    words = line.split()
    out = {}
    for k, v in zip(words[0::2], words[1::2]):
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = v
    return out


def read_stats(path):
    """{(job, round, target): {'before': {...}, 'after': {...}}}"""
    stats = {}
    try:
        with open(path) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                if len(fields) < 5:
                    continue
                job, rnd, target, when, text = fields[:5]
                stats.setdefault((job, int(rnd), target), {})[when] = parse_stats(text)
    except OSError:
        pass
    return stats


def balanced(pairs, kinds):
    """Geometric mean over the kinds of round of the median ratio of each.

    pairs: (ratio, kind) per round, kind the two targets' places (None
    where unknown); kinds: the places in a round.  None unless each
    target ran in every place in as many of the kinds as in any other
    place (one rotation gives each place once, the reversed one once
    more, or the same kinds again): a part of a rotation that ran would
    weigh some places more than others.
    """
    if not kinds:
        return None
    groups = {}
    for ratio, kind in pairs:
        if all(kind):
            groups.setdefault(kind, []).append(ratio)
    for side in (0, 1):
        per_place = collections.Counter(k[side] for k in groups)
        if len(per_place) != kinds or len(set(per_place.values())) != 1:
            return None
    logs = [math.log(statistics.median(g)) for g in groups.values()]
    return math.exp(sum(logs) / len(logs))


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def fmt_iops(v):
    if v is None:
        return "-"
    if v >= 100000:
        return "%.0fk" % (v / 1000)
    if v >= 10000:
        return "%.1fk" % (v / 1000)
    if v >= 1000:
        return "%.2fk" % (v / 1000)
    return "%.0f" % v


def fmt_ratio(v):
    return "-" if v is None else "%.2f" % v


def fmt_sum(s, fmt):
    if s is None:
        return "-"
    return "%s [%s-%s]" % (fmt(s["median"]), fmt(s["min"]), fmt(s["max"]))


def fmt_balanced(s):
    return fmt_ratio(s.get("balanced")) if s else "-"


def build(runs, stats):
    jobs = [j for j in JOBS if any(r["job"] == j for r in runs)]
    jobs += sorted({r["job"] for r in runs} - set(jobs))
    targets = [t for t in TARGETS if any(r["target"] == t for r in runs)]
    by = {(r["job"], r["round"], r["target"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})

    for r in runs:
        s = stats.get((r["job"], r["round"], r["target"]))
        if s and "before" in s and "after" in s:
            d = {}
            for k, v in s["after"].items():
                b = s["before"].get(k)
                if isinstance(v, int) and isinstance(b, int):
                    d[k] = v - b
            r["pool_stats_delta"] = d

    result = {}
    for j in jobs:
        result[j] = {}
        kinds = max((r["place"] or 0 for r in runs if r["job"] == j), default=0)
        for t in targets:
            iops = [by[(j, n, t)]["iops"] for n in rounds if (j, n, t) in by]
            bw = [by[(j, n, t)]["bw_bytes"] for n in rounds if (j, n, t) in by]
            lat = [by[(j, n, t)]["lat_mean_us"] for n in rounds if (j, n, t) in by]
            ent = {"iops": summary(iops), "bw_bytes": summary(bw),
                   "lat_mean_us": summary(lat),
                   "errors": sum(1 for n in rounds
                                 if (j, n, t) in by and by[(j, n, t)]["error"])}
            shares, per_pass = [], []
            for n in rounds:
                d = by.get((j, n, t), {}).get("pool_stats_delta") or {}
                f, q = d.get("fast_ios"), d.get("deferred_ios")
                p = d.get("worker_passes")
                if f is not None and q is not None and f + q > 0:
                    shares.append(f / (f + q))
                if q is not None and p:
                    per_pass.append(q / p)
            if shares:
                ent["fast_path_share"] = summary(shares)
            if per_pass:
                ent["deferred_per_pass"] = summary(per_pass)
            for base in ("linear", "thin-pool"):
                pairs = []
                for n in rounds:
                    a = by.get((j, n, t))
                    b = by.get((j, n, base))
                    if a and b and a["iops"] is not None and b["iops"]:
                        pairs.append((a["iops"] / b["iops"],
                                      (a["place"], b["place"])))
                s = summary([r for r, _ in pairs])
                if s and t != base:
                    s["balanced"] = balanced(pairs, kinds)
                ent["vs_" + base.replace("-", "_")] = s
            result[j][t] = ent
    return jobs, targets, result


def table(jobs, targets, result, markdown=False):
    head = ["job", "target", "IOPS median [min-max]", "x linear", "balanced",
            "x thin-pool", "balanced"]
    rows = []
    for j in jobs:
        for t in targets:
            e = result[j][t]
            iops = fmt_sum(e["iops"], fmt_iops)
            if e["errors"]:
                iops += " (%d failed)" % e["errors"]
            rows.append([j, TARGET_LABELS.get(t, t), iops,
                         fmt_sum(e["vs_linear"], fmt_ratio),
                         fmt_balanced(e["vs_linear"]),
                         fmt_sum(e["vs_thin_pool"], fmt_ratio),
                         fmt_balanced(e["vs_thin_pool"])])
    if markdown:
        out = ["| " + " | ".join(head) + " |",
               "|" + "|".join("---" for _ in head) + "|"]
        last = None
        for r in rows:
            r = list(r)
            if r[0] == last:
                r[0] = ""
            else:
                last = r[0]
            out.append("| " + " | ".join(r) + " |")
        return "\n".join(out)
    w = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w[i]) for i, h in enumerate(head)).rstrip()]
    out.append("  ".join("-" * x for x in w))
    last = None
    for r in rows:
        if last is not None and r[0] != last:
            out.append("")
        c = list(r)
        if r[0] == last:
            c[0] = ""
        last = r[0]
        out.append("  ".join(c[i].ljust(w[i]) for i in range(len(c))).rstrip())
    return "\n".join(out)


GNUPLOT = r"""
set terminal pngcairo size 1400,1000 font "DejaVu Sans,10"
set output '{png}'
set datafile separator "\t"
set datafile missing "NaN"
set style data histograms
set style histogram errorbars gap 1.5 lw 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set grid ytics
set key outside top center horizontal
set xtics nomirror
set xrange [-0.6:{xmax}]
set multiplot layout 2,1 title "{title}" font ",12"
set title "median IOPS over the rounds (bars: min to max), log scale"
set logscale y
set ylabel "IOPS"
plot {plot_iops}
unset logscale y
unset key
set title "IOPS / linear's IOPS in the same round (median, min to max)"
set ylabel "ratio to linear"
set yrange [0:*]
plot {plot_ratio}, 1 notitle with lines dt 2 lc rgb "black"
unset multiplot
"""

COLORS = {"raw": "#7f7f7f", "linear": "#1f77b4", "thin-pool": "#d62728",
          "thin-scalable": "#2ca02c"}


def chart(png, jobs, targets, result, title):
    gnuplot = shutil.which("gnuplot")
    if not gnuplot:
        print("report: gnuplot not found (apt-get install gnuplot-nox, or "
              "scripts/install-deps); no chart", file=sys.stderr)
        return False
    base = os.path.splitext(png)[0]
    dat = base + ".dat"
    with open(dat, "w") as f:
        f.write("# job")
        for t in targets:
            f.write("\t%s\t%s_min\t%s_max\t%s/lin\tmin\tmax" % (t, t, t, t))
        f.write("\n")
        for j in jobs:
            f.write(j)
            for t in targets:
                e = result[j][t]
                for key in ("iops", "vs_linear"):
                    s = e[key]
                    if s is None:
                        f.write("\tNaN\tNaN\tNaN")
                    else:
                        f.write("\t%g\t%g\t%g" % (s["median"], s["min"], s["max"]))
            f.write("\n")
    pi, pr = [], []
    for i, t in enumerate(targets):
        c = 2 + 6 * i
        src = "'%s'" % dat if i == 0 else "''"
        lab = ":xtic(1)" if i == 0 else ""
        color = COLORS.get(t, "#9467bd")
        pi.append("%s using %d:%d:%d%s title '%s' lc rgb '%s'"
                  % (src, c, c + 1, c + 2, lab, TARGET_LABELS.get(t, t), color))
        pr.append("%s using %d:%d:%d%s title '%s' lc rgb '%s'"
                  % (src, c + 3, c + 4, c + 5, lab, TARGET_LABELS.get(t, t), color))
    gp = base + ".gp"
    with open(gp, "w") as f:
        f.write(GNUPLOT.format(png=png, xmax=len(jobs) - 0.4, title=title.replace('"', "'"),
                               plot_iops=", ".join(pi), plot_ratio=", ".join(pr)))
    p = subprocess.run([gnuplot, gp], capture_output=True, text=True)
    if p.returncode != 0:
        print("report: gnuplot failed:\n" + p.stderr, file=sys.stderr)
        return False
    return True


def git_describe(top):
    try:
        head = subprocess.run(["git", "-C", top, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", top, "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vm-out", required=True, help="the VM run's out dir")
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    ap.add_argument("--kver", default="?")
    ap.add_argument("--smp", default="?")
    ap.add_argument("--host-env", help="host facts (key=value lines)")
    a = ap.parse_args()

    info = read_env(os.path.join(a.vm_out, "info.env"))
    host = read_env(a.host_env) if a.host_env else {}
    runs = read_runs(os.path.join(a.vm_out, "runs.tsv"))
    stats = read_stats(os.path.join(a.vm_out, "stats.tsv"))
    jobs, targets, result = build(runs, stats)

    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    host.setdefault("loadavg_end", open("/proc/loadavg").read().split()[0])
    doc = {
        "kver": a.kver,
        "kernel": info.get("kernel"),
        "smp": int(info["vcpus"]) if "vcpus" in info else a.smp,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git": host.pop("git", None) or git_describe(top),
        "settings": {k: info[k] for k in info if k not in ("kernel",)},
        "host": dict(host, nproc=os.cpu_count()),
        "jobs": {j: JOBS.get(j, j) for j in jobs},
        "targets": targets,
        "notes": ("Ratios are per round (a target's IOPS over the baseline's "
                  "IOPS in the same round), then median/min/max over the "
                  "rounds; balanced (for both baselines): the geometric mean "
                  "over the kinds of round (the two targets' places) of each "
                  "kind's median. "
                  "Absolute IOPS under qemu TCG mean little."),
        "summary": result,
        "runs": runs,
    }
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

    title = "thin-scalable bench: kernel %s, %s vCPUs, %s rounds of %s s, %s" % (
        info.get("kernel", a.kver), doc["smp"], info.get("rounds", "?"),
        info.get("runtime", "?"), doc["date"][:16].replace("T", " "))
    if info.get("gtod_reduce") == "0":
        title += ", fio's full timekeeping"
    if host.get("clock") == "icount":
        title += ", guest time in instructions (icount)"
    print()
    print(title)
    print("(IOPS: median [min-max] over the rounds; x linear, x thin-pool: "
          "ratio to that target in the same round, median [min-max];")
    print(" balanced: geometric mean over the kinds of round, by the two "
          "targets' places, of the median ratio in each)")
    print()
    print(table(jobs, targets, result))
    print()
    for j in jobs:
        print("  %-18s %s" % (j, JOBS.get(j, "")))
    for key, what, fmt_one in (
            ("fast_path_share", "bios on the fast path",
             lambda v: "%.0f%%" % (100 * v)),
            ("deferred_per_pass", "deferred bios per worker pass",
             lambda v: "%.1f" % v)):
        found = ["%s %s" % (j, fmt_one(result[j]["thin-scalable"][key]["median"]))
                 for j in jobs if key in result[j].get("thin-scalable", {})]
        if found:
            print()
            print("thin-scalable %s (the pool's stats, median): %s"
                  % (what, ", ".join(found)))
    errors = [r for r in runs if r["error"]]
    for r in errors[:20]:
        print("report: %s round %d %s: %s" % (r["job"], r["round"], r["target"],
                                             r["error"]), file=sys.stderr)

    md = os.path.splitext(a.json)[0] + ".md"
    with open(md, "w") as f:
        f.write(title + "\n\n" + table(jobs, targets, result, markdown=True) + "\n")
    print()
    print("JSON:     " + a.json)
    print("Markdown: " + md)
    ok = True
    if a.png:
        if chart(a.png, jobs, targets, result, title):
            print("chart:    " + a.png)
        else:
            ok = False
    return 0 if ok and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
