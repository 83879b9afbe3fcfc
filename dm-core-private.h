/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * dm-core-private.h - what device-mapper core shares with its own targets
 * in drivers/md/dm.h, a header an out-of-tree module cannot include: the
 * status flag of "status --noflush", and the internal suspend that
 * dm-thin uses to suspend a pool's thin devices with the pool (exported,
 * GPL-only, by dm-mod on 6.1 and 6.12).
 */
#ifndef DM_CORE_PRIVATE_H
#define DM_CORE_PRIVATE_H

#include <linux/device-mapper.h>

#define STATUS_NOFLUSH_FLAG (1 << 0)

void dm_internal_suspend_noflush(struct mapped_device *md);
void dm_internal_resume(struct mapped_device *md);

#endif
