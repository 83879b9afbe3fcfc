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
 * With tlb=BITS each line has a third column: the data accesses of those
 * instructions that miss a model of qemu's softmmu TLB, direct mapped,
 * 2^BITS entries of 4 KiB pages with eight more for the entries they
 * evicted (qemu's victim TLB, searched on a miss, its entries replaced
 * in turn), one such TLB for the accesses of kernel code and one for
 * user space's (qemu keeps a TLB per MMU mode; the kernel's accesses
 * to user memory between stac and clac have a mode of their own there,
 * which the model counts as the kernel's).  qemu also resizes its TLB
 * between 2^6 and 2^22 entries by how much of it was used, and empties
 * it when the guest switches page tables; the model does neither.  What
 * it tells is which code touches pages that the rest of the IO path
 * does not keep in the TLB: where qemu walks the guest's page tables.
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
 * several vCPU threads at once) and the writing out take table_lock.  The
 * TLB model takes no lock: like the counts, it holds with one vCPU only.
 *
 * Built against Debian 12's qemu 7.2 plugin API (version 1), for x86-64
 * system emulation.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
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
	uint64_t tlb_misses;
};

static struct block_count *table;
/* User space's counts, and those of kernel blocks beyond the table's room. */
static struct block_count user_count, overflow_count;
static unsigned int tlb_bits;	/* 0: no TLB model */

#define VICTIMS 8

/* Entries: page number + 1; 0 is empty. */
struct tlb_model {
	uint64_t *entries;
	uint64_t victims[VICTIMS];
	unsigned int next_victim;
};

static struct tlb_model kernel_tlb, user_tlb;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static char out_dir[4096] = ".";
static unsigned int marks;

/* The counters of kernel address @vaddr; called with table_lock held. */
static struct block_count *counter_for(uint64_t vaddr)
{
	uint64_t h = (vaddr * 0x9e3779b97f4a7c15ULL) >> (64 - TABLE_BITS);
	unsigned long i, probes;

	for (probes = 0; probes < TABLE_SIZE / 2; probes++) {
		i = (h + probes) & (TABLE_SIZE - 1);
		if (table[i].vaddr == vaddr)
			return &table[i];
		if (!table[i].vaddr) {
			table[i].vaddr = vaddr;
			return &table[i];
		}
	}
	return NULL;
}

/*
 * A data access at @vaddr through @tlb: a hit in the victims swaps the
 * entries, as qemu does; a miss everywhere counts in @misses, and the
 * entry it replaces, if any, becomes a victim.
 */
static void tlb_access(struct tlb_model *tlb, uint64_t vaddr, uint64_t *misses)
{
	uint64_t page = (vaddr >> 12) + 1;
	uint64_t *entry = &tlb->entries[page & ((1ULL << tlb_bits) - 1)];
	unsigned int i;

	if (*entry == page)
		return;
	for (i = 0; i < VICTIMS; i++) {
		if (tlb->victims[i] == page) {
			tlb->victims[i] = *entry;
			*entry = page;
			return;
		}
	}
	if (*entry)
		tlb->victims[tlb->next_victim++ % VICTIMS] = *entry;
	*entry = page;
	(*misses)++;
}

static void kernel_access(unsigned int vcpu, qemu_plugin_meminfo_t info,
			  uint64_t vaddr, void *misses)
{
	tlb_access(&kernel_tlb, vaddr, misses);
}

static void user_access(unsigned int vcpu, qemu_plugin_meminfo_t info,
			uint64_t vaddr, void *misses)
{
	tlb_access(&user_tlb, vaddr, misses);
}

