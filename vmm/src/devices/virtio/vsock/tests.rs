//! The vsock device driven over simulated guest RAM: a hand-written split-ring "driver" puts
//! packets (well-formed and hostile) on the queues, real unix sockets play the host side, and
//! the device is pumped through the same handler the device thread uses.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};

use crate::kvm::memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use super::connection::BUF_ALLOC;
use super::muxer::{self, Muxer, VsockStats};
use super::packet::{self, HEADER_LEN, HOST_CID, Header, TYPE_STREAM, op};
use super::{Vsock, VsockHandler};
use crate::devices::bus::BusDevice;
use crate::devices::virtio::Interrupt;
use crate::devices::virtio::mmio::VirtioMmio;
use crate::devices::virtio::test_driver::{DESC_NEXT, GuestQueue, QUEUE_SIZE, bring_up};
use crate::event_loop::{Registry, Subscriber};

const GUEST_CID: u64 = 3;
const RAM: usize = 16 << 20;
const BUFFERS_START: u64 = 1 << 20;
struct Harness {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    mem: Arc<GuestMemoryMmap>,
    device: Arc<Mutex<VirtioMmio<Vsock>>>,
    handler: VsockHandler,
    epoll: Epoll,
    queues: [GuestQueue; 3],
    stats: Arc<VsockStats>,
    next_buffer: u64,
    rx_buffers: HashMap<u32, u64>,
    notify: Vec<EventFd>,
}

const RX: usize = 0;
const TX: usize = 1;
const EV: usize = 2;

