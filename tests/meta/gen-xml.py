#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-only
#
# tests/meta/gen-xml.py - makes thin_dump XML for the interop tests, and
# normalizes XML to the exact text thin_dump 0.9.0 would print for it.
#
#   gen-xml.py gen --seed N [--devices D] [--mappings M] [--max-run R]
#                  [--noncanonical]
#       Simulates a pool's life the way dm-thin would record it: thin
#       devices written in runs of consecutive blocks, snapshots of live
#       devices (the pool time goes up by one, origin and snapshot share
#       every mapping, each keeps the old mapping times), then writes to
#       either side breaking sharing (a new data block at the new time),
#       new mappings and discards.  So the same data blocks appear in
#       several devices with different times, and mappings of one device
#       carry many times.  About M mapped blocks over D devices.
#       --noncanonical writes runs split at random points, some as
#       range_mappings of length 1, devices in random order and a wrong
#       mapped_blocks here and there: what a hand-edited dump may hold.
#
#   gen-xml.py normalize FILE
#       Prints FILE as thin_dump prints such metadata: devices by id,
#       mapped_blocks recounted, mappings coalesced into runs
#       (consecutive virtual and data blocks with the same time).
#
# Output goes to stdout.  Deterministic for a given seed.

import argparse
import random
import sys
import xml.etree.ElementTree as ET


class Dev:
    def __init__(self, dev_id, time, trans):
        self.dev_id = dev_id
        self.creation_time = time
        self.snap_time = time
        self.trans = trans
        self.map = {}           # virt -> (data, time)


class Pool:
    def __init__(self, rng, nr_data_blocks):
        self.rng = rng
        self.time = 0
        self.next_data = 0
        self.nr_data_blocks = nr_data_blocks
        self.devs = {}

    def alloc(self, n):
        """n consecutive data blocks, after a random gap now and then."""
        if self.rng.random() < 0.2:
            self.next_data += self.rng.randint(1, 50)
        b = self.next_data
        self.next_data += n
        return b

    def new_id(self):
        while True:
            r = self.rng.random()
            if r < 0.05:
                i = (1 << 24) - 1 - self.rng.randint(0, 3)
            elif r < 0.5:
                i = self.rng.randint(0, 64)
            else:
                i = self.rng.randint(0, (1 << 24) - 1)
            if i not in self.devs:
                return i

    def write_run(self, dev, virt_space, maxlen):
        length = self.rng.randint(1, maxlen)
        start = self.rng.randint(0, virt_space - 1)
        data = self.alloc(length)
        for i in range(length):
            dev.map[start + i] = (data + i, self.time)
        return length

    def discard(self, dev, virt_space):
        start = self.rng.randint(0, virt_space - 1)
        for v in range(start, start + self.rng.randint(1, 64)):
            dev.map.pop(v, None)

    def snapshot(self, origin):
        self.time += 1
        snap = Dev(self.new_id(), self.time, self.rng.randint(0, 9))
        origin.snap_time = self.time
        snap.map = dict(origin.map)
        self.devs[snap.dev_id] = snap
        return snap