static void write_line(FILE *f, const char *key, uint64_t insns,
		       uint64_t misses)
{
	if (tlb_bits)
		fprintf(f, "%s\t%" PRIu64 "\t%" PRIu64 "\n", key, insns,
			misses);
	else
		fprintf(f, "%s\t%" PRIu64 "\n", key, insns);
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
		write_line(f, "user", user_count.insns, user_count.tlb_misses);
		if (overflow_count.insns)
			write_line(f, "0", overflow_count.insns,
				   overflow_count.tlb_misses);
		for (i = 0; i < TABLE_SIZE; i++) {
			char addr[20];

			if (!table[i].insns)
				continue;
			snprintf(addr, sizeof(addr), "%" PRIx64, table[i].vaddr);
			write_line(f, addr, table[i].insns, table[i].tlb_misses);
		}
		if (fclose(f))
			fprintf(stderr, "insn-count: writing %s failed\n", path);
	}
	for (i = 0; i < TABLE_SIZE; i++)
		table[i].insns = table[i].tlb_misses = 0;
	user_count.insns = user_count.tlb_misses = 0;
	overflow_count.insns = overflow_count.tlb_misses = 0;
	pthread_mutex_unlock(&table_lock);
}

static void translate_block(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
	uint64_t vaddr = qemu_plugin_tb_vaddr(tb);
	struct block_count *c = &user_count;
	bool kernel = vaddr >= KERNEL_START;
	size_t n = qemu_plugin_tb_n_insns(tb);
	size_t i;

	if (kernel) {
		pthread_mutex_lock(&table_lock);
		c = counter_for(vaddr);
		pthread_mutex_unlock(&table_lock);
		if (!c)
			c = &overflow_count;
	}
	for (i = 0; i < n; i++) {
		struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);

		if (qemu_plugin_insn_size(insn) == sizeof(mark_insn) &&
		    !memcmp(qemu_plugin_insn_data(insn), mark_insn, sizeof(mark_insn)))
			qemu_plugin_register_vcpu_insn_exec_cb(insn, write_counts,
							       QEMU_PLUGIN_CB_NO_REGS, NULL);
		if (tlb_bits)
			qemu_plugin_register_vcpu_mem_cb(
				insn, kernel ? kernel_access : user_access,
				QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_MEM_RW,
				&c->tlb_misses);
	}
	qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64,
						 &c->insns, n);
}

/*
 * Arguments: out=DIR, where the counts go (default: qemu's directory);
 * tlb=BITS, count the misses of a TLB model of 2^BITS entries (6 to 22).
 */
QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
					   int argc, char **argv)
{
	int i;

	if (!info->system_emulation || strcmp(info->target_name, "x86_64") != 0) {
		fprintf(stderr, "insn-count: for x86-64 system emulation only\n");
		return -1;
	}
	for (i = 0; i < argc; i++) {
		if (!strncmp(argv[i], "out=", 4) && argv[i][4]) {
			snprintf(out_dir, sizeof(out_dir), "%s", argv[i] + 4);
		} else if (!strncmp(argv[i], "tlb=", 4)) {
			char *end;
			unsigned long bits = strtoul(argv[i] + 4, &end, 10);

			if (end == argv[i] + 4 || *end || bits < 6 || bits > 22) {
				fprintf(stderr, "insn-count: tlb wants 6 to 22 bits, not '%s'\n",
					argv[i] + 4);
				return -1;
			}
			tlb_bits = bits;
		} else {
			fprintf(stderr, "insn-count: unknown argument '%s' (out=DIR, tlb=BITS)\n",
				argv[i]);
			return -1;
		}
	}
	table = calloc(TABLE_SIZE, sizeof(*table));
	if (tlb_bits) {
		kernel_tlb.entries = calloc(1UL << tlb_bits, sizeof(uint64_t));
		user_tlb.entries = calloc(1UL << tlb_bits, sizeof(uint64_t));
	}
	if (!table || (tlb_bits && (!kernel_tlb.entries || !user_tlb.entries))) {
		fprintf(stderr, "insn-count: out of memory\n");
		return -1;
	}
	qemu_plugin_register_vcpu_tb_trans_cb(id, translate_block);
	return 0;
}
