//! Accepts HTTP/2 requests whose `:authority` the HTTP stack would refuse.
//!
//! gRPC clients give unix-socket requests an authority of their own making: grpcio (C core)
//! sends the socket path percent-encoded (`tmp%2Fx%2Fagentvmd.sock`), which is not a valid
//! URI authority, and the h2 server answers such a stream with RST_STREAM(PROTOCOL_ERROR)
//! before any service sees it. The authority means nothing on a unix socket, so this
//! connection wrapper reads the client's side of the connection frame by frame and
//! re-encodes every header block, replacing an authority that does not parse with
//! `localhost`. Everything else passes through unchanged: the preface, every other frame, and
//! the whole server-to-client direction.
//!
//! Header blocks are re-encoded rather than patched in place because HPACK is stateful: the
//! server's decoder must see one consistent encoder, and from the first rewritten block on
//! that encoder is ours.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Every peer accepts frames of this size (RFC 9113 §4.2); the re-encoded block is split
/// into CONTINUATION frames beyond it.
const MAX_FRAME_PAYLOAD: usize = 16_384;
/// The largest header block accepted from a client, across its CONTINUATION frames.
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// What replaces an authority that does not parse.
const STAND_IN_AUTHORITY: &[u8] = b"localhost";
/// Read from the client at most this much at a time.
const READ_CHUNK: usize = 16 * 1024;

/// A header block being collected: HEADERS, then CONTINUATION frames up to END_HEADERS.
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The client's side of one connection, with its header blocks re-encoded (module docs).
pub struct LenientAuthority<S> {
    inner: S,
    /// Bytes from the client not yet framed.
    raw: BytesMut,
    /// Bytes ready for the server.
    ready: BytesMut,
    preface_left: usize,
    pending: Option<PendingBlock>,
    decoder: fluke_hpack::Decoder<'static>,
    encoder: fluke_hpack::Encoder<'static>,
    eof: bool,
}

impl<S> LenientAuthority<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            raw: BytesMut::new(),
            ready: BytesMut::new(),
            preface_left: PREFACE_LEN,
            pending: None,
            decoder: fluke_hpack::Decoder::new(),
            encoder: fluke_hpack::Encoder::new(),
            eof: false,
        }
    }

    /// Moves every complete frame of `raw` to `ready`, re-encoding header blocks.
    fn process(&mut self) -> io::Result<()> {
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.raw.len());
            self.ready.extend_from_slice(&self.raw.split_to(n));
            self.preface_left -= n;
            if self.preface_left > 0 {
                return Ok(());
            }
        }
        while self.raw.len() >= FRAME_HEADER_LEN {
            let len = u32::from_be_bytes([0, self.raw[0], self.raw[1], self.raw[2]]) as usize;
            if self.raw.len() < FRAME_HEADER_LEN + len {
                break;
            }
            let frame = self.raw.split_to(FRAME_HEADER_LEN + len);
            let (kind, flags) = (frame[3], frame[4]);
            let stream_id =
                u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
            let payload = &frame[FRAME_HEADER_LEN..];
            if let Some(block) = self.pending.as_mut() {
                if kind != TYPE_CONTINUATION || block.stream_id != stream_id {
                    return Err(invalid(
                        "a frame other than its CONTINUATION inside a header block",
                    ));
                }
                block.fragment.extend_from_slice(payload);
                if block.fragment.len() > MAX_HEADER_BLOCK {
                    return Err(invalid("a header block larger than 1 MiB"));
                }
                if flags & FLAG_END_HEADERS != 0
                    && let Some(block) = self.pending.take()
                {
                    self.emit(block)?;
                }
                continue;
            }
            if kind != TYPE_HEADERS {
                self.ready.extend_from_slice(&frame);
                continue;
            }
            let block = headers_frame(stream_id, flags, payload)?;
            if flags & FLAG_END_HEADERS != 0 {
                self.emit(block)?;
            } else {
                self.pending = Some(block);
            }
        }
        Ok(())
    }

    /// Decodes `block` with the client's HPACK state, fixes its authority and writes it to
    /// `ready` encoded with ours.
    fn emit(&mut self, block: PendingBlock) -> io::Result<()> {
        let mut headers = self
            .decoder
            .decode(&block.fragment)
            .map_err(|e| invalid(&format!("undecodable header block: {e:?}")))?;
        for (name, value) in &mut headers {
            if name.as_slice() == b":authority"
                && http::uri::Authority::try_from(value.as_slice()).is_err()
            {
                *value = STAND_IN_AUTHORITY.to_vec();
            }
        }
        let encoded = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let first_room = MAX_FRAME_PAYLOAD - if block.priority.is_some() { 5 } else { 0 };
        let (first, mut rest) = encoded.split_at(encoded.len().min(first_room));
        let mut flags = if block.end_stream { FLAG_END_STREAM } else { 0 };
        if block.priority.is_some() {
            flags |= FLAG_PRIORITY;
        }
        if rest.is_empty() {
            flags |= FLAG_END_HEADERS;
        }
        let priority = block.priority.as_ref().map(|p| &p[..]).unwrap_or_default();
        self.frame_header(
            priority.len() + first.len(),
            TYPE_HEADERS,
            flags,
            block.stream_id,
        );
        self.ready.extend_from_slice(priority);
        self.ready.extend_from_slice(first);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME_PAYLOAD));
            let flags = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
            self.frame_header(chunk.len(), TYPE_CONTINUATION, flags, block.stream_id);
            self.ready.extend_from_slice(chunk);
            rest = tail;
        }
        Ok(())
    }

    fn frame_header(&mut self, len: usize, kind: u8, flags: u8, stream_id: u32) {
        self.ready.put_uint(len as u64, 3);
        self.ready.put_u8(kind);
        self.ready.put_u8(flags);
        self.ready.put_u32(stream_id);
    }
}

