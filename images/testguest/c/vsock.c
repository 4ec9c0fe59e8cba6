/*
 * vsock connections. Received data is consumed (moved into the frame buffer and handled) as
 * it arrives, so fwd_cnt always equals the bytes received and the advertised credit is never
 * stretched; what the guest sends waits in a per-connection ring until the peer has credit.
 */
#include "vsock.h"
#include "frame.h"
#include "plat.h"

enum { C_FREE, C_CONNECTING, C_OPEN, C_CLOSING };

struct conn {
	u8 state;
	u8 need_request;  /* we are connecting and have not sent REQUEST yet */
	u8 need_response; /* the peer's REQUEST is accepted, RESPONSE not sent yet */
	u8 need_credit;   /* send CREDIT_UPDATE */
	u32 lport, pport;
	/* Peer credit: we may have at most peer_buf_alloc bytes unconsumed by the peer. */
	u32 peer_buf_alloc, peer_fwd_cnt, tx_cnt;
	/* Our side: bytes consumed, and the value the peer last heard from us. */
	u32 fwd_cnt, fwd_reported;
	struct tg_fbuf in;
	u8 *out;
	u32 out_head, out_len;
};

static u64 my_cid;
static struct conn conns[TG_MAX_CONN];
static u8 in_bufs[TG_MAX_CONN][TG_FRAME_BUF] TG_BIG;
static u8 out_bufs[TG_MAX_CONN][TG_OUT_CAP] TG_BIG;
static u32 next_ephemeral;

/* RSTs owed to connections that no longer (or never did) exist here. */
static struct {
	u32 lport, pport;
} rst_q[16];
static u32 rst_n;

static void queue_rst(u32 lport, u32 pport)
{
	if (rst_n == TG_LEN(rst_q)) {
		tg_error("vsock rst queue full");
		return;
	}
	rst_q[rst_n].lport = lport;
	rst_q[rst_n].pport = pport;
	rst_n++;
}

/* A new connection on a port pair must not get the RST still owed to its predecessor. */
static void drop_queued_rst(u32 lport, u32 pport)
{
	u32 kept = 0;
	for (u32 i = 0; i < rst_n; i++)
		if (rst_q[i].lport != lport || rst_q[i].pport != pport)
			rst_q[kept++] = rst_q[i];
	rst_n = kept;
}

/* Bit i set: conns[i] is in use. Every packet and every pump looks connections up, and
 * under PVM's emulator a scan of all of them costs more than the packet itself. */
static u32 live;
_Static_assert(TG_MAX_CONN <= 32, "one bit per connection in `live`");

static u32 conn_index(const struct conn *c)
{
	return (u32)(c - conns);
}

/* The next connection in use from `*m` (cleared from it), or 0. */
static struct conn *next_live(u32 *m)
{
	if (!*m)
		return 0;
	u32 i = (u32)__builtin_ctz(*m);
	*m &= *m - 1;
	return &conns[i];
}

static void conn_free(struct conn *c)
{
	c->state = C_FREE;
	live &= ~(1u << conn_index(c));
}

/* Forgets the connection now; the peer hears RST as soon as a tx buffer is free. */
static void conn_reset(struct conn *c)
{
	queue_rst(c->lport, c->pport);
	conn_free(c);
}

static struct conn *conn_new(u32 lport, u32 pport)
{
	for (u32 i = 0; i < TG_MAX_CONN; i++) {
		struct conn *c = &conns[i];
		if (c->state != C_FREE)
			continue;
		memset(c, 0, sizeof *c);
		live |= 1u << i;
		c->lport = lport;
		c->pport = pport;
		c->in.buf = in_bufs[i];
		c->out = out_bufs[i];
		return c;
	}
	return 0;
}

static struct conn *conn_find(u32 lport, u32 pport)
{
	u32 m = live;
	for (struct conn *c; (c = next_live(&m));)
		if (c->lport == lport && c->pport == pport)
			return c;
	return 0;
}

void tg_vsock_init(u64 cid)
{
	tg_vsock_reset(cid);
}

