/*
 * A polled virtio-blk driver that runs one fixed sequence at boot and reports each result:
 *
 *   TESTGUEST DISK id=<serial> sector0=<text at the start of sector 0>
 *   TESTGUEST DISK capacity=<sectors> ro=<0|1> write=<st> flush=<st> readback=<OK|BAD> beyond=<st>
 *
 * It writes "testguest wrote <n>" (n from testguest.disk=<n>) to sector 1, flushes, reads it
 * back, and reads one sector past the end (the device must refuse: status 1). Statuses are
 * virtio-blk's: 0 OK, 1 IOERR, 2 UNSUPP; 255 means the device never answered.
 * Afterwards every counter turn writes "count=<n>" to sector 2 (plat_disk_note).
 * The disk's interrupt line stays masked: completions are seen by polling the used ring.
 */
#include "disk.h"
#include "plat.h"
#include "virtio_mmio.h"
#include "x86.h"


enum { T_IN = 0, T_OUT = 1, T_FLUSH = 4, T_GET_ID = 8 };
#define VIRTIO_ID_BLOCK 2
#define F_RO (1u << 5)
#define QSIZE 4
#define NO_ANSWER 255
#define POLL_LIMIT 50000000u

static u32 base;
static int ready;
/* Written before read (the queue set-up zeroes the ring headers), so left out of .bss. */
static u8 ring[3][4096] TG_BIG __attribute__((aligned(4096)));
static u8 header[16];
static u8 sector[512] TG_BIG __attribute__((aligned(512)));
static volatile u8 status_byte;
static u16 avail_idx, used_seen;

static u32 rd(u32 reg) { return mmio_read32(base + reg); }
static void wr(u32 reg, u32 v) { mmio_write32(base + reg, v); }

static void desc(u32 i, const volatile void *buf, u32 len, u16 flags, u16 next)
{
	u8 *d = ring[0] + i * 16;
	st64(d, (u32)(uintptr_t)buf);
	st32(d + 8, len);
	st16(d + 12, flags);
	st16(d + 14, next);
}

/* One request of header, an optional data buffer and the status byte; returns the status. */
static u32 request(u32 type, u64 at, u8 *data, u32 len, int device_writes)
{
	st32(header, type);
	st32(header + 4, 0);
	st64(header + 8, at);
	status_byte = NO_ANSWER;
	desc(0, header, 16, DESC_F_NEXT, 1);
	u16 last = 1;
	if (len) {
		desc(1, data, len, DESC_F_NEXT | (device_writes ? DESC_F_WRITE : 0), 2);
		last = 2;
	}
	desc(last, &status_byte, 1, DESC_F_WRITE, 0);
	st16(ring[1] + 4 + 2 * (avail_idx % QSIZE), 0);
	barrier();
	avail_idx++;
	*(volatile u16 *)(ring[1] + 2) = avail_idx;
	barrier();
	wr(R_QUEUE_NOTIFY, 0);
	for (u32 spin = 0; *(volatile u16 *)(ring[2] + 2) == used_seen; spin++)
		if (spin == POLL_LIMIT)
			return NO_ANSWER;
	used_seen++;
	wr(R_INTERRUPT_ACK, rd(R_INTERRUPT_STATUS));
	return status_byte;
}

