/* PIC setup and acknowledgement, the IDT, and exception reports. */
#include "pic.h"
#include "plat.h"
#include "x86.h"

#define PIC1 0x20
#define PIC2 0xa0
#define EOI 0x20
#define OCW3_READ_ISR 0x0b

static u8 mask1 = 0xff, mask2 = 0xff;

void pic_init(void)
{
	outb(PIC1, 0x11); /* ICW1: edge triggered, cascade, ICW4 follows */
	outb(PIC2, 0x11);
	outb(PIC1 + 1, TG_IRQ_BASE);     /* ICW2: vector base */
	outb(PIC2 + 1, TG_IRQ_BASE + 8);
	outb(PIC1 + 1, 0x04); /* ICW3: slave on line 2 */
	outb(PIC2 + 1, 0x02); /* ICW3: slave id 2 */
	outb(PIC1 + 1, 0x01); /* ICW4: 8086 mode, normal EOI */
	outb(PIC2 + 1, 0x01);
	outb(PIC1 + 1, mask1);
	outb(PIC2 + 1, mask2);
}

void pic_unmask(u32 irq)
{
	if (irq >= 8) {
		mask2 &= (u8)~(1u << (irq - 8));
		mask1 &= (u8)~(1u << 2);
		outb(PIC2 + 1, mask2);
	} else {
		mask1 &= (u8)~(1u << irq);
	}
	outb(PIC1 + 1, mask1);
}

void pic_mask(u32 irq)
{
	if (irq >= 8) {
		mask2 |= (u8)(1u << (irq - 8));
		outb(PIC2 + 1, mask2);
	} else {
		mask1 |= (u8)(1u << irq);
		outb(PIC1 + 1, mask1);
	}
}

static int in_service(u16 pic, u32 line)
{
	outb(pic, OCW3_READ_ISR);
	return inb(pic) >> line & 1;
}

int pic_ack(u32 irq)
{
	/* IRQ 7 and 15 are also what a PIC reports when the line dropped before the ack. */
	if (irq == 7 && !in_service(PIC1, 7))
		return 0;
	if (irq == 15 && !in_service(PIC2, 7)) {
		outb(PIC1, EOI); /* the master did see the cascade line */
		return 0;
	}
	if (irq >= 8)
		outb(PIC2, EOI);
	outb(PIC1, EOI);
	return 1;
}

#define LAPIC 0xfee00000u
#define LAPIC_SVR 0x0f0
#define LAPIC_LVT_LINT0 0x350
#define LAPIC_LVT_LINT1 0x360

void lapic_virtual_wire(void)
{
	u32 a, b, c, d;
	cpuid(1, &a, &b, &c, &d);
	if (!(d & (1u << 9)))
		return; /* no LAPIC: the PIC drives INTR directly */
	/* The VMM sets this up too; doing it here costs three writes and makes the guest work
	 * under any VMM (a LAPIC left in its reset state would swallow PIC interrupts). */
	mmio_write32(LAPIC + LAPIC_SVR, 0x100 | TG_SPURIOUS_VECTOR);
	mmio_write32(LAPIC + LAPIC_LVT_LINT0, 0x700); /* ExtINT */
	mmio_write32(LAPIC + LAPIC_LVT_LINT1, 0x400); /* NMI */
}

extern u8 tg_isr_stubs[];
extern u8 tg_nmi_entry[];

static u32 idt[TG_IDT_VECTORS * 2];

/* An interrupt gate as two words: code selector 0x08; 0x8e = present, DPL 0, 32-bit interrupt
 * gate (IF cleared on entry). */
static void set_gate(u32 v, u32 off)
{
	idt[2 * v] = (off & 0xffffu) | 0x08u << 16;
	idt[2 * v + 1] = (off & 0xffff0000u) | 0x8e00u;
}

void idt_init(void)
{
	/* Every guest instruction is emulated (~0.5 us): the stubs are 16 bytes apart, so within
	 * one 64 KiB page only the low half of each gate moves. */
	u32 first = (u32)(uintptr_t)tg_isr_stubs;
	u32 last = first + (TG_IDT_VECTORS - 1) * 16;
	if (first >> 16 == last >> 16) {
		set_gate(0, first);
		u32 lo = idt[0], hi = idt[1];
		for (u32 v = 1; v < TG_IDT_VECTORS; v++) {
			lo += 16;
			idt[2 * v] = lo;
			idt[2 * v + 1] = hi;
		}
	} else {
		for (u32 v = 0; v < TG_IDT_VECTORS; v++)
			set_gate(v, first + v * 16);
	}
	set_gate(2, (u32)(uintptr_t)tg_nmi_entry);
	struct {
		u16 limit;
		u32 base;
	} __attribute__((packed)) desc = {sizeof idt - 1, (u32)(uintptr_t)idt};
	__asm__ volatile("lidt %0" : : "m"(desc));
}

/* Called on the exception stack by start.S; frame points at the vector pushed by the stub. */
TG_NORETURN void tg_exception(u32 vector, const u32 *frame);
TG_NORETURN void tg_exception(u32 vector, const u32 *frame)
{
	/* Vectors 8, 10-14, 17, 21 push an error code between the vector and EIP. */
	int has_error = vector == 8 || (vector >= 10 && vector <= 14) || vector == 17 ||
			vector == 21;
	struct tg_line l = {.len = 0};
	line_str(&l, "TESTGUEST ERROR exception ");
	line_u64(&l, vector);
	if (has_error) {
		line_str(&l, " error ");
		line_hex(&l, frame[1]);
	}
	line_str(&l, " eip ");
	line_hex(&l, frame[has_error ? 2 : 1]);
	line_emit(&l);
	halt_forever();
}
