/*
 * Envelope dispatch and the command handlers. Field numbers are those of
 * proto/api/agentvm/guest/v1/guest.proto, common.proto and harness.proto.
 */
#include "handlers.h"
#include "plat.h"
#include "proto.h"

/* Envelope */
enum {
	ENV_ID = 1,
	ENV_HELLO = 2,
	ENV_READY = 3,
	ENV_RESTORED = 4,
	ENV_RESTORED_ACK = 5,
	ENV_HEALTH_CHECK = 6,
	ENV_HEALTH_REPORT = 7,
	ENV_SHUTDOWN = 8,
	ENV_DESCRIBE_HARNESS = 9,
	ENV_HARNESS_DESCRIPTOR = 10,
	ENV_HARNESS = 11,
	ENV_ERROR = 12,
	ENV_DIRTY_MEMORY = 13,
	ENV_DIRTY_MEMORY_DONE = 14,
};

/* Bounds on what is copied from requests into replies or guest RAM. */
#define MAX_IDENTITY 2048u
#define MAX_EXECUTION_ID 1024u
#define MAX_ECHO_TEXT 1024u

/* Guest state. It lives in guest RAM, so snapshots, restores and forks carry it along. */
static u64 harness_count;
static int echo_mode;
static u64 restore_generation;
static u32 identity_len;
static int has_identity;
static u8 identity[MAX_IDENTITY] TG_BIG; /* read only up to identity_len */
/* What the last Restored notice said. Nothing reads it back; it is there for whoever inspects
 * guest memory (a snapshot, a debugger), hence external so the stores are not optimised out. */
struct tg_restore_record tg_restore_record;
static u8 *dirty_base;
static u32 dirty_pages;
static u32 dirty_prev_stamp;
static u32 dirty_prev_pages;

/* One reply is encoded here at a time; the largest is a Ready carrying MAX_IDENTITY. */
static u8 scratch[8192] TG_BIG;

void tg_dirty_setup(u8 *base, u32 pages)
{
	dirty_base = base;
	dirty_pages = pages;
}

static u32 begin(struct pb_enc *e, u64 id)
{
	e->buf = scratch;
	e->cap = sizeof scratch;
	e->len = 0;
	e->overflow = 0;
	u32 frame = pb_open(e, 0);
	pb_put_uint(e, ENV_ID, id);
	return frame;
}

static int finish(struct pb_enc *e, u32 frame, struct tg_sink *out)
{
	pb_close(e, frame);
	if (e->overflow) {
		tg_error("reply too large");
		return TG_ABORT;
	}
	return out->emit(out->ctx, e->buf, e->len) ? TG_ABORT : TG_KEEP;
}

int tg_send_error(struct tg_sink *out, u64 id, u32 code, const char *msg)
{
	struct pb_enc e;
	u32 f = begin(&e, id);
	u32 m = pb_open(&e, ENV_ERROR);
	pb_put_uint(&e, 1, code);
	pb_put_str(&e, 2, msg);
	pb_close(&e, m);
	return finish(&e, f, out);
}

static int send_error_n(struct tg_sink *out, u64 id, u32 code, const char *msg, u64 n)
{
	struct tg_line l = {.len = 0};
	line_str(&l, msg);
	line_u64(&l, n);
	l.buf[l.len < TG_LINE_MAX ? l.len : TG_LINE_MAX - 1] = 0;
	return tg_send_error(out, id, code, l.buf);
}

int tg_send_ready(struct tg_sink *out, u64 id)
{
	struct pb_enc e;
	u32 f = begin(&e, id);
	u32 m = pb_open(&e, ENV_READY);
	pb_put_uint(&e, 1, TG_PROTOCOL_VERSION);
	pb_put_str(&e, 2, "testguest-1");
	pb_put_uint(&e, 3, 1); /* boot_generation: this image never reboots in place */
	pb_put_uint(&e, 4, restore_generation);
	if (has_identity) {
		/* Kept as the encoded Identity message it arrived as, so it is echoed exactly. */
		u32 i = pb_open(&e, 5);
		if (identity_len <= e.cap - e.len) {
			memcpy(e.buf + e.len, identity, identity_len);
			e.len += identity_len;
		} else {
			e.overflow = 1;
		}
		pb_close(&e, i);
	}
	pb_put_uint(&e, 6, 1);
	pb_put_uint(&e, 7, TG_MAX_FRAME);
	pb_close(&e, m);
	return finish(&e, f, out);
}