void tg_vsock_reset(u64 cid)
{
	my_cid = cid;
	for (u32 i = 0; i < TG_MAX_CONN; i++)
		conn_free(&conns[i]);
	live = 0;
	rst_n = 0;
}

int tg_vsock_connect(u32 port)
{
	u32 lport = TG_EPHEMERAL_PORT + (next_ephemeral++ & 0x3fff);
	struct conn *c = conn_new(lport, port);
	if (!c)
		return -1;
	c->state = C_CONNECTING;
	c->need_request = 1;
	return 0;
}

static int sink_emit(void *ctx, const u8 *frame, u32 n)
{
	struct conn *c = ctx;
	if (n > TG_OUT_CAP - c->out_len)
		return -1;
	u32 tail = (c->out_head + c->out_len) % TG_OUT_CAP;
	u32 first = TG_MIN(n, TG_OUT_CAP - tail);
	memcpy(c->out + tail, frame, first);
	memcpy(c->out, frame + first, n - first);
	c->out_len += n;
	return 0;
}

/* Applies a connection's verdict after it handled input. */
static void conn_verdict(struct conn *c, int r)
{
	if (r == TG_CLOSE) {
		c->state = C_CLOSING;
	} else if (r == TG_ABORT) {
		tg_error("vsock reply queue full");
		conn_reset(c);
	}
}

static void on_data(struct conn *c, const u8 *p, u32 n)
{
	if (c->state != C_OPEN)
		return; /* closing: the rest of the stream is not read */
	struct tg_sink sink = {sink_emit, c};
	int r = tg_frames_feed(&c->in, p, n, &sink);
	c->fwd_cnt += n;
	if (c->fwd_cnt - c->fwd_reported >= TG_BUF_ALLOC / 2)
		c->need_credit = 1;
	conn_verdict(c, r);
}

void tg_vsock_rx(const u8 *pkt, u32 len)
{
	if (len < TG_HDR_LEN) {
		tg_error_n("vsock short packet", len);
		return;
	}
	u64 src_cid = ld64(pkt), dst_cid = ld64(pkt + 8);
	u32 sport = ld32(pkt + 16), dport = ld32(pkt + 20), plen = ld32(pkt + 24);
	u16 type = ld16(pkt + 28), op = ld16(pkt + 30);
	if (src_cid != TG_HOST_CID) {
		tg_error_n("vsock packet from cid", src_cid);
		return;
	}
	if (dst_cid != my_cid) {
		tg_error_n("vsock packet for cid", dst_cid);
		return;
	}
	struct conn *c = conn_find(dport, sport);
	if (op == VSOCK_OP_RST) {
		if (c && c->state == C_CONNECTING)
			tg_error_n("vsock connect refused, port", c->pport);
		if (c)
			conn_free(c);
		return;
	}
	if (type != 1 /* STREAM */ || plen > len - TG_HDR_LEN) {
		tg_error_n("vsock malformed packet op", op);
		if (c)
			conn_reset(c);
		else
			queue_rst(dport, sport);
		return;
	}
	if (!c) {
		if (op != VSOCK_OP_REQUEST || dport != TG_VSOCK_PORT) {
			queue_rst(dport, sport);
			return;
		}
		c = conn_new(dport, sport);
		if (!c) {
			tg_error("vsock too many connections");
			queue_rst(dport, sport);
			return;
		}
		drop_queued_rst(dport, sport);
		c->state = C_OPEN;
		c->need_response = 1;
	}
	c->peer_buf_alloc = ld32(pkt + 36);
	c->peer_fwd_cnt = ld32(pkt + 40);
	switch (op) {
	case VSOCK_OP_REQUEST:
		if (!c->need_response) /* a second REQUEST on an existing connection */
			conn_reset(c);
		break;
	case VSOCK_OP_RESPONSE:
		if (c->state != C_CONNECTING || c->need_request) {
			conn_reset(c);
			break;
		}
		c->state = C_OPEN;
		{
			struct tg_sink sink = {sink_emit, c};
			conn_verdict(c, tg_send_ready(&sink, 0));
		}
		break;
	case VSOCK_OP_RW:
		if (c->state == C_CONNECTING)
			conn_reset(c);
		else
			on_data(c, pkt + TG_HDR_LEN, plen);
		break;
	case VSOCK_OP_CREDIT_UPDATE:
		break;
	case VSOCK_OP_CREDIT_REQUEST:
		c->need_credit = 1;
		break;
	case VSOCK_OP_SHUTDOWN:
	default:
		conn_reset(c);
		break;
	}
}

