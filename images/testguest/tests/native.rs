//! The test guest's hardware-independent C (frame codec, handlers, vsock state machine,
//! command line parser), compiled for the host together with `tests/c/driver.c` and
//! driven packet by packet; replies are decoded with prost. AddressSanitizer and UBSan watch
//! the C where the host gcc supports them, so hostile input must not read or write out of
//! bounds. The boot, PIC and virtqueue code is proven by booting the image in a VMM.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

use agentvm_proto::guest::framing::{FrameDecoder, frame_bytes};
use agentvm_proto::guest::v1::envelope::Body;
use agentvm_proto::guest::v1::{
    DescribeHarness, DirtyMemory, DirtyMemoryDone, Envelope, GuestError, HarnessFrame, HealthCheck,
    HealthReport, Hello, Identity, Ready, Restored, RestoredAck, Shutdown, StreamClose,
    harness_frame, restored,
};
use agentvm_proto::v1::{
    Cancel, Capabilities, ControllerFrame, Event, EventKind, HarnessDescriptor, HarnessEnd,
    Message as ContentMessage, Part, Resumability, Start, TextPart, controller_frame, event, part,
};
use agentvm_testguest::{EPHEMERAL_PORT_BASE, MAX_CONNECTIONS, VSOCK_BUF_ALLOC, VSOCK_PORT};
use prost::Message;

const HOST_CID: u64 = 2;
const GUEST_CID: u64 = 3;
const HDR: usize = 44;
const MAX_PAYLOAD: usize = 4096 - HDR;

const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;

// ---------------------------------------------------------------------------------------------
// The native driver process.

const C_SOURCES: &[&str] = &[
    "proto.c",
    "fmt.c",
    "handlers.c",
    "frame.c",
    "vsock.c",
    "cmdline.c",
];

fn driver_binary() -> &'static PathBuf {
    static DRIVER: OnceLock<PathBuf> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        // Per process: test runners that use one process per test must not race on it.
        // Drivers of processes that have exited are removed.
        let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        const PREFIX: &str = "testguest-native-driver-";
        for entry in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix(PREFIX)
                && !PathBuf::from(format!("/proc/{pid}")).exists()
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let out = tmp.join(format!("{PREFIX}{}", std::process::id()));
        let build = |sanitize: bool| -> Result<(), String> {
            let mut cmd = Command::new("gcc");
            cmd.args([
                "-DTG_NATIVE",
                "-std=gnu11",
                "-g",
                "-O1",
                "-fno-omit-frame-pointer",
                "-Wall",
                "-Wextra",
                "-Werror",
            ]);
            if sanitize {
                cmd.args(["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]);
            }
            cmd.arg("-I").arg(root.join("c"));
            for src in C_SOURCES {
                cmd.arg(root.join("c").join(src));
            }
            cmd.arg(root.join("tests/c/driver.c")).arg("-o").arg(&out);
            let output = cmd.output().map_err(|e| format!("running gcc: {e}"))?;
            if output.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&output.stderr).into_owned())
            }
        };
        if let Err(e) = build(true) {
            eprintln!("note: no sanitizers for the native test guest ({e}); building without");
            build(false).unwrap_or_else(|e| panic!("building the native test driver:\n{e}"));
        }
        out
    })
}

#[derive(Debug, Clone, PartialEq)]
enum Out {
    Pkt(Pkt),
    Serial(String),
    Reset,
    Frame(Vec<u8>),
    Action(u32),
    Word(u32),
    Parsed(String),
}

struct Driver {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Driver {
    fn spawn() -> Self {
        let mut child = Command::new(driver_binary())
            .env("ASAN_OPTIONS", "detect_leaks=0")
            .env("UBSAN_OPTIONS", "print_stacktrace=1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the native test driver");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self {
            child,
            stdin,
            stdout,
        }
    }

    fn died(&mut self) -> ! {
        let status = self.child.wait().unwrap();
        let mut stderr = String::new();
        let _ = self
            .child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr);
        panic!("the native test guest died ({status}):\n{stderr}");
    }

    fn cmd(&mut self, cmd: u8, payload: &[u8]) -> Vec<Out> {
        let mut msg = vec![cmd];
        msg.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        msg.extend_from_slice(payload);
        if self
            .stdin
            .write_all(&msg)
            .and_then(|_| self.stdin.flush())
            .is_err()
        {
            self.died();
        }
        let mut outs = Vec::new();
        loop {
            let mut hdr = [0u8; 5];
            if self.stdout.read_exact(&mut hdr).is_err() {
                self.died();
            }
            let mut body = vec![0u8; u32::from_le_bytes(hdr[1..5].try_into().unwrap()) as usize];
            if self.stdout.read_exact(&mut body).is_err() {
                self.died();
            }
            outs.push(match hdr[0] {
                b'.' => return outs,
                b'P' => Out::Pkt(Pkt::decode(&body)),
                b'S' => Out::Serial(String::from_utf8(body).unwrap()),
                b'X' => Out::Reset,
                b'F' => Out::Frame(body),
                b'A' => Out::Action(u32::from_le_bytes(body.try_into().unwrap())),
                b'W' => Out::Word(u32::from_le_bytes(body.try_into().unwrap())),
                b'K' => Out::Parsed(String::from_utf8(body).unwrap()),
                k => panic!("unknown output record {k}"),
            });
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// vsock packets and a host that speaks to the guest through them.

#[derive(Debug, Clone, PartialEq, Default)]
struct Pkt {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    ty: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
    payload: Vec<u8>,
}

impl Pkt {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HDR + self.payload.len());
        b.extend_from_slice(&self.src_cid.to_le_bytes());
        b.extend_from_slice(&self.dst_cid.to_le_bytes());
        b.extend_from_slice(&self.src_port.to_le_bytes());
        b.extend_from_slice(&self.dst_port.to_le_bytes());
        b.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.ty.to_le_bytes());
        b.extend_from_slice(&self.op.to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        b.extend_from_slice(&self.buf_alloc.to_le_bytes());
        b.extend_from_slice(&self.fwd_cnt.to_le_bytes());
        b.extend_from_slice(&self.payload);
        b
    }

    fn decode(b: &[u8]) -> Self {
        assert!(b.len() >= HDR, "guest sent a {}-byte packet", b.len());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap());
        let p = Self {
            src_cid: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            dst_cid: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            ty: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
            payload: b[HDR..].to_vec(),
        };
        assert_eq!(u32_at(24) as usize, p.payload.len(), "len field of {p:?}");
        assert_eq!(p.ty, 1, "guest packets are STREAM");
        assert_eq!(p.flags, 0);
        assert!(b.len() <= 4096, "one tx buffer holds at most 4 KiB");
        p
    }
}

/// The host's view of one connection.
struct Conn {
    guest_port: u32,
    /// What we advertise; we consume everything at once, so fwd_cnt = received.
    buf_alloc: u32,
    received: u32,
    sent: u32,
    guest_buf_alloc: u32,
    guest_fwd_cnt: u32,
    /// The credit our last packet granted.
    told_buf_alloc: u32,
    told_fwd: u32,
    dec: FrameDecoder,
    frames: VecDeque<Envelope>,
    reset: bool,
}

struct Host {
    d: Driver,
    cid: u64,
    conns: HashMap<u32, Conn>,
    serial: Vec<String>,
    resets: usize,
}

impl Host {
    fn new() -> Self {
        Self::with(0, 0)
    }

