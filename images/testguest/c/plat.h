/*
 * What the hardware-independent code (handlers, frame, vsock) needs from below. The guest
 * implements these in main.c/virtio.c/clock.c; the native test driver fakes them.
 */
#ifndef TG_PLAT_H
#define TG_PLAT_H

#include "tg.h"

/* Writes one line (a newline is appended) to the console. */
void plat_line(const char *s, u32 n);
/* A transmit buffer of TG_PKT_MAX bytes, or NULL while all are in flight. */
u8 *plat_tx_alloc(void);
/* Queues the first len bytes of a buffer from plat_tx_alloc as one packet. */
void plat_tx_submit(u8 *buf, u32 len);
/* Milliseconds since boot, 0 when unknown. */
u64 plat_uptime_ms(void);
/* Records the counter's value on the disk the guest checked at boot, if any (sector 2,
 * "count=<n>"), so the host can see which VM wrote what to its own disk. */
void plat_disk_note(u64 count);
/* Asks the VMM to stop the VM. Returns only where that is not possible (native build). */
void plat_reset(void);

#endif
