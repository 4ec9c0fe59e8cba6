/* Reassembles length-prefixed frames from a connection's byte stream. */
#ifndef TG_FRAME_H
#define TG_FRAME_H

#include "handlers.h"

/* A buffer this large always has room for one more byte while no whole frame is held. */
#define TG_FRAME_BUF (TG_MAX_FRAME + 16)

struct tg_fbuf {
	u8 *buf; /* TG_FRAME_BUF bytes */
	u32 len;
};

/* Appends stream bytes and handles every whole frame; returns TG_KEEP/TG_CLOSE/TG_ABORT. */
int tg_frames_feed(struct tg_fbuf *fb, const u8 *data, u32 n, struct tg_sink *out);

#endif
