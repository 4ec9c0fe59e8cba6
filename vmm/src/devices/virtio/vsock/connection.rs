//! One vsock stream between a guest port and a host unix socket: its state, both credit
//! windows and the bytes in flight each way.
//!
//! Credit (virtio 1.2 §5.10.6.3): each side advertises a receive buffer (`buf_alloc`) and how
//! much of it it has consumed (`fwd_cnt`); a sender may have at most `buf_alloc - (sent -
//! fwd_cnt)` bytes outstanding. We count a guest byte as consumed once it is written to the
//! host socket, so what we buffer for a slow host reader is bounded by our own `buf_alloc`;
//! a guest that sends beyond it breaks the protocol and is reset.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

/// Our receive buffer per connection, advertised to the guest.
pub const BUF_ALLOC: u32 = 256 << 10;
/// The most host bytes read ahead for the guest per connection.
pub const STAGE_MAX: usize = 64 << 10;
/// Tell the guest about freed buffer space once this much has been consumed unannounced.
const CREDIT_UPDATE_THRESHOLD: u32 = BUF_ALLOC / 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Host-initiated: REQUEST sent to the guest, waiting for RESPONSE or RST.
    Connecting,
    Established,
    /// SHUTDOWN sent to the guest after the host hung up; waiting for its RST.
    Closing,
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("guest sent {pending} bytes beyond the {BUF_ALLOC}-byte window it was given")]
    CreditExceeded { pending: usize },
    #[error("host socket: {0}")]
    Io(#[from] io::Error),
}

pub struct Connection {
    pub stream: UnixStream,
    pub state: State,
    /// Host-side port (allocated for host-initiated streams, the dialled port otherwise).
    pub local_port: u32,
    /// Guest-side port.
    pub peer_port: u32,
    /// Expiry of the current state (connect or close timeout).
    pub deadline: Option<Instant>,
    /// What the guest allows us: its buffer and how much of it it has consumed.
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// Payload bytes we have put in the guest's receive queue.
    rx_cnt: Wrapping<u32>,
    /// Guest bytes written to the host socket, and the last value the guest heard.
    fwd_cnt: Wrapping<u32>,
    fwd_cnt_told: Wrapping<u32>,
    /// Guest bytes waiting for the host socket to drain.
    to_host: VecDeque<u8>,
    /// Host bytes read ahead, waiting for a guest receive buffer.
    to_guest: Vec<u8>,
    /// The host closed its side (read returned 0 or the socket hung up).
    pub host_eof: bool,
    /// The guest said it will send / receive no more.
    pub guest_done_sending: bool,
    pub guest_done_receiving: bool,
    /// The host socket's write side has been shut down after the guest's SHUTDOWN(SEND).
    host_write_shut: bool,
    /// Queued in the muxer's delivery order.
    pub queued_for_guest: bool,
    /// A CREDIT_UPDATE must reach the guest.
    pub credit_update_due: bool,
    /// A CREDIT_UPDATE packet is already waiting in the muxer's control queue.
    pub credit_update_queued: bool,
    /// The host socket's events in the epoll set; `None` when it is not registered.
    pub interest: Option<u32>,
}

impl Connection {
    pub fn new(stream: UnixStream, state: State, local_port: u32, peer_port: u32) -> Self {
        Self {
            stream,
            state,
            local_port,
            peer_port,
            deadline: None,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            fwd_cnt_told: Wrapping(0),
            to_host: VecDeque::new(),
            to_guest: Vec::new(),
            host_eof: false,
            guest_done_sending: false,
            guest_done_receiving: false,
            host_write_shut: false,
            queued_for_guest: false,
            credit_update_due: false,
            credit_update_queued: false,
            interest: None,
        }
    }

    /// Every guest packet carries its current credit.
    pub fn update_peer_credit(&mut self, buf_alloc: u32, fwd_cnt: u32) {
        self.peer_buf_alloc = buf_alloc;
        self.peer_fwd_cnt = Wrapping(fwd_cnt);
    }

    /// How many more bytes the guest can take right now.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Our credit fields for an outgoing header; the guest now knows our `fwd_cnt`.
    pub fn our_credit(&mut self) -> (u32, u32) {
        self.fwd_cnt_told = self.fwd_cnt;
        self.credit_update_due = false;
        (BUF_ALLOC, self.fwd_cnt.0)
    }

    /// Takes guest payload for the host: written at once as far as the socket allows, the rest
    /// buffered within our window.
    pub fn push_to_host(&mut self, payload: &[u8]) -> Result<(), ConnectionError> {
        let pending = self.to_host.len() + payload.len();
        if pending > BUF_ALLOC as usize {
            return Err(ConnectionError::CreditExceeded { pending });
        }
        let mut rest = payload;
        if self.to_host.is_empty() {
            let written = write_some(&mut self.stream, payload)?;
            self.consumed(written);
            rest = &payload[written..];
        }
        self.to_host.extend(rest);
        Ok(())
    }