    /// A guest with `dirty_pages` of dirty region and `tx_limit` tx buffers (0: unlimited).
    fn with(dirty_pages: u32, tx_limit: u32) -> Self {
        let mut d = Driver::spawn();
        let mut init = GUEST_CID.to_le_bytes().to_vec();
        init.extend_from_slice(&dirty_pages.to_le_bytes());
        init.extend_from_slice(&tx_limit.to_le_bytes());
        assert!(d.cmd(b'i', &init).is_empty());
        Self {
            d,
            cid: GUEST_CID,
            conns: HashMap::new(),
            serial: Vec::new(),
            resets: 0,
        }
    }

    /// Runs a driver command and takes in whatever the guest sent; returns its packets.
    fn cmd(&mut self, cmd: u8, payload: &[u8]) -> Vec<Pkt> {
        let outs = self.d.cmd(cmd, payload);
        self.absorb(outs)
    }

    fn absorb(&mut self, outs: Vec<Out>) -> Vec<Pkt> {
        let mut pkts = Vec::new();
        for out in outs {
            match out {
                Out::Pkt(p) => {
                    assert_eq!(p.src_cid, self.cid);
                    assert_eq!(p.dst_cid, HOST_CID);
                    if let Some(c) = self.conns.get_mut(&p.dst_port)
                        && c.guest_port == p.src_port
                    {
                        c.guest_buf_alloc = p.buf_alloc;
                        c.guest_fwd_cnt = p.fwd_cnt;
                        if p.op == OP_RST {
                            c.reset = true;
                        }
                        if p.op == OP_RW {
                            c.received += p.payload.len() as u32;
                            assert!(
                                c.received - c.told_fwd <= c.told_buf_alloc,
                                "the guest overran the credit the host gave it"
                            );
                            c.dec.extend(&p.payload);
                            while let Some(f) = c.dec.next_frame().expect("guest frames decode") {
                                c.frames.push_back(f);
                            }
                        }
                    }
                    pkts.push(p);
                }
                Out::Serial(s) => self.serial.push(s),
                Out::Reset => self.resets += 1,
                other => panic!("unexpected output {other:?}"),
            }
        }
        pkts
    }

    fn pkt(&self, hport: u32, op: u16, payload: &[u8]) -> Pkt {
        let (gport, buf_alloc, fwd) = match self.conns.get(&hport) {
            Some(c) => (c.guest_port, c.buf_alloc, c.received),
            None => (VSOCK_PORT, 1 << 20, 0),
        };
        Pkt {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: hport,
            dst_port: gport,
            ty: 1,
            op,
            flags: 0,
            buf_alloc,
            fwd_cnt: fwd,
            payload: payload.to_vec(),
        }
    }

    fn send(&mut self, p: &Pkt) -> Vec<Pkt> {
        if let Some(c) = self.conns.get_mut(&p.src_port) {
            if p.op == OP_RW {
                c.sent += p.payload.len() as u32;
            }
            c.told_buf_alloc = p.buf_alloc;
            c.told_fwd = p.fwd_cnt;
        }
        self.cmd(b'p', &p.encode())
    }

    fn track(&mut self, hport: u32, guest_port: u32, buf_alloc: u32) {
        self.conns.insert(
            hport,
            Conn {
                guest_port,
                buf_alloc,
                received: 0,
                sent: 0,
                guest_buf_alloc: 0,
                guest_fwd_cnt: 0,
                told_buf_alloc: 0,
                told_fwd: 0,
                dec: FrameDecoder::new(1 << 20),
                frames: VecDeque::new(),
                reset: false,
            },
        );
    }

    /// Connects from `hport` to the guest's port 1024, advertising `buf_alloc`.
    fn open_with(&mut self, hport: u32, buf_alloc: u32) {
        self.track(hport, VSOCK_PORT, buf_alloc);
        let req = self.pkt(hport, OP_REQUEST, &[]);
        let out = self.send(&req);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].op, OP_RESPONSE);
        assert_eq!((out[0].src_port, out[0].dst_port), (VSOCK_PORT, hport));
        assert_eq!(out[0].buf_alloc, VSOCK_BUF_ALLOC);
        assert_eq!(out[0].fwd_cnt, 0);
    }

    fn open(&mut self, hport: u32) {
        self.open_with(hport, 1 << 20);
    }

    /// Writes stream bytes in RW packets, never beyond the guest's credit.
    fn write(&mut self, hport: u32, mut bytes: &[u8], chunk: usize) -> Vec<Pkt> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let c = &self.conns[&hport];
            if c.reset {
                break;
            }
            let credit = c.guest_buf_alloc - (c.sent - c.guest_fwd_cnt);
            assert!(credit > 0, "the guest left the host without credit");
            let n = bytes.len().min(chunk).min(credit as usize).min(MAX_PAYLOAD);
            let p = self.pkt(hport, OP_RW, &bytes[..n]);
            out.extend(self.send(&p));
            bytes = &bytes[n..];
        }
        out
    }

    fn frames(&mut self, hport: u32) -> Vec<Envelope> {
        self.conns
            .get_mut(&hport)
            .unwrap()
            .frames
            .drain(..)
            .collect()
    }

    fn request(&mut self, hport: u32, env: &Envelope) -> Vec<Envelope> {
        self.write(hport, &frame_bytes(env), MAX_PAYLOAD);
        self.frames(hport)
    }

    fn is_reset(&self, hport: u32) -> bool {
        self.conns[&hport].reset
    }
}

fn env(id: u64, body: Body) -> Envelope {
    Envelope {
        id,
        body: Some(body),
    }
}

fn hello(id: u64) -> Envelope {
    env(
        id,
        Body::Hello(Hello {
            protocol_version: 1,
            host_version: "test".into(),
        }),
    )
}

fn ready(id: u64, restore_generation: u64, identity: Option<Identity>) -> Envelope {
    env(
        id,
        Body::Ready(Ready {
            protocol_version: 1,
            agent_version: "testguest-1".into(),
            boot_generation: 1,
            restore_generation,
            identity,
            harness_running: true,
            // TG_MAX_FRAME (c/handlers.h): the host keeps its frames below it.
            max_frame_bytes: 256 * 1024,
        }),
    )
}

fn guest_error(id: u64, code: i32, message: &str) -> Envelope {
    env(
        id,
        Body::Error(GuestError {
            code,
            message: message.into(),
        }),
    )
}

fn error_code(e: &Envelope) -> i32 {
    match &e.body {
        Some(Body::Error(err)) => err.code,
        other => panic!("expected GuestError, got {other:?}"),
    }
}

fn harness(id: u64, stream: u64, frame: harness_frame::Frame) -> Envelope {
    env(
        id,
        Body::Harness(HarnessFrame {
            stream,
            frame: Some(frame),
        }),
    )
}

fn controller(id: u64, stream: u64, exec: &str, frame: controller_frame::Frame) -> Envelope {
    harness(
        id,
        stream,
        harness_frame::Frame::Controller(ControllerFrame {
            session: "sess-1".into(),
            execution_id: exec.into(),
            frame: Some(frame),
        }),
    )
}

fn start(id: u64, stream: u64, exec: &str) -> Envelope {
    let input = ContentMessage {
        role: "user".into(),
        parts: vec![Part {
            part: Some(part::Part::Text(TextPart {
                text: "hello".into(),
            })),
        }],
    };
    controller(
        id,
        stream,
        exec,
        controller_frame::Frame::Start(Start {
            config: b"{\"k\":1}".to_vec(),
            history: vec![Event {
                execution_id: "old".into(),
                kind: EventKind::EventInput as i32,
                body: Some(event::Body::Message(input.clone())),
                ..Default::default()
            }],
            inputs: vec![input],
            identity: None,
            resume_from_seq: 4,
            history_after_seq: 0,
            history_continues: false,
        }),
    )
}

