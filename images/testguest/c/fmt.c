/* Decimal/hex formatting and serial lines. No 64-bit division: libgcc is not linked. */
#include "plat.h"

static const u64 pow10[20] = {
	10000000000000000000ull, 1000000000000000000ull, 100000000000000000ull,
	10000000000000000ull, 1000000000000000ull, 100000000000000ull, 10000000000000ull,
	1000000000000ull, 100000000000ull, 10000000000ull, 1000000000ull, 100000000ull,
	10000000ull, 1000000ull, 100000ull, 10000ull, 1000ull, 100ull, 10ull, 1ull,
};

/* The common case (counts, ids, sizes): the CPU's own 32-bit division, a digit at a time. */
static u32 fmt_u32(char *out, u32 v)
{
	char rev[10];
	u32 n = 0, len = 0;
	do {
		rev[n++] = (char)('0' + v % 10);
		v /= 10;
	} while (v);
	while (n)
		out[len++] = rev[--n];
	return len;
}

u32 tg_fmt_u64(char *out, u64 v)
{
	if (!(v >> 32))
		return fmt_u32(out, (u32)v);
	u32 n = 0, i = 0;
	while (i < 19 && v < pow10[i])
		i++;
	for (; i < 20; i++) {
		char d = '0';
		/* At most 9 subtractions per digit (10^19 fits only once). */
		while (v >= pow10[i]) {
			v -= pow10[i];
			d++;
		}
		out[n++] = d;
	}
	return n;
}

u32 tg_strlen(const char *s)
{
	/* A string instruction: one emulated iteration per byte instead of a loop's several. */
	const char *p = s;
	size_t left = ~(size_t)0;
	__asm__ volatile("repne scasb" : "+D"(p), "+c"(left) : "a"(0) : "memory", "cc");
	return (u32)(p - s - 1);
}

void line_str(struct tg_line *l, const char *s)
{
	u32 n = TG_MIN(tg_strlen(s), TG_LINE_MAX - l->len);
	memcpy(l->buf + l->len, s, n);
	l->len += n;
}

void line_u64(struct tg_line *l, u64 v)
{
	char d[20];
	u32 n = tg_fmt_u64(d, v);
	for (u32 i = 0; i < n && l->len < TG_LINE_MAX; i++)
		l->buf[l->len++] = d[i];
}

void line_hex(struct tg_line *l, u32 v)
{
	static const char hex[] = "0123456789abcdef";
	line_str(l, "0x");
	for (int s = 28; s >= 0 && l->len < TG_LINE_MAX; s -= 4)
		l->buf[l->len++] = hex[(v >> s) & 15];
}

void line_emit(struct tg_line *l)
{
	plat_line(l->buf, l->len);
	l->len = 0;
}

void tg_log(const char *msg)
{
	struct tg_line l = {.len = 0};
	line_str(&l, "TESTGUEST ");
	line_str(&l, msg);
	line_emit(&l);
}

static u32 errors_printed;
#define TG_MAX_ERROR_LINES 32

static int error_allowed(void)
{
	if (errors_printed > TG_MAX_ERROR_LINES)
		return 0;
	if (errors_printed++ == TG_MAX_ERROR_LINES) {
		tg_log("ERROR further errors not shown");
		return 0;
	}
	return 1;
}

void tg_error(const char *what)
{
	if (!error_allowed())
		return;
	struct tg_line l = {.len = 0};
	line_str(&l, "TESTGUEST ERROR ");
	line_str(&l, what);
	line_emit(&l);
}

void tg_error_n(const char *what, u64 n)
{
	if (!error_allowed())
		return;
	struct tg_line l = {.len = 0};
	line_str(&l, "TESTGUEST ERROR ");
	line_str(&l, what);
	line_str(&l, " ");
	line_u64(&l, n);
	line_emit(&l);
}
