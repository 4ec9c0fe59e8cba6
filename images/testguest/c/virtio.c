/*
 * virtio-mmio (version 2) transport and split virtqueues for the vsock device. Each rx/tx
 * descriptor owns one fixed 4 KiB buffer (header and payload together), so a descriptor id
 * is also a buffer index. Everything the device hands back is checked before use.
 */
#include "virtio.h"
#include "virtio_mmio.h"
#include "plat.h"
#include "vsock.h"
#include "x86.h"


enum { Q_RX, Q_TX, Q_EVENT, NQ };

#define QMAX 64
#define EVQ_MAX 8
#define RX_POSTED 16
#define VIRTIO_ID_VSOCK 19
#define EVENT_TRANSPORT_RESET 0

struct vq {
	u32 size; /* a power of two, <= QMAX */
	u16 avail_idx, used_seen;
	u8 *desc, *avail;
	const volatile u8 *used;
	u8 busy[QMAX]; /* owned by the device */
	u8 kick;       /* buffers added since the last notify */
};

static u32 mmio;
static int live;
static struct vq vqs[NQ];
/* desc table, avail ring, used ring: a page each, per queue. */
static u8 rings[NQ][3][4096] TG_BIG __attribute__((aligned(4096)));
static u8 rx_bufs[QMAX][TG_PKT_MAX] TG_BIG __attribute__((aligned(4096)));
static u8 tx_bufs[QMAX][TG_PKT_MAX] TG_BIG __attribute__((aligned(4096)));
static u8 ev_bufs[EVQ_MAX][4];
static u8 tx_free[QMAX];
static u32 tx_nfree;

static u32 rd(u32 reg) { return mmio_read32(mmio + reg); }
static void wr(u32 reg, u32 v) { mmio_write32(mmio + reg, v); }

static void vq_add(struct vq *q, u32 id, const void *buf, u32 len, u16 flags)
{
	u8 *d = q->desc + id * 16;
	st64(d, (u32)(uintptr_t)buf);
	st32(d + 8, len);
	st16(d + 12, flags);
	st16(d + 14, 0);
	st16(q->avail + 4 + 2 * (q->avail_idx & (q->size - 1)), (u16)id);
	q->busy[id] = 1;
	q->kick = 1;
	barrier(); /* the device must see the descriptor before the index */
	*(volatile u16 *)(q->avail + 2) = ++q->avail_idx;
}

static u16 used_idx(const struct vq *q) { return *(const volatile u16 *)(q->used + 2); }

/* Hands each buffer the device returned to fn, after checking id and length. */
static void vq_reap(struct vq *q, u32 max_len, void (*fn)(u32 id, u32 len))
{
	u16 idx = used_idx(q);
	barrier(); /* read the entries only after the index that covers them */
	if ((u16)(idx - q->used_seen) > q->size) {
		tg_error_n("virtio used index jumped, queue", (u64)(q - vqs));
		q->used_seen = idx;
		return;
	}
	while (q->used_seen != idx) {
		const volatile u8 *e = q->used + 4 + 8 * (q->used_seen & (q->size - 1));
		u32 id = *(const volatile u32 *)e, len = *(const volatile u32 *)(e + 4);
		q->used_seen++;
		if (id >= q->size || !q->busy[id]) {
			tg_error_n("virtio bad used id", id);
			continue;
		}
		q->busy[id] = 0;
		if (len > max_len) {
			tg_error_n("virtio used len", len);
			len = 0; /* the buffer is returned to its owner unread */
		}
		fn(id, len);
	}
}

static void tx_done(u32 id, u32 len)
{
	(void)len;
	tx_free[tx_nfree++] = (u8)id;
}

static void rx_done(u32 id, u32 len)
{
	if (len)
		tg_vsock_rx(rx_bufs[id], len);
	vq_add(&vqs[Q_RX], id, rx_bufs[id], TG_PKT_MAX, DESC_F_WRITE);
}

static u64 read_cid(void)
{
	u32 gen, lo, hi, tries = 0;
	do {
		gen = rd(R_CONFIG_GENERATION);
		lo = rd(R_CONFIG);
		hi = rd(R_CONFIG + 4);
	} while (gen != rd(R_CONFIG_GENERATION) && ++tries < 16);
	return (u64)hi << 32 | lo;
}

static void print_cid(const char *what, u64 cid)
{
	struct tg_line l = {.len = 0};
	line_str(&l, what);
	line_u64(&l, cid);
	line_emit(&l);
}

static void event_done(u32 id, u32 len)
{
	if (len >= 4 && ld32(ev_bufs[id]) == EVENT_TRANSPORT_RESET) {
		u64 cid = read_cid();
		tg_vsock_reset(cid);
		print_cid("TESTGUEST VSOCK RESET cid=", cid);
	}
	vq_add(&vqs[Q_EVENT], id, ev_bufs[id], 4, DESC_F_WRITE);
}

u8 *plat_tx_alloc(void)
{
	return tx_nfree ? tx_bufs[tx_free[tx_nfree - 1]] : 0;
}

void plat_tx_submit(u8 *buf, u32 len)
{
	u32 id = (u32)(buf - tx_bufs[0]) / TG_PKT_MAX;
	/* buf must be the one plat_tx_alloc just returned: the top of the free stack. */
	if (!tx_nfree || tx_free[tx_nfree - 1] != id || len > TG_PKT_MAX) {
		tg_error("virtio tx buffer misuse");
		return;
	}
	tx_nfree--;
	vq_add(&vqs[Q_TX], id, buf, len, 0);
}