/// The three frames of one counter turn.
fn turn(id: u64, stream: u64, exec: &str, count: u64) -> Vec<Envelope> {
    let ev = |kind: EventKind, body| {
        harness(
            id,
            stream,
            harness_frame::Frame::Event(Event {
                execution_id: exec.into(),
                schema_version: 1,
                kind: kind as i32,
                body: Some(body),
                ..Default::default()
            }),
        )
    };
    vec![
        ev(
            EventKind::EventOutput,
            event::Body::Message(ContentMessage {
                role: "assistant".into(),
                parts: vec![Part {
                    part: Some(part::Part::Text(TextPart {
                        text: count.to_string(),
                    })),
                }],
            }),
        ),
        ev(
            EventKind::EventEnd,
            event::Body::End(HarnessEnd {
                state: "COMPLETED".into(),
                error: None,
            }),
        ),
        harness(
            id,
            stream,
            harness_frame::Frame::Close(StreamClose {
                code: 0,
                message: String::new(),
            }),
        ),
    ]
}

fn dirty(id: u64, mebibytes: u32, stamp: u32) -> Envelope {
    env(id, Body::DirtyMemory(DirtyMemory { mebibytes, stamp }))
}

fn dirty_done(id: u64, pages: u32, mismatched: u32) -> Envelope {
    env(
        id,
        Body::DirtyMemoryDone(DirtyMemoryDone { pages, mismatched }),
    )
}

// ---------------------------------------------------------------------------------------------
// Frame protocol.

#[test]
fn hello_gets_ready_and_a_wrong_version_is_refused() {
    let mut h = Host::new();
    h.open(5000);
    assert_eq!(h.request(5000, &hello(7)), vec![ready(7, 0, None)]);
    let v2 = env(
        8,
        Body::Hello(Hello {
            protocol_version: 2,
            host_version: String::new(),
        }),
    );
    assert_eq!(
        h.request(5000, &v2),
        vec![guest_error(8, 9, "unsupported protocol version 2")]
    );
    let max = env(
        10,
        Body::Hello(Hello {
            protocol_version: u32::MAX,
            host_version: String::new(),
        }),
    );
    assert_eq!(
        h.request(5000, &max),
        vec![guest_error(
            10,
            9,
            "unsupported protocol version 4294967295"
        )]
    );
    // A refusal is an answer, not a protocol error: the connection stays up.
    assert_eq!(h.request(5000, &hello(9)), vec![ready(9, 0, None)]);
    assert!(!h.is_reset(5000));
}

#[test]
fn health_check_reports_uptime() {
    let mut h = Host::new();
    h.open(5000);
    h.cmd(b'u', &123_456_789_012u64.to_le_bytes());
    let got = h.request(5000, &env(3, Body::HealthCheck(HealthCheck {})));
    assert_eq!(
        got,
        vec![env(
            3,
            Body::HealthReport(HealthReport {
                uptime_ms: 123_456_789_012,
                harness_running: true,
                harness_restarts: 0,
                restore_generation: 0,
            })
        )]
    );
}

#[test]
fn describe_harness() {
    let mut h = Host::new();
    h.open(5000);
    let got = h.request(5000, &env(4, Body::DescribeHarness(DescribeHarness {})));
    assert_eq!(
        got,
        vec![env(
            4,
            Body::HarnessDescriptor(HarnessDescriptor {
                id: "testguest".into(),
                models: vec![],
                tools: vec![],
                capabilities: Some(Capabilities {
                    resumability: Resumability::RequiresMemorySnapshot as i32,
                    ..Default::default()
                }),
                version: "1".into(),
            })
        )]
    );
}

#[test]
fn counter_turns_count_up_across_connections() {
    let mut h = Host::new();
    h.open(5000);
    h.open(5001);
    assert_eq!(h.request(5000, &start(10, 5, "e1")), turn(10, 5, "e1", 1));
    assert_eq!(h.request(5001, &start(11, 0, "e2")), turn(11, 0, "e2", 2));
    assert_eq!(
        h.request(5000, &start(12, 1 << 40, "")),
        turn(12, 1 << 40, "", 3)
    );
    for n in 4..=12 {
        assert_eq!(h.request(5001, &start(n, n, "x")), turn(n, n, "x", n));
    }
}

/// A Start whose inputs end with `last` (an earlier input and a non-text part first, so
/// the guest must find the last input's text part).
fn start_with_inputs(id: u64, stream: u64, exec: &str, last: Vec<Part>) -> Envelope {
    let text = |t: &str| Part {
        part: Some(part::Part::Text(TextPart { text: t.into() })),
    };
    controller(
        id,
        stream,
        exec,
        controller_frame::Frame::Start(Start {
            config: vec![],
            history: vec![],
            inputs: vec![
                ContentMessage {
                    role: "user".into(),
                    parts: vec![text("earlier")],
                },
                ContentMessage {
                    role: "user".into(),
                    parts: last,
                },
            ],
            identity: None,
            resume_from_seq: 0,
            history_after_seq: 0,
            history_continues: false,
        }),
    )
}

/// The frames of one turn answered with `text`.
fn answered(id: u64, stream: u64, exec: &str, text: &str) -> Vec<Envelope> {
    let mut frames = turn(id, stream, exec, 1);
    if let Some(Body::Harness(h)) = &mut frames[0].body
        && let Some(harness_frame::Frame::Event(ev)) = &mut h.frame
        && let Some(event::Body::Message(m)) = &mut ev.body
    {
        m.parts = vec![Part {
            part: Some(part::Part::Text(TextPart { text: text.into() })),
        }];
    } else {
        panic!("turn() changed shape");
    }
    frames
}

#[test]
fn echo_mode_describes_a_stateless_harness_and_echoes_the_last_input() {
    let mut h = Host::new();
    h.cmd(b'm', &1u32.to_le_bytes());
    h.open(5000);
    let got = h.request(5000, &env(4, Body::DescribeHarness(DescribeHarness {})));
    let Some(Body::HarnessDescriptor(d)) = &got[0].body else {
        panic!("{got:?}");
    };
    assert_eq!(d.id, "testguest-echo");
    assert_eq!(
        d.capabilities,
        Some(Capabilities {
            resumability: Resumability::StatelessReplay as i32,
            fork_safe: true,
            ..Default::default()
        })
    );
    let text = |t: &str| Part {
        part: Some(part::Part::Text(TextPart { text: t.into() })),
    };
    // Every turn answers from its own Start: the same Start, the same answer.
    for _ in 0..2 {
        assert_eq!(
            h.request(5000, &start_with_inputs(10, 5, "e1", vec![text("héllo")])),
            answered(10, 5, "e1", "echo:héllo")
        );
    }
    // A non-text part before the text part is skipped.
    let reasoning = Part {
        part: Some(part::Part::Reasoning(Default::default())),
    };
    assert_eq!(
        h.request(
            5000,
            &start_with_inputs(11, 6, "e2", vec![reasoning, text("two")])
        ),
        answered(11, 6, "e2", "echo:two")
    );
    // No text at all: an empty echo.
    assert_eq!(
        h.request(5000, &start_with_inputs(12, 7, "e3", vec![])),
        answered(12, 7, "e3", "echo:")
    );
    // Too long to echo: the stream is closed with INVALID_ARGUMENT, the guest carries on.
    let got = h.request(
        5000,
        &start_with_inputs(13, 8, "e4", vec![text(&"x".repeat(1025))]),
    );
    let Some(Body::Harness(hf)) = &got[0].body else {
        panic!("{got:?}");
    };
    let Some(harness_frame::Frame::Close(close)) = &hf.frame else {
        panic!("{got:?}");
    };
    assert_eq!(close.code, 3, "{close:?}");
    assert_eq!(
        h.request(5000, &start_with_inputs(14, 9, "e5", vec![text("ok")])),
        answered(14, 9, "e5", "echo:ok")
    );
}

