//! Hybrid vsock (Firecracker's scheme): guest vsock streams multiplexed onto host unix sockets.
//!
//! - Host → guest: a client connects to `<socket>`, writes `CONNECT <port>\n`; we send the
//!   guest a REQUEST from a fresh host port in [2^30, 2^31) and, once it accepts, answer
//!   `OK <host port>\n`; from then on the socket is the stream.
//! - Guest → host: a REQUEST to CID 2 port P makes us connect to `<socket>_P`.
//!
//! The guest is untrusted: every packet is checked against the connection it names, anything
//! that does not fit gets that connection reset (RST) and nothing else; buffers per
//! connection are bounded by the credit we advertise, and the number of connections and of
//! queued control packets is capped.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::EventSet;

use super::connection::{BUF_ALLOC, Connection, State};
use super::host::{self, ConnectLine};
use super::packet::{self, HEADER_LEN, HOST_CID, Header, TYPE_STREAM, op};
use crate::event_loop::Registry;

/// Firecracker's limit, which guest drivers and tests have come to expect.
pub const MAX_CONNECTIONS: usize = 1023;
/// Guest packets are not taken while this many replies wait for receive buffers.
pub const CONTROL_BACKLOG_MAX: usize = 1024;
/// How long a host client may take to send its CONNECT line, and the guest to accept a
/// host-initiated connection or acknowledge our SHUTDOWN.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest payload we accept in one guest packet (Linux sends at most 64 KiB).
pub const MAX_PAYLOAD: u32 = 64 << 10;
const HOST_PORT_FIRST: u32 = 1 << 30;
const HOST_PORT_END: u32 = 1 << 31;

/// Epoll tokens: the listener, then host streams by fd. Queue tokens live below this too.
pub const TOKEN_LISTENER: u32 = 0;
pub const TOKEN_STREAM_BASE: u32 = 16;

type Key = (u32, u32);

#[derive(Debug, Default)]
pub struct VsockStats {
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub connections_opened: AtomicU64,
    pub connections_closed: AtomicU64,
    pub resets_sent: AtomicU64,
    pub malformed_packets: AtomicU64,
    pub refused_host_clients: AtomicU64,
}

impl VsockStats {
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("tx_packets", get(&self.tx_packets)),
            ("tx_bytes", get(&self.tx_bytes)),
            ("rx_packets", get(&self.rx_packets)),
            ("rx_bytes", get(&self.rx_bytes)),
            ("connections_opened", get(&self.connections_opened)),
            ("connections_closed", get(&self.connections_closed)),
            ("resets_sent", get(&self.resets_sent)),
            ("malformed_packets", get(&self.malformed_packets)),
            ("refused_host_clients", get(&self.refused_host_clients)),
        ]
    }

    fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// A host client that has not finished its CONNECT line yet.
struct Pending {
    stream: UnixStream,
    line: Vec<u8>,
    deadline: Instant,
}

pub struct Muxer {
    guest_cid: u64,
    socket_path: PathBuf,
    listener: UnixListener,
    pending: HashMap<RawFd, Pending>,
    connections: HashMap<Key, Connection>,
    by_fd: HashMap<RawFd, Key>,
    /// Packets without payload for the guest, oldest first.
    control: VecDeque<Header>,
    /// Connections with read-ahead host bytes, in delivery order.
    delivery: VecDeque<Key>,
    next_host_port: u32,
    stats: Arc<VsockStats>,
}

fn stream_token(fd: RawFd) -> u32 {
    TOKEN_STREAM_BASE + fd as u32
}

impl Muxer {
    pub fn new(
        guest_cid: u64,
        socket_path: &Path,
        listener: UnixListener,
        stats: Arc<VsockStats>,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(Self {
            guest_cid,
            socket_path: socket_path.to_owned(),
            listener,
            pending: HashMap::new(),
            connections: HashMap::new(),
            by_fd: HashMap::new(),
            control: VecDeque::new(),
            delivery: VecDeque::new(),
            next_host_port: HOST_PORT_FIRST,
            stats,
        })
    }

    pub fn register(&mut self, registry: &mut Registry<'_>) -> std::io::Result<()> {
        registry.add(self.listener.as_raw_fd(), TOKEN_LISTENER, EventSet::IN)
    }

    pub fn connection_count(&self) -> usize {
        self.connections.len() + self.pending.len()
    }

