#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-only
"""Report on a scripts/profile run: for each target, its IOPS and the
guest CPU time per IO that perf's samples show (summed over the vCPUs,
the whole run: fio's start too), and the functions that cost more per IO
than on the reference target (the first in profile.env's targets): by
their own samples (self) and by the samples with them on the stack
(inclusive).  For a run of scripts/profile --insns (count=insns in
profile.env): guest instructions per IO instead of time, by function
(their own: the counts have no call stacks), and the functions whose
count differs most from the reference target's; and the same for the
misses of the TLB model if the run had one (scripts/profile --tlb).

usage: profile-report.py [--top N] [--tree FUNC]... DIR
"""

import argparse
import bisect
import collections
import gzip
import os
import signal
import sys


class Profile:
    """One target's perf script output: samples per function."""

    def __init__(self, path):
        self.self_us = collections.Counter()
        self.incl_us = collections.Counter()
        self.stacks = []        # (period_us, [outermost ... innermost])
        self.total_us = 0.0
        with gzip.open(path, 'rt', errors='replace') as f:
            period, stack = 0.0, []
            for line in f:
                if not line.strip():
                    self._add(period, stack)
                    stack = []
                elif line[0] not in ' \t':
                    # "comm pid [cpu] time: period event:"
                    fields = line.split()
                    period = next((float(x) / 1000 for x, e in
                                   zip(fields, fields[1:])
                                   if e.endswith(':') and x.isdigit()), 0.0)
                else:
                    fields = line.split()
                    if len(fields) >= 2:
                        stack.append(fields[1].split('+')[0])
            self._add(period, stack)

    def _add(self, period, stack):
        if not stack:
            return
        self.total_us += period
        self.self_us[stack[0]] += period
        for fn in set(stack):
            self.incl_us[fn] += period
        self.stacks.append((period, stack[::-1]))