#[test]
fn cancel_closes_the_stream_and_other_controller_frames_are_ignored() {
    let mut h = Host::new();
    h.open(5000);
    let cancel = controller(
        20,
        9,
        "e1",
        controller_frame::Frame::Cancel(Cancel {
            reason: "user".into(),
        }),
    );
    assert_eq!(
        h.request(5000, &cancel),
        vec![harness(
            20,
            9,
            harness_frame::Frame::Close(StreamClose {
                code: 1,
                message: "canceled".into(),
            })
        )]
    );
    let park = controller(
        21,
        9,
        "e1",
        controller_frame::Frame::Park(Default::default()),
    );
    assert!(h.request(5000, &park).is_empty());
    let no_frame = env(
        22,
        Body::Harness(HarnessFrame {
            stream: 9,
            frame: None,
        }),
    );
    assert!(h.request(5000, &no_frame).is_empty());
    let host_close = harness(23, 9, harness_frame::Frame::Close(StreamClose::default()));
    assert!(h.request(5000, &host_close).is_empty());
    // None of that touched the count.
    assert_eq!(h.request(5000, &start(24, 9, "e2")), turn(24, 9, "e2", 1));
}

#[test]
fn dirty_memory_stamps_and_verifies() {
    const PAGES: u32 = 2 * 256 + 3;
    let mut h = Host::with(PAGES, 0);
    h.open(5000);
    let word = |h: &mut Host, page: u32| match h.d.cmd(b'w', &page.to_le_bytes())[..] {
        [Out::Word(w)] => w,
        ref other => panic!("{other:?}"),
    };

    assert_eq!(
        h.request(5000, &dirty(1, 1, 0xabc)),
        vec![dirty_done(1, 256, 0)]
    );
    for page in [0, 1, 200, 255] {
        assert_eq!(word(&mut h, page), 0xabc ^ page);
    }
    assert_eq!(word(&mut h, 256), 0, "beyond the request");

    // Verify only: pages the last stamping call covered are compared, nothing is written.
    assert_eq!(
        h.request(5000, &dirty(2, 2, 0)),
        vec![dirty_done(2, 512, 0)]
    );
    assert_eq!(word(&mut h, 256), 0);
    let mut poke = 10u32.to_le_bytes().to_vec();
    poke.extend_from_slice(&0u32.to_le_bytes());
    h.d.cmd(b'W', &poke);
    assert_eq!(
        h.request(5000, &dirty(3, 1, 0)),
        vec![dirty_done(3, 256, 1)]
    );
    assert_eq!(word(&mut h, 10), 0, "verify mode does not repair");

    // Stamping checks the previous stamps first, then writes the new ones.
    assert_eq!(
        h.request(5000, &dirty(4, 2, 0x55)),
        vec![dirty_done(4, 512, 1)]
    );
    assert_eq!(word(&mut h, 10), 0x55 ^ 10);
    assert_eq!(word(&mut h, 511), 0x55 ^ 511);
    // Clamped to the region: 515 pages, all previously covered ones intact.
    assert_eq!(
        h.request(5000, &dirty(5, 100, 7)),
        vec![dirty_done(5, PAGES, 0)]
    );
    assert_eq!(word(&mut h, PAGES - 1), 7 ^ (PAGES - 1));
    assert_eq!(
        h.request(5000, &dirty(6, u32::MAX, 0)),
        vec![dirty_done(6, PAGES, 0)]
    );
    // A page index that equals the stamp stores 0 and is still verified.
    assert_eq!(
        h.request(5000, &dirty(7, 3, 300)),
        vec![dirty_done(7, PAGES, 0)]
    );
    assert_eq!(word(&mut h, 300), 0);
    assert_eq!(
        h.request(5000, &dirty(8, 3, 0)),
        vec![dirty_done(8, PAGES, 0)]
    );
    // Zero MiB with a stamp: nothing covered, so the next verify compares nothing.
    assert_eq!(h.request(5000, &dirty(9, 0, 9)), vec![dirty_done(9, 0, 0)]);
    assert_eq!(
        h.request(5000, &dirty(10, 3, 0)),
        vec![dirty_done(10, PAGES, 0)]
    );
}

#[test]
fn dirty_memory_without_a_region_does_nothing() {
    let mut h = Host::new();
    h.open(5000);
    assert_eq!(h.request(5000, &dirty(1, 64, 1)), vec![dirty_done(1, 0, 0)]);
}

#[test]
fn restored_is_acked_remembered_and_reported() {
    let mut h = Host::new();
    h.open(5000);
    let identity = Identity {
        session_uid: "sess-uid".into(),
        hostname: "vm-1".into(),
        vsock_cid: 9,
        vm_id: "vm-id-1".into(),
    };
    let restored = |generation, identity| {
        env(
            30 + generation,
            Body::Restored(Restored {
                kind: restored::Kind::Forked as i32,
                entropy: vec![0x5a; 32],
                wall_clock_unix_nanos: -5,
                identity,
                generation,
                network: None,
            }),
        )
    };
    assert_eq!(
        h.request(5000, &restored(7, Some(identity.clone()))),
        vec![env(37, Body::RestoredAck(RestoredAck { generation: 7 }))]
    );
    assert!(h.serial.contains(&"TESTGUEST RESTORED 7".to_string()));
    assert_eq!(
        h.request(5000, &hello(1)),
        vec![ready(1, 7, Some(identity))]
    );
    let health = h.request(5000, &env(2, Body::HealthCheck(HealthCheck {})));
    assert!(
        matches!(&health[0].body, Some(Body::HealthReport(r)) if r.restore_generation == 7),
        "{health:?}"
    );
    // An empty identity is still an identity; a missing one clears it.
    assert_eq!(
        h.request(5000, &restored(8, Some(Identity::default()))),
        vec![env(38, Body::RestoredAck(RestoredAck { generation: 8 }))]
    );
    assert_eq!(
        h.request(5000, &hello(3)),
        vec![ready(3, 8, Some(Identity::default()))]
    );
    h.request(5000, &restored(9, None));
    assert_eq!(h.request(5000, &hello(4)), vec![ready(4, 9, None)]);
    // Other connections see the same guest state.
    h.open(5001);
    assert_eq!(h.request(5001, &hello(5)), vec![ready(5, 9, None)]);
}

#[test]
fn an_oversized_identity_is_refused() {
    let mut h = Host::new();
    h.open(5000);
    let big = env(
        1,
        Body::Restored(Restored {
            identity: Some(Identity {
                hostname: "h".repeat(4000),
                ..Default::default()
            }),
            generation: 3,
            ..Default::default()
        }),
    );
    let got = h.request(5000, &big);
    assert_eq!(error_code(&got[0]), 8);
    assert_eq!(
        h.request(5000, &hello(2)),
        vec![ready(2, 0, None)],
        "not applied"
    );
}

#[test]
fn shutdown_resets_the_vm_without_a_reply() {
    let mut h = Host::new();
    h.open(5000);
    let got = h.request(
        5000,
        &env(
            1,
            Body::Shutdown(Shutdown {
                reason: "done".into(),
                grace_ms: 10,
            }),
        ),
    );
    assert!(got.is_empty());
    assert_eq!(h.serial, vec!["TESTGUEST SHUTDOWN".to_string()]);
    assert_eq!(h.resets, 1);
}

