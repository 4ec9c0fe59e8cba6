//! Ethernet frames for the tests, built byte by byte the way a network stack would send
//! them (checksums left zero: nothing on the device's path reads them).

use std::net::Ipv4Addr;

pub const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x01];
pub const BROADCAST: [u8; 6] = [0xff; 6];
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;

pub fn ethernet(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(14 + payload.len());
    frame.extend_from_slice(&dst);
    frame.extend_from_slice(&src);
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// An ARP packet: operation 1 (request) or 2 (reply).
pub fn arp(op: u16, sender: ([u8; 6], Ipv4Addr), target: ([u8; 6], Ipv4Addr)) -> Vec<u8> {
    let mut p = vec![0, 1, 0x08, 0x00, 6, 4];
    p.extend_from_slice(&op.to_be_bytes());
    p.extend_from_slice(&sender.0);
    p.extend_from_slice(&sender.1.octets());
    p.extend_from_slice(&target.0);
    p.extend_from_slice(&target.1.octets());
    p
}

/// An IPv4 packet with a 20-byte header; `fragment` is the flags-and-offset word.
pub fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, fragment: u16, payload: &[u8]) -> Vec<u8> {
    let total = (20 + payload.len()) as u16;
    let mut p = vec![0x45, 0];
    p.extend_from_slice(&total.to_be_bytes());
    p.extend_from_slice(&[0x12, 0x34]);
    p.extend_from_slice(&fragment.to_be_bytes());
    p.extend_from_slice(&[64, protocol, 0, 0]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(payload);
    p
}

/// A TCP or UDP header (8 bytes are enough for the filter) and a payload.
pub fn transport(src_port: u16, dst_port: u16, payload: &[u8]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src_port.to_be_bytes());
    p.extend_from_slice(&dst_port.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    p.extend_from_slice(payload);
    p
}

pub fn icmp(kind: u8, id: u16) -> Vec<u8> {
    let mut p = vec![kind, 0, 0, 0];
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&[0, 1]);
    p.extend_from_slice(b"ping data");
    p
}

/// The guest sending `protocol` (TCP/UDP) from `src_port` to `dst`:`dst_port`.
pub fn guest_sends(protocol: u8, src_port: u16, dst: Ipv4Addr, dst_port: u16) -> Vec<u8> {
    let l4 = transport(src_port, dst_port, b"hello");
    ethernet(
        GATEWAY_MAC,
        GUEST_MAC,
        0x0800,
        &ipv4(GUEST_IP, dst, protocol, 0, &l4),
    )
}

/// `src`:`src_port` sending `protocol` to the guest's `dst_port`.
pub fn guest_receives(protocol: u8, src: Ipv4Addr, src_port: u16, dst_port: u16) -> Vec<u8> {
    let l4 = transport(src_port, dst_port, b"reply");
    ethernet(
        GUEST_MAC,
        GATEWAY_MAC,
        0x0800,
        &ipv4(src, GUEST_IP, protocol, 0, &l4),
    )
}

/// xorshift64: reproducible noise without a dependency; a failure names its round.
pub struct Noise(pub u64);

impl Noise {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}