/// The parts of a HEADERS frame's payload: padding dropped, priority kept.
fn headers_frame(stream_id: u32, flags: u8, payload: &[u8]) -> io::Result<PendingBlock> {
    let mut body = payload;
    if flags & FLAG_PADDED != 0 {
        let (&pad, rest) = body
            .split_first()
            .ok_or_else(|| invalid("PADDED HEADERS without a pad length"))?;
        let kept = rest
            .len()
            .checked_sub(pad as usize)
            .ok_or_else(|| invalid("HEADERS padding longer than the frame"))?;
        body = &rest[..kept];
    }
    let priority = if flags & FLAG_PRIORITY != 0 {
        let (p, rest) = body
            .split_at_checked(5)
            .ok_or_else(|| invalid("HEADERS with PRIORITY shorter than 5 bytes"))?;
        body = rest;
        Some(<[u8; 5]>::try_from(p).expect("split at 5"))
    } else {
        None
    };
    Ok(PendingBlock {
        stream_id,
        end_stream: flags & FLAG_END_STREAM != 0,
        priority,
        fragment: body.to_vec(),
    })
}

fn invalid(why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 from client: {why}"),
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for LenientAuthority<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; READ_CHUNK];
            let mut chunk_buf = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut chunk_buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if chunk_buf.filled().is_empty() => {
                    // The client is gone; whatever it left unframed goes on as it was.
                    this.eof = true;
                    let rest = this.raw.split();
                    this.ready.extend_from_slice(&rest);
                }
                Poll::Ready(Ok(())) => {
                    this.raw.extend_from_slice(chunk_buf.filled());
                    if let Err(e) = this.process() {
                        return Poll::Ready(Err(e));
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LenientAuthority<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for LenientAuthority<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        f.push(kind);
        f.push(flags);
        f.extend_from_slice(&stream_id.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Feeds `client` through the wrapper (in `split` sized pieces) and returns what the
    /// server reads.
    async fn through(client: &[u8], split: usize) -> io::Result<Vec<u8>> {
        let (mut near, far) = tokio::io::duplex(1 << 20);
        let pieces: Vec<Vec<u8>> = client.chunks(split).map(<[u8]>::to_vec).collect();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for p in pieces {
                near.write_all(&p).await.unwrap();
                tokio::task::yield_now().await;
            }
        });
        let mut out = Vec::new();
        LenientAuthority::new(far).read_to_end(&mut out).await?;
        Ok(out)
    }

    /// Splits server-side bytes into (kind, flags, stream, payload) after the preface.
    fn frames(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert_eq!(&bytes[..PREFACE_LEN], PREFACE);
        let mut rest = &bytes[PREFACE_LEN..];
        let mut out = Vec::new();
        while !rest.is_empty() {
            let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            out.push((rest[3], rest[4], id, rest[9..9 + len].to_vec()));
            rest = &rest[9 + len..];
        }
        out
    }

    fn request(authority: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (
                b":path".to_vec(),
                b"/agentsessions.v1.Sessions/GetSession".to_vec(),
            ),
            (b":authority".to_vec(), authority.to_vec()),
            (b"content-type".to_vec(), b"application/grpc".to_vec()),
        ]
    }

    fn encode(enc: &mut fluke_hpack::Encoder<'_>, headers: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        enc.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
    }

    /// A literal header with incremental indexing and an indexed name (RFC 7541 §6.2.1).
    fn indexed_literal(name_index: u8, value: &[u8]) -> Vec<u8> {
        let mut b = vec![0x40 | name_index, value.len() as u8];
        b.extend_from_slice(value);
        b
    }

    #[tokio::test]
    async fn a_percent_encoded_authority_becomes_localhost_and_the_rest_is_kept() {
        let bad = b"tmp%2Fx%2Fagentvmd.sock";
        let path = b"/agentsessions.v1.Sessions/GetSession";
        // As grpcio encodes it: POST and http from the static table, the rest inserted into
        // the dynamic table (content-type at 62, :authority at 63, :path at 64 after it)...
        let mut first = vec![0x83, 0x86];
        first.extend(indexed_literal(4, path));
        first.extend(indexed_literal(1, bad));
        first.extend(indexed_literal(31, b"application/grpc"));
        // ...and the next request refers to those entries by index only.
        let second = [0x83, 0x86, 0x80 | 64, 0x80 | 63, 0x80 | 62];
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        bytes.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &first));
        bytes.extend(frame(0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\0")); // DATA
        bytes.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            3,
            &second,
        ));
        let want = |authority: &[u8]| {
            vec![
                (b":method".to_vec(), b"POST".to_vec()),
                (b":scheme".to_vec(), b"http".to_vec()),
                (b":path".to_vec(), path.to_vec()),
                (b":authority".to_vec(), authority.to_vec()),
                (b"content-type".to_vec(), b"application/grpc".to_vec()),
            ]
        };
        assert_eq!(
            fluke_hpack::Decoder::new().decode(&first).unwrap(),
            want(bad),
            "the client's blocks are what the test means them to be"
        );
        for split in [1, 7, 4096] {
            let out = frames(&through(&bytes, split).await.unwrap());
            assert_eq!(out.len(), 4, "split {split}");
            assert_eq!(out[0].0, 0x4);
            assert_eq!(out[2], (0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\0".to_vec()));
            let mut server = fluke_hpack::Decoder::new();
            for (i, stream) in [(1, 1u32), (3, 3)] {
                let (kind, flags, id, block) = &out[i];
                assert_eq!((*kind, *id), (TYPE_HEADERS, stream));
                assert_ne!(flags & FLAG_END_HEADERS, 0);
                let headers = server.decode(block).unwrap();
                assert_eq!(headers, want(b"localhost"), "split {split} stream {stream}");
            }
            assert_ne!(out[3].1 & FLAG_END_STREAM, 0, "END_STREAM kept");
        }
    }

    #[tokio::test]
    async fn continuation_padding_and_priority_are_handled_and_a_valid_authority_is_kept() {
        let mut client_enc = fluke_hpack::Encoder::new();
        let mut headers = request(b"localhost:50051");
        headers.push((b"x-long".to_vec(), vec![b'a'; 40_000]));
        let block = encode(&mut client_enc, &headers);
        let (a, b) = block.split_at(100);
        let mut first = vec![3u8]; // pad length
        first.extend_from_slice(&[0, 0, 0, 0, 16]); // priority
        first.extend_from_slice(a);
        first.extend_from_slice(&[0, 0, 0]);
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(TYPE_HEADERS, FLAG_PADDED | FLAG_PRIORITY, 5, &first));
        bytes.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, b));
        let out = frames(&through(&bytes, 1000).await.unwrap());
        assert!(out.len() >= 3, "40 KB re-encoded spans CONTINUATION frames");
        assert_eq!(out[0].0, TYPE_HEADERS);
        assert_ne!(out[0].1 & FLAG_PRIORITY, 0);
        assert_eq!(out[0].1 & FLAG_PADDED, 0);
        assert_eq!(&out[0].3[..5], &[0, 0, 0, 0, 16]);
        let mut block = out[0].3[5..].to_vec();
        for f in &out[1..] {
            assert_eq!((f.0, f.2), (TYPE_CONTINUATION, 5));
            assert!(f.3.len() <= MAX_FRAME_PAYLOAD);
            block.extend_from_slice(&f.3);
        }
        assert_ne!(out.last().unwrap().1 & FLAG_END_HEADERS, 0);
        assert_eq!(fluke_hpack::Decoder::new().decode(&block).unwrap(), headers);
    }

    #[tokio::test]
    async fn hostile_framing_ends_the_connection_with_an_error() {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(TYPE_HEADERS, 0, 1, b"\x82"));
        bytes.extend(frame(0x0, 0, 1, b"x")); // DATA inside a header block
        assert!(through(&bytes, 64).await.is_err());
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_PADDED,
            1,
            &[200, 1, 2],
        ));
        assert!(through(&bytes, 64).await.is_err());
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0xff; 32]));
        assert!(through(&bytes, 64).await.is_err(), "an undecodable block");
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(TYPE_HEADERS, 0, 1, &[]));
        for _ in 0..80 {
            bytes.extend(frame(TYPE_CONTINUATION, 0, 1, &[0u8; 16_000]));
        }
        assert!(
            through(&bytes, 1 << 16).await.is_err(),
            "an endless header block"
        );
    }
}