def fio_ios(path):
    """IOs done and IOPS from fio's terse v3 line (reads or writes)."""
    with open(path) as f:
        for line in f:
            x = line.split(';')
            if x[0] == '3' and len(x) > 80:
                rd_kib, wr_kib = int(x[5]), int(x[46])
                ios, iops = ((rd_kib // 4, float(x[7])) if rd_kib >= wr_kib
                             else (wr_kib // 4, float(x[48])))
                if ios and iops:
                    return ios, iops
    raise ValueError(f'{path}: no IO in fio\'s terse output')


class Symbols:
    """The guest's /proc/kallsyms: the function an address is in."""

    def __init__(self, path):
        syms = []
        with open(path) as f:
            for line in f:
                x = line.split()
                # Text symbols; "[module]" follows a module's.
                if len(x) >= 3 and x[1] in 'tTwW' and int(x[0], 16):
                    syms.append((int(x[0], 16), ' '.join(x[2:])))
        syms.sort()
        self.addrs = [a for a, _ in syms]
        self.names = [n for _, n in syms]

    def name(self, addr):
        i = bisect.bisect_right(self.addrs, addr) - 1
        return self.names[i] if i >= 0 and addr else '(unknown)'


def insn_counts(path, symbols):
    """One of insn-count.c's files: instructions per function, and in
    user space (under "(user space)"); and the TLB model's misses the
    same way, empty if the run had no model."""
    counts, misses = collections.Counter(), collections.Counter()
    with open(path) as f:
        for line in f:
            key, *values = line.split()
            if not values:
                raise ValueError(f'{path}: a line without a count')
            fn = '(user space)' if key == 'user' else symbols.name(int(key, 16))
            counts[fn] += int(values[0])
            if len(values) > 1:
                misses[fn] += int(values[1])
    return counts, misses


def print_diff(ref, t, rcounts, rios, counts, ios, what, top, digits=0):
    """The functions whose @what per IO differ most between @ref and @t."""
    total = sum(counts.values()) / ios - sum(rcounts.values()) / rios
    print(f'\n{t} against {ref}: {total:+.{digits}f} {what} per IO;'
          f' the functions whose count differs most'
          f' (per IO: {ref}, {t}, difference):')
    diff = {fn: counts[fn] / ios - rcounts[fn] / rios
            for fn in set(counts) | set(rcounts)}
    prec = max(digits, 1)
    for fn in sorted(diff, key=lambda k: -abs(diff[k]))[:top]:
        print(f'  {rcounts[fn] / rios:9.{prec}f} {counts[fn] / ios:9.{prec}f}'
              f' {diff[fn]:+9.{prec}f}  {fn}')


def report_insns(args, env, targets):
    """The report of a run of scripts/profile --insns."""
    if args.tree:
        sys.exit('profile-report: --tree needs call stacks: perf\'s runs only')
    symbols = Symbols(os.path.join(args.dir, 'kallsyms'))
    # Two marks per target: a file more means a mark that was not ours.
    if os.path.exists(os.path.join(args.dir, f'insns-{2 * len(targets)}.tsv')):
        sys.exit(f'profile-report: {args.dir}: more marks than the runs made')
    runs = {}
    for i, t in enumerate(targets):
        try:
            # Marks before and after each run: the i-th run is file 2i+1.
            counts, misses = insn_counts(
                os.path.join(args.dir, f'insns-{2 * i + 1}.tsv'), symbols)
            runs[t] = (counts, misses,
                       *fio_ios(os.path.join(args.dir, f'{t}.fio')))
        except (OSError, ValueError) as e:
            sys.exit(f'profile-report: {args.dir}: no result for {t}: {e}')

    ref = targets[0]
    print(f'{env.get("job")}, {env.get("kernel")}, {env.get("vcpus")} vCPU,'
          ' guest instructions per IO (the whole run: fio\'s start too;'
          ' IOPS under the plugin)')
    print('  target          IOPS  instructions/IO  of them in user space')
    for t, (counts, _, ios, iops) in runs.items():
        print(f'  {t:14s} {iops:6.0f} {sum(counts.values()) / ios:16.0f}'
              f' {counts["(user space)"] / ios:22.0f}')
    rcounts, rmisses, rios, _ = runs[ref]
    for t, (counts, misses, ios, _) in runs.items():
        if t == ref:
            continue
        print_diff(ref, t, rcounts, rios, counts, ios, 'instructions', args.top)
        if misses or rmisses:
            print_diff(ref, t, rmisses, rios, misses, ios,
                       'misses of the TLB model', args.top, 2)


def print_tree(prof, root, ios, depth=4, min_share=0.02):
    """The call tree below @root, in us per 1000 IOs."""
    tree = collections.Counter()
    for period, stack in prof.stacks:
        if root not in stack:
            continue
        path = tuple(stack[stack.index(root):][:depth + 1])
        for k in range(1, len(path) + 1):
            tree[path[:k]] += period
    total = tree[(root,)]
    if not total:
        print(f'  {root}: no samples')
        return

    def show(prefix, indent):
        kids = [(k, v) for k, v in tree.items()
                if len(k) == len(prefix) + 1 and k[:-1] == prefix]
        for k, v in sorted(kids, key=lambda kv: -kv[1]):
            if v >= min_share * total:
                print(f'  {"  " * indent}{v * 1000 / ios:8.1f}  {k[-1]}')
                show(k, indent + 1)
    print(f'  {total * 1000 / ios:8.1f}  {root}')
    show((root,), 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--top', type=int, default=30)
    ap.add_argument('--tree', action='append', default=[])
    ap.add_argument('dir')
    args = ap.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # | head

    env = {}
    if not os.path.exists(os.path.join(args.dir, 'profile.env')):
        sys.exit(f'profile-report: {args.dir}: no profile.env, the run did not get far')
    with open(os.path.join(args.dir, 'profile.env')) as f:
        for line in f:
            k, _, v = line.strip().partition('=')
            env[k] = v
    targets = env.get('targets', '').split()
    if env.get('count') == 'insns':
        report_insns(args, env, targets)
        return
    runs = {}
    for t in targets:
        try:
            prof = Profile(os.path.join(args.dir, f'{t}.perf.gz'))
            runs[t] = (prof, *fio_ios(os.path.join(args.dir, f'{t}.fio')))
        except (OSError, EOFError, ValueError) as e:
            sys.exit(f'profile-report: {args.dir}: no result for {t}: {e}')
        if not prof.total_us:
            sys.exit(f'profile-report: {args.dir}: {t}\'s profile has no samples')

    ref = targets[0]
    print(f'{env.get("job")}, {env.get("kernel")}, {env.get("vcpus")} vCPUs, '
          f'under perf (which slows every target)')
    print('  target          IOPS  wall us/IO  CPU us/IO (all vCPUs, the whole run)')
    for t, (prof, ios, iops) in runs.items():
        print(f'  {t:14s} {iops:6.0f} {1e6 / iops:11.2f} {prof.total_us / ios:10.2f}')
    rprof, rios, riops = runs[ref]
    for t, (prof, ios, iops) in runs.items():
        if t == ref:
            continue
        print(f'\n{t} against {ref}, per 1000 IOs: wall time'
              f' {(1e6 / iops - 1e6 / riops) * 1000:+.0f} us, CPU time'
              f' {(prof.total_us / ios - rprof.total_us / rios) * 1000:+.0f} us;'
              ' the functions that take more CPU time:')
        for kind in ('self', 'incl'):
            a, b = getattr(rprof, kind + '_us'), getattr(prof, kind + '_us')
            diff = {fn: b[fn] / ios - a[fn] / rios for fn in set(a) | set(b)}
            print(f'  {"self" if kind == "self" else "inclusive"}'
                  f' (us per 1000 IOs: {ref}, {t}, difference)')
            for fn in sorted(diff, key=lambda k: -diff[k])[:args.top]:
                print(f'  {a[fn] * 1000 / rios:8.1f} {b[fn] * 1000 / ios:8.1f}'
                      f' {diff[fn] * 1000:8.1f}  {fn}')
    for root in args.tree:
        for t, (prof, ios, _) in runs.items():
            print(f'\n{t}: call tree below {root} (CPU us per 1000 IOs)')
            print_tree(prof, root, ios)


if __name__ == '__main__':
    main()
