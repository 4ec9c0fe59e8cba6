/* The kernel command line the VMM passes: virtio_mmio.device=... and testguest.* options. */
#ifndef TG_CMDLINE_H
#define TG_CMDLINE_H

#include "tg.h"

#define TG_MAX_MMIO 8

struct tg_mmio_dev {
	u64 size, base;
	u32 irq;
};

struct tg_cmdline {
	u32 ndev;
	struct tg_mmio_dev dev[TG_MAX_MMIO];
	u32 connect_port; /* testguest.connect=<port>; 0 = none */
	u32 irqtest;      /* testguest.irqtest: prove PIC interrupt delivery with the PIT */
	u32 echo;         /* testguest.echo: be the stateless echo harness, not the counter */
	u32 disk;         /* testguest.disk=<n>: check the first disk at boot, writing n; 0 = none */
	u32 bad;          /* options with a malformed value, ignored */
};

/* Parses at most max bytes of a NUL-terminated command line. */
void tg_cmdline_parse(const char *s, u32 max, struct tg_cmdline *out);

#endif