#[test]
fn bodies_the_guest_does_not_handle_are_unimplemented() {
    let mut h = Host::new();
    h.open(5000);
    let cases = [
        (ready(1, 0, None), "unimplemented envelope field 3"),
        (
            env(2, Body::HealthReport(HealthReport::default())),
            "unimplemented envelope field 7",
        ),
        (
            env(3, Body::DirtyMemoryDone(DirtyMemoryDone::default())),
            "unimplemented envelope field 14",
        ),
        (Envelope { id: 4, body: None }, "envelope has no body"),
    ];
    for (request, message) in cases {
        let id = request.id;
        assert_eq!(
            h.request(5000, &request),
            vec![guest_error(id, 12, message)]
        );
    }
    // A body field from a newer protocol (number 20, and a varint 300) is named too.
    let mut raw = vec![0x08, 0x05, 0xa2, 0x01, 0x01, 0x00, 0xe0, 0x12, 0xac, 0x02];
    let mut frame = vec![raw.len() as u8];
    frame.append(&mut raw);
    h.write(5000, &frame, MAX_PAYLOAD);
    assert_eq!(
        h.frames(5000),
        vec![guest_error(5, 12, "unimplemented envelope field 300")]
    );
    assert!(!h.is_reset(5000));
}

#[test]
fn replies_are_canonical_protobuf() {
    // Byte for byte what prost encodes, not just something prost can decode.
    let mut d = Driver::spawn();
    d.cmd(b'i', &[3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let requests = [
        hello(1),
        env(2, Body::DescribeHarness(DescribeHarness {})),
        start(3, 7, &"x".repeat(300)),
        env(4, Body::HealthCheck(HealthCheck {})),
    ];
    let mut expected: Vec<Vec<u8>> = vec![
        frame_bytes(&ready(1, 0, None)),
        frame_bytes(&env(
            2,
            Body::HarnessDescriptor(HarnessDescriptor {
                id: "testguest".into(),
                capabilities: Some(Capabilities {
                    resumability: 2,
                    ..Default::default()
                }),
                version: "1".into(),
                ..Default::default()
            }),
        )),
    ];
    expected.extend(turn(3, 7, &"x".repeat(300), 1).iter().map(frame_bytes));
    expected.push(frame_bytes(&env(
        4,
        Body::HealthReport(HealthReport {
            harness_running: true,
            ..Default::default()
        }),
    )));
    let mut got = Vec::new();
    for r in &requests {
        for out in d.cmd(b'e', &r.encode_to_vec()) {
            match out {
                Out::Frame(f) => got.push(f),
                Out::Action(a) => assert_eq!(a, 0),
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(got, expected);
}

#[test]
fn ids_of_every_varint_width_come_back_canonical() {
    // The codec works in 32-bit halves: every boundary of a varint's width, both halves.
    let mut d = Driver::spawn();
    d.cmd(b'i', &[3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let mut ids: Vec<u64> = vec![1, u64::MAX, 1 << 63];
    for bits in [7u32, 14, 21, 28, 31, 32, 35, 42, 49, 56] {
        ids.extend([(1u64 << bits) - 1, 1u64 << bits, (1u64 << bits) | 0x55]);
    }
    for id in ids {
        let request = env(id, Body::HealthCheck(HealthCheck {}));
        let expected = frame_bytes(&env(
            id,
            Body::HealthReport(HealthReport {
                harness_running: true,
                ..Default::default()
            }),
        ));
        let got: Vec<Vec<u8>> = d
            .cmd(b'e', &request.encode_to_vec())
            .into_iter()
            .filter_map(|out| match out {
                Out::Frame(f) => Some(f),
                _ => None,
            })
            .collect();
        assert_eq!(got, vec![expected], "id {id:#x}");
        // And a stream id of the same width through a counter turn.
        let exec = format!("e{id}");
        let frames: Vec<Vec<u8>> = d
            .cmd(b'e', &start(id, id, &exec).encode_to_vec())
            .into_iter()
            .filter_map(|out| match out {
                Out::Frame(f) => Some(f),
                _ => None,
            })
            .collect();
        assert_eq!(frames.len(), 3, "id {id:#x}");
        let decoded: Vec<Envelope> = frames
            .iter()
            .map(|f| {
                let mut b = &f[..];
                Envelope::decode_length_delimited(&mut b).unwrap()
            })
            .collect();
        assert!(
            decoded.iter().all(|e| e.id == id),
            "id {id:#x}: {decoded:?}"
        );
    }
}

#[test]
fn malformed_frames_get_invalid_argument_then_rst() {
    let bodies: Vec<Vec<u8>> = vec![
        vec![0x12, 0x05], // hello claiming 5 bytes that are not there
        vec![0x08],       // id with its varint missing
        vec![0x08, 0xff], // truncated varint
        vec![
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
        ], // > 64 bits
        vec![0x0b, 0x0c], // group start/end (wire types 3 and 4)
        vec![0x0e],       // wire type 6
        vec![0x0f],       // wire type 7
        vec![0x00, 0x00], // field 0
        vec![0x0a, 0x00], // id as bytes
        vec![0x10, 0x01], // hello as a varint
        vec![0x12, 0x02, 0x08, 0xff], // hello with a truncated version
        vec![0x12, 0x02, 0x0a, 0x05], // hello: host_version overruns
        vec![0x5a, 0x02, 0x12, 0x03], // harness: controller overruns
        vec![0x5a, 0x04, 0x12, 0x02, 0x12, 0x09], // controller: execution_id overruns
        vec![0x6a, 0x02, 0x10, 0x80], // dirty_memory: truncated stamp
        vec![0x22, 0x02, 0x22, 0x05], // restored: identity overruns
        vec![0x22, 0x04, 0x22, 0x02, 0x0b, 0x00], // restored: identity holds a group
        vec![0x32, 0x01, 0x0f], // health_check holding wire type 7
        vec![0x42, 0x01, 0x08], // shutdown holding a truncated field
        vec![0x09, 0x01, 0x02], // fixed64 cut short
        vec![0x8d, 0x01, 0x01], // fixed32 (field 17) cut short
        vec![0x80, 0x80, 0x80, 0x80, 0x80, 0x01], // key above 32 bits
    ];
    for (i, body) in bodies.iter().enumerate() {
        let mut h = Host::new();
        let port = 6000 + i as u32;
        h.open(port);
        let mut frame = vec![body.len() as u8];
        frame.extend_from_slice(body);
        let pkts = h.write(port, &frame, MAX_PAYLOAD);
        assert_eq!(
            h.frames(port),
            vec![guest_error(0, 3, "malformed frame")],
            "body {i}: {body:02x?}"
        );
        assert_eq!(pkts.last().unwrap().op, OP_RST, "body {i}");
        // The connection is gone: more data is answered with RST, and nothing is decoded.
        let again = h.pkt(port, OP_RW, &frame_bytes(&hello(1)));
        let pkts = h.send(&again);
        assert_eq!(pkts.len(), 1);
        assert_eq!(pkts[0].op, OP_RST);
        assert!(h.frames(port).is_empty());
    }
}

#[test]
fn frame_lengths_over_the_limit_are_refused() {
    let cases: [&[u8]; 3] = [
        &[0x81, 0x80, 0x10],                                           // 256 KiB + 1
        &[0xff, 0xff, 0xff, 0xff, 0x0f],                               // 4 GiB - 1
        &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], // 2^64 - 1
    ];
    for (i, prefix) in cases.iter().enumerate() {
        let mut h = Host::new();
        h.open(5000);
        let pkts = h.write(5000, prefix, MAX_PAYLOAD);
        assert_eq!(
            h.frames(5000),
            vec![guest_error(0, 8, "frame too large")],
            "{i}"
        );
        assert_eq!(pkts.last().unwrap().op, OP_RST);
    }
    // An overlong varint can never become a length.
    let mut h = Host::new();
    h.open(5000);
    h.write(5000, &[0xff; 11], MAX_PAYLOAD);
    assert_eq!(error_code(&h.frames(5000)[0]), 3);
    assert!(h.is_reset(5000));
}

#[test]
fn a_frame_of_exactly_256_kib_is_reassembled() {
    let mut h = Host::new();
    h.open(5000);
    // A Start whose config pads the Envelope to exactly MAX_FRAME bytes.
    let mut request = start(1, 2, "big");
    let pad = |r: &mut Envelope, n: usize| {
        if let Some(Body::Harness(HarnessFrame {
            frame: Some(harness_frame::Frame::Controller(c)),
            ..
        })) = &mut r.body
            && let Some(controller_frame::Frame::Start(s)) = &mut c.frame
        {
            s.config = vec![b'c'; n];
        }
    };
    let mut n = agentvm_testguest::MAX_FRAME - 100;
    pad(&mut request, n);
    n = n + agentvm_testguest::MAX_FRAME - request.encoded_len();
    pad(&mut request, n);
    assert_eq!(request.encoded_len(), agentvm_testguest::MAX_FRAME);
    // Two of them back to back, in odd-sized packets.
    let mut wire = frame_bytes(&request);
    wire.extend(frame_bytes(&request));
    h.write(5000, &wire, 3001);
    let mut expected = turn(1, 2, "big", 1);
    expected.extend(turn(1, 2, "big", 2));
    assert_eq!(h.frames(5000), expected);
    // The guest reported what it consumed as it went (the host's write loop relies on it).
    assert_eq!(h.conns[&5000].guest_fwd_cnt, wire.len() as u32);
    // One byte more is too much.
    pad(&mut request, n + 1);
    h.write(5000, &frame_bytes(&request)[..8], MAX_PAYLOAD);
    assert_eq!(error_code(&h.frames(5000)[0]), 8);
}

#[test]
fn frames_split_anywhere_and_batched_are_all_handled() {
    let mut h = Host::new();
    h.open(5000);
    let mut wire = Vec::new();
    for id in 1..=20 {
        wire.extend(frame_bytes(&hello(id)));
    }
    // All in one packet.
    h.write(5000, &wire, MAX_PAYLOAD);
    let expected: Vec<_> = (1..=20).map(|id| ready(id, 0, None)).collect();
    assert_eq!(h.frames(5000), expected);
    // One byte per packet.
    h.write(5000, &wire, 1);
    assert_eq!(h.frames(5000), expected);
    // Empty RW packets are harmless.
    let empty = h.pkt(5000, OP_RW, &[]);
    h.send(&empty);
    assert!(h.frames(5000).is_empty());
    assert!(!h.is_reset(5000));
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn hostile_envelopes_never_crash_the_guest() {
    let mut d = Driver::spawn();
    d.cmd(b'i', &[3, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]);
    let valid: Vec<Vec<u8>> = vec![
        hello(1).encode_to_vec(),
        start(2, 3, "e").encode_to_vec(),
        start_with_inputs(
            6,
            7,
            "e",
            vec![Part {
                part: Some(part::Part::Text(TextPart { text: "hi".into() })),
            }],
        )
        .encode_to_vec(),
        dirty(3, 1, 5).encode_to_vec(),
        env(
            4,
            Body::Restored(Restored {
                entropy: vec![1; 16],
                identity: Some(Identity {
                    hostname: "h".into(),
                    ..Default::default()
                }),
                generation: 1,
                ..Default::default()
            }),
        )
        .encode_to_vec(),
        env(5, Body::HealthCheck(HealthCheck {})).encode_to_vec(),
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let check = |outs: Vec<Out>| {
        for o in outs {
            match o {
                // Whatever the guest answers must itself be a well-formed Envelope.
                Out::Frame(f) => {
                    let mut dec = FrameDecoder::new(1 << 20);
                    dec.extend(&f);
                    dec.next_frame().unwrap().unwrap();
                }
                Out::Action(a) => assert!(a <= 2),
                Out::Serial(_) => {}
                other => panic!("{other:?}"),
            }
        }
    };
    for round in 0..3000 {
        // Half the rounds as the echo harness, which parses the Start's inputs.
        if round % 1500 == 0 {
            d.cmd(b'm', &u32::from(round != 0).to_le_bytes());
        }
        let mut bytes = if round % 3 == 0 {
            // Pure noise.
            let n = (xorshift(&mut x) % 64) as usize;
            (0..n).map(|_| xorshift(&mut x) as u8).collect()
        } else {
            // A valid request, mutated and cut.
            let mut b = valid[(xorshift(&mut x) % valid.len() as u64) as usize].clone();
            for _ in 0..1 + xorshift(&mut x) % 4 {
                let i = (xorshift(&mut x) % b.len() as u64) as usize;
                b[i] = xorshift(&mut x) as u8;
            }
            let keep = b.len() - (xorshift(&mut x) % 3) as usize;
            b.truncate(keep);
            b
        };
        check(d.cmd(b'e', &bytes));
        // The same bytes as a stream, with a random length prefix.
        let mut stream = vec![(xorshift(&mut x) % 0x80) as u8];
        stream.append(&mut bytes);
        check(d.cmd(b'f', &stream));
    }
    // Deep nesting and huge inner lengths: the guest never descends into what it skips.
    let mut nested = vec![0x08, 0x01];
    for _ in 0..10_000 {
        let mut outer = vec![0x5a];
        let mut len = nested.len();
        while len >= 0x80 {
            outer.push(len as u8 | 0x80);
            len >>= 7;
        }
        outer.push(len as u8);
        outer.extend(&nested);
        nested = outer;
        if nested.len() > 200_000 {
            break;
        }
    }
    check(d.cmd(b'e', &nested));
    for huge in [
        &[0x5a, 0xff, 0xff, 0xff, 0xff, 0x0f][..],
        &[
            0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
        ],
        &[0x5a, 0x06, 0x12, 0x04, 0x1a, 0xff, 0xff, 0x7f],
    ] {
        check(d.cmd(b'e', huge));
    }
    // Still alive and well (what Ready says depends on which mutated Restored got through).
    let outs = d.cmd(b'e', &hello(9).encode_to_vec());
    let Out::Frame(f) = &outs[0] else {
        panic!("{outs:?}")
    };
    let mut dec = FrameDecoder::new(1 << 20);
    dec.extend(f);
    let reply = dec.next_frame().unwrap().unwrap();
    assert!(
        matches!(reply.body, Some(Body::Ready(_))) && reply.id == 9,
        "{reply:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// vsock.

#[test]
fn other_ports_and_unknown_connections_get_rst() {
    let mut h = Host::new();
    let mut req = h.pkt(7000, OP_REQUEST, &[]);
    req.dst_port = 1025;
    let out = h.send(&req);
    assert_eq!(out.len(), 1);
    assert_eq!(
        (out[0].op, out[0].src_port, out[0].dst_port),
        (OP_RST, 1025, 7000)
    );
    for op in [
        OP_RW,
        OP_RESPONSE,
        OP_SHUTDOWN,
        OP_CREDIT_UPDATE,
        OP_CREDIT_REQUEST,
    ] {
        let out = h.send(&h.pkt(7001, op, b"x"));
        assert_eq!(out.len(), 1, "op {op}");
        assert_eq!(out[0].op, OP_RST);
    }
    // RST is never answered.
    assert!(h.send(&h.pkt(7002, OP_RST, &[])).is_empty());
}

#[test]
fn sixteen_connections_at_once_and_no_more() {
    let mut h = Host::new();
    for port in 0..MAX_CONNECTIONS as u32 {
        h.open(8000 + port);
    }
    let out = h.send(&h.pkt(9000, OP_REQUEST, &[]));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].op, OP_RST);
    for port in 0..MAX_CONNECTIONS as u32 {
        assert_eq!(
            h.request(8000 + port, &hello(port.into())),
            vec![ready(port.into(), 0, None)]
        );
    }
    // Once one goes, a new one fits.
    assert!(h.send(&h.pkt(8003, OP_RST, &[])).is_empty());
    h.open(9000);
}

#[test]
fn shutdown_and_rst_forget_the_connection() {
    let mut h = Host::new();
    h.open(5000);
    let mut shut = h.pkt(5000, OP_SHUTDOWN, &[]);
    shut.flags = 3;
    let out = h.send(&shut);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].op, out[0].dst_port), (OP_RST, 5000));
    let out = h.send(&h.pkt(5000, OP_RW, &frame_bytes(&hello(1))));
    assert_eq!(out[0].op, OP_RST, "forgotten");

    h.open(5001);
    assert!(h.send(&h.pkt(5001, OP_RST, &[])).is_empty());
    let out = h.send(&h.pkt(5001, OP_RW, &frame_bytes(&hello(1))));
    assert_eq!(out[0].op, OP_RST, "forgotten");
    // The port can be reused.
    h.open(5001);
    assert_eq!(h.request(5001, &hello(2)), vec![ready(2, 0, None)]);
}

#[test]
fn malformed_packets_reset_only_their_connection() {
    let mut h = Host::new();
    h.open(5000);
    let malformed: [fn(&Host) -> Vec<u8>; 4] = [
        |h| {
            let mut p = h.pkt(5001, OP_RW, b"abc");
            p.ty = 2; // SEQPACKET
            p.encode()
        },
        |h| {
            let mut b = h.pkt(5001, OP_RW, b"abc").encode();
            b[24] = 4; // len beyond the packet
            b
        },
        |h| h.pkt(5001, 99, &[]).encode(),
        |h| h.pkt(5001, OP_REQUEST, &[]).encode(), // a second REQUEST
    ];
    for make in &malformed {
        h.open(5001);
        let out = h.cmd(b'p', &make(&h));
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].op, out[0].dst_port), (OP_RST, 5001));
        let out = h.send(&h.pkt(5001, OP_RW, b"x"));
        assert_eq!(out[0].op, OP_RST, "forgotten");
    }
    // Trailing bytes after the payload are ignored; short packets and other CIDs are dropped.
    h.open(5001);
    let mut b = h.pkt(5001, OP_RW, &frame_bytes(&hello(1))).encode();
    b.extend_from_slice(b"trailing");
    h.cmd(b'p', &b);
    assert_eq!(h.frames(5001), vec![ready(1, 0, None)]);
    assert!(h.cmd(b'p', &[0u8; 43]).is_empty());
    assert!(h.cmd(b'p', &[]).is_empty());
    let mut other = h.pkt(5001, OP_RW, b"x");
    other.dst_cid = 4;
    assert!(h.send(&other).is_empty());
    let mut other = h.pkt(5001, OP_RW, b"x");
    other.src_cid = 5;
    assert!(h.send(&other).is_empty());
    // The bystander never noticed.
    assert_eq!(h.request(5000, &hello(2)), vec![ready(2, 0, None)]);
    assert!(!h.is_reset(5000));
}

#[test]
fn the_guest_never_exceeds_the_host_credit() {
    let mut h = Host::new();
    h.open_with(5000, 10);
    let expected = frame_bytes(&ready(1, 0, None));
    assert!(expected.len() > 20);
    let out = h.write(5000, &frame_bytes(&hello(1)), MAX_PAYLOAD);
    let rw: Vec<_> = out.iter().filter(|p| p.op == OP_RW).collect();
    assert_eq!(rw.len(), 1);
    assert_eq!(rw[0].payload, expected[..10]);
    // Nothing more while the host reports nothing consumed.
    let mut stale = h.pkt(5000, OP_CREDIT_UPDATE, &[]);
    stale.fwd_cnt = 0;
    assert!(h.send(&stale).is_empty());
    let mut got = rw[0].payload.clone();
    while got.len() < expected.len() {
        // The host has now consumed all it got (fwd_cnt = received) and grows its buffer.
        h.conns.get_mut(&5000).unwrap().buf_alloc += 3;
        let out = h.send(&h.pkt(5000, OP_CREDIT_UPDATE, &[]));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].op, OP_RW);
        assert!(out[0].payload.len() <= 13);
        got.extend(&out[0].payload);
    }
    assert_eq!(got, expected);
    assert_eq!(h.frames(5000), vec![ready(1, 0, None)]);
}

