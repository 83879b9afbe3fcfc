// SPDX-License-Identifier: GPL-2.0-only
/*
 * user/crc32c.c - crc32c (Castagnoli) for the userspace build, with the
 * kernel's calling convention: @seed is the initial register value and
 * the result is not inverted.  The usual "CRC-32C" of a message is
 * therefore ~crc32c(~0, msg, len); dm-thin checksums are
 * crc32c(~0, block, len) ^ salt.
 *
 * Slicing-by-8: eight 256-entry tables let the loop fold eight input
 * bytes per step with eight independent lookups.  tab[0] is the classic
 * byte-at-a-time table for the reflected polynomial 0x82F63B78;
 * tab[k][i] is the register after byte i followed by k zero bytes, so a
 * byte that sits k places before the end of an 8-byte group is looked up
 * in tab[k].  Input words are assembled byte by byte as little-endian, so
 * the result does not depend on host byte order or alignment.
 *
 * Locking: the tables are built once, under pthread_once(); afterwards
 * they are read only and crc32c() may run on any number of threads.
 */
#define DM_MSG_PREFIX "crc32c"
#include "persistent-data/compat.h"

#define CRC32C_POLY_REFLECTED 0x82F63B78u

static u32 tab[8][256];
static pthread_once_t tab_once = PTHREAD_ONCE_INIT;

static void build_tables(void)
{
	unsigned int i, k, bit;

	for (i = 0; i < 256; i++) {
		u32 r = i;

		for (bit = 0; bit < 8; bit++)
			r = (r >> 1) ^ ((r & 1) ? CRC32C_POLY_REFLECTED : 0);
		tab[0][i] = r;
	}
	for (k = 1; k < 8; k++)
		for (i = 0; i < 256; i++)
			tab[k][i] = (tab[k - 1][i] >> 8) ^
				    tab[0][tab[k - 1][i] & 0xff];
}

static inline u32 get_le32(const u8 *p)
{
	return (u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24;
}

u32 crc32c(u32 seed, const void *data, unsigned int len)
{
	const u8 *p = data;
	u32 crc = seed;

	pthread_once(&tab_once, build_tables);

	for (; len >= 8; len -= 8, p += 8) {
		u32 lo = crc ^ get_le32(p);
		u32 hi = get_le32(p + 4);

		crc = tab[7][lo & 0xff] ^ tab[6][(lo >> 8) & 0xff] ^
		      tab[5][(lo >> 16) & 0xff] ^ tab[4][lo >> 24] ^
		      tab[3][hi & 0xff] ^ tab[2][(hi >> 8) & 0xff] ^
		      tab[1][(hi >> 16) & 0xff] ^ tab[0][hi >> 24];
	}
	while (len--)
		crc = (crc >> 8) ^ tab[0][(crc ^ *p++) & 0xff];

	return crc;
}
