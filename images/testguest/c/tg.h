/*
 * Types and small helpers shared by every test guest source, in both builds: the
 * freestanding 32-bit guest and the native (host) build the Rust tests drive.
 */
#ifndef TG_H
#define TG_H

#include <stddef.h>
#include <stdint.h>

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;

#define TG_NORETURN __attribute__((noreturn))
/* Large buffers live here: NOBITS like .bss but not zeroed at boot (zeroing megabytes costs
 * ~0.1 s per MiB under PVM's emulator). Code must never read them before writing them. */
#ifdef TG_NATIVE
#define TG_BIG /* a plain global, so AddressSanitizer guards it */
#else
#define TG_BIG __attribute__((section(".bss.big")))
#endif
#define TG_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define TG_MIN(a, b) ((a) < (b) ? (a) : (b))

#ifdef TG_NATIVE
#include <string.h>
#else
/* gcc may emit calls to these even with -ffreestanding; libc.c provides them. */
void *memcpy(void *dst, const void *src, size_t n);
void *memmove(void *dst, const void *src, size_t n);
void *memset(void *dst, int c, size_t n);
int memcmp(const void *a, const void *b, size_t n);
#endif

static inline u16 ld16(const u8 *p) { return (u16)(p[0] | (u32)p[1] << 8); }
static inline u32 ld32(const u8 *p)
{
	return (u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24;
}
static inline u64 ld64(const u8 *p) { return ld32(p) | (u64)ld32(p + 4) << 32; }
static inline void st16(u8 *p, u16 v)
{
	p[0] = (u8)v;
	p[1] = (u8)(v >> 8);
}
static inline void st32(u8 *p, u32 v)
{
	st16(p, (u16)v);
	st16(p + 2, (u16)(v >> 16));
}
static inline void st64(u8 *p, u64 v)
{
	st32(p, (u32)v);
	st32(p + 4, (u32)(v >> 32));
}

/* fmt.c: one serial line at a time, built without printf. */
#define TG_LINE_MAX 96
struct tg_line {
	char buf[TG_LINE_MAX];
	u32 len;
};
void line_str(struct tg_line *l, const char *s);
void line_u64(struct tg_line *l, u64 v);
void line_hex(struct tg_line *l, u32 v);
void line_emit(struct tg_line *l);
/* Writes v in decimal to out (at least 20 bytes), returns the digit count. */
u32 tg_fmt_u64(char *out, u64 v);
u32 tg_strlen(const char *s);
/* Prints "TESTGUEST <msg>". */
void tg_log(const char *msg);
/* Prints "TESTGUEST ERROR <what>[ <n>]"; only the first few dozen, so a hostile peer cannot
 * turn every packet into a millisecond of serial output. */
void tg_error(const char *what);
void tg_error_n(const char *what, u64 n);

#endif
