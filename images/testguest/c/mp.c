/* Counts the processors of the MP table the VMM builds (Intel MP spec 1.4). */
#include "tg.h"

#define MP_SIG 0x5f504d5fu /* "_MP_" */
#define PCMP_SIG 0x504d4350u /* "PCMP" */

static u8 sum(const u8 *p, u32 n)
{
	u8 s = 0;
	for (u32 i = 0; i < n; i++)
		s = (u8)(s + p[i]);
	return s;
}

static const u8 *find_fps(u32 start, u32 end)
{
	for (u32 a = start; a + 16 <= end; a += 16) {
		const u8 *p = (const u8 *)(uintptr_t)a;
		if (ld32(p) == MP_SIG && p[8] == 1 && sum(p, 16) == 0)
			return p;
	}
	return 0;
}

u32 mp_count_cpus(void);
u32 mp_count_cpus(void)
{
	const u8 *fps = find_fps(0x9fc00, 0xa0000);
	if (!fps)
		fps = find_fps(0xf0000, 0x100000);
	if (!fps)
		return 1;
	u32 table = ld32(fps + 4);
	if (!table)
		return fps[11] ? 2 : 1; /* a default configuration: all of them have two CPUs */
	if (table >= 0xfee00000u)
		return 1;
	const u8 *t = (const u8 *)(uintptr_t)table;
	if (ld32(t) != PCMP_SIG)
		return 1;
	/* Walked by length, as Linux does: some firmware (qboot) leaves the entry count 0. */
	u32 len = ld16(t + 4), cpus = 0;
	for (u32 off = 44; off < len;) {
		u8 type = t[off];
		if (type == 0) {
			cpus++;
			off += 20;
		} else if (type <= 4) {
			off += 8;
		} else {
			break; /* unknown entry: its size is unknown too */
		}
	}
	return cpus ? cpus : 1;
}
