/* Protobuf wire primitives. Every length is checked against the remaining input first. */
#include "proto.h"

int pb_varint_long(struct pb_dec *d, u64 *v)
{
	/* In 32-bit halves, as pb_put_varint_long encodes. */
	u32 lo = 0, hi = 0;
	for (u32 i = 0; i < 10; i++) {
		if (d->p >= d->end)
			return -1;
		u32 b = *d->p++;
		/* The tenth byte holds only bit 63. */
		if (i == 9 && b > 1)
			return -1;
		u32 bits = b & 0x7f, shift = 7 * i;
		if (shift < 32) {
			lo |= bits << shift;
			if (shift > 25)
				hi |= bits >> (32 - shift);
		} else {
			hi |= bits << (shift - 32);
		}
		if (!(b & 0x80)) {
			*v = (u64)hi << 32 | lo;
			return 0;
		}
	}
	return -1;
}

int pb_key(struct pb_dec *d, u32 *field, u32 *wire_type)
{
	u64 k;
	if (pb_varint(d, &k) || k > 0xffffffffu)
		return -1;
	*field = (u32)k >> 3;
	*wire_type = (u32)k & 7;
	if (*field == 0)
		return -1;
	switch (*wire_type) {
	case PB_VARINT:
	case PB_I64:
	case PB_LEN:
	case PB_I32:
		return 0;
	default: /* groups (3, 4) are not proto3; 6 and 7 do not exist */
		return -1;
	}
}

int pb_bytes(struct pb_dec *d, const u8 **p, u32 *n)
{
	u64 len;
	if (pb_varint(d, &len) || len > (u64)(d->end - d->p))
		return -1;
	*p = d->p;
	*n = (u32)len;
	d->p += len;
	return 0;
}

int pb_skip(struct pb_dec *d, u32 wire_type)
{
	u64 v;
	const u8 *p;
	u32 n;
	switch (wire_type) {
	case PB_VARINT:
		return pb_varint(d, &v);
	case PB_I64:
		n = 8;
		break;
	case PB_I32:
		n = 4;
		break;
	case PB_LEN:
		return pb_bytes(d, &p, &n);
	default:
		return -1;
	}
	if ((u32)(d->end - d->p) < n)
		return -1;
	d->p += n;
	return 0;
}

int pb_utf8(const u8 *p, u32 n)
{
	for (u32 i = 0; i < n;) {
		u8 c = p[i];
		u32 len, cp, min;
		if (c < 0x80) {
			i++;
			continue;
		}
		if ((c & 0xe0) == 0xc0) {
			len = 2, cp = c & 0x1fu, min = 0x80;
		} else if ((c & 0xf0) == 0xe0) {
			len = 3, cp = c & 0x0fu, min = 0x800;
		} else if ((c & 0xf8) == 0xf0) {
			len = 4, cp = c & 0x07u, min = 0x10000;
		} else {
			return -1;
		}
		if (n - i < len)
			return -1;
		for (u32 k = 1; k < len; k++) {
			if ((p[i + k] & 0xc0) != 0x80)
				return -1;
			cp = cp << 6 | (p[i + k] & 0x3fu);
		}
		/* Overlong forms, UTF-16 surrogates and code points past Unicode are all invalid. */
		if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
			return -1;
		i += len;
	}
	return 0;
}

int pb_check(const u8 *p, u32 n)
{
	struct pb_dec d = {p, p + n};
	u32 f, wt;
	while (d.p < d.end)
		if (pb_key(&d, &f, &wt) || pb_skip(&d, wt))
			return -1;
	return 0;
}

int pb_prefix(const u8 *p, u32 n, u64 *v, u32 *used)
{
	struct pb_dec d = {p, p + TG_MIN(n, 10u)};
	if (pb_varint(&d, v) == 0) {
		*used = (u32)(d.p - p);
		return 1;
	}
	/* Failed: for want of bytes only if every byte so far had its continuation bit. */
	if (n >= 10)
		return -1;
	for (u32 i = 0; i < n; i++)
		if (!(p[i] & 0x80))
			return -1;
	return 0;
}

static void put_byte(struct pb_enc *e, u8 b)
{
	if (e->len < e->cap)
		e->buf[e->len++] = b;
	else
		e->overflow = 1;
}

void pb_put_varint_long(struct pb_enc *e, u64 v)
{
	/* In 32-bit halves: 64-bit shifts and compares cost several instructions each here. */
	u32 lo = (u32)v, hi = (u32)(v >> 32);
	while (hi) {
		put_byte(e, (u8)lo | 0x80);
		lo = lo >> 7 | hi << 25;
		hi >>= 7;
	}
	while (lo >= 0x80) {
		put_byte(e, (u8)lo | 0x80);
		lo >>= 7;
	}
	put_byte(e, (u8)lo);
}

void pb_put_raw(struct pb_enc *e, const void *p, u32 n)
{
	if (n > e->cap - e->len) {
		e->overflow = 1;
		return;
	}
	memcpy(e->buf + e->len, p, n);
	e->len += n;
}

void pb_put_str(struct pb_enc *e, u32 field, const char *s)
{
	pb_put_bytes(e, field, s, tg_strlen(s));
}

void pb_close(struct pb_enc *e, u32 mark)
{
	if (e->overflow)
		return;
	u32 body = e->len - mark - 1;
	if (body < 0x80) { /* the byte pb_open left is enough */
		e->buf[mark] = (u8)body;
		return;
	}
	u8 tmp[10];
	struct pb_enc l = {tmp, sizeof tmp, 0, 0};
	pb_put_varint(&l, body);
	if (l.len > 1) {
		if (l.len - 1 > e->cap - e->len) {
			e->overflow = 1;
			return;
		}
		memmove(e->buf + mark + l.len, e->buf + mark + 1, body);
		e->len += l.len - 1;
	}
	memcpy(e->buf + mark, tmp, l.len);
}