impl Harness {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("v.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let stats = Arc::new(VsockStats::default());
        let muxer = Muxer::new(GUEST_CID, &socket, listener, stats.clone()).unwrap();
        let mem = Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM)]).unwrap());
        let interrupt = Interrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut transport =
            VirtioMmio::new(Vsock::new(GUEST_CID, muxer), mem.clone(), interrupt).unwrap();
        let queues = [
            GuestQueue::new(0x10000),
            GuestQueue::new(0x20000),
            GuestQueue::new(0x30000),
        ];
        bring_up(&mut transport, &queues, 1);
        assert!(transport.is_activated());
        let notify = transport
            .queue_events()
            .iter()
            .map(|e| e.try_clone().unwrap())
            .collect();
        let device = Arc::new(Mutex::new(transport));
        let mut handler = VsockHandler::new(device.clone()).unwrap();
        let epoll = Epoll::new().unwrap();
        handler.register(&mut Registry::new(&epoll, 0)).unwrap();
        let mut harness = Self {
            _dir: dir,
            socket,
            mem,
            device,
            handler,
            epoll,
            queues,
            stats,
            next_buffer: BUFFERS_START,
            rx_buffers: HashMap::new(),
            notify,
        };
        // The event queue keeps buffers for transport resets, as drivers do.
        for _ in 0..4 {
            let buf = harness.alloc(4);
            harness.queues[EV].push_chain(&harness.mem, &[(buf, 4, true)]);
        }
        harness
    }

    fn alloc(&mut self, len: u64) -> u64 {
        let at = self.next_buffer;
        self.next_buffer += len.next_multiple_of(64);
        assert!(
            self.next_buffer < RAM as u64,
            "test ran out of guest buffer space"
        );
        at
    }

    /// Runs the device until nothing is ready any more.
    fn pump(&mut self) {
        let mut events = vec![EpollEvent::default(); 32];
        for _ in 0..1000 {
            let n = self.epoll.wait(5, &mut events).unwrap();
            let now = Instant::now();
            if self.handler.deadline().is_some_and(|d| d <= now) {
                self.handler
                    .on_deadline(now, &mut Registry::new(&self.epoll, 0));
            }
            if n == 0 {
                return;
            }
            for event in &events[..n] {
                self.handler.on_event(
                    event.data() as u32,
                    event.event_set(),
                    &mut Registry::new(&self.epoll, 0),
                );
            }
        }
        panic!("the device never went idle");
    }

    fn kick(&mut self, queue: usize) {
        self.notify[queue].write(1).unwrap();
        self.pump();
    }

    fn post_rx(&mut self, count: usize) {
        for _ in 0..count {
            let buf = self.alloc(4096);
            let head = self.queues[RX].push_chain(&self.mem, &[(buf, 4096, true)]);
            self.rx_buffers.insert(u32::from(head), buf);
        }
        self.kick(RX);
    }

    fn write_packet(&mut self, header: &Header, payload: &[u8]) -> (u64, u64) {
        let hdr = self.alloc(HEADER_LEN as u64 + payload.len() as u64);
        self.mem
            .write_slice(&header.to_bytes(), GuestAddress(hdr))
            .unwrap();
        let data = hdr + HEADER_LEN as u64;
        self.mem.write_slice(payload, GuestAddress(data)).unwrap();
        (hdr, data)
    }

    /// Header and payload in one descriptor (Linux ≥ 6.1.63 does this).
    fn send(&mut self, header: Header, payload: &[u8]) {
        let (hdr, _) = self.write_packet(&header, payload);
        let len = (HEADER_LEN + payload.len()) as u32;
        self.queues[TX].push_chain(&self.mem, &[(hdr, len, false)]);
        self.kick(TX);
    }

    /// Header and payload in separate descriptors, the payload itself split in two.
    fn send_split(&mut self, header: Header, payload: &[u8]) {
        let (hdr, data) = self.write_packet(&header, payload);
        let half = payload.len() / 2;
        self.queues[TX].push_chain(
            &self.mem,
            &[
                (hdr, HEADER_LEN as u32, false),
                (data, half as u32, false),
                (data + half as u64, (payload.len() - half) as u32, false),
            ],
        );
        self.kick(TX);
    }

    fn received(&mut self) -> Vec<(Header, Vec<u8>)> {
        let used = self.queues[RX].take_used(&self.mem);
        used.into_iter()
            .filter_map(|(id, len)| {
                let buf = self.rx_buffers.remove(&id)?;
                if (len as usize) < HEADER_LEN {
                    return None;
                }
                let mut raw = [0u8; HEADER_LEN];
                self.mem.read_slice(&mut raw, GuestAddress(buf)).unwrap();
                let header = Header::parse(&raw);
                let mut payload = vec![0u8; len as usize - HEADER_LEN];
                self.mem
                    .read_slice(&mut payload, GuestAddress(buf + HEADER_LEN as u64))
                    .unwrap();
                assert_eq!(
                    header.len as usize,
                    payload.len(),
                    "len field matches the bytes"
                );
                Some((header, payload))
            })
            .collect()
    }

    fn guest_header(&self, op: u16, local: u32, peer: u32) -> Header {
        Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: local,
            dst_port: peer,
            kind: TYPE_STREAM,
            op,
            buf_alloc: 64 << 10,
            ..Default::default()
        }
    }

    /// Host connects to guest port `guest_port`; the guest accepts. Returns the host stream and
    /// the host port the device chose.
    fn host_connect(&mut self, guest_port: u32) -> (UnixStream, u32) {
        let mut host = UnixStream::connect(&self.socket).unwrap();
        host.write_all(format!("CONNECT {guest_port}\n").as_bytes())
            .unwrap();
        self.post_rx(4);
        self.pump();
        let got = self.received();
        let request = got
            .iter()
            .find(|(h, _)| h.op == op::REQUEST && h.dst_port == guest_port)
            .unwrap_or_else(|| panic!("no REQUEST in {got:?}"))
            .0;
        assert_eq!((request.src_cid, request.dst_cid), (HOST_CID, GUEST_CID));
        assert!(request.src_port >= 1 << 30);
        let host_port = request.src_port;
        self.send(self.guest_header(op::RESPONSE, guest_port, host_port), &[]);
        let line = read_line(&mut host);
        assert_eq!(line, format!("OK {host_port}\n"));
        (host, host_port)
    }

    fn counter(&self, name: &str) -> u64 {
        self.stats
            .counters()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .unwrap()
    }
}

fn read_line(stream: &mut UnixStream) -> String {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut line = Vec::new();
    let mut byte = [0u8];
    while line.last() != Some(&b'\n') {
        match stream.read(&mut byte) {
            Ok(1) => line.push(byte[0]),
            other => panic!("connection ended before a line: {other:?} after {line:?}"),
        }
    }
    String::from_utf8(line).unwrap()
}

fn read_exactly(stream: &mut UnixStream, n: usize) -> Vec<u8> {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = vec![0u8; n];
    stream.read_exact(&mut buf).unwrap();
    buf
}

fn assert_closed(stream: &mut UnixStream) {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the host socket to be closed, got {other:?}"),
    }
}

fn rw(h: &Harness, local: u32, peer: u32, len: usize) -> Header {
    Header {
        len: len as u32,
        ..h.guest_header(op::RW, local, peer)
    }
}