static int on_hello(const u8 *p, u32 n, u64 id, struct tg_sink *out)
{
	struct pb_dec d = {p, p + n};
	u64 version = 0;
	u32 f, wt;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		if (f == 1 && wt == PB_VARINT) {
			if (pb_varint(&d, &version))
				return -1;
			version = (u32)version;
		} else if (f == 1 || pb_skip(&d, wt)) {
			return -1;
		}
	}
	if (version != TG_PROTOCOL_VERSION)
		return send_error_n(out, id, TG_FAILED_PRECONDITION, "unsupported protocol version ",
				    version);
	return tg_send_ready(out, id);
}

static u32 fnv1a(const u8 *p, u32 n)
{
	u32 h = 0x811c9dc5u;
	for (u32 i = 0; i < n; i++) {
		h ^= p[i];
		h *= 0x01000193u;
	}
	return h;
}

/* The Identity is echoed in Ready as the bytes it came in, so they must be an Identity prost
 * will decode: strings (1, 2, 4) as valid UTF-8, vsock_cid (3) as a varint. */
static int identity_ok(const u8 *p, u32 n)
{
	struct pb_dec d = {p, p + n};
	u32 f, wt;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		if (f == 1 || f == 2 || f == 4) {
			const u8 *s;
			u32 sn;
			if (wt != PB_LEN || pb_bytes(&d, &s, &sn) || pb_utf8(s, sn))
				return -1;
		} else if (f == 3) {
			u64 v;
			if (wt != PB_VARINT || pb_varint(&d, &v))
				return -1;
		} else if (pb_skip(&d, wt)) {
			return -1;
		}
	}
	return 0;
}

static int on_restored(const u8 *p, u32 n, u64 id, struct tg_sink *out)
{
	struct pb_dec d = {p, p + n};
	u64 kind = 0, wall = 0, generation = 0;
	const u8 *entropy = 0, *ident = 0;
	u32 entropy_len = 0, ident_len = 0;
	u32 f, wt;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		switch (f) {
		case 1:
		case 3:
		case 5: {
			u64 v;
			if (wt != PB_VARINT || pb_varint(&d, &v))
				return -1;
			if (f == 1)
				kind = v;
			else if (f == 3)
				wall = v;
			else
				generation = v;
			break;
		}
		case 2:
			if (wt != PB_LEN || pb_bytes(&d, &entropy, &entropy_len))
				return -1;
			break;
		case 4:
			if (wt != PB_LEN || pb_bytes(&d, &ident, &ident_len) ||
			    identity_ok(ident, ident_len))
				return -1;
			break;
		default:
			if (pb_skip(&d, wt))
				return -1;
		}
	}
	if (ident_len > MAX_IDENTITY)
		return tg_send_error(out, id, TG_RESOURCE_EXHAUSTED, "identity too large");
	tg_restore_record.kind = (u32)kind;
	tg_restore_record.entropy_fnv1a = fnv1a(entropy, entropy_len);
	tg_restore_record.wall_clock_unix_nanos = wall;
	tg_restore_record.generation = generation;
	restore_generation = generation;
	has_identity = ident != 0;
	identity_len = ident_len;
	if (ident_len)
		memcpy(identity, ident, ident_len);

	struct tg_line l = {.len = 0};
	line_str(&l, "TESTGUEST RESTORED ");
	line_u64(&l, generation);
	line_emit(&l);

	struct pb_enc e;
	u32 fr = begin(&e, id);
	u32 m = pb_open(&e, ENV_RESTORED_ACK);
	pb_put_uint(&e, 1, generation);
	pb_close(&e, m);
	return finish(&e, fr, out);
}

static int on_health(u64 id, struct tg_sink *out)
{
	struct pb_enc e;
	u32 f = begin(&e, id);
	u32 m = pb_open(&e, ENV_HEALTH_REPORT);
	pb_put_uint(&e, 1, plat_uptime_ms());
	pb_put_uint(&e, 2, 1);
	pb_put_uint(&e, 4, restore_generation);
	pb_close(&e, m);
	return finish(&e, f, out);
}

