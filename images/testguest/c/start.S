/*
 * PVH entry. The VMM jumps here in 32-bit protected mode, paging off, interrupts off, with
 * EBX = struct hvm_start_info and no stack. We load our own GDT and stack, clear .bss and call
 * tg_start(EBX).
 *
 * Interrupts never return: iret is not available under PVM's instruction emulator. The IRQ
 * stubs drop the interrupted frame and restart the main loop on a fresh stack, which is safe
 * because interrupts are only ever enabled in the main loop's "sti; hlt".
 */

#define XEN_ELFNOTE_PHYS32_ENTRY 18
#define CODE_SEL 0x08
#define DATA_SEL 0x10

	.section .note.Xen, "a", @note
	.p2align 2
	.long 4				/* name size: "Xen\0" */
	.long 4				/* descriptor size */
	.long XEN_ELFNOTE_PHYS32_ENTRY
	.asciz "Xen"
	.long tg_entry

	.section .text.entry, "ax"
	.code32
	.globl tg_entry
tg_entry:
	cli
	cld
	lgdt gdt_desc
	ljmp $CODE_SEL, $1f
1:	mov $DATA_SEL, %eax
	mov %eax, %ds
	mov %eax, %es
	mov %eax, %ss
	mov %eax, %fs
	mov %eax, %gs
	mov $tg_stack_top, %esp
	/* .bss is small; the big buffers are in .bss.big, which is not cleared. */
	mov $__bss_start, %edi
	mov $__bss_end, %ecx
	sub %edi, %ecx
	shr $2, %ecx
	xor %eax, %eax
	rep stosl
	push %ebx
	call tg_start
	jmp tg_halt

	.globl tg_halt
tg_halt:
	cli
	hlt
	jmp tg_halt

/* One 16-byte stub per vector 0..TG_IDT_VECTORS-1: push the vector, go to the common path. */
	.p2align 4
	.globl tg_isr_stubs
tg_isr_stubs:
	.set vec, 0
	.rept 64
	.p2align 4
	push $vec
	jmp isr_common
	.set vec, vec + 1
	.endr

isr_common:
	mov (%esp), %eax
	cmp $0x20, %eax
	jb 2f
	/* An IRQ: it can only have hit "sti; hlt", so there is nothing to go back to. */
	mov $tg_stack_top, %esp
	push %eax
	call tg_irq
	jmp tg_halt
2:	/* An exception: report it from a stack of its own (this one may be the problem). */
	mov %esp, %edx
	mov $tg_exc_stack_top, %esp
	push %edx
	push %eax
	call tg_exception
	jmp tg_halt

/*
 * NMI: may arrive anywhere, so it must resume the interrupted code, without iret. The frame is
 * EIP, CS, EFLAGS; rewrite it to EFLAGS, EIP, (unused) so that popf restores the flags (and
 * IF) and "ret $4" returns to EIP and drops the third word. NMIs stay blocked afterwards
 * (only iret unblocks them), which is fine: there is nothing to do on one.
 */
	.globl tg_nmi_entry
tg_nmi_entry:
	push %eax
	mov 4(%esp), %eax	/* EIP */
	mov %eax, 8(%esp)	/* over CS */
	mov 12(%esp), %eax	/* EFLAGS */
	mov %eax, 4(%esp)	/* over EIP */
	pop %eax
	popf
	ret $4

	.section .rodata
	.p2align 3
gdt:
	.quad 0
	/* Accessed bits preset, so loading a selector never writes to this table. */
	.quad 0x00cf9b000000ffff	/* CODE_SEL: flat 4 GiB, 32-bit, execute/read */
	.quad 0x00cf93000000ffff	/* DATA_SEL: flat 4 GiB, read/write */
gdt_end:
gdt_desc:
	.word gdt_end - gdt - 1
	.long gdt

	.section .bss.big, "aw", @nobits
	.p2align 12
	.space 65536
	.globl tg_stack_top
tg_stack_top:
	.space 4096
tg_exc_stack_top:

	.section .note.GNU-stack, "", @progbits