/* Sends one packet; 0 if no tx buffer is free. */
static int send_pkt(struct conn *c, u32 lport, u32 pport, u16 op, const u8 *ring, u32 head,
		    u32 n)
{
	u8 *b = plat_tx_alloc();
	if (!b)
		return 0;
	st64(b, my_cid);
	st64(b + 8, TG_HOST_CID);
	st32(b + 16, lport);
	st32(b + 20, pport);
	st32(b + 24, n);
	st16(b + 28, 1);
	st16(b + 30, op);
	st32(b + 32, 0);
	st32(b + 36, c ? TG_BUF_ALLOC : 0);
	st32(b + 40, c ? c->fwd_cnt : 0);
	if (n) {
		u32 first = TG_MIN(n, TG_OUT_CAP - head);
		memcpy(b + TG_HDR_LEN, ring + head, first);
		memcpy(b + TG_HDR_LEN + first, ring, n - first);
	}
	if (c) {
		c->fwd_reported = c->fwd_cnt;
		c->need_credit = 0;
	}
	plat_tx_submit(b, TG_HDR_LEN + n);
	return 1;
}

static int ctl(struct conn *c, u16 op)
{
	return send_pkt(c, c->lport, c->pport, op, 0, 0, 0);
}

/* Sends what this connection owes; 0 when tx buffers ran out. */
static int pump_conn(struct conn *c)
{
	if (c->need_request) {
		if (!ctl(c, VSOCK_OP_REQUEST))
			return 0;
		c->need_request = 0;
	}
	if (c->need_response) {
		if (!ctl(c, VSOCK_OP_RESPONSE))
			return 0;
		c->need_response = 0;
	}
	while (c->out_len && c->state != C_CONNECTING) {
		u32 unacked = c->tx_cnt - c->peer_fwd_cnt;
		u32 credit = unacked > c->peer_buf_alloc ? 0 : c->peer_buf_alloc - unacked;
		u32 n = TG_MIN(TG_MIN(c->out_len, credit), (u32)(TG_PKT_MAX - TG_HDR_LEN));
		if (!n)
			break; /* the rest goes when the peer's next CREDIT_UPDATE arrives */
		if (!send_pkt(c, c->lport, c->pport, VSOCK_OP_RW, c->out, c->out_head, n))
			return 0;
		c->tx_cnt += n;
		c->out_head = (c->out_head + n) % TG_OUT_CAP;
		c->out_len -= n;
	}
	if (c->need_credit && !ctl(c, VSOCK_OP_CREDIT_UPDATE))
		return 0;
	if (c->state == C_CLOSING && !c->out_len)
		conn_reset(c);
	return 1;
}

void tg_vsock_pump(void)
{
	/* Connections first: a reset conn queues its RST, which goes out below. The starting
	 * point rotates so one busy connection cannot keep the tx buffers from the others. */
	static u32 start;
	u32 from = start++ % TG_MAX_CONN;
	/* Those at `from` and above, then those below it. */
	u32 rounds[2] = {live & (~0u << from), live & ((1u << from) - 1)};
	for (u32 r = 0; r < 2; r++) {
		u32 m = rounds[r];
		for (struct conn *c; (c = next_live(&m));)
			if (!pump_conn(c))
				goto pumped;
	}
pumped:
	u32 sent = 0;
	while (sent < rst_n && send_pkt(0, rst_q[sent].lport, rst_q[sent].pport, VSOCK_OP_RST, 0,
					0, 0))
		sent++;
	if (sent) {
		memmove(rst_q, rst_q + sent, (rst_n - sent) * sizeof rst_q[0]);
		rst_n -= sent;
	}
}