void tg_set_echo(int on)
{
	echo_mode = on;
}

static int on_describe(u64 id, struct tg_sink *out)
{
	struct pb_enc e;
	u32 f = begin(&e, id);
	u32 m = pb_open(&e, ENV_HARNESS_DESCRIPTOR);
	pb_put_str(&e, 1, echo_mode ? "testguest-echo" : "testguest");
	u32 caps = pb_open(&e, 4);
	if (echo_mode) {
		pb_put_uint(&e, 1, 1); /* RESUMABILITY_STATELESS_REPLAY */
		pb_put_uint(&e, 2, 1); /* fork_safe */
	} else {
		pb_put_uint(&e, 1, 2); /* RESUMABILITY_REQUIRES_MEMORY_SNAPSHOT */
	}
	pb_close(&e, caps);
	pb_put_str(&e, 5, "1");
	pb_close(&e, m);
	return finish(&e, f, out);
}

/* Opens Envelope{id, harness: HarnessFrame{stream, ...}}; returns the HarnessFrame mark. */
static u32 begin_harness(struct pb_enc *e, u64 id, u64 stream, u32 *frame)
{
	*frame = begin(e, id);
	u32 h = pb_open(e, ENV_HARNESS);
	pb_put_uint(e, 1, stream);
	return h;
}

static int send_close(u64 id, u64 stream, u32 code, const char *msg, struct tg_sink *out)
{
	struct pb_enc e;
	u32 f, h = begin_harness(&e, id, stream, &f);
	u32 c = pb_open(&e, 4); /* StreamClose */
	pb_put_uint(&e, 1, code);
	pb_put_str(&e, 2, msg);
	pb_close(&e, c);
	pb_close(&e, h);
	return finish(&e, f, out);
}

/* One turn answered with `text`: OUTPUT, END COMPLETED, then a clean close. */
static int answer_turn(u64 id, u64 stream, const u8 *exec, u32 exec_len, const void *text,
		       u32 text_len, struct tg_sink *out)
{
	struct pb_enc e;
	u32 f, h, ev, msg, part, tp, end;

	h = begin_harness(&e, id, stream, &f);
	ev = pb_open(&e, 3); /* Event */
	pb_put_bytes(&e, 2, exec, exec_len);
	pb_put_uint(&e, 4, 1);  /* schema_version */
	pb_put_uint(&e, 7, 3);  /* EVENT_OUTPUT */
	msg = pb_open(&e, 8);   /* Message */
	pb_put_str(&e, 1, "assistant");
	part = pb_open(&e, 2);  /* Part */
	tp = pb_open(&e, 1);    /* TextPart */
	pb_put_bytes(&e, 1, text, text_len);
	pb_close(&e, tp);
	pb_close(&e, part);
	pb_close(&e, msg);
	pb_close(&e, ev);
	pb_close(&e, h);
	int r = finish(&e, f, out);
	if (r != TG_KEEP)
		return r;

	h = begin_harness(&e, id, stream, &f);
	ev = pb_open(&e, 3);
	pb_put_bytes(&e, 2, exec, exec_len);
	pb_put_uint(&e, 4, 1);
	pb_put_uint(&e, 7, 10); /* EVENT_END */
	end = pb_open(&e, 16);  /* HarnessEnd */
	pb_put_str(&e, 1, "COMPLETED");
	pb_close(&e, end);
	pb_close(&e, ev);
	pb_close(&e, h);
	r = finish(&e, f, out);
	if (r != TG_KEEP)
		return r;
	return send_close(id, stream, 0, "", out);
}

static int counter_turn(u64 id, u64 stream, const u8 *exec, u32 exec_len, struct tg_sink *out)
{
	char digits[20];
	u32 nd = tg_fmt_u64(digits, ++harness_count);
	plat_disk_note(harness_count);
	return answer_turn(id, stream, exec, exec_len, digits, nd, out);
}

/* The first field `want` (length-delimited) in a message; 0 when absent, -1 when malformed.
 * With `last`, the last one instead (repeated fields). */
static int find_field(const u8 *p, u32 n, u32 want, int last, const u8 **b, u32 *bn)
{
	struct pb_dec d = {p, p + n};
	u32 f, wt;
	int found = 0;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		if (f == want && wt == PB_LEN) {
			if (pb_bytes(&d, b, bn))
				return -1;
			found = 1;
			if (!last)
				return 1;
		} else if (pb_skip(&d, wt)) {
			return -1;
		}
	}
	return found;
}

