/*
 * Just enough of the protobuf wire format for agentvm.guest.v1: a bounds-checked decoder
 * that never reads outside [p, end), and an encoder into a fixed buffer.
 */
#ifndef TG_PROTO_H
#define TG_PROTO_H

#include "tg.h"

enum { PB_VARINT = 0, PB_I64 = 1, PB_LEN = 2, PB_I32 = 5 };

struct pb_dec {
	const u8 *p;
	const u8 *end;
};

/* All return 0 on success and -1 on malformed or truncated input. */
int pb_varint_long(struct pb_dec *d, u64 *v);
/* Nearly every varint on this wire (keys, lengths, enums, small ids) is one byte, and under
 * PVM's emulator each guest instruction costs ~0.5 us: that case is inline and short. */
static inline int pb_varint(struct pb_dec *d, u64 *v)
{
	if (d->p < d->end && !(*d->p & 0x80)) {
		*v = *d->p++;
		return 0;
	}
	return pb_varint_long(d, v);
}
/* A field key: rejects field number 0, keys over 32 bits and wire types 3, 4, 6, 7. */
int pb_key(struct pb_dec *d, u32 *field, u32 *wire_type);
/* A length-delimited payload that must lie within the input. */
int pb_bytes(struct pb_dec *d, const u8 **p, u32 *n);
int pb_skip(struct pb_dec *d, u32 wire_type);
/* 0 if p[0..n) is valid UTF-8 (what prost demands of string fields the guest echoes). */
int pb_utf8(const u8 *p, u32 n);
/* Walks a whole message without interpreting it: 0 if it is well-formed at the top level. */
int pb_check(const u8 *p, u32 n);

/*
 * The varint length prefix of a frame at the start of p[0..n): 1 with *v and *used set, 0 if
 * more bytes are needed, -1 if it can never be valid.
 */
int pb_prefix(const u8 *p, u32 n, u64 *v, u32 *used);

struct pb_enc {
	u8 *buf;
	u32 cap;
	u32 len;
	int overflow; /* set once anything did not fit; the output is then garbage */
};

void pb_put_varint_long(struct pb_enc *e, u64 v);
static inline void pb_put_varint(struct pb_enc *e, u64 v)
{
	if (v < 0x80 && e->len < e->cap)
		e->buf[e->len++] = (u8)v;
	else
		pb_put_varint_long(e, v);
}
static inline void pb_put_key(struct pb_enc *e, u32 field, u32 wire_type)
{
	pb_put_varint(e, (u64)field << 3 | wire_type);
}
/* proto3 scalars: nothing is written for 0. */
static inline void pb_put_uint(struct pb_enc *e, u32 field, u64 v)
{
	if (!v)
		return;
	pb_put_key(e, field, PB_VARINT);
	pb_put_varint(e, v);
}
void pb_put_raw(struct pb_enc *e, const void *p, u32 n);
/* A string or bytes field; nothing is written when empty. */
static inline void pb_put_bytes(struct pb_enc *e, u32 field, const void *p, u32 n)
{
	if (!n)
		return;
	pb_put_key(e, field, PB_LEN);
	pb_put_varint(e, n);
	pb_put_raw(e, p, n);
}
void pb_put_str(struct pb_enc *e, u32 field, const char *s);
/* A length-delimited field whose bytes follow: write them after this, then pb_close(mark).
 * Field 0 writes no key, just the length (a frame's prefix). Always present, even if empty.
 * The length gets one byte here; pb_close moves the body if it needs more. */
static inline u32 pb_open(struct pb_enc *e, u32 field)
{
	if (field)
		pb_put_key(e, field, PB_LEN);
	u32 mark = e->len;
	pb_put_varint(e, 0);
	return mark;
}
void pb_close(struct pb_enc *e, u32 mark);

#endif
