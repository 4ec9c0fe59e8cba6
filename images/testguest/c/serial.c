/* COM1 output. Each port access is a VM exit (~15 us under PVM): keep lines short. */
#include "plat.h"
#include "x86.h"

#define COM1 0x3f8
#define LSR_THR_EMPTY 0x20

static void put(char c)
{
	/* Bounded, so a UART that never reports ready cannot hang the guest. */
	for (u32 i = 0; i < 100000 && !(inb(COM1 + 5) & LSR_THR_EMPTY); i++)
		;
	outb(COM1, (u8)c);
}

void plat_line(const char *s, u32 n)
{
	for (u32 i = 0; i < n; i++)
		put(s[i]);
	put('\n');
}
