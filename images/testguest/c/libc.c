/* The four functions gcc may call on its own in freestanding code. String instructions: under
 * PVM's emulator a rep iteration costs about what one instruction does, a C loop several. */
#include "tg.h"

void *memcpy(void *dst, const void *src, size_t n)
{
	void *d = dst;
	size_t words = n >> 2;
	__asm__ volatile("rep movsl" : "+D"(d), "+S"(src), "+c"(words) : : "memory");
	n &= 3;
	__asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(n) : : "memory");
	return dst;
}

void *memmove(void *dst, const void *src, size_t n)
{
	if ((uintptr_t)dst <= (uintptr_t)src || (uintptr_t)dst >= (uintptr_t)src + n)
		return memcpy(dst, src, n);
	/* Overlapping with dst above src: copy backwards, bytewise (rare, and short here). */
	u8 *d = (u8 *)dst + n - 1;
	const u8 *s = (const u8 *)src + n - 1;
	__asm__ volatile("std; rep movsb; cld" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
	return dst;
}

void *memset(void *dst, int c, size_t n)
{
	void *d = dst;
	__asm__ volatile("rep stosb" : "+D"(d), "+c"(n) : "a"(c) : "memory");
	return dst;
}

int memcmp(const void *a, const void *b, size_t n)
{
	const u8 *x = a, *y = b;
	for (size_t i = 0; i < n; i++)
		if (x[i] != y[i])
			return x[i] < y[i] ? -1 : 1;
	return 0;
}