    /// Writes buffered guest bytes to the host socket; shuts its write side down once the
    /// guest is done sending and everything is out.
    pub fn flush_to_host(&mut self) -> Result<(), ConnectionError> {
        while !self.to_host.is_empty() {
            let (front, _) = self.to_host.as_slices();
            let written = write_some(&mut self.stream, front)?;
            if written == 0 {
                break;
            }
            self.to_host.drain(..written);
            self.consumed(written);
        }
        if self.to_host.is_empty() && self.guest_done_sending && !self.host_write_shut {
            self.host_write_shut = true;
            // The peer may already be gone; then there is nothing left to shut.
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }

    fn consumed(&mut self, bytes: usize) {
        self.fwd_cnt += Wrapping(bytes as u32);
        if (self.fwd_cnt - self.fwd_cnt_told).0 >= CREDIT_UPDATE_THRESHOLD {
            self.credit_update_due = true;
        }
    }

    pub fn has_data_for_host(&self) -> bool {
        !self.to_host.is_empty()
    }

    pub fn has_data_for_guest(&self) -> bool {
        !self.to_guest.is_empty()
    }

    /// The host hung up and everything it sent has reached the guest: time to close.
    pub fn drained_after_host_eof(&self) -> bool {
        self.host_eof && self.to_guest.is_empty()
    }

    /// Whether reading the host socket now could produce something to deliver.
    pub fn wants_host_data(&self) -> bool {
        self.state == State::Established
            && !self.host_eof
            && !self.guest_done_receiving
            && self.to_guest.is_empty()
            && self.peer_credit() > 0
    }

    /// Reads host bytes ahead, as much as the guest's credit allows. Sets `host_eof` when the
    /// host has closed.
    pub fn fill_from_host(&mut self) -> Result<(), ConnectionError> {
        if !self.wants_host_data() {
            return Ok(());
        }
        let want = (self.peer_credit() as usize).min(STAGE_MAX);
        self.to_guest.resize(want, 0);
        match self.stream.read(&mut self.to_guest) {
            Ok(0) => {
                self.to_guest.clear();
                self.host_eof = true;
                Ok(())
            }
            Ok(n) => {
                self.to_guest.truncate(n);
                Ok(())
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                self.to_guest.clear();
                Ok(())
            }
            Err(e) => {
                self.to_guest.clear();
                Err(e.into())
            }
        }
    }

    /// Takes up to `max` read-ahead bytes (never more than the guest's credit) for one packet.
    pub fn take_for_guest(&mut self, max: usize) -> Vec<u8> {
        let n = self
            .to_guest
            .len()
            .min(max)
            .min(self.peer_credit() as usize);
        let chunk: Vec<u8> = self.to_guest.drain(..n).collect();
        self.rx_cnt += Wrapping(chunk.len() as u32);
        chunk
    }
}

/// One non-blocking write; a full socket is not an error.
fn write_some(stream: &mut UnixStream, bytes: &[u8]) -> io::Result<usize> {
    if bytes.is_empty() {
        return Ok(0);
    }
    match stream.write(bytes) {
        Ok(n) => Ok(n),
        Err(e)
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted =>
        {
            Ok(0)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Connection, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (Connection::new(a, State::Established, 1 << 30, 5000), b)
    }

    #[test]
    fn credit_window_arithmetic_wraps() {
        let (mut conn, _peer) = pair();
        conn.update_peer_credit(1000, 0);
        assert_eq!(conn.peer_credit(), 1000);
        conn.rx_cnt = Wrapping(u32::MAX - 10);
        conn.peer_fwd_cnt = Wrapping(u32::MAX - 100);
        assert_eq!(conn.peer_credit(), 910);
        conn.rx_cnt += Wrapping(200); // wraps past zero
        assert_eq!(conn.peer_credit(), 710);
        // A guest claiming to have consumed more than we sent gets no extra credit.
        conn.update_peer_credit(10, 0);
        conn.rx_cnt = Wrapping(5);
        assert_eq!(conn.peer_credit(), 5);
    }

    #[test]
    fn guest_overrunning_our_window_is_an_error() {
        let (mut conn, _peer) = pair();
        // Fill the socket so nothing drains.
        let chunk = vec![0u8; 64 << 10];
        let mut total = 0;
        loop {
            conn.push_to_host(&chunk).unwrap();
            total += chunk.len();
            if conn.has_data_for_host() {
                break;
            }
            assert!(total < 64 << 20, "socket never filled");
        }
        let err = loop {
            match conn.push_to_host(&chunk) {
                Ok(()) => continue,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, ConnectionError::CreditExceeded { .. }));
    }

    #[test]
    fn consumed_bytes_come_due_as_credit_updates() {
        let (mut conn, mut peer) = pair();
        conn.push_to_host(&vec![1u8; (CREDIT_UPDATE_THRESHOLD - 1) as usize])
            .unwrap();
        assert!(!conn.credit_update_due);
        conn.push_to_host(&[1u8]).unwrap();
        assert!(conn.credit_update_due);
        assert_eq!(conn.our_credit(), (BUF_ALLOC, CREDIT_UPDATE_THRESHOLD));
        assert!(!conn.credit_update_due);
        let mut sink = vec![0u8; 1 << 20];
        let _ = peer.read(&mut sink);
    }

    #[test]
    fn read_ahead_respects_guest_credit_and_sees_eof() {
        let (mut conn, mut peer) = pair();
        peer.write_all(&[7u8; 100]).unwrap();
        conn.fill_from_host().unwrap();
        assert!(!conn.has_data_for_guest(), "no credit yet, nothing read");
        conn.update_peer_credit(30, 0);
        conn.fill_from_host().unwrap();
        assert_eq!(conn.take_for_guest(1000).len(), 30);
        assert_eq!(conn.peer_credit(), 0);
        conn.update_peer_credit(1000, 30);
        conn.fill_from_host().unwrap();
        assert_eq!(conn.take_for_guest(50).len(), 50);
        assert_eq!(conn.take_for_guest(50).len(), 20);
        drop(peer);
        conn.fill_from_host().unwrap();
        assert!(conn.host_eof);
    }
}
