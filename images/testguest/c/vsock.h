/*
 * virtio-vsock stream connections over packets: the state machine and credit accounting,
 * with no knowledge of virtqueues (packets come in through tg_vsock_rx and leave through
 * plat_tx_alloc/plat_tx_submit).
 */
#ifndef TG_VSOCK_H
#define TG_VSOCK_H

#include "tg.h"

#define TG_VSOCK_PORT 1024
#define TG_HOST_CID 2
#define TG_MAX_CONN 16
#define TG_PKT_MAX 4096 /* one rx or tx buffer: header and payload together */
#define TG_HDR_LEN 44
#define TG_BUF_ALLOC (64u * 1024) /* receive credit advertised per connection */
#define TG_OUT_CAP (32u * 1024)   /* replies queued per connection while out of credit */
#define TG_EPHEMERAL_PORT 49152

enum {
	VSOCK_OP_REQUEST = 1,
	VSOCK_OP_RESPONSE = 2,
	VSOCK_OP_RST = 3,
	VSOCK_OP_SHUTDOWN = 4,
	VSOCK_OP_RW = 5,
	VSOCK_OP_CREDIT_UPDATE = 6,
	VSOCK_OP_CREDIT_REQUEST = 7,
};

void tg_vsock_init(u64 cid);
/* TRANSPORT_RESET: every connection is gone; the CID may have changed. */
void tg_vsock_reset(u64 cid);
/* One received packet (header and payload) of len bytes. */
void tg_vsock_rx(const u8 *pkt, u32 len);
/* Opens a connection to the host's port; -1 if no slot is free. */
int tg_vsock_connect(u32 port);
/* Sends whatever is pending, as far as tx buffers and peer credit allow. */
void tg_vsock_pump(void);

#endif