def generate(seed, nr_devices, nr_mappings, max_run):
    rng = random.Random(seed)
    pool = Pool(rng, 0)
    virt_space = max(1024, nr_mappings // max(1, nr_devices) * 3)
    maxlen = max_run or rng.choice([4, 32, 300])
    # roughly: a third of the devices are thin, the rest snapshots
    nr_thin = max(1, nr_devices // 3)
    per_step = max(1, nr_mappings // (nr_devices * 2))
    total = lambda: sum(len(d.map) for d in pool.devs.values())

    for _ in range(nr_thin):
        d = Dev(pool.new_id(), pool.time, rng.randint(0, 9))
        pool.devs[d.dev_id] = d
        written = 0
        while written < per_step:
            written += pool.write_run(d, virt_space, maxlen)
    while len(pool.devs) < nr_devices:
        origin = rng.choice(list(pool.devs.values()))
        snap = pool.snapshot(origin)
        # writes after the snapshot, to the snapshot, the origin or others
        for _ in range(rng.randint(1, 6)):
            target = rng.choice([snap, origin,
                                 rng.choice(list(pool.devs.values()))])
            written = 0
            budget = max(1, per_step // 4)
            while written < budget:
                written += pool.write_run(target, virt_space, maxlen)
            if rng.random() < 0.3:
                pool.discard(target, virt_space)
    # top up to about the size asked for
    devs = list(pool.devs.values())
    while total() < nr_mappings:
        pool.write_run(rng.choice(devs), virt_space, maxlen)
    pool.nr_data_blocks = pool.next_data + rng.randint(0, 1000)
    return pool


def runs(mapping):
    """Coalesce {virt: (data, time)} into thin_dump's runs."""
    out = []
    for v in sorted(mapping):
        d, t = mapping[v]
        if out:
            ov, od, ol, ot = out[-1]
            if v == ov + ol and d == od + ol and t == ot:
                out[-1] = (ov, od, ol + 1, ot)
                continue
        out.append((v, d, 1, t))
    return out


def emit(sb, devs, rng=None, out=sys.stdout):
    """Print in thin_dump's format; with @rng, noncanonically."""
    w = out.write
    w('<superblock uuid="" time="%d" transaction="%d" flags="%d" '
      'version="2" data_block_size="%d" nr_data_blocks="%d">\n' % sb)
    order = sorted(devs, key=lambda d: d.dev_id)
    if rng:
        rng.shuffle(order)
    for d in order:
        mapped = len(d.map)
        if rng and rng.random() < 0.1:
            mapped += rng.randint(1, 5)
        w('  <device dev_id="%d" mapped_blocks="%d" transaction="%d" '
          'creation_time="%d" snap_time="%d">\n'
          % (d.dev_id, mapped, d.trans, d.creation_time, d.snap_time))
        for v, b, n, t in runs(d.map):
            pieces = [(v, b, n)]
            if rng and n > 1 and rng.random() < 0.3:
                cut = rng.randint(1, n - 1)
                pieces = [(v, b, cut), (v + cut, b + cut, n - cut)]
            for pv, pb, pn in pieces:
                if pn == 1 and not (rng and rng.random() < 0.2):
                    w('    <single_mapping origin_block="%d" data_block="%d" '
                      'time="%d"/>\n' % (pv, pb, t))
                else:
                    w('    <range_mapping origin_begin="%d" data_begin="%d" '
                      'length="%d" time="%d"/>\n' % (pv, pb, pn, t))
        w('  </device>\n')
    w('</superblock>\n')


def cmd_gen(args):
    pool = generate(args.seed, args.devices, args.mappings, args.max_run)
    rng = random.Random(args.seed * 7 + 1)
    sb = (pool.time + rng.randint(0, 3), rng.randint(0, 1 << 40), 0,
          rng.choice([128, 256, 1024, 8192, 2097152]), pool.nr_data_blocks)
    emit(sb, pool.devs.values(), rng if args.noncanonical else None)


def cmd_normalize(args):
    root = ET.parse(args.file).getroot()
    a = root.attrib
    sb = (int(a['time']), int(a['transaction']), int(a['flags']),
          int(a['data_block_size']), int(a['nr_data_blocks']))
    devs = []
    for de in root:
        d = Dev(int(de.attrib['dev_id']), int(de.attrib['creation_time']),
                int(de.attrib['transaction']))
        d.snap_time = int(de.attrib['snap_time'])
        for m in de:
            if m.tag == 'single_mapping':
                d.map[int(m.attrib['origin_block'])] = (
                    int(m.attrib['data_block']), int(m.attrib['time']))
            else:
                v, b = int(m.attrib['origin_begin']), int(m.attrib['data_begin'])
                for i in range(int(m.attrib['length'])):
                    d.map[v + i] = (b + i, int(m.attrib['time']))
        devs.append(d)
    emit(sb, devs)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest='cmd', required=True)
    g = sub.add_parser('gen')
    g.add_argument('--seed', type=int, required=True)
    g.add_argument('--devices', type=int, default=12)
    g.add_argument('--mappings', type=int, default=5000)
    g.add_argument('--max-run', type=int, default=0,
                   help='longest run written at once (default: random)')
    g.add_argument('--noncanonical', action='store_true')
    n = sub.add_parser('normalize')
    n.add_argument('file')
    args = p.parse_args()
    if args.cmd == 'gen':
        cmd_gen(args)
    else:
        cmd_normalize(args)


if __name__ == '__main__':
    main()