#[test]
fn credit_request_and_consumption_get_credit_updates() {
    let mut h = Host::new();
    h.open(5000);
    let wire = frame_bytes(&hello(1));
    h.write(5000, &wire, MAX_PAYLOAD);
    h.frames(5000);
    let out = h.send(&h.pkt(5000, OP_CREDIT_REQUEST, &[]));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].op, OP_CREDIT_UPDATE);
    assert_eq!(out[0].buf_alloc, VSOCK_BUF_ALLOC);
    assert_eq!(out[0].fwd_cnt, wire.len() as u32);

    // Half the window consumed without any reply: the guest says so by itself.
    let mut h = Host::new();
    h.open(5000);
    let big = frame_bytes(&start(1, 1, &"e".repeat(40_000)));
    let half = (VSOCK_BUF_ALLOC / 2) as usize;
    let out = h.write(5000, &big[..half - 1], MAX_PAYLOAD);
    assert!(out.is_empty(), "{out:?}");
    let out = h.write(5000, &big[half - 1..half], MAX_PAYLOAD);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].op, out[0].fwd_cnt), (OP_CREDIT_UPDATE, half as u32));
}

#[test]
fn an_execution_id_over_1_kib_is_refused() {
    let mut h = Host::new();
    h.open(5000);
    let got = h.request(5000, &start(1, 1, &"e".repeat(1025)));
    assert_eq!(error_code(&got[0]), 8);
    assert_eq!(
        h.request(5000, &start(2, 1, &"e".repeat(1024))),
        turn(2, 1, &"e".repeat(1024), 1)
    );
}

