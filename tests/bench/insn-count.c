// SPDX-License-Identifier: GPL-2.0-only
/*
 * insn-count.c - a qemu TCG plugin (scripts/profile --insns): counts the
 * guest instructions executed, per kernel translation block start
 * address, and in user space all together, and writes the counts out at
 * each mark the guest makes.
 *
 * The guest marks by executing "xchg %bx,%bx" (tests/bench/insn-mark.c;
 * nothing else runs it).  At the n-th mark the plugin writes
 * <out>/insns-<n>.tsv, the counts since the mark before (since qemu
 * started for the first), and starts again from zero:
 *
 *	user	<instructions in user space>
 *	<hex address>	<instructions in the blocks that start there>
 *
 * A block ends at a branch, call or return, so it lies in one function
 * (but where one falls through into the next): scripts/profile's report
 * names it with the guest's /proc/kallsyms.
 *
 * What counts: every block adds its instruction count to its address's
 * counter when it is entered (qemu's inline add, no call out of the
 * translated code).  So a block that faults part way counts whole, and a
 * string instruction with a rep prefix counts once per repeat (qemu 7.2
 * runs one repeat per pass through its block): a 4 KiB copy by rep movsq
 * counts 512.  The adds are not atomic: with several vCPUs running at
 * once some are lost, so the counts hold with one vCPU only.  Counters
 * live in a fixed open-addressing table that never moves (the translated
 * code holds their addresses); blocks beyond its room are counted in one
 * overflow counter, reported as address 0.
 *
 * Locking: the table's inserts (at translation, which MTTCG may run on
 * several vCPU threads at once) and the writing out take table_lock.
 *
 * Built against Debian 12's qemu 7.2 plugin API (version 1), for x86-64
 * system emulation.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

#define TABLE_BITS 20
#define TABLE_SIZE (1UL << TABLE_BITS)
#define KERNEL_START 0xffff800000000000ULL

static const uint8_t mark_insn[] = { 0x66, 0x87, 0xdb };	/* xchg %bx,%bx */

struct block_count {
	uint64_t vaddr;		/* 0: a free slot */
	uint64_t insns;
};

static struct block_count *table;
static uint64_t overflow_insns, user_insns;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static char out_dir[4096] = ".";
static unsigned int marks;

/* The counter of kernel address @vaddr; called with table_lock held. */
static uint64_t *counter_for(uint64_t vaddr)
{
	uint64_t h = (vaddr * 0x9e3779b97f4a7c15ULL) >> (64 - TABLE_BITS);
	unsigned long i, probes;

	for (probes = 0; probes < TABLE_SIZE / 2; probes++) {
		i = (h + probes) & (TABLE_SIZE - 1);
		if (table[i].vaddr == vaddr)
			return &table[i].insns;
		if (!table[i].vaddr) {
			table[i].vaddr = vaddr;
			return &table[i].insns;
		}
	}
	return &overflow_insns;
}

/* At a mark: write the counts since the last one, and reset them. */
static void write_counts(unsigned int vcpu, void *udata)
{
	char path[4200];
	unsigned long i;
	FILE *f;

	pthread_mutex_lock(&table_lock);
	snprintf(path, sizeof(path), "%s/insns-%u.tsv", out_dir, marks);
	marks++;
	f = fopen(path, "w");
	if (!f) {
		fprintf(stderr, "insn-count: cannot write %s: %s\n", path, strerror(errno));
	} else {
		fprintf(f, "user\t%" PRIu64 "\n", user_insns);
		if (overflow_insns)
			fprintf(f, "0\t%" PRIu64 "\n", overflow_insns);
		for (i = 0; i < TABLE_SIZE; i++) {
			if (table[i].insns)
				fprintf(f, "%" PRIx64 "\t%" PRIu64 "\n",
					table[i].vaddr, table[i].insns);
		}
		if (fclose(f))
			fprintf(stderr, "insn-count: writing %s failed\n", path);
	}
	for (i = 0; i < TABLE_SIZE; i++)
		table[i].insns = 0;
	user_insns = overflow_insns = 0;
	pthread_mutex_unlock(&table_lock);
}

static void translate_block(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
	uint64_t vaddr = qemu_plugin_tb_vaddr(tb);
	uint64_t *counter = &user_insns;
	size_t n = qemu_plugin_tb_n_insns(tb);
	size_t i;

	for (i = 0; i < n; i++) {
		struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);

		if (qemu_plugin_insn_size(insn) == sizeof(mark_insn) &&
		    !memcmp(qemu_plugin_insn_data(insn), mark_insn, sizeof(mark_insn)))
			qemu_plugin_register_vcpu_insn_exec_cb(insn, write_counts,
							       QEMU_PLUGIN_CB_NO_REGS, NULL);
	}
	if (vaddr >= KERNEL_START) {
		pthread_mutex_lock(&table_lock);
		counter = counter_for(vaddr);
		pthread_mutex_unlock(&table_lock);
	}
	qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, counter, n);
}

/* Arguments: out=DIR, where the counts go (default: qemu's directory). */
QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
					   int argc, char **argv)
{
	int i;

	if (!info->system_emulation || strcmp(info->target_name, "x86_64") != 0) {
		fprintf(stderr, "insn-count: for x86-64 system emulation only\n");
		return -1;
	}
	for (i = 0; i < argc; i++) {
		if (strncmp(argv[i], "out=", 4) != 0 || !argv[i][4]) {
			fprintf(stderr, "insn-count: unknown argument '%s' (out=DIR)\n",
				argv[i]);
			return -1;
		}
		snprintf(out_dir, sizeof(out_dir), "%s", argv[i] + 4);
	}
	table = calloc(TABLE_SIZE, sizeof(*table));
	if (!table) {
		fprintf(stderr, "insn-count: out of memory\n");
		return -1;
	}
	qemu_plugin_register_vcpu_tb_trans_cb(id, translate_block);
	return 0;
}
