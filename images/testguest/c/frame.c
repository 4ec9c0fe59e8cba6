/* Frame reassembly: varint length, then that many bytes of Envelope. */
#include "frame.h"
#include "proto.h"

static int close_with(struct tg_sink *out, u32 code, const char *msg)
{
	int r = tg_send_error(out, 0, code, msg);
	return r == TG_KEEP ? TG_CLOSE : r;
}

int tg_frames_feed(struct tg_fbuf *fb, const u8 *data, u32 n, struct tg_sink *out)
{
	while (n) {
		u32 c = TG_MIN(n, TG_FRAME_BUF - fb->len);
		if (!c) /* cannot happen with TG_FRAME_BUF > max prefix + TG_MAX_FRAME */
			return close_with(out, TG_RESOURCE_EXHAUSTED, "frame buffer full");
		memcpy(fb->buf + fb->len, data, c);
		fb->len += c;
		data += c;
		n -= c;

		u32 pos = 0;
		for (;;) {
			u64 len;
			u32 prefix;
			int r = pb_prefix(fb->buf + pos, fb->len - pos, &len, &prefix);
			if (r == 0)
				break;
			if (r < 0)
				return close_with(out, TG_INVALID_ARGUMENT, "malformed frame length");
			if (len > TG_MAX_FRAME)
				return close_with(out, TG_RESOURCE_EXHAUSTED, "frame too large");
			if (len > fb->len - pos - prefix)
				break;
			r = tg_handle_envelope(fb->buf + pos + prefix, (u32)len, out);
			pos += prefix + (u32)len;
			if (r != TG_KEEP)
				return r;
		}
		/* What is left is the start of one frame, which arrived within this chunk. */
		if (pos) {
			memmove(fb->buf, fb->buf + pos, fb->len - pos);
			fb->len -= pos;
		}
	}
	return TG_KEEP;
}
