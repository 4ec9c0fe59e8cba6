/* The 8259 pair (and the LAPIC's virtual wire in front of it). */
#ifndef TG_PIC_H
#define TG_PIC_H

#include "tg.h"

#define TG_IRQ_BASE 0x20 /* master IRQ 0-7 at 0x20-0x27, slave IRQ 8-15 at 0x28-0x2f */
#define TG_IDT_VECTORS 64
#define TG_SPURIOUS_VECTOR 0x3f

/* Initialises both PICs with every line masked. */
void pic_init(void);
void pic_unmask(u32 irq);
void pic_mask(u32 irq);
/* Acknowledges irq; returns 0 if it was spurious (nothing to handle). */
int pic_ack(u32 irq);
/* Makes sure PIC interrupts reach the CPU: LAPIC enabled, LINT0 ExtINT, LINT1 NMI. */
void lapic_virtual_wire(void);
void idt_init(void);

#endif