#[test]
fn host_initiated_stream_carries_data_both_ways() {
    let mut h = Harness::new();
    let (mut host, port) = h.host_connect(1024);
    host.write_all(b"hello guest").unwrap();
    h.pump();
    let got = h.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.op, op::RW);
    assert_eq!(got[0].1, b"hello guest");
    assert_eq!(got[0].0.buf_alloc, BUF_ALLOC);
    // Header and payload together, then split across three descriptors.
    h.send(rw(&h, 1024, port, 5), b"hello");
    h.send_split(rw(&h, 1024, port, 6), b" host!");
    assert_eq!(read_exactly(&mut host, 11), b"hello host!");
}

#[test]
fn guest_initiated_stream_dials_the_port_socket() {
    let mut h = Harness::new();
    let listener = UnixListener::bind(format!("{}_52", h.socket.display())).unwrap();
    h.post_rx(4);
    h.send(h.guest_header(op::REQUEST, 40000, 52), &[]);
    let got = h.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.op, op::RESPONSE);
    assert_eq!((got[0].0.src_port, got[0].0.dst_port), (52, 40000));
    let (mut accepted, _) = listener.accept().unwrap();
    h.send(rw(&h, 40000, 52, 3), b"abc");
    assert_eq!(read_exactly(&mut accepted, 3), b"abc");
    accepted.write_all(b"xyz").unwrap();
    h.pump();
    assert_eq!(h.received()[0].1, b"xyz");
    // Nobody listens on port 53: refused with RST.
    h.send(h.guest_header(op::REQUEST, 40001, 53), &[]);
    let got = h.received();
    assert_eq!(got[0].0.op, op::RST);
    assert_eq!(got[0].0.dst_port, 40001);
}

#[test]
fn a_malformed_packet_resets_only_its_own_stream() {
    let mut h = Harness::new();
    let (mut a, port_a) = h.host_connect(1024);
    let (mut b, port_b) = h.host_connect(1024);
    // Stream A: the header claims more payload than its descriptors hold.
    let header = rw(&h, 1024, port_a, 1000);
    let (hdr, _) = h.write_packet(&header, b"short");
    h.queues[TX].push_chain(&h.mem, &[(hdr, (HEADER_LEN + 5) as u32, false)]);
    h.kick(TX);
    let got = h.received();
    assert!(
        got.iter()
            .any(|(x, _)| x.op == op::RST && x.src_port == port_a)
    );
    assert_closed(&mut a);
    // Stream B is untouched.
    h.send(rw(&h, 1024, port_b, 4), b"fine");
    assert_eq!(read_exactly(&mut b, 4), b"fine");
    assert!(h.counter("malformed_packets") >= 1);
}

#[test]
fn hostile_descriptors_are_consumed_without_harm() {
    let mut h = Harness::new();
    let (mut host, port) = h.host_connect(1024);
    let mem = h.mem.clone();
    h.queues[TX].take_used(&mem);
    // Buffer outside guest RAM.
    let head = h.queues[TX].next_desc;
    h.queues[TX].push_raw(&mem, &[(head, 0xdead_0000_0000, 64, 0, 0)], head);
    // A descriptor chain that loops on itself.
    h.queues[TX].push_raw(
        &mem,
        &[(head + 1, BUFFERS_START, 16, DESC_NEXT, head + 1)],
        head + 1,
    );
    // A next index beyond the table.
    h.queues[TX].push_raw(
        &mem,
        &[(head + 2, BUFFERS_START, 16, DESC_NEXT, 999)],
        head + 2,
    );
    // Shorter than a header.
    h.queues[TX].push_raw(&mem, &[(head + 3, BUFFERS_START, 10, 0, 0)], head + 3);
    // A header saying 100 KiB of payload.
    let big = rw(&h, 1024, port, 100 << 10);
    let (addr, _) = h.write_packet(&big, &[]);
    h.queues[TX].push_raw(&mem, &[(head + 4, addr, HEADER_LEN as u32, 0, 0)], head + 4);
    h.queues[TX].next_desc = head + 5;
    h.kick(TX);
    assert_eq!(
        h.queues[TX].take_used(&mem).len(),
        5,
        "every chain comes back"
    );
    assert!(h.counter("malformed_packets") >= 4);
    // The oversized packet named a live stream: it was reset.
    assert_closed(&mut host);
    // The device still works.
    let (mut again, port) = h.host_connect(1024);
    h.send(rw(&h, 1024, port, 2), b"ok");
    assert_eq!(read_exactly(&mut again, 2), b"ok");
}

