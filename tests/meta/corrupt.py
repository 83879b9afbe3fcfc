#!/usr/bin/env python3
# SPDX-License-Identifier: GPL-2.0-only
#
# tests/meta/corrupt.py - damages metadata images for bad-input.sh, so the
# damage gets past the checksums when that is the point.
#
# Every dm-thin metadata block keeps a crc32c of bytes 4..4095 in its
# first 4 bytes, xored with a per-kind constant (superblock, btree node,
# space map index, bitmap).  "Resealing" recomputes it with the constant
# the block matched before the change, so the reader sees a valid block
# holding a bad value.
#
#   corrupt.py set IMG BLOCK OFFSET FMT VALUE   pack VALUE (struct FMT,
#                                               little endian) and reseal
#   corrupt.py flip IMG BLOCK OFFSET            invert a byte, no reseal
#   corrupt.py fuzz IMG SEED N                  N random byte changes in
#                                               one random live block
#                                               other than the superblock,
#                                               each resealed
#   corrupt.py fuzz-all IMG SEED N              the same, the superblock too
#   corrupt.py kinds IMG                        list the live blocks with
#                                               valid checksums

import random
import struct
import sys

BLOCK = 4096
ENTRIES = (BLOCK - 16) * 4     # 2-bit counts per space map bitmap
XORS = {'superblock': 160774, 'btree': 121107, 'index': 160478,
        'bitmap': 240779}

_table = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _table.append(_c)


def crc32c_raw(data, crc=0xFFFFFFFF):
    """crc32c as the kernel computes it: seed in, no final inversion."""
    t = _table
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def kind_of(block):
    """The kind whose checksum @block carries, or None."""
    if not any(block):
        return None
    stored = struct.unpack_from('<I', block, 0)[0]
    crc = crc32c_raw(block[4:])
    for k, x in XORS.items():
        if crc ^ x == stored:
            return k
    return None


def reseal(block, kind):
    struct.pack_into('<I', block, 0, crc32c_raw(block[4:]) ^ XORS[kind])


class Image:
    def __init__(self, path):
        self.path = path
        with open(path, 'rb') as f:
            self.data = bytearray(f.read())

    def block(self, n):
        return self.data[n * BLOCK:(n + 1) * BLOCK]

    def put(self, n, block):
        self.data[n * BLOCK:(n + 1) * BLOCK] = block

    def save(self):
        with open(self.path, 'r+b') as f:
            f.write(self.data)

    def live(self):
        """Blocks with a non-zero count in the metadata space map."""
        sb = self.block(0)
        nr_blocks, _, index = struct.unpack_from('<QQQ', sb, 192)
        idx = self.block(index)
        live = set()
        for i in range((nr_blocks + ENTRIES - 1) // ENTRIES):
            bitmap = struct.unpack_from('<Q', idx, 16 + 16 * i)[0]
            bm = self.block(bitmap)
            for j in range(min(ENTRIES, nr_blocks - i * ENTRIES)):
                word = struct.unpack_from('<Q', bm, 16 + (j // 32) * 8)[0]
                if (word >> (2 * (j % 32))) & 3:
                    live.add(i * ENTRIES + j)
        return live

    def valid_blocks(self):
        """(block, kind) of every live block with a valid checksum."""
        live = self.live()
        out = []
        for n in range(len(self.data) // BLOCK):
            if n not in live:
                continue
            k = kind_of(self.block(n))
            if k:
                out.append((n, k))
        return out


def cmd_set(img, n, off, fmt, value):
    im = Image(img)
    b = im.block(n)
    kind = kind_of(b)
    struct.pack_into('<' + fmt, b, off, value)
    if kind:
        reseal(b, kind)
    im.put(n, b)
    im.save()


def cmd_flip(img, n, off):
    im = Image(img)
    im.data[n * BLOCK + off] ^= 0xFF
    im.save()


def cmd_fuzz(img, seed, count, with_sb=False):
    rng = random.Random(seed)
    im = Image(img)
    blocks = [(n, k) for n, k in im.valid_blocks() if with_sb or n != 0]
    if not blocks:
        sys.exit('no valid blocks to fuzz')
    n, kind = rng.choice(blocks)
    b = im.block(n)
    for _ in range(count):
        r = rng.random()
        if r < 0.5:
            # the header and the first entries, where damage matters most
            off = rng.randint(4, 127)
        else:
            off = rng.randint(4, BLOCK - 1)
        if rng.random() < 0.5:
            b[off] = rng.randint(0, 255)
        else:
            b[off] ^= 1 << rng.randint(0, 7)
    reseal(b, kind)
    im.put(n, b)
    im.save()
    print('%s block %d' % (kind, n))


def main():
    a = sys.argv[1:]
    if a[:1] == ['set'] and len(a) == 6:
        v = a[5]
        cmd_set(a[1], int(a[2]), int(a[3]), a[4], int(v, 0))
    elif a[:1] == ['flip'] and len(a) == 4:
        cmd_flip(a[1], int(a[2]), int(a[3]))
    elif a[:1] in (['fuzz'], ['fuzz-all']) and len(a) == 4:
        cmd_fuzz(a[1], int(a[2]), int(a[3]), a[0] == 'fuzz-all')
    elif a[:1] == ['kinds'] and len(a) == 2:
        for n, k in Image(a[1]).valid_blocks():
            print(n, k)
    else:
        sys.exit(__doc__)


if __name__ == '__main__':
    main()
