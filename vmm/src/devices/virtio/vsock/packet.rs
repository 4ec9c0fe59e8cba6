//! The virtio-vsock packet header (virtio 1.2 §5.10.6), little-endian on the wire.

pub const HEADER_LEN: usize = 44;

pub const TYPE_STREAM: u16 = 1;

pub mod op {
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;
}

/// SHUTDOWN flags: the sender will receive / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// The host's CID as the guest sees it.
pub const HOST_CID: u64 = 2;

/// The event queue's only event: all connections are gone (sent at snapshot).
pub const EVENT_TRANSPORT_RESET: u32 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub kind: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn parse(bytes: &[u8; HEADER_LEN]) -> Self {
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap_or_default());
        let u16_at = |i: usize| u16::from_le_bytes(bytes[i..i + 2].try_into().unwrap_or_default());
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            kind: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        out[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        out[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        out[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        out[24..28].copy_from_slice(&self.len.to_le_bytes());
        out[28..30].copy_from_slice(&self.kind.to_le_bytes());
        out[30..32].copy_from_slice(&self.op.to_le_bytes());
        out[32..36].copy_from_slice(&self.flags.to_le_bytes());
        out[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        out[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        out
    }

    /// A reply header: source and destination swapped.
    pub fn reply(&self, op: u16) -> Self {
        Self {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            kind: TYPE_STREAM,
            op,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_field_offsets() {
        let header = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 0x1234,
            dst_port: 1024,
            len: 77,
            kind: TYPE_STREAM,
            op: op::RW,
            flags: SHUTDOWN_SEND,
            buf_alloc: 65536,
            fwd_cnt: 9,
        };
        let bytes = header.to_bytes();
        assert_eq!(&bytes[0..8], &3u64.to_le_bytes());
        assert_eq!(&bytes[24..28], &77u32.to_le_bytes());
        assert_eq!(&bytes[30..32], &op::RW.to_le_bytes());
        assert_eq!(Header::parse(&bytes), header);
        let reply = header.reply(op::RST);
        assert_eq!((reply.src_cid, reply.dst_port, reply.len), (2, 0x1234, 0));
    }
}