static const char *vq_setup(u32 qi, u32 want)
{
	struct vq *q = &vqs[qi];
	wr(R_QUEUE_SEL, qi);
	if (rd(R_QUEUE_READY))
		return "queue already live";
	u32 max = rd(R_QUEUE_NUM_MAX);
	if (!max)
		return "queue missing";
	q->size = 1;
	while (q->size * 2 <= TG_MIN(max, want))
		q->size *= 2;
	q->desc = rings[qi][0];
	q->avail = rings[qi][1];
	q->used = rings[qi][2];
	q->avail_idx = q->used_seen = 0;
	/* Only the ring headers need to start at zero: neither side reads an entry before the
	 * index that covers it. Clearing whole pages costs milliseconds under PVM's emulator. */
	st32(q->avail, 0);
	st32(rings[qi][2], 0);
	memset(q->busy, 0, sizeof q->busy);
	wr(R_QUEUE_NUM, q->size);
	wr(R_QUEUE_DESC_LOW, (u32)(uintptr_t)q->desc);
	wr(R_QUEUE_DESC_HIGH, 0);
	wr(R_QUEUE_DRIVER_LOW, (u32)(uintptr_t)q->avail);
	wr(R_QUEUE_DRIVER_HIGH, 0);
	wr(R_QUEUE_DEVICE_LOW, (u32)(uintptr_t)q->used);
	wr(R_QUEUE_DEVICE_HIGH, 0);
	wr(R_QUEUE_READY, 1);
	return 0;
}

static const char *check_window(u64 base, u64 size)
{
	if (base >> 32 || base + size > 0xffffffffull)
		return "device above 4 GiB";
	if (size < R_CONFIG + 8)
		return "device window too small";
	return 0;
}

int virtio_is_vsock(u64 base, u64 size)
{
	if (check_window(base, size))
		return 0;
	mmio = (u32)base;
	return rd(R_MAGIC) == 0x74726976 && rd(R_DEVICE_ID) == VIRTIO_ID_VSOCK;
}

static const char *init(void)
{
	if (rd(R_VERSION) != 2)
		return "not virtio-mmio version 2";
	wr(R_STATUS, 0);
	for (u32 i = 0; rd(R_STATUS) && i < 1000; i++)
		;
	wr(R_STATUS, S_ACKNOWLEDGE);
	wr(R_STATUS, S_ACKNOWLEDGE | S_DRIVER);
	wr(R_DEVICE_FEATURES_SEL, 1);
	if (!(rd(R_DEVICE_FEATURES) & 1))
		return "no VIRTIO_F_VERSION_1";
	/* Only VERSION_1: stream sockets need no feature bit, nothing else is wanted. */
	wr(R_DRIVER_FEATURES_SEL, 0);
	wr(R_DRIVER_FEATURES, 0);
	wr(R_DRIVER_FEATURES_SEL, 1);
	wr(R_DRIVER_FEATURES, 1);
	wr(R_STATUS, S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
	if (!(rd(R_STATUS) & S_FEATURES_OK))
		return "FEATURES_OK refused";
	const char *err;
	if ((err = vq_setup(Q_RX, QMAX)) || (err = vq_setup(Q_TX, QMAX)) ||
	    (err = vq_setup(Q_EVENT, EVQ_MAX)))
		return err;

	u64 cid = read_cid();
	if (cid <= TG_HOST_CID || cid >= 0xffffffffu)
		return "invalid guest cid";
	tg_vsock_init(cid);
	/* A few receive buffers are plenty for frame traffic, and each one posted is boot time. */
	for (u32 i = 0; i < TG_MIN(vqs[Q_RX].size, RX_POSTED); i++)
		vq_add(&vqs[Q_RX], i, rx_bufs[i], TG_PKT_MAX, DESC_F_WRITE);
	for (u32 i = 0; i < vqs[Q_EVENT].size; i++)
		vq_add(&vqs[Q_EVENT], i, ev_bufs[i], 4, DESC_F_WRITE);
	for (tx_nfree = 0; tx_nfree < vqs[Q_TX].size; tx_nfree++)
		tx_free[tx_nfree] = (u8)tx_nfree;
	wr(R_STATUS, S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
	print_cid("TESTGUEST VSOCK cid=", cid);
	return 0;
}

int virtio_vsock_init(u64 base, u64 size)
{
	const char *err = check_window(base, size);
	if (!err) {
		mmio = (u32)base;
		err = init();
		if (err)
			wr(R_STATUS, rd(R_STATUS) | S_FAILED);
	}
	if (err) {
		struct tg_line l = {.len = 0};
		line_str(&l, "TESTGUEST NOVSOCK ");
		line_str(&l, err);
		line_emit(&l);
		return -1;
	}
	live = 1;
	virtio_service(); /* notifies the device of the posted buffers */
	return 0;
}

int virtio_pending(void)
{
	if (!live)
		return 0;
	for (u32 i = 0; i < NQ; i++)
		if (used_idx(&vqs[i]) != vqs[i].used_seen)
			return 1;
	return 0;
}

void virtio_irq(void)
{
	if (!live)
		return;
	u32 status = rd(R_INTERRUPT_STATUS);
	if (status)
		wr(R_INTERRUPT_ACK, status);
}

void virtio_service(void)
{
	if (!live)
		return;
	vq_reap(&vqs[Q_TX], TG_PKT_MAX, tx_done);
	vq_reap(&vqs[Q_EVENT], 4, event_done);
	vq_reap(&vqs[Q_RX], TG_PKT_MAX, rx_done);
	tg_vsock_pump();
	for (u32 i = 0; i < NQ; i++) {
		if (vqs[i].kick) {
			vqs[i].kick = 0;
			wr(R_QUEUE_NOTIFY, i);
		}
	}
}