    /// Too many replies are waiting for the guest to post receive buffers.
    pub fn backlogged(&self) -> bool {
        self.control.len() >= CONTROL_BACKLOG_MAX
    }

    pub fn has_work_for_guest(&self) -> bool {
        !self.control.is_empty() || !self.delivery.is_empty()
    }

    /// Accepts every waiting host client.
    pub fn accept(&mut self, registry: &mut Registry<'_>) {
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a vsock host client");
                    return;
                }
            };
            if self.connection_count() >= MAX_CONNECTIONS {
                VsockStats::bump(&self.stats.refused_host_clients, 1);
                continue;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!(error = %e, "vsock host client");
                continue;
            }
            let fd = stream.as_raw_fd();
            if let Err(e) = registry.add(fd, stream_token(fd), EventSet::IN) {
                tracing::warn!(error = %e, "registering a vsock host client");
                continue;
            }
            self.pending.insert(
                fd,
                Pending {
                    stream,
                    line: Vec::new(),
                    deadline: Instant::now() + HANDSHAKE_TIMEOUT,
                },
            );
        }
    }

    /// Readiness on a host stream registered under `token`.
    pub fn on_stream_event(&mut self, token: u32, events: EventSet, registry: &mut Registry<'_>) {
        let fd = token.wrapping_sub(TOKEN_STREAM_BASE) as RawFd;
        if self.pending.contains_key(&fd) {
            self.on_connect_line(fd, registry);
            return;
        }
        let Some(&key) = self.by_fd.get(&fd) else {
            return;
        };
        let Some(conn) = self.connections.get_mut(&key) else {
            return;
        };
        if events.contains(EventSet::ERROR) {
            self.close(key, registry, true);
            return;
        }
        if events.contains(EventSet::OUT)
            && let Err(e) = conn.flush_to_host()
        {
            tracing::debug!(error = %e, port = key.0, "vsock host write");
            self.close(key, registry, true);
            return;
        }
        // A hang-up needs no case of its own: with IN registered the read below sees the
        // end of the stream, with OUT the write above fails, and with neither the socket is
        // not in the epoll set.
        self.pump_from_host(key, registry);
        self.queue_credit_update_if_due(key);
        self.sync_interest(key, registry);
    }

    fn on_connect_line(&mut self, fd: RawFd, registry: &mut Registry<'_>) {
        let Some(pending) = self.pending.get_mut(&fd) else {
            return;
        };
        let line = host::read_connect_line(&pending.stream, &mut pending.line);
        let port = match line {
            Ok(ConnectLine::Incomplete) => return,
            Ok(ConnectLine::Port(port)) => Some(port),
            Ok(ConnectLine::Closed | ConnectLine::Invalid) | Err(_) => None,
        };
        registry.remove(fd);
        let Some(pending) = self.pending.remove(&fd) else {
            return;
        };
        let Some(guest_port) = port else {
            VsockStats::bump(&self.stats.refused_host_clients, 1);
            return;
        };
        let Some(local_port) = self.allocate_host_port(guest_port) else {
            VsockStats::bump(&self.stats.refused_host_clients, 1);
            return;
        };
        let mut conn = Connection::new(pending.stream, State::Connecting, local_port, guest_port);
        conn.deadline = Some(Instant::now() + HANDSHAKE_TIMEOUT);
        let key = (local_port, guest_port);
        self.by_fd.insert(fd, key);
        self.connections.insert(key, conn);
        VsockStats::bump(&self.stats.connections_opened, 1);
        self.push_control(Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: local_port,
            dst_port: guest_port,
            kind: TYPE_STREAM,
            op: op::REQUEST,
            buf_alloc: BUF_ALLOC,
            ..Default::default()
        });
        // Data the client sends before the guest accepts waits in the socket.
        self.sync_interest(key, registry);
    }

    fn allocate_host_port(&mut self, guest_port: u32) -> Option<u32> {
        for _ in 0..=MAX_CONNECTIONS {
            let port = self.next_host_port;
            self.next_host_port = if port + 1 >= HOST_PORT_END {
                HOST_PORT_FIRST
            } else {
                port + 1
            };
            if !self.connections.contains_key(&(port, guest_port)) {
                return Some(port);
            }
        }
        None
    }

    /// One packet the guest put on its transmit queue. `payload` is exactly `header.len`
    /// bytes (the caller checked that).
    pub fn on_guest_packet(&mut self, header: Header, payload: &[u8], registry: &mut Registry<'_>) {
        VsockStats::bump(&self.stats.tx_packets, 1);
        VsockStats::bump(&self.stats.tx_bytes, payload.len() as u64);
        if header.kind != TYPE_STREAM
            || header.src_cid != self.guest_cid
            || header.dst_cid != HOST_CID
        {
            self.malformed(&header, "wrong type or addresses");
            return;
        }
        let key = (header.dst_port, header.src_port);
        if header.op == op::REQUEST {
            self.on_guest_connect(header, registry);
            return;
        }
        let Some(conn) = self.connections.get_mut(&key) else {
            // No such stream: tell the guest, unless it is itself saying goodbye.
            if header.op != op::RST {
                self.push_rst(&header);
            }
            return;
        };
        conn.update_peer_credit(header.buf_alloc, header.fwd_cnt);
        match header.op {
            op::RESPONSE => self.on_guest_accept(key, registry),
            op::RW => {
                if conn.state != State::Established || conn.guest_done_sending {
                    self.malformed(&header, "data outside an open stream");
                    self.close(key, registry, true);
                    return;
                }
                if let Err(e) = conn.push_to_host(payload) {
                    tracing::debug!(error = %e, port = key.0, "vsock stream reset");
                    self.close(key, registry, true);
                    return;
                }
            }
            op::CREDIT_UPDATE => {}
            op::CREDIT_REQUEST => conn.credit_update_due = true,
            op::SHUTDOWN => {
                conn.guest_done_receiving |= header.flags & packet::SHUTDOWN_RCV != 0;
                conn.guest_done_sending |= header.flags & packet::SHUTDOWN_SEND != 0;
                if conn.guest_done_sending && (conn.guest_done_receiving || conn.host_eof) {
                    // Both directions are finished: flush what we can and end it.
                    let _ = conn.flush_to_host();
                    self.close(key, registry, true);
                    return;
                }
                if let Err(e) = conn.flush_to_host() {
                    tracing::debug!(error = %e, "vsock host write");
                    self.close(key, registry, true);
                    return;
                }
            }
            op::RST => {
                self.close(key, registry, false);
                return;
            }
            _ => {
                self.malformed(&header, "unknown operation");
                self.close(key, registry, true);
                return;
            }
        }
        self.pump_from_host(key, registry);
        self.queue_credit_update_if_due(key);
        self.sync_interest(key, registry);
    }

    fn on_guest_connect(&mut self, header: Header, registry: &mut Registry<'_>) {
        let key = (header.dst_port, header.src_port);
        if self.connections.contains_key(&key) {
            // The guest reused a live port pair: that stream is broken either way.
            self.close(key, registry, false);
            self.push_rst(&header);
            return;
        }
        if self.connection_count() >= MAX_CONNECTIONS {
            self.push_rst(&header);
            return;
        }
        let path = PathBuf::from(format!(
            "{}_{}",
            self.socket_path.display(),
            header.dst_port
        ));
        let stream = match host::connect_nonblocking(&path) {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "guest connect refused");
                self.push_rst(&header);
                return;
            }
        };
        let fd = stream.as_raw_fd();
        let mut conn =
            Connection::new(stream, State::Established, header.dst_port, header.src_port);
        conn.update_peer_credit(header.buf_alloc, header.fwd_cnt);
        self.by_fd.insert(fd, key);
        self.connections.insert(key, conn);
        VsockStats::bump(&self.stats.connections_opened, 1);
        let mut reply = header.reply(op::RESPONSE);
        reply.buf_alloc = BUF_ALLOC;
        self.push_control(reply);
        self.pump_from_host(key, registry);
        self.sync_interest(key, registry);
    }

    fn on_guest_accept(&mut self, key: Key, registry: &mut Registry<'_>) {
        let Some(conn) = self.connections.get_mut(&key) else {
            return;
        };
        if conn.state != State::Connecting {
            self.close(key, registry, true);
            return;
        }
        conn.state = State::Established;
        conn.deadline = None;
        let ok = format!("OK {}\n", key.0);
        // A fresh unix socket has room for a dozen bytes; anything else means it is gone.
        if conn.stream.write(ok.as_bytes()).ok() != Some(ok.len()) {
            self.close(key, registry, true);
        }
    }

    /// Reads what the guest can take from the host socket and queues it for delivery; starts
    /// the close handshake once the host has hung up and all its bytes are delivered.
    fn pump_from_host(&mut self, key: Key, registry: &mut Registry<'_>) {
        let Some(conn) = self.connections.get_mut(&key) else {
            return;
        };
        if let Err(e) = conn.fill_from_host() {
            tracing::debug!(error = %e, port = key.0, "vsock host read");
            self.close(key, registry, true);
            return;
        }
        if conn.has_data_for_guest() && !conn.queued_for_guest {
            conn.queued_for_guest = true;
            self.delivery.push_back(key);
        }
        if conn.state == State::Established && conn.drained_after_host_eof() {
            conn.state = State::Closing;
            conn.deadline = Some(Instant::now() + HANDSHAKE_TIMEOUT);
            let header = Header {
                src_cid: HOST_CID,
                dst_cid: self.guest_cid,
                src_port: key.0,
                dst_port: key.1,
                kind: TYPE_STREAM,
                op: op::SHUTDOWN,
                flags: packet::SHUTDOWN_RCV | packet::SHUTDOWN_SEND,
                ..Default::default()
            };
            self.push_control(header);
        }
    }

    fn queue_credit_update_if_due(&mut self, key: Key) {
        let Some(conn) = self.connections.get_mut(&key) else {
            return;
        };
        if conn.credit_update_due && !conn.credit_update_queued {
            conn.credit_update_queued = true;
            let header = Header {
                src_cid: HOST_CID,
                dst_cid: self.guest_cid,
                src_port: key.0,
                dst_port: key.1,
                kind: TYPE_STREAM,
                op: op::CREDIT_UPDATE,
                ..Default::default()
            };
            self.push_control(header);
        }
    }

    /// Keeps the host socket's epoll interest in line with what the connection can do now.
    fn sync_interest(&mut self, key: Key, registry: &mut Registry<'_>) {
        let Some(conn) = self.connections.get_mut(&key) else {
            return;
        };
        let mut events = EventSet::empty();
        if conn.wants_host_data() {
            events |= EventSet::IN;
        }
        if conn.has_data_for_host() {
            events |= EventSet::OUT;
        }
        let fd = conn.stream.as_raw_fd();
        let token = stream_token(fd);
        // With no interest we leave the set entirely: a hung-up socket would otherwise report
        // HUP forever. Reads are retried whenever the guest grants credit.
        let result = match (conn.interest, events.is_empty()) {
            (None, true) => Ok(()),
            (None, false) => registry.add(fd, token, events),
            (Some(_), true) => {
                registry.remove(fd);
                Ok(())
            }
            (Some(old), false) if old == events.bits() => Ok(()),
            (Some(_), false) => registry.modify(fd, token, events),
        };
        match result {
            Ok(()) => conn.interest = (!events.is_empty()).then_some(events.bits()),
            Err(e) => {
                tracing::warn!(error = %e, "vsock epoll interest");
                self.close(key, registry, true);
            }
        }
    }

    /// The next packet for a guest receive buffer that holds `capacity` bytes.
    pub fn next_for_guest(
        &mut self,
        capacity: usize,
        registry: &mut Registry<'_>,
    ) -> Option<(Header, Vec<u8>)> {
        while let Some(mut header) = self.control.pop_front() {
            let key = (header.src_port, header.dst_port);
            match self.connections.get_mut(&key) {
                Some(conn) => {
                    (header.buf_alloc, header.fwd_cnt) = conn.our_credit();
                    if header.op == op::CREDIT_UPDATE {
                        conn.credit_update_queued = false;
                    }
                }
                // Replies for streams that ended meanwhile are moot, except the resets.
                None if header.op != op::RST => continue,
                None => {}
            }
            self.count_rx(&header, 0);
            return Some((header, Vec::new()));
        }
        let room = capacity.checked_sub(HEADER_LEN).filter(|r| *r > 0)?;
        while let Some(key) = self.delivery.pop_front() {
            let Some(conn) = self.connections.get_mut(&key) else {
                continue;
            };
            conn.queued_for_guest = false;
            let payload = conn.take_for_guest(room.min(MAX_PAYLOAD as usize));
            if payload.is_empty() {
                continue;
            }
            let (buf_alloc, fwd_cnt) = conn.our_credit();
            let header = Header {
                src_cid: HOST_CID,
                dst_cid: self.guest_cid,
                src_port: key.0,
                dst_port: key.1,
                len: payload.len() as u32,
                kind: TYPE_STREAM,
                op: op::RW,
                buf_alloc,
                fwd_cnt,
                ..Default::default()
            };
            if conn.has_data_for_guest() {
                conn.queued_for_guest = true;
                self.delivery.push_back(key);
            } else {
                self.pump_from_host(key, registry);
                self.sync_interest(key, registry);
            }
            self.count_rx(&header, payload.len());
            return Some((header, payload));
        }
        None
    }

    fn count_rx(&self, header: &Header, bytes: usize) {
        VsockStats::bump(&self.stats.rx_packets, 1);
        VsockStats::bump(&self.stats.rx_bytes, bytes as u64);
        if header.op == op::RST {
            VsockStats::bump(&self.stats.resets_sent, 1);
        }
    }

    /// Puts a packet back at the head of the queue (no receive buffer could take it).
    pub fn unsend(&mut self, header: Header) {
        self.control.push_front(header);
    }

    pub fn deadline(&self) -> Option<Instant> {
        let conns = self.connections.values().filter_map(|c| c.deadline);
        let pending = self.pending.values().map(|p| p.deadline);
        conns.chain(pending).min()
    }

    /// Ends whatever handshake ran out of time.
    pub fn on_deadline(&mut self, now: Instant, registry: &mut Registry<'_>) {
        let late: Vec<RawFd> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in late {
            registry.remove(fd);
            self.pending.remove(&fd);
            VsockStats::bump(&self.stats.refused_host_clients, 1);
        }
        let expired: Vec<Key> = self
            .connections
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in expired {
            tracing::debug!(
                host_port = key.0,
                guest_port = key.1,
                "vsock handshake timed out"
            );
            self.close(key, registry, true);
        }
    }

    /// Drops every connection and pending client (transport reset): the guest forgets its
    /// side through the reset event, so no RST is sent.
    pub fn reset_all(&mut self, registry: &mut Registry<'_>) {
        for (fd, _) in self.pending.drain() {
            registry.remove(fd);
        }
        let keys: Vec<Key> = self.connections.keys().copied().collect();
        for key in keys {
            self.close(key, registry, false);
        }
        self.control.clear();
        self.delivery.clear();
    }

    fn close(&mut self, key: Key, registry: &mut Registry<'_>, send_rst: bool) {
        let Some(conn) = self.connections.remove(&key) else {
            return;
        };
        let fd = conn.stream.as_raw_fd();
        if conn.interest.is_some() {
            registry.remove(fd);
        }
        self.by_fd.remove(&fd);
        VsockStats::bump(&self.stats.connections_closed, 1);
        if send_rst {
            self.push_control(Header {
                src_cid: HOST_CID,
                dst_cid: self.guest_cid,
                src_port: key.0,
                dst_port: key.1,
                kind: TYPE_STREAM,
                op: op::RST,
                ..Default::default()
            });
        }
    }

    fn push_rst(&mut self, from_guest: &Header) {
        self.push_control(from_guest.reply(op::RST));
    }

    fn push_control(&mut self, header: Header) {
        self.control.push_back(header);
    }

    fn malformed(&mut self, header: &Header, why: &str) {
        VsockStats::bump(&self.stats.malformed_packets, 1);
        tracing::debug!(?header, why, "malformed vsock packet from the guest");
        if header.op != op::RST {
            let mut reply = header.reply(op::RST);
            // Answer as the host, whatever the guest claimed to address.
            reply.src_cid = HOST_CID;
            reply.dst_cid = self.guest_cid;
            self.push_control(reply);
        }
    }

    /// A guest packet that could not even be read whole: reset the stream it names.
    pub fn on_unreadable_packet(
        &mut self,
        header: Option<Header>,
        why: &str,
        registry: &mut Registry<'_>,
    ) {
        VsockStats::bump(&self.stats.malformed_packets, 1);
        tracing::debug!(?header, why, "unreadable vsock packet from the guest");
        if let Some(header) = header
            && header.op != op::RST
        {
            self.close((header.dst_port, header.src_port), registry, false);
            let mut reply = header.reply(op::RST);
            reply.src_cid = HOST_CID;
            reply.dst_cid = self.guest_cid;
            self.push_control(reply);
        }
    }
}
