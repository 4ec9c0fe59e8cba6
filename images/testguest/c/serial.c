/* COM1 output. Each port access is a VM exit (~15 us under PVM): keep lines short. */
#include "plat.h"
#include "x86.h"

#define COM1 0x3f8
#define LSR_THR_EMPTY 0x20

#define FIFO_DEPTH 16

static void wait_fifo_empty(void)
{
	/* Bounded, so a UART that never reports ready cannot hang the guest. */
	for (u32 i = 0; i < 100000 && !(inb(COM1 + 5) & LSR_THR_EMPTY); i++)
		;
}

/* With the 16550's FIFO on, an empty transmitter takes 16 bytes at once: one status read per
 * 16 bytes instead of one per byte halves the exits a line costs. */
void plat_line(const char *s, u32 n)
{
	static int fifo_on;
	if (!fifo_on) {
		outb(COM1 + 2, 0x07); /* FCR: enable and clear both FIFOs */
		fifo_on = 1;
	}
	for (u32 i = 0; i < n; i += FIFO_DEPTH) {
		u32 chunk = TG_MIN(n - i, (u32)FIFO_DEPTH);
		const char *p = s + i;
		wait_fifo_empty();
		__asm__ volatile("rep outsb" : "+S"(p), "+c"(chunk) : "d"(COM1) : "memory");
	}
	if (n % FIFO_DEPTH == 0)
		wait_fifo_empty();
	outb(COM1, '\n');
}
