/* testguest.disk=<n>: a polled virtio-blk check run once at boot, for the VMM's disk tests. */
#ifndef TG_DISK_H
#define TG_DISK_H

#include "cmdline.h"

/* Finds the first virtio-blk device among the command line's virtio_mmio devices, runs the
 * check on it and prints what it found on the serial line ("TESTGUEST DISK ..."). */
void disk_check(const struct tg_cmdline *cl);

#endif