/* Start{inputs: repeated Message = 3}: the text of the last input's first text part.
 * Message{parts = 2}, Part{text = 1}, TextPart{text = 1}. Returns 0 with *tn = 0 when the
 * turn has no text, -1 when the Start is malformed. */
static int last_input_text(const u8 *start, u32 n, const u8 **t, u32 *tn)
{
	const u8 *msg, *part, *tp;
	u32 mn, pn, tpn;
	*tn = 0;
	int r = find_field(start, n, 3, 1, &msg, &mn);
	if (r <= 0)
		return r;
	struct pb_dec d = {msg, msg + mn};
	u32 f, wt;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		if (f != 2 || wt != PB_LEN) {
			if (pb_skip(&d, wt))
				return -1;
			continue;
		}
		if (pb_bytes(&d, &part, &pn))
			return -1;
		r = find_field(part, pn, 1, 0, &tp, &tpn);
		if (r < 0)
			return -1;
		if (r == 0)
			continue; /* not a text part */
		r = find_field(tp, tpn, 1, 0, t, tn);
		return r < 0 ? -1 : 0;
	}
	return 0;
}

/* The stateless echo turn: "echo:" and the last input's text, recomputed from the Start alone,
 * so a fresh guest given the same Start answers the same (what replay relies on). */
static int echo_turn(u64 id, u64 stream, const u8 *exec, u32 exec_len, const u8 *start,
		     u32 start_len, struct tg_sink *out)
{
	static u8 text[5 + MAX_ECHO_TEXT];
	const u8 *in;
	u32 in_len;
	if (last_input_text(start, start_len, &in, &in_len))
		return tg_send_error(out, id, TG_INVALID_ARGUMENT, "malformed Start");
	if (in_len > MAX_ECHO_TEXT)
		return send_close(id, stream, TG_INVALID_ARGUMENT, "input text too long to echo", out);
	if (pb_utf8(in, in_len))
		return send_close(id, stream, TG_INVALID_ARGUMENT, "input text is not UTF-8", out);
	memcpy(text, "echo:", 5);
	memcpy(text + 5, in, in_len);
	return answer_turn(id, stream, exec, exec_len, text, 5 + in_len, out);
}

static int on_harness(const u8 *p, u32 n, u64 id, struct tg_sink *out)
{
	struct pb_dec d = {p, p + n};
	u64 stream = 0;
	u32 frame = 0, f, wt, ctl_len = 0;
	const u8 *ctl = 0;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		if (f == 1) {
			if (wt != PB_VARINT || pb_varint(&d, &stream))
				return -1;
		} else if (f >= 2 && f <= 4) {
			const u8 *b;
			u32 bn;
			if (wt != PB_LEN || pb_bytes(&d, &b, &bn))
				return -1;
			frame = f; /* oneof: the last one wins */
			ctl = b;
			ctl_len = bn;
		} else if (pb_skip(&d, wt)) {
			return -1;
		}
	}
	if (frame != 2)
		return TG_KEEP; /* events and closes from the host mean nothing here */

	/* ControllerFrame: execution_id, and which of start/cancel/... it carries. The counter
	 * never reads Start's contents; echo reads only its last input. */
	d.p = ctl;
	d.end = ctl + ctl_len;
	const u8 *exec = 0, *start = 0;
	u32 exec_len = 0, start_len = 0, kind = 0;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		if (f >= 1 && f <= 8) {
			const u8 *b;
			u32 bn;
			if (wt != PB_LEN || pb_bytes(&d, &b, &bn))
				return -1;
			if (f == 2) {
				exec = b;
				exec_len = bn;
			} else if (f >= 3) {
				kind = f;
				start = b;
				start_len = bn;
			}
		} else if (pb_skip(&d, wt)) {
			return -1;
		}
	}
	if (kind == 3) {
		if (exec_len > MAX_EXECUTION_ID)
			return tg_send_error(out, id, TG_RESOURCE_EXHAUSTED, "execution_id too long");
		if (pb_utf8(exec, exec_len))
			return -1; /* it is echoed: it must be a valid string */
		if (echo_mode)
			return echo_turn(id, stream, exec, exec_len, start, start_len, out);
		return counter_turn(id, stream, exec, exec_len, out);
	}
	if (kind == 4)
		return send_close(id, stream, 1, "canceled", out);
	return TG_KEEP;
}

