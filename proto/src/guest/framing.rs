//! Length-delimited framing: each frame is a protobuf varint length, then that many bytes of
//! one `Envelope`. The decoder is incremental (feed bytes as they arrive, take whole frames)
//! so it works over any byte stream, and it bounds every frame: a peer cannot make us buffer
//! more than `max_frame` bytes or spin on a malformed length.

use prost::Message;

use super::v1::Envelope;

/// Default upper bound of one frame. A harness `Start` carries the whole history, so this is
/// generous; the transport may choose a smaller one.
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// The longest valid varint for a u64 length.
const MAX_VARINT_LEN: usize = 10;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame length {len} exceeds the limit of {max} bytes")]
    TooLarge { len: u64, max: usize },
    #[error("frame length prefix is not a valid varint")]
    BadLength,
    #[error("frame body does not decode as agentvm.guest.v1.Envelope: {0}")]
    Decode(String),
}

/// Appends one encoded frame to `out`.
pub fn encode_frame(envelope: &Envelope, out: &mut Vec<u8>) {
    let len = envelope.encoded_len();
    out.reserve(len + MAX_VARINT_LEN);
    // Writing the varint and the body by hand avoids the (infallible for Vec) error path.
    let mut n = len as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
    envelope.encode_raw(out);
}

/// Encodes one frame into a fresh buffer.
pub fn frame_bytes(envelope: &Envelope) -> Vec<u8> {
    let mut out = Vec::new();
    encode_frame(envelope, &mut out);
    out
}

/// Incremental frame decoder.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    max_frame: usize,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME)
    }
}

impl FrameDecoder {
    pub fn new(max_frame: usize) -> Self {
        Self {
            buf: Vec::new(),
            max_frame,
        }
    }

    /// Adds bytes read from the stream.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that do not yet form a whole frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Takes the next whole frame, `Ok(None)` when more bytes are needed. After an error the
    /// stream is out of sync and must be dropped.
    pub fn next_frame(&mut self) -> Result<Option<Envelope>, FrameError> {
        let Some((len, prefix)) = read_varint(&self.buf)? else {
            return Ok(None);
        };
        if len > self.max_frame as u64 {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame,
            });
        }
        let len = len as usize;
        if self.buf.len() < prefix + len {
            return Ok(None);
        }
        let result = Envelope::decode(&self.buf[prefix..prefix + len])
            .map_err(|e| FrameError::Decode(e.to_string()));
        self.buf.drain(..prefix + len);
        result.map(Some)
    }
}

/// Reads a varint from the front of `buf`: `Ok(None)` if incomplete, otherwise the value and
/// the number of bytes it took.
fn read_varint(buf: &[u8]) -> Result<Option<(u64, usize)>, FrameError> {
    let mut value: u64 = 0;
    for (i, &b) in buf.iter().enumerate().take(MAX_VARINT_LEN) {
        if i == MAX_VARINT_LEN - 1 && b > 1 {
            return Err(FrameError::BadLength);
        }
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some((value, i + 1)));
        }
    }
    if buf.len() >= MAX_VARINT_LEN {
        return Err(FrameError::BadLength);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::v1::{HealthCheck, Hello, envelope::Body};

    fn hello(id: u64) -> Envelope {
        Envelope {
            id,
            body: Some(Body::Hello(Hello {
                protocol_version: 1,
                host_version: "test".into(),
            })),
        }
    }

    #[test]
    fn matches_prost_length_delimited_encoding() {
        let env = hello(3);
        assert_eq!(frame_bytes(&env), env.encode_length_delimited_to_vec());
    }

    #[test]
    fn round_trips_frames_fed_one_byte_at_a_time() {
        let mut wire = Vec::new();
        encode_frame(&hello(7), &mut wire);
        encode_frame(
            &Envelope {
                id: 8,
                body: Some(Body::HealthCheck(HealthCheck {})),
            },
            &mut wire,
        );
        let mut dec = FrameDecoder::default();
        let mut got = Vec::new();
        for b in &wire {
            dec.extend(std::slice::from_ref(b));
            while let Some(f) = dec.next_frame().unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], hello(7));
        assert_eq!(got[1].id, 8);
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn refuses_a_length_over_the_limit_before_buffering_it() {
        let mut dec = FrameDecoder::new(1024);
        // varint 1 MiB
        dec.extend(&[0x80, 0x80, 0x40]);
        assert_eq!(
            dec.next_frame(),
            Err(FrameError::TooLarge {
                len: 1 << 20,
                max: 1024
            })
        );
    }

    #[test]
    fn refuses_an_overlong_varint() {
        let mut dec = FrameDecoder::default();
        dec.extend(&[0xff; 11]);
        assert_eq!(dec.next_frame(), Err(FrameError::BadLength));
    }

    #[test]
    fn reports_a_body_that_is_not_an_envelope() {
        let mut dec = FrameDecoder::default();
        // length 2, then field 2 (hello), wire type 2, claiming 5 bytes that are not there
        dec.extend(&[0x02, 0x12, 0x05]);
        assert!(matches!(dec.next_frame(), Err(FrameError::Decode(_))));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // Deterministic xorshift byte soup: the decoder may only return frames, need-more,
        // or an error.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            let mut dec = FrameDecoder::new(4096);
            let mut bytes = Vec::new();
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                bytes.push(x as u8);
            }
            dec.extend(&bytes);
            for _ in 0..64 {
                match dec.next_frame() {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }
}
