/* Port I/O, MMIO and the few privileged instructions the guest uses. */
#ifndef TG_X86_H
#define TG_X86_H

#include "tg.h"

static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port)); }

static inline u8 inb(u16 port)
{
	u8 v;
	__asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
	return v;
}

static inline u32 mmio_read32(u32 addr) { return *(volatile u32 *)(uintptr_t)addr; }
static inline void mmio_write32(u32 addr, u32 v) { *(volatile u32 *)(uintptr_t)addr = v; }

static inline u64 rdtsc(void)
{
	u32 lo, hi;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return (u64)hi << 32 | lo;
}

static inline void cpuid(u32 leaf, u32 *a, u32 *b, u32 *c, u32 *d)
{
	__asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(0));
}

/* Orders memory accesses against the device: x86 keeps stores in order and loads in order,
 * so only the compiler has to be stopped from moving them. */
#define barrier() __asm__ volatile("" : : : "memory")

static inline TG_NORETURN void halt_forever(void)
{
	for (;;)
		__asm__ volatile("cli; hlt");
}

#endif
