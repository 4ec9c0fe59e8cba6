/* The virtio-mmio vsock device: transport, split virtqueues, and the glue to vsock.c. */
#ifndef TG_VIRTIO_H
#define TG_VIRTIO_H

#include "tg.h"

/* True if a virtio-mmio vsock device answers at base. */
int virtio_is_vsock(u64 base, u64 size);
/* Initialises the device at base; prints VSOCK or NOVSOCK. 0 on success. */
int virtio_vsock_init(u64 base, u64 size);
/* Handles everything the device has returned, refills rx, sends what is pending. */
void virtio_service(void);
/* True if the device has returned buffers since the last virtio_service. */
int virtio_pending(void);
/* Acknowledges the device's interrupt. */
void virtio_irq(void);

#endif