/* Brings the device to DRIVER_OK with one queue; returns an error or 0. */
static const char *init(u32 *read_only)
{
	if (rd(R_VERSION) != 2)
		return "not virtio-mmio version 2";
	wr(R_STATUS, 0);
	wr(R_STATUS, S_ACKNOWLEDGE);
	wr(R_STATUS, S_ACKNOWLEDGE | S_DRIVER);
	wr(R_DEVICE_FEATURES_SEL, 0);
	u32 low = rd(R_DEVICE_FEATURES);
	*read_only = (low & F_RO) != 0;
	wr(R_DEVICE_FEATURES_SEL, 1);
	if (!(rd(R_DEVICE_FEATURES) & 1))
		return "no VIRTIO_F_VERSION_1";
	wr(R_DRIVER_FEATURES_SEL, 0);
	wr(R_DRIVER_FEATURES, low & F_RO);
	wr(R_DRIVER_FEATURES_SEL, 1);
	wr(R_DRIVER_FEATURES, 1);
	wr(R_STATUS, S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
	if (!(rd(R_STATUS) & S_FEATURES_OK))
		return "FEATURES_OK refused";
	wr(R_QUEUE_SEL, 0);
	if (rd(R_QUEUE_NUM_MAX) < QSIZE)
		return "queue too small";
	st32(ring[1], 0);
	st32(ring[2], 0);
	wr(R_QUEUE_NUM, QSIZE);
	wr(R_QUEUE_DESC_LOW, (u32)(uintptr_t)ring[0]);
	wr(R_QUEUE_DESC_HIGH, 0);
	wr(R_QUEUE_DRIVER_LOW, (u32)(uintptr_t)ring[1]);
	wr(R_QUEUE_DRIVER_HIGH, 0);
	wr(R_QUEUE_DEVICE_LOW, (u32)(uintptr_t)ring[2]);
	wr(R_QUEUE_DEVICE_HIGH, 0);
	wr(R_QUEUE_READY, 1);
	wr(R_STATUS, S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
	return 0;
}

/* Appends up to max printable bytes of s (stopping at the first other byte). */
static void line_text(struct tg_line *l, const u8 *s, u32 max)
{
	char text[40];
	u32 n = 0;
	while (n < max && n + 1 < sizeof text && s[n] >= 0x20 && s[n] < 0x7f) {
		text[n] = (char)s[n];
		n++;
	}
	text[n] = 0;
	line_str(l, text);
}

void disk_check(const struct tg_cmdline *cl)
{
	base = 0;
	for (u32 i = 0; i < cl->ndev && !base; i++) {
		const struct tg_mmio_dev *d = &cl->dev[i];
		if (d->base >> 32 || d->size < R_CONFIG + 8)
			continue;
		if (mmio_read32((u32)d->base + R_MAGIC) == 0x74726976 &&
		    mmio_read32((u32)d->base + R_DEVICE_ID) == VIRTIO_ID_BLOCK)
			base = (u32)d->base;
	}
	if (!base) {
		tg_log("DISK none among the virtio_mmio devices");
		return;
	}
	u32 read_only;
	const char *err = init(&read_only);
	if (err) {
		tg_error(err);
		return;
	}
	u64 capacity = rd(R_CONFIG) | (u64)rd(R_CONFIG + 4) << 32;
	ready = 1;

	struct tg_line l = {.len = 0};
	memset(sector, 0, 32);
	u32 st = request(T_GET_ID, 0, sector, 20, 1);
	line_str(&l, "TESTGUEST DISK id=");
	if (st == 0)
		line_text(&l, sector, 20);
	else
		line_u64(&l, st);
	st = request(T_IN, 0, sector, 512, 1);
	line_str(&l, " sector0=");
	if (st == 0)
		line_text(&l, sector, 32);
	else
		line_u64(&l, st);
	line_emit(&l);

	char text[32] = "testguest wrote ";
	u32 n = tg_strlen(text);
	n += tg_fmt_u64(text + n, cl->disk);
	memset(sector, 0, sizeof sector);
	memcpy(sector, text, n);
	u32 wrote = request(T_OUT, 1, sector, 512, 0);
	u32 flushed = request(T_FLUSH, 0, 0, 0, 0);
	memset(sector, 0, sizeof sector);
	u32 reread = request(T_IN, 1, sector, 512, 1);
	int same = reread == 0 && memcmp(sector, text, n) == 0;
	u32 beyond = request(T_IN, capacity, sector, 512, 1);

	l.len = 0;
	line_str(&l, "TESTGUEST DISK capacity=");
	line_u64(&l, capacity);
	line_str(&l, read_only ? " ro=1 write=" : " ro=0 write=");
	line_u64(&l, wrote);
	line_str(&l, " flush=");
	line_u64(&l, flushed);
	line_str(&l, same ? " readback=OK beyond=" : " readback=BAD beyond=");
	line_u64(&l, beyond);
	line_emit(&l);
}

void plat_disk_note(u64 count)
{
	if (!ready)
		return;
	char text[32] = "count=";
	u32 n = tg_strlen(text);
	n += tg_fmt_u64(text + n, count);
	memset(sector, 0, sizeof sector);
	memcpy(sector, text, n);
	u32 st = request(T_OUT, 2, sector, 512, 0);
	if (st)
		tg_error_n("disk note status", st);
}