#[test]
fn tx_buffer_shortage_delays_but_loses_nothing() {
    let mut h = Host::with(0, 1);
    h.open(5000); // the RESPONSE took the only buffer
    let out = h.write(5000, &frame_bytes(&hello(1)), MAX_PAYLOAD);
    assert!(out.is_empty(), "{out:?}");
    let out = h.cmd(b't', &[]);
    assert_eq!(out.len(), 1);
    assert_eq!(h.frames(5000), vec![ready(1, 0, None)]);
    // A counter turn is three frames; they go out one packet per buffer.
    h.cmd(b't', &[]);
    h.write(5000, &frame_bytes(&start(2, 1, "e")), MAX_PAYLOAD);
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(h.frames(5000));
        h.cmd(b't', &[]);
    }
    assert_eq!(got, turn(2, 1, "e", 1));
    // RSTs owed to strangers also wait for a buffer.
    assert_eq!(h.request(5000, &hello(3)), vec![ready(3, 0, None)]);
    let out = h.send(&h.pkt(7000, OP_RW, b"x"));
    assert!(out.is_empty(), "{out:?}");
    let out = h.cmd(b't', &[]);
    assert_eq!(out[0].op, OP_RST);
    // An RST still owed to a connection is not sent to a new one on the same ports.
    h.cmd(b't', &[]);
    assert_eq!(h.request(5000, &hello(4)), vec![ready(4, 0, None)]);
    let mut shut = h.pkt(5000, OP_SHUTDOWN, &[]);
    shut.fwd_cnt = 0; // no credit for anything else either
    assert!(h.send(&shut).is_empty());
    h.track(5000, VSOCK_PORT, 1 << 20);
    assert!(h.send(&h.pkt(5000, OP_REQUEST, &[])).is_empty());
    let out = h.cmd(b't', &[]);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].op, OP_RESPONSE);
    assert_eq!(h.request(5000, &hello(5)), vec![]);
    let out = h.cmd(b't', &[]);
    assert_eq!(out.iter().map(|p| p.op).collect::<Vec<_>>(), vec![OP_RW]);
    assert_eq!(h.frames(5000), vec![ready(5, 0, None)]);
}

