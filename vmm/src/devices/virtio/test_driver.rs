//! A hand-written split-ring "driver" for device tests: it lays out virtqueues in simulated
//! guest RAM, publishes descriptor chains (well-formed and hostile) and reads back what the
//! device used, as a guest kernel would.

use vm_memory::{Bytes, GuestAddress};

use crate::kvm::memory::GuestMemoryMmap;

use super::VirtioDevice;
use super::mmio::VirtioMmio;
use super::status;
use crate::devices::bus::BusDevice;

pub const QUEUE_SIZE: u16 = 64;
pub const DESC_NEXT: u16 = 1;
pub const DESC_WRITE: u16 = 2;

/// A split virtqueue as a guest driver sees it.
pub struct GuestQueue {
    desc: u64,
    avail: u64,
    used: u64,
    pub next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

impl GuestQueue {
    pub fn new(base: u64) -> Self {
        Self {
            desc: base,
            avail: base + 16 * u64::from(QUEUE_SIZE),
            used: base + 0x2000,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    fn write_desc(mem: &GuestMemoryMmap, at: u64, addr: u64, len: u32, flags: u16, next: u16) {
        mem.write_obj(addr, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        mem.write_obj(next, GuestAddress(at + 14)).unwrap();
    }

    /// Writes descriptors verbatim (index, addr, len, flags, next) and makes `head` available.
    pub fn push_raw(
        &mut self,
        mem: &GuestMemoryMmap,
        descs: &[(u16, u64, u32, u16, u16)],
        head: u16,
    ) {
        for &(index, addr, len, flags, next) in descs {
            Self::write_desc(
                mem,
                self.desc + 16 * u64::from(index),
                addr,
                len,
                flags,
                next,
            );
        }
        self.publish(mem, head);
    }

    /// A well-formed chain of (addr, len, device-writable) buffers.
    pub fn push_chain(&mut self, mem: &GuestMemoryMmap, buffers: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in buffers.iter().enumerate() {
            let index = self.next_desc;
            self.next_desc = (self.next_desc + 1) % QUEUE_SIZE;
            let mut flags = if writable { DESC_WRITE } else { 0 };
            if i + 1 < buffers.len() {
                flags |= DESC_NEXT;
            }
            Self::write_desc(
                mem,
                self.desc + 16 * u64::from(index),
                addr,
                len,
                flags,
                self.next_desc,
            );
        }
        self.publish(mem, head);
        head
    }

    fn publish(&mut self, mem: &GuestMemoryMmap, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % QUEUE_SIZE);
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    /// Chains made available that the device has not returned yet (as far as `take_used`
    /// has seen).
    pub fn outstanding(&self) -> u16 {
        self.avail_idx.wrapping_sub(self.used_seen)
    }

    /// Used entries (id, len) the device returned since the last call.
    pub fn take_used(&mut self, mem: &GuestMemoryMmap) -> Vec<(u32, u32)> {
        let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let at = self.used + 4 + 8 * u64::from(self.used_seen % QUEUE_SIZE);
            let id: u32 = mem.read_obj(GuestAddress(at)).unwrap();
            let len: u32 = mem.read_obj(GuestAddress(at + 4)).unwrap();
            out.push((id, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }
}

/// Takes `t` through feature negotiation to DRIVER_OK with `queues`, acking the low feature
/// word and `high_features` (bit 0 of the high word is VIRTIO_F_VERSION_1).
pub fn bring_up<D: VirtioDevice>(t: &mut VirtioMmio<D>, queues: &[GuestQueue], high_features: u32) {
    bring_up_with(t, queues, 0, high_features)
}

/// As [`bring_up`], acking `low_features` too.
pub fn bring_up_with<D: VirtioDevice>(
    t: &mut VirtioMmio<D>,
    queues: &[GuestQueue],
    low_features: u32,
    high_features: u32,
) {
    let w = |t: &mut VirtioMmio<D>, offset: u64, value: u32| t.write(offset, &value.to_le_bytes());
    w(t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    w(t, 0x24, 0);
    w(t, 0x20, low_features);
    w(t, 0x24, 1);
    w(t, 0x20, high_features);
    w(
        t,
        0x70,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    );
    for (i, q) in queues.iter().enumerate() {
        w(t, 0x30, i as u32);
        w(t, 0x38, u32::from(QUEUE_SIZE));
        w(t, 0x80, q.desc as u32);
        w(t, 0x90, q.avail as u32);
        w(t, 0xa0, q.used as u32);
        w(t, 0x44, 1);
    }
    w(t, 0x70, 0xf);
}
