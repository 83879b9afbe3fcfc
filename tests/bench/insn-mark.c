// SPDX-License-Identifier: GPL-2.0-only
/*
 * insn-mark.c - the guest's mark for the insn-count.c qemu plugin: runs
 * the marker instruction (xchg %bx,%bx) and exits.  Built static and
 * without libc (scripts/profile --insns), so that it runs in the guest
 * and executes nothing else worth counting.
 */
void _start(void)
{
	__asm__ volatile("xchg %%bx, %%bx\n\t"
			 "mov $60, %%eax\n\t"	/* exit(0) */
			 "xor %%edi, %%edi\n\t"
			 "syscall"
			 : : : "memory");
	__builtin_unreachable();
}