#[test]
fn a_host_that_never_reads_gets_reset() {
    let mut h = Host::new();
    h.open_with(5000, 0);
    // HealthCheck frames: 3 bytes each, each answered with 5 bytes nobody reads.
    let mut wire = Vec::new();
    while wire.len() < 24 * 1024 {
        wire.extend(frame_bytes(&env(0, Body::HealthCheck(HealthCheck {}))));
    }
    let out = h.write(5000, &wire, MAX_PAYLOAD);
    assert!(out.iter().any(|p| p.op == OP_RST), "{out:?}");
    assert!(h.is_reset(5000));
}

#[test]
fn an_error_is_delivered_before_the_rst() {
    let mut h = Host::new();
    h.open_with(5000, 4);
    let out = h.write(5000, &[0x02, 0x12, 0x05], MAX_PAYLOAD);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].op, OP_RW);
    // More input on a closing connection is not read (this packet grants no new credit).
    let mut more = h.pkt(5000, OP_RW, &frame_bytes(&hello(1)));
    more.fwd_cnt = 0;
    assert!(h.send(&more).is_empty());
    h.conns.get_mut(&5000).unwrap().buf_alloc = 1 << 20;
    let out = h.send(&h.pkt(5000, OP_CREDIT_UPDATE, &[]));
    assert_eq!(
        out.iter().map(|p| p.op).collect::<Vec<_>>(),
        vec![OP_RW, OP_RST]
    );
    assert_eq!(h.frames(5000), vec![guest_error(0, 3, "malformed frame")]);
}

#[test]
fn transport_reset_drops_every_connection_and_takes_the_new_cid() {
    let mut h = Host::new();
    h.open(5000);
    h.open(5001);
    h.cmd(b'r', &7u64.to_le_bytes());
    // Packets for the old CID are not for this guest any more.
    assert!(h.send(&h.pkt(5000, OP_RW, b"x")).is_empty());
    h.cid = 7;
    let out = h.send(&h.pkt(5000, OP_RW, b"x"));
    assert_eq!((out[0].op, out[0].src_cid), (OP_RST, 7));
    h.open(5001);
    assert_eq!(h.request(5001, &hello(1)), vec![ready(1, 0, None)]);
}

#[test]
fn connect_sends_request_then_ready_on_response() {
    let mut h = Host::new();
    let outs = h.d.cmd(b'c', &6000u32.to_le_bytes());
    assert_eq!(outs[0], Out::Action(0));
    let pkts = h.absorb(outs[1..].to_vec());
    assert_eq!(pkts.len(), 1);
    assert_eq!(pkts[0].op, OP_REQUEST);
    assert_eq!(pkts[0].dst_port, 6000);
    let gport = pkts[0].src_port;
    assert_eq!(gport, EPHEMERAL_PORT_BASE);
    h.track(6000, gport, 1 << 20);
    let out = h.send(&h.pkt(6000, OP_RESPONSE, &[]));
    assert_eq!(out.len(), 1);
    assert_eq!(h.frames(6000), vec![ready(0, 0, None)]);
    // From here it is an ordinary connection.
    assert_eq!(h.request(6000, &start(3, 1, "e")), turn(3, 1, "e", 1));

    // A refused connect is forgotten; the next one uses the next port.
    let outs = h.d.cmd(b'c', &6001u32.to_le_bytes());
    let pkts = h.absorb(outs[1..].to_vec());
    assert_eq!(pkts[0].src_port, EPHEMERAL_PORT_BASE + 1);
    h.track(6001, EPHEMERAL_PORT_BASE + 1, 1 << 20);
    assert!(h.send(&h.pkt(6001, OP_RST, &[])).is_empty());
    assert_eq!(
        h.serial.last().unwrap(),
        "TESTGUEST ERROR vsock connect refused, port 6001"
    );
    let out = h.send(&h.pkt(6001, OP_RESPONSE, &[]));
    assert_eq!(out[0].op, OP_RST);
    // Data before the RESPONSE is a protocol error.
    let outs = h.d.cmd(b'c', &6002u32.to_le_bytes());
    h.absorb(outs[1..].to_vec());
    h.track(6002, EPHEMERAL_PORT_BASE + 2, 1 << 20);
    let out = h.send(&h.pkt(6002, OP_RW, b"x"));
    assert_eq!(out[0].op, OP_RST);
}

// ---------------------------------------------------------------------------------------------
// Command line.

fn parse(cmdline: &str) -> String {
    let mut d = Driver::spawn();
    match &d.cmd(b'k', cmdline.as_bytes())[..] {
        [Out::Parsed(s)] => s.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn command_line() {
    assert_eq!(
        parse("console=ttyS0 virtio_mmio.device=4K@0xd0000000:5 testguest.connect=7000"),
        "dev 1000@d0000000:5;connect 7000;irqtest 0;echo 0;bad 0"
    );
    assert_eq!(
        parse(
            "virtio_mmio.device=0x1000@0xD0001000:12:3\tvirtio_mmio.device=1M@4096:7 \
             testguest.irqtest  reboot=k"
        ),
        "dev 1000@d0001000:12;dev 100000@1000:7;connect 0;irqtest 1;echo 0;bad 0"
    );
    // Not NUL-terminated in the driver: the length bound is what ends the parse.
    assert_eq!(
        parse("virtio_mmio.device=512@0xfeb00000:10"),
        "dev 200@feb00000:10;connect 0;irqtest 0;echo 0;bad 0"
    );
    assert_eq!(parse(""), "connect 0;irqtest 0;echo 0;bad 0");
    for bad in [
        "virtio_mmio.device=4K@:5",
        "virtio_mmio.device=4K@0xd0000000",
        "virtio_mmio.device=4K@0xd0000000:",
        "virtio_mmio.device=4Q@0x1:1",
        "virtio_mmio.device=4K@0xd0000000:5x",
        "virtio_mmio.device=4K@0xd0000000:99999999999",
        "virtio_mmio.device=99999999999999999999999@0:1",
        "virtio_mmio.device=0x",
        "virtio_mmio.device=",
        "testguest.connect=abc",
        "testguest.connect=0",
        "testguest.connect=",
        "testguest.connect=5000x",
    ] {
        assert_eq!(parse(bad), "connect 0;irqtest 0;echo 0;bad 1", "{bad}");
    }
    assert_eq!(
        parse("testguest.echo console=ttyS0"),
        "connect 0;irqtest 0;echo 1;bad 0"
    );
    // Lookalikes are not options.
    assert_eq!(
        parse(
            "xvirtio_mmio.device=4K@0:1 testguest.irqtests testguest.connectx=1 testguest.echoes"
        ),
        "connect 0;irqtest 0;echo 0;bad 0"
    );
    let many: Vec<String> = (0..10)
        .map(|i| {
            format!(
                "virtio_mmio.device=4K@0x{:x}:5",
                0xd000_0000u32 + i * 0x1000
            )
        })
        .collect();
    assert_eq!(parse(&many.join(" ")).matches("dev ").count(), 8);
}
