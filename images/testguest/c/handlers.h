/*
 * agentvm.guest.v1 request handlers and the guest state they keep (the counter, the last
 * Restored notice, the dirty-memory stamps). Independent of vsock: replies go to a sink.
 */
#ifndef TG_HANDLERS_H
#define TG_HANDLERS_H

#include "tg.h"

#define TG_MAX_FRAME (256u * 1024)
#define TG_PROTOCOL_VERSION 1
#define TG_DIRTY_PAGE 4096u

/* What the connection should do after a frame. */
enum {
	TG_KEEP = 0,  /* carry on */
	TG_CLOSE = 1, /* send what was queued, then reset the connection */
	TG_ABORT = 2, /* reset it now (a reply did not fit) */
};

/* Status codes (google.rpc.Code) used in GuestError. */
enum {
	TG_INVALID_ARGUMENT = 3,
	TG_RESOURCE_EXHAUSTED = 8,
	TG_FAILED_PRECONDITION = 9,
	TG_UNIMPLEMENTED = 12,
};

struct tg_sink {
	/* Queues one whole frame (length prefix included); -1 when it does not fit. */
	int (*emit)(void *ctx, const u8 *frame, u32 n);
	void *ctx;
};

struct tg_restore_record {
	u32 kind;
	u32 entropy_fnv1a; /* 32-bit FNV-1a of Restored.entropy */
	u64 wall_clock_unix_nanos;
	u64 generation;
};
extern struct tg_restore_record tg_restore_record;

/* Handles one Envelope (the frame body, without its length prefix). */
int tg_handle_envelope(const u8 *env, u32 n, struct tg_sink *out);
/* The Ready envelope (sent unsolicited, id 0, on a connection the guest opened). */
int tg_send_ready(struct tg_sink *out, u64 id);
int tg_send_error(struct tg_sink *out, u64 id, u32 code, const char *msg);
/* Echo mode: the harness is `testguest-echo` (stateless, fork-safe), whose turn answers
 * "echo:" and the text of the turn's last input, instead of the counter. */
void tg_set_echo(int on);
/* The dirty region: pages of 4 KiB from base. */
void tg_dirty_setup(u8 *base, u32 pages);

#endif
