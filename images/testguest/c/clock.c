/*
 * Uptime from the TSC, calibrated against PIT channel 2 on first use (so boot does not pay
 * for it). No 64-bit division is available (no libgcc), hence udiv64 below.
 */
#include "plat.h"
#include "x86.h"

#define PIT_HZ 1193182u
#define CALIBRATE_MS 10u

static u64 tsc_boot;
static u32 tsc_per_ms;
static int calibrated; /* 0 not tried, 1 ok, -1 failed */

void clock_init(void);
void clock_init(void)
{
	u32 a, b, c, d;
	cpuid(1, &a, &b, &c, &d);
	if (!(d & (1u << 4))) {
		calibrated = -1; /* no TSC */
		return;
	}
	tsc_boot = rdtsc();
}

static void calibrate(void)
{
	u32 latch = PIT_HZ / (1000 / CALIBRATE_MS);
	u8 port61 = inb(0x61);
	/* Gate channel 2 on, speaker off; mode 0 raises OUT2 (port 0x61 bit 5) at terminal count. */
	outb(0x61, (u8)((port61 & ~0x02) | 0x01));
	outb(0x43, 0xb0);
	outb(0x42, (u8)latch);
	outb(0x42, (u8)(latch >> 8));
	u64 t0 = rdtsc();
	/* Programming mode 0 drops OUT2; if it reads high now there is no channel 2 behind port
	 * 0x61 (qemu's microvm has none, for one). */
	int present = !(inb(0x61) & 0x20);
	u64 delta = 0;
	/* Bounded by the TSC, not by a count of port reads: those cost anything from a few
	 * nanoseconds (emulated by qemu's TCG) to tens of microseconds (a VM exit under PVM).
	 * More than 2^32 ticks for 10 ms would be no usable result anyway. */
	while (present && !(inb(0x61) & 0x20) && !((delta = rdtsc() - t0) >> 32))
		;
	delta = rdtsc() - t0;
	outb(0x61, port61);
	calibrated = -1;
	if (!present || delta >> 32 || delta < CALIBRATE_MS) {
		tg_error("tsc calibration failed; uptime reported as 0");
		return;
	}
	tsc_per_ms = (u32)delta / CALIBRATE_MS;
	calibrated = 1;
}

/* Two 32-bit divisions: the high half's remainder is below `d`, so `divl` of it and the
 * low half cannot overflow. (A bit-at-a-time loop costs ~600 emulated instructions.) */
static u64 udiv64(u64 n, u32 d)
{
	u32 hi = (u32)(n >> 32), lo = (u32)n;
	u32 q_hi = hi / d, r = hi % d, q_lo;
	__asm__("divl %4" : "=a"(q_lo), "=d"(r) : "a"(lo), "d"(r), "rm"(d) : "cc");
	return (u64)q_hi << 32 | q_lo;
}

u64 plat_uptime_ms(void)
{
	if (!calibrated)
		calibrate();
	if (calibrated < 0)
		return 0;
	return udiv64(rdtsc() - tsc_boot, tsc_per_ms);
}
