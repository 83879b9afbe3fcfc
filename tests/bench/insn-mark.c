// SPDX-License-Identifier: GPL-2.0-only
/*
 * insn-mark.c - the guest's mark for the insn-count.c qemu plugin: runs
 * the marker instruction (xchg %bx,%bx) and exits.  Built static and
 * without libc (scripts/profile --insns), so that it runs in the guest
 * and executes nothing else worth counting.
 */
#define NR_EXIT 60

void _start(void)
{
	asm volatile("xchg %%bx, %%bx\n\t"
		     "syscall"
		     : : "a" (NR_EXIT), "D" (0) : "rcx", "r11", "memory");
	__builtin_unreachable();
}