#[test]
fn unusable_receive_buffers_are_returned_and_skipped() {
    let mut h = Harness::new();
    let mem = h.mem.clone();
    // A read-only "receive" buffer and one too small for a header.
    let a = h.alloc(4096);
    let b = h.alloc(16);
    h.queues[RX].push_chain(&mem, &[(a, 4096, false)]);
    h.queues[RX].push_chain(&mem, &[(b, 16, true)]);
    h.send(h.guest_header(op::REQUEST, 40000, 99), &[]);
    h.post_rx(1);
    let used = h.queues[RX].take_used(&mem);
    assert_eq!(used.len(), 3);
    assert_eq!((used[0].1, used[1].1), (0, 0));
    assert_eq!(
        used[2].1 as usize, HEADER_LEN,
        "the RST landed in the good buffer"
    );
}

#[test]
fn protocol_violations_get_a_reset() {
    let mut h = Harness::new();
    h.post_rx(8);
    let wrong_type = Header {
        kind: 2,
        ..h.guest_header(op::REQUEST, 1, 2)
    };
    let wrong_cid = Header {
        src_cid: 99,
        ..h.guest_header(op::REQUEST, 1, 2)
    };
    let wrong_dst = Header {
        dst_cid: 7,
        ..h.guest_header(op::REQUEST, 1, 2)
    };
    let no_stream = rw(&h, 1, 2, 1);
    for header in [wrong_type, wrong_cid, wrong_dst] {
        h.send(header, &[]);
    }
    h.send(no_stream, b"x");
    // A reset for a stream that does not exist needs no answer.
    h.send(h.guest_header(op::RST, 1, 2), &[]);
    let got = h.received();
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(
        got.iter()
            .all(|(x, _)| x.op == op::RST && x.src_cid == HOST_CID && x.dst_cid == GUEST_CID)
    );
    let (mut host, port) = h.host_connect(1024);
    h.send(h.guest_header(77, 1024, port), &[]);
    assert!(h.received().iter().any(|(x, _)| x.op == op::RST));
    assert_closed(&mut host);
}

#[test]
fn host_data_waits_for_guest_credit() {
    let mut h = Harness::new();
    let mut host = UnixStream::connect(&h.socket).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    h.post_rx(8);
    let port = h.received()[0].0.src_port;
    // The guest accepts but advertises no buffer space.
    let accept = Header {
        buf_alloc: 0,
        ..h.guest_header(op::RESPONSE, 1024, port)
    };
    h.send(accept, &[]);
    assert_eq!(read_line(&mut host), format!("OK {port}\n"));
    host.write_all(&[9u8; 100]).unwrap();
    h.pump();
    assert!(h.received().is_empty(), "sent without credit");
    let credit = Header {
        buf_alloc: 10,
        ..h.guest_header(op::CREDIT_UPDATE, 1024, port)
    };
    h.send(credit, &[]);
    let got = h.received();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].1.len(), 10);
    // A credit request is answered with our window.
    h.send(h.guest_header(op::CREDIT_REQUEST, 1024, port), &[]);
    let got = h.received();
    assert_eq!(got[0].0.op, op::CREDIT_UPDATE);
    assert_eq!(got[0].0.buf_alloc, BUF_ALLOC);
}

#[test]
fn a_guest_ignoring_our_window_is_reset() {
    let mut h = Harness::new();
    let (mut host, port) = h.host_connect(1024);
    // The host never reads; the guest keeps sending past BUF_ALLOC plus the socket buffer.
    let chunk = vec![1u8; 60 << 10];
    for _ in 0..200 {
        h.post_rx(1);
        h.send(rw(&h, 1024, port, chunk.len()), &chunk);
        if h.received().iter().any(|(x, _)| x.op == op::RST) {
            assert_closed_after_drain(&mut host);
            return;
        }
    }
    panic!("the guest was never reset");
}