static int on_dirty(const u8 *p, u32 n, u64 id, struct tg_sink *out)
{
	struct pb_dec d = {p, p + n};
	u64 mib = 0, stamp = 0;
	u32 f, wt;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			return -1;
		if (f == 1 || f == 2) {
			u64 v;
			if (wt != PB_VARINT || pb_varint(&d, &v))
				return -1;
			if (f == 1)
				mib = (u32)v;
			else
				stamp = (u32)v;
		} else if (pb_skip(&d, wt)) {
			return -1;
		}
	}
	u64 want = mib << 8;
	u32 pages = want < dirty_pages ? (u32)want : dirty_pages;
	u32 check = TG_MIN(pages, dirty_prev_pages);
	u32 expect = dirty_prev_stamp, mismatched = 0;
	/* One word per page: a byte-wise pass over megabytes would take seconds under PVM. */
	volatile u32 *w = (volatile u32 *)dirty_base;
	const u32 step = TG_DIRTY_PAGE / 4;
	for (u32 i = 0; i < check; i++, w += step)
		if (*w != (expect ^ i))
			mismatched++;
	if (stamp) {
		w = (volatile u32 *)dirty_base;
		for (u32 i = 0; i < pages; i++, w += step)
			*w = (u32)stamp ^ i;
		dirty_prev_stamp = (u32)stamp;
		dirty_prev_pages = pages;
	}

	struct pb_enc e;
	u32 fr = begin(&e, id);
	u32 m = pb_open(&e, ENV_DIRTY_MEMORY_DONE);
	pb_put_uint(&e, 1, pages);
	pb_put_uint(&e, 2, mismatched);
	pb_close(&e, m);
	return finish(&e, fr, out);
}

int tg_handle_envelope(const u8 *env, u32 n, struct tg_sink *out)
{
	struct pb_dec d = {env, env + n};
	u64 id = 0;
	u32 f, wt, body = 0, body_len = 0, unknown = 0;
	const u8 *b = 0;
	while (d.p < d.end) {
		if (pb_key(&d, &f, &wt))
			goto malformed;
		if (f == ENV_ID) {
			if (wt != PB_VARINT || pb_varint(&d, &id))
				goto malformed;
		} else if (f <= ENV_DIRTY_MEMORY_DONE) {
			if (wt != PB_LEN || pb_bytes(&d, &b, &body_len))
				goto malformed;
			body = f; /* oneof: the last one wins */
		} else {
			if (pb_skip(&d, wt))
				goto malformed;
			unknown = f;
		}
	}

	int r;
	switch (body) {
	case ENV_HELLO:
		r = on_hello(b, body_len, id, out);
		break;
	case ENV_RESTORED:
		r = on_restored(b, body_len, id, out);
		break;
	case ENV_HEALTH_CHECK:
		r = pb_check(b, body_len) ? -1 : on_health(id, out);
		break;
	case ENV_DESCRIBE_HARNESS:
		r = pb_check(b, body_len) ? -1 : on_describe(id, out);
		break;
	case ENV_HARNESS:
		r = on_harness(b, body_len, id, out);
		break;
	case ENV_DIRTY_MEMORY:
		r = on_dirty(b, body_len, id, out);
		break;
	case ENV_SHUTDOWN:
		if (pb_check(b, body_len))
			goto malformed;
		tg_log("SHUTDOWN");
		plat_reset();
		return TG_KEEP;
	case 0:
		if (unknown)
			return send_error_n(out, id, TG_UNIMPLEMENTED, "unimplemented envelope field ",
					    unknown);
		return tg_send_error(out, id, TG_UNIMPLEMENTED, "envelope has no body");
	default:
		return send_error_n(out, id, TG_UNIMPLEMENTED, "unimplemented envelope field ", body);
	}
	if (r >= 0)
		return r;
malformed:
	r = tg_send_error(out, 0, TG_INVALID_ARGUMENT, "malformed frame");
	return r == TG_KEEP ? TG_CLOSE : r;
}
