// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-thin-scalable.c - the device-mapper targets of thin-scalable.
 *
 * This file will own the two targets, thin-scalable-pool and
 * thin-scalable, drop-in replacements for dm-thin's thin-pool and thin:
 * table parsing, the map and end_io paths (the lock-free fast path and the
 * deferred slow path), the workers, messages, status lines and pool modes
 * (issue 3; see DESIGN.md sections 1 and 4).
 *
 * At this stage none of that exists: the module carries the metadata layer
 * (dm-thin-metadata.c and persistent-data/) only, and registers no target.
 * Loading it therefore makes no new target available; it only proves that
 * the metadata layer builds and links as kernel code.
 *
 * Module dependencies: the metadata layer calls dm_bufio_* (dm-bufio.ko)
 * and crc32c() (libcrc32c.ko).  Those are hard symbol dependencies, which
 * modpost records in the module's "depends" and modprobe follows, so no
 * MODULE_SOFTDEP() is needed.  Whoever loads the module with a bare insmod
 * must load dm-mod, dm-bufio and libcrc32c first.
 */

#include <linux/module.h>
#include <linux/init.h>
#include <linux/device-mapper.h>

#define DM_MSG_PREFIX "thin-scalable"

static int __init tsp_init(void)
{
	return 0;
}

static void __exit tsp_exit(void)
{
}

module_init(tsp_init);
module_exit(tsp_exit);

MODULE_DESCRIPTION(DM_NAME " thin provisioning target with scalable metadata");
MODULE_AUTHOR("thin-scalable developers");
MODULE_LICENSE("GPL");