fn assert_closed_after_drain(stream: &mut UnixStream) {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn a_flood_of_requests_is_capped_while_nobody_reads() {
    let mut h = Harness::new();
    let mem = h.mem.clone();
    // 3000 REQUESTs to a port nobody listens on, no receive buffers: every one wants an RST.
    // The driver keeps its queue full, as a flooding guest would.
    let header = h.guest_header(op::REQUEST, 1, 4242);
    let (addr, _) = h.write_packet(&header, &[]);
    let mut outstanding = 0usize;
    let mut taken = 0usize;
    for _ in 0..3000 / usize::from(QUEUE_SIZE) {
        while outstanding < usize::from(QUEUE_SIZE) {
            h.queues[TX].push_chain(&mem, &[(addr, HEADER_LEN as u32, false)]);
            outstanding += 1;
        }
        h.kick(TX);
        let done = h.queues[TX].take_used(&mem).len();
        outstanding -= done;
        taken += done;
    }
    assert!(
        taken <= muxer::CONTROL_BACKLOG_MAX + usize::from(QUEUE_SIZE),
        "took {taken} packets with nowhere to put the replies"
    );
    assert_eq!(
        h.device.lock().unwrap().device().muxer().connection_count(),
        0
    );
    // Posting receive buffers drains the replies and lets the rest through.
    h.post_rx(32);
    let resets = h.received();
    assert_eq!(resets.len(), 32);
    assert!(resets.iter().all(|(x, _)| x.op == op::RST));
    assert!(!h.queues[TX].take_used(&mem).is_empty(), "transmit resumed");
}

#[test]
fn garbage_connect_lines_and_silence_are_dropped() {
    let mut h = Harness::new();
    h.post_rx(4);
    let mut garbage = UnixStream::connect(&h.socket).unwrap();
    garbage.write_all(b"HELLO THERE\n").unwrap();
    h.pump();
    assert_closed(&mut garbage);
    assert!(h.received().is_empty(), "nothing reached the guest");
    // A client that connects and never finishes its line is dropped after the timeout.
    let mut silent = UnixStream::connect(&h.socket).unwrap();
    silent.write_all(b"CONN").unwrap();
    h.pump();
    std::thread::sleep(muxer::HANDSHAKE_TIMEOUT + Duration::from_millis(100));
    h.pump();
    assert_closed(&mut silent);
}

#[test]
fn a_guest_that_never_accepts_times_out() {
    let mut h = Harness::new();
    h.post_rx(4);
    let mut host = UnixStream::connect(&h.socket).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    h.pump();
    let port = h.received()[0].0.src_port;
    std::thread::sleep(muxer::HANDSHAKE_TIMEOUT + Duration::from_millis(100));
    h.pump();
    assert_closed(&mut host);
    let got = h.received();
    assert!(
        got.iter()
            .any(|(x, _)| x.op == op::RST && x.src_port == port)
    );
}

#[test]
fn host_hang_up_closes_towards_the_guest() {
    let mut h = Harness::new();
    let (host, port) = h.host_connect(1024);
    drop(host);
    h.pump();
    let got = h.received();
    let shutdown = got
        .iter()
        .find(|(x, _)| x.op == op::SHUTDOWN)
        .expect("SHUTDOWN");
    assert_eq!(
        shutdown.0.flags,
        packet::SHUTDOWN_RCV | packet::SHUTDOWN_SEND
    );
    h.send(h.guest_header(op::RST, 1024, port), &[]);
    assert_eq!(
        h.device.lock().unwrap().device().muxer().connection_count(),
        0
    );
    assert_eq!(h.counter("connections_closed"), 1);
}

#[test]
fn guest_shutdown_of_both_directions_ends_the_stream() {
    let mut h = Harness::new();
    let (mut host, port) = h.host_connect(1024);
    h.send(rw(&h, 1024, port, 4), b"last");
    let bye = Header {
        flags: packet::SHUTDOWN_RCV | packet::SHUTDOWN_SEND,
        ..h.guest_header(op::SHUTDOWN, 1024, port)
    };
    h.send(bye, &[]);
    assert_eq!(read_exactly(&mut host, 4), b"last");
    assert_closed(&mut host);
    assert!(h.received().iter().any(|(x, _)| x.op == op::RST));
}

#[test]
fn transport_reset_drops_everything_and_tells_the_guest() {
    let mut h = Harness::new();
    let (mut host, _) = h.host_connect(1024);
    {
        let mut device = h.device.lock().unwrap();
        let mut active = device.active().unwrap();
        super::transport_reset(&mut active, &mut Registry::new(&h.epoll, 0));
    }
    assert_closed(&mut host);
    let mem = h.mem.clone();
    let used = h.queues[EV].take_used(&mem);
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].1, 4);
    let event: u32 = mem.read_obj(GuestAddress(BUFFERS_START)).unwrap();
    assert_eq!(event, packet::EVENT_TRANSPORT_RESET);
    assert_eq!(
        h.device.lock().unwrap().device().muxer().connection_count(),
        0
    );
}

#[test]
fn driver_reset_closes_host_streams() {
    let mut h = Harness::new();
    let (mut host, _) = h.host_connect(1024);
    h.device.lock().unwrap().write(0x70, &0u32.to_le_bytes());
    // The next event on the device thread notices the reset.
    h.kick(TX);
    assert_closed(&mut host);
    let _ = host.as_raw_fd();
}
