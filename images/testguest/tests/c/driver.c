/*
 * Native test driver: the test guest's hardware-independent code (frame codec, handlers, vsock
 * state machine, command line parser) with fake platform hooks, driven over stdin/stdout by
 * tests/native.rs. Built with the host gcc, under AddressSanitizer/UBSan where available.
 *
 * Input records:  u8 command, u32 little-endian length, payload.
 * Output records: u8 kind, u32 little-endian length, payload; '.' ends each command's output.
 */
#include <stdio.h>
#include <stdlib.h>

#include "cmdline.h"
#include "frame.h"
#include "handlers.h"
#include "plat.h"
#include "vsock.h"

static u64 uptime;
static u32 tx_limit, tx_in_flight;
static u8 *dirty;
static u32 dirty_pages;
static struct tg_fbuf raw_stream;

static void rec(u8 kind, const void *p, u32 n)
{
	u8 len[4];
	st32(len, n);
	fputc(kind, stdout);
	fwrite(len, 1, 4, stdout);
	if (n)
		fwrite(p, 1, n, stdout);
}

void plat_line(const char *s, u32 n) { rec('S', s, n); }

u8 *plat_tx_alloc(void)
{
	if (tx_limit && tx_in_flight >= tx_limit)
		return NULL;
	/* Exactly TG_PKT_MAX bytes, so ASan sees any write past a tx buffer. Freed on submit. */
	return malloc(TG_PKT_MAX);
}

void plat_tx_submit(u8 *buf, u32 len)
{
	if (len > TG_PKT_MAX) {
		fprintf(stderr, "tx packet of %u bytes\n", len);
		abort();
	}
	rec('P', buf, len);
	free(buf);
	tx_in_flight++;
}

u64 plat_uptime_ms(void) { return uptime; }

void plat_reset(void) { rec('X', NULL, 0); }

void plat_disk_note(u64 count) { (void)count; }

static int emit_frame(void *ctx, const u8 *frame, u32 n)
{
	(void)ctx;
	rec('F', frame, n);
	return 0;
}

static void need(u32 n, u32 want, const char *what)
{
	if (n < want) {
		fprintf(stderr, "%s: payload of %u bytes, want %u\n", what, n, want);
		exit(2);
	}
}

static void command(u8 cmd, u8 *p, u32 n)
{
	struct tg_sink sink = {emit_frame, NULL};
	u8 word[4];
	switch (cmd) {
	case 'i': /* u64 cid, u32 dirty pages, u32 tx buffer limit (0: unlimited) */
		need(n, 16, "init");
		tg_vsock_init(ld64(p));
		dirty_pages = ld32(p + 8);
		tx_limit = ld32(p + 12);
		free(dirty);
		dirty = dirty_pages ? calloc(dirty_pages, TG_DIRTY_PAGE) : NULL;
		tg_dirty_setup(dirty, dirty_pages);
		break;
	case 'p': /* one received packet */
		tg_vsock_rx(p, n);
		tg_vsock_pump();
		break;
	case 'r': /* transport reset, u64 new cid */
		need(n, 8, "reset");
		tg_vsock_reset(ld64(p));
		break;
	case 'c': /* connect to u32 port */
		need(n, 4, "connect");
		st32(word, (u32)tg_vsock_connect(ld32(p)));
		rec('A', word, 4);
		tg_vsock_pump();
		break;
	case 't': /* the device completed every tx buffer */
		tx_in_flight = 0;
		tg_vsock_pump();
		break;
	case 'w': /* read the stamp word of dirty page u32 */
		need(n, 4, "read word");
		if (ld32(p) >= dirty_pages)
			exit(2);
		rec('W', dirty + (size_t)ld32(p) * TG_DIRTY_PAGE, 4);
		break;
	case 'W': /* u32 page, u32 value */
		need(n, 8, "write word");
		if (ld32(p) >= dirty_pages)
			exit(2);
		memcpy(dirty + (size_t)ld32(p) * TG_DIRTY_PAGE, p + 4, 4);
		break;
	case 'm': /* u32: 1 = echo harness, 0 = counter */
		need(n, 4, "mode");
		tg_set_echo((int)ld32(p));
		break;
	case 'u': /* u64 uptime in ms */
		need(n, 8, "uptime");
		uptime = ld64(p);
		break;
	case 'e': /* one Envelope, handled directly */
		st32(word, (u32)tg_handle_envelope(p, n, &sink));
		rec('A', word, 4);
		break;
	case 'f': /* stream bytes into one frame buffer outside vsock */
		if (!raw_stream.buf)
			raw_stream.buf = malloc(TG_FRAME_BUF);
		st32(word, (u32)tg_frames_feed(&raw_stream, p, n, &sink));
		if (ld32(word) != TG_KEEP)
			raw_stream.len = 0;
		rec('A', word, 4);
		break;
	case 'k': { /* parse a command line; answer with a summary */
		struct tg_cmdline cl;
		char out[512];
		int len = 0;
		tg_cmdline_parse((const char *)p, n, &cl);
		for (u32 i = 0; i < cl.ndev; i++)
			len += snprintf(out + len, sizeof out - (size_t)len, "dev %llx@%llx:%u;",
					(unsigned long long)cl.dev[i].size,
					(unsigned long long)cl.dev[i].base, cl.dev[i].irq);
		len += snprintf(out + len, sizeof out - (size_t)len,
				"connect %u;irqtest %u;echo %u;bad %u", cl.connect_port, cl.irqtest,
				cl.echo, cl.bad);
		rec('K', out, (u32)len);
		break;
	}
	default:
		fprintf(stderr, "unknown command %c\n", cmd);
		exit(2);
	}
}

int main(void)
{
	u8 hdr[5];
	while (fread(hdr, 1, 5, stdin) == 5) {
		u32 n = ld32(hdr + 1);
		/* An exact-size copy: reading one byte past the input trips ASan. The 'k' command
		 * gets no terminator, so the parser's length bound is what stops it. */
		u8 *p = malloc(n ? n : 1);
		if (n && fread(p, 1, n, stdin) != n)
			return 2;
		command(hdr[0], p, n);
		free(p);
		rec('.', NULL, 0);
		fflush(stdout);
	}
	return 0;
}
