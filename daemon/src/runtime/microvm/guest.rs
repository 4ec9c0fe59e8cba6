//! The host side of `agentvm.guest.v1`: a stream to the guest agent over hybrid vsock
//! (`CONNECT <port>\n` → `OK <n>\n` on the VM's socket), length-delimited frames on it, and
//! the harness channel the controller uses ([`GuestEndpoint`]) built from such streams.
//!
//! Nothing here assumes a stream survives: every snapshot resets them all, so each Describe
//! and each execution opens its own, with retries while a guest is booting or still dropping
//! the streams a restore cut.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::Instrument;

use agentvm_proto::guest::framing::{FrameDecoder, frame_bytes};
use agentvm_proto::guest::v1::envelope::Body;
use agentvm_proto::guest::v1::{
    DescribeHarness, Envelope, HarnessFrame, Hello, Ready, Restored, harness_frame,
};
use agentvm_proto::guest::{GUEST_AGENT_PORT, PROTOCOL_VERSION};
use agentvm_proto::v1::{ControllerFrame, HarnessDescriptor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};

use crate::controller::endpoint::{HarnessEndpoint, HarnessStream};

/// Largest frame accepted from a guest (a harness event carries at most a model message).
const MAX_FRAME: usize = 4 << 20;
/// Room for the envelope and HarnessFrame around a Start inside one guest frame.
const START_ENVELOPE_ROOM: usize = 1024;
/// How often a wait on the guest looks at the VMM behind it: a VMM that exits, or stops
/// running (SIGSTOP, a frozen cgroup) for a whole tick, ends the wait then.
const WATCH_TICK: Duration = Duration::from_millis(250);

/// The deadlines of the guest protocol.
#[derive(Debug, Clone, Copy)]
pub struct GuestTimeouts {
    /// How long a booted or restored guest may take to answer on vsock at all.
    pub ready: Duration,
    /// How long the guest agent may take to answer a call of its own (the vsock handshake,
    /// Hello, Restored). A Describe and an execution wait on the harness instead, and are
    /// bounded by the host's Describe and harness idle deadlines.
    pub reply: Duration,
}

/// How the VMM behind a guest stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmHealth {
    Running,
    Gone,
    /// Alive but unable to run, and why ("is stopped (SIGSTOP)").
    Stalled(String),
}

/// Tells how the VMM behind a guest stands.
pub type Liveness = Arc<dyn Fn() -> VmmHealth + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    #[error("vsock socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("the guest refused vsock port {port} (answered {answer:?})")]
    Refused { port: u32, answer: String },
    #[error("guest stream: {0}")]
    Io(#[from] std::io::Error),
    #[error("the guest sent a bad frame: {0}")]
    Frame(String),
    #[error("the guest did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the guest answered {got} where {want} was expected")]
    Unexpected { want: &'static str, got: String },
    #[error("the guest speaks protocol version {0}, the host {PROTOCOL_VERSION}")]
    Version(u32),
    #[error("the guest reported error {code}: {message}")]
    Guest { code: i32, message: String },
    #[error("the session's VMM is not running")]
    VmmGone,
    #[error("the session's VMM {0}")]
    VmmStalled(String),
}

/// Watches the VMM while a read waits on its guest.
struct Watch {
    health: Liveness,
    /// When the VMM was first seen unable to run, since it last ran.
    stalled_since: Option<tokio::time::Instant>,
}

impl Watch {
    fn new(health: Liveness) -> Self {
        Self {
            health,
            stalled_since: None,
        }
    }

    /// An error once the VMM is gone, or has been unable to run for a whole tick (a stop
    /// that brief may be a debugger's look or a freezer passing by).
    fn check(&mut self) -> Result<(), GuestError> {
        match (self.health)() {
            VmmHealth::Running => {
                self.stalled_since = None;
                Ok(())
            }
            VmmHealth::Gone => Err(GuestError::VmmGone),
            VmmHealth::Stalled(why) => match self.stalled_since {
                Some(since) if since.elapsed() >= WATCH_TICK => Err(GuestError::VmmStalled(why)),
                Some(_) => Ok(()),
                None => {
                    self.stalled_since = Some(tokio::time::Instant::now());
                    Ok(())
                }
            },
        }
    }

    /// Reads what the guest sends next, until `within` (no bound: as long as the VMM runs).
    /// Cancel-safe: nothing read is lost when the caller stops waiting.
    async fn read(
        &mut self,
        stream: &mut UnixStream,
        buf: &mut [u8],
        within: Option<Duration>,
    ) -> Result<usize, GuestError> {
        let deadline = within.map(|d| tokio::time::Instant::now() + d);
        loop {
            let next_look = tokio::time::Instant::now() + WATCH_TICK;
            let wake = deadline.map_or(next_look, |d| d.min(next_look));
            tokio::select! {
                read = stream.read(buf) => return Ok(read?),
                _ = tokio::time::sleep_until(wake) => {
                    if let (Some(at), Some(after)) = (deadline, within)
                        && tokio::time::Instant::now() >= at
                    {
                        return Err(GuestError::Timeout(after));
                    }
                    self.check()?;
                }
            }
        }
    }
}

/// One open stream to the guest agent.
pub struct GuestConn {
    stream: UnixStream,
    watch: Watch,
    /// The bound on the guest agent's answers to its own calls.
    reply_timeout: Duration,
    decoder: FrameDecoder,
    /// The largest frame the guest said it reads (its Ready).
    guest_max_frame: usize,
    next_id: u64,
    /// The harness stream id the next execution on this connection takes: each has its
    /// own, so nothing late from an earlier one can pass for the next's.
    next_execution: u64,
}

impl GuestConn {
    /// `CONNECT port` on the VM's vsock socket.
    pub async fn connect(
        socket: &Path,
        port: u32,
        reply_timeout: Duration,
        health: Liveness,
    ) -> Result<Self, GuestError> {
        let mut stream =
            UnixStream::connect(socket)
                .await
                .map_err(|source| GuestError::Connect {
                    path: socket.display().to_string(),
                    source,
                })?;
        stream
            .write_all(format!("CONNECT {port}\n").as_bytes())
            .await?;
        // Byte by byte: what follows the line is already the guest's stream.
        let mut watch = Watch::new(health);
        let mut line = Vec::new();
        let mut byte = [0u8];
        while line.last() != Some(&b'\n') && line.len() < 64 {
            let read = watch
                .read(&mut stream, &mut byte, Some(reply_timeout))
                .await?;
            if read == 0 {
                break;
            }
            line.push(byte[0]);
        }
        if !line.starts_with(b"OK ") || line.last() != Some(&b'\n') {
            return Err(GuestError::Refused {
                port,
                answer: String::from_utf8_lossy(&line).into_owned(),
            });
        }
        Ok(Self {
            stream,
            watch,
            reply_timeout,
            decoder: FrameDecoder::new(MAX_FRAME),
            guest_max_frame: agentvm_proto::guest::framing::DEFAULT_MAX_FRAME,
            next_id: 1,
            next_execution: 1,
        })
    }

    /// Connects and exchanges Hello/Ready, retrying until `timeouts.ready` while the guest
    /// is not listening yet or drops the stream (a guest still booting, or applying a
    /// restore's transport reset) — but not once `health` says there is no VMM to wait for,
    /// or one that cannot run.
    pub async fn ready(
        socket: &Path,
        timeouts: GuestTimeouts,
        health: &Liveness,
    ) -> Result<(Self, Ready), GuestError> {
        let deadline = tokio::time::Instant::now() + timeouts.ready;
        let mut pause = Duration::from_millis(1);
        loop {
            if health() == VmmHealth::Gone {
                return Err(GuestError::VmmGone);
            }
            let attempt = async {
                let mut conn =
                    Self::connect(socket, GUEST_AGENT_PORT, timeouts.reply, health.clone()).await?;
                let ready = conn.hello().await?;
                Ok::<_, GuestError>((conn, ready))
            };
            let result = tokio::time::timeout(Duration::from_secs(5), attempt)
                .await
                .unwrap_or(Err(GuestError::Timeout(Duration::from_secs(5))));
            match result {
                Ok(done) => return Ok(done),
                Err(
                    e @ (GuestError::Version(_)
                    | GuestError::Guest { .. }
                    | GuestError::VmmGone
                    | GuestError::VmmStalled(_)),
                ) => return Err(e),
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
            }
        }
    }

    /// The largest harness Start this guest can be sent: its frame limit, less room for the
    /// envelope around the Start, and never more than a harness's gRPC server takes.
    pub fn max_start_bytes(&self) -> usize {
        self.guest_max_frame
            .saturating_sub(START_ENVELOPE_ROOM)
            .min(crate::controller::endpoint::DEFAULT_MAX_START_BYTES)
    }

    /// Whether the guest may still be at the other end: the stream is neither closed nor
    /// failed (checked without reading anything).
    pub fn is_open(&self) -> bool {
        use nix::sys::socket::{MsgFlags, recv};
        use std::os::fd::AsRawFd;
        // A one-byte peek: it neither blocks nor consumes anything.
        let mut byte = [0u8; 1];
        match recv(
            self.stream.as_raw_fd(),
            &mut byte,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => e == nix::errno::Errno::EAGAIN,
        }
    }

    pub async fn send(&mut self, body: Body) -> Result<u64, GuestError> {
        let id = self.next_id;
        self.next_id += 1;
        self.stream
            .write_all(&frame_bytes(&Envelope {
                id,
                body: Some(body),
            }))
            .await?;
        Ok(id)
    }

    /// The guest's next frame, waiting at most `within` for each read (no bound: as long as
    /// the VMM runs).
    pub async fn recv(&mut self, within: Option<Duration>) -> Result<Envelope, GuestError> {
        let mut buf = [0u8; 16 << 10];
        loop {
            match self.decoder.next_frame() {
                Ok(Some(envelope)) => return Ok(envelope),
                Ok(None) => {}
                Err(e) => return Err(GuestError::Frame(e.to_string())),
            }
            let n = self.watch.read(&mut self.stream, &mut buf, within).await?;
            if n == 0 {
                return Err(GuestError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            self.decoder.extend(&buf[..n]);
        }
    }

    /// Sends `body` and waits for its answer, at most `within` (none: the caller bounds it).
    async fn call(&mut self, body: Body, within: Option<Duration>) -> Result<Body, GuestError> {
        let id = self.send(body).await?;
        loop {
            let reply = self.recv(within).await?;
            match reply.body {
                Some(Body::Error(e)) => {
                    return Err(GuestError::Guest {
                        code: e.code,
                        message: e.message,
                    });
                }
                Some(body) if reply.id == id => return Ok(body),
                // Unsolicited frames (a Ready from a guest-initiated stream) are not ours.
                _ => continue,
            }
        }
    }

    pub async fn hello(&mut self) -> Result<Ready, GuestError> {
        match self
            .call(
                Body::Hello(Hello {
                    protocol_version: PROTOCOL_VERSION,
                    host_version: format!("agentvmd {}", env!("CARGO_PKG_VERSION")),
                }),
                Some(self.reply_timeout),
            )
            .await?
        {
            Body::Ready(ready) if ready.protocol_version == PROTOCOL_VERSION => {
                if ready.max_frame_bytes > 0 {
                    self.guest_max_frame = ready.max_frame_bytes as usize;
                }
                Ok(ready)
            }
            Body::Ready(ready) => Err(GuestError::Version(ready.protocol_version)),
            other => Err(unexpected("Ready", &other)),
        }
    }

    /// Tells a restored or forked guest so; returns the generation it acknowledged.
    pub async fn restored(&mut self, notice: Restored) -> Result<u64, GuestError> {
        let want = notice.generation;
        match self
            .call(Body::Restored(notice), Some(self.reply_timeout))
            .await?
        {
            Body::RestoredAck(ack) if ack.generation == want => Ok(ack.generation),
            other => Err(unexpected("RestoredAck", &other)),
        }
    }

    /// The harness's descriptor. The guest answers once its harness does, which on a first
    /// boot waits for the harness process to start: the caller bounds it.
    pub async fn describe(&mut self) -> Result<HarnessDescriptor, GuestError> {
        match self
            .call(Body::DescribeHarness(DescribeHarness {}), None)
            .await?
        {
            Body::HarnessDescriptor(d) => Ok(d),
            other => Err(unexpected("HarnessDescriptor", &other)),
        }
    }
}

fn unexpected(want: &'static str, got: &Body) -> GuestError {
    let name = format!("{got:?}");
    GuestError::Unexpected {
        want,
        got: name.split('(').next().unwrap_or_default().to_owned(),
    }
}

fn to_status(e: GuestError) -> Status {
    match e {
        GuestError::Guest { code, message } => Status::new(Code::from_i32(code), message),
        GuestError::Timeout(_) => Status::deadline_exceeded(e.to_string()),
        // The turn's failure handling tells a stalled VMM by asking the runtime again.
        GuestError::VmmStalled(_) => Status::unavailable(e.to_string()),
        other => Status::unavailable(other.to_string()),
    }
}

/// A stream kept between uses, for the next Describe or execution of the same VM.
type IdleConn = Arc<Mutex<Option<GuestConn>>>;

/// The harness inside a VM, reached over the guest protocol. One stream is kept open
/// between uses: a turn (Describe, then the execution) costs no vsock dial or Hello while
/// the guest keeps it. The endpoint lives as long as its incarnation, so a stream never
/// outlives the VM it was opened to.
pub struct GuestEndpoint {
    socket: PathBuf,
    timeouts: GuestTimeouts,
    health: Liveness,
    idle: IdleConn,
    /// What the guest last said it can take (`GuestConn::max_start_bytes`).
    max_start: std::sync::atomic::AtomicUsize,
}

impl GuestEndpoint {
    /// An endpoint for the guest behind `socket`, starting with `kept` (the stream the VM
    /// answered Ready on) when there is one.
    pub fn new(
        socket: PathBuf,
        timeouts: GuestTimeouts,
        health: Liveness,
        kept: Option<GuestConn>,
    ) -> Self {
        let max_start = kept.as_ref().map_or(
            crate::controller::endpoint::DEFAULT_MAX_START_BYTES,
            GuestConn::max_start_bytes,
        );
        Self {
            socket,
            timeouts,
            health,
            idle: Arc::new(Mutex::new(kept)),
            max_start: max_start.into(),
        }
    }

    /// The kept stream if the guest still holds it open, else a fresh one.
    async fn conn(&self) -> Result<GuestConn, Status> {
        let kept = self.idle.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(conn) = kept.filter(GuestConn::is_open) {
            return Ok(conn);
        }
        let (conn, _) = GuestConn::ready(&self.socket, self.timeouts, &self.health)
            .await
            .map_err(to_status)?;
        self.max_start
            .store(conn.max_start_bytes(), std::sync::atomic::Ordering::Relaxed);
        Ok(conn)
    }
}

fn keep(idle: &IdleConn, conn: GuestConn) {
    *idle.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
}

#[async_trait::async_trait]
impl HarnessEndpoint for GuestEndpoint {
    async fn describe(&self) -> Result<HarnessDescriptor, Status> {
        let mut conn = self.conn().await?;
        let descriptor = conn.describe().await.map_err(to_status)?;
        keep(&self.idle, conn);
        Ok(descriptor)
    }

    fn max_start_bytes(&self) -> usize {
        self.max_start.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn connect(&self) -> Result<HarnessStream, Status> {
        let conn = self.conn().await?;
        let (frames_tx, frames_rx) = mpsc::channel::<ControllerFrame>(16);
        let (events_tx, events_rx) = mpsc::channel(64);
        tokio::spawn(pump(conn, frames_rx, events_tx, self.idle.clone()).in_current_span());
        Ok(HarnessStream {
            frames: frames_tx,
            events: Box::pin(ReceiverStream::new(events_rx)),
        })
    }
}

/// Moves one execution between the controller's channels and the guest stream until the
/// guest closes it (or the controller goes away). An execution the guest closed leaves the
/// stream in `idle` for the next one.
async fn pump(
    mut conn: GuestConn,
    mut frames: mpsc::Receiver<ControllerFrame>,
    events: mpsc::Sender<Result<agentvm_proto::v1::Event, Status>>,
    idle: IdleConn,
) {
    let execution = conn.next_execution;
    conn.next_execution += 1;
    let mut host_open = true;
    loop {
        tokio::select! {
            frame = frames.recv(), if host_open => match frame {
                Some(frame) => {
                    let sent = conn.send(Body::Harness(HarnessFrame {
                        stream: execution,
                        frame: Some(harness_frame::Frame::Controller(frame)),
                    })).await;
                    if let Err(e) = sent {
                        let _ = events.send(Err(to_status(e))).await;
                        return;
                    }
                }
                None => host_open = false,
            },
            // No deadline of its own: the controller's harness idle deadline bounds a
            // harness that thinks long, the watch a VMM that exits or stops.
            reply = conn.recv(None) => {
                let item = match reply {
                    Ok(Envelope { body: Some(Body::Harness(HarnessFrame { stream, frame: Some(frame) })), .. }) if stream == execution => match frame {
                        harness_frame::Frame::Event(event) => Some(Ok(event)),
                        harness_frame::Frame::Close(close) => {
                            // The execution is over, however it ended; the stream serves on.
                            keep(&idle, conn);
                            if close.code != 0 {
                                let status = Status::new(Code::from_i32(close.code), close.message);
                                let _ = events.send(Err(status)).await;
                            }
                            return;
                        }
                        harness_frame::Frame::Controller(_) => Some(Err(Status::internal("the guest sent a controller frame"))),
                    },
                    Ok(Envelope { body: Some(Body::Error(e)), .. }) => Some(Err(Status::new(Code::from_i32(e.code), e.message))),
                    Ok(_) => None,
                    Err(e) => Some(Err(to_status(e))),
                };
                let Some(item) = item else { continue };
                let failed = item.is_err();
                // A closed channel means the controller went away: nothing more to deliver.
                if events.send(item).await.is_err() || failed {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use agentvm_proto::guest::v1::StreamClose;
    use tokio::net::UnixListener;
    use tokio_stream::StreamExt;

    use super::*;

    /// A VMM's hybrid vsock socket with a guest behind it that answers Hello, Describe and
    /// one event plus a clean close per execution; it hangs up after each execution when
    /// `hang_up` is set. Counts the streams opened to it.
    fn fake_guest(socket: &Path, hang_up: bool) -> Arc<AtomicUsize> {
        fake_guest_thinking(socket, hang_up, Duration::ZERO)
    }

    /// [`fake_guest`] whose harness thinks `think` before each execution's event, and never
    /// answers a Describe when that is `Duration::MAX`.
    fn fake_guest_thinking(socket: &Path, hang_up: bool, think: Duration) -> Arc<AtomicUsize> {
        let listener = UnixListener::bind(socket).unwrap();
        let opened = Arc::new(AtomicUsize::new(0));
        let count = opened.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut line = [0u8; 64];
                    let mut got = 0;
                    while !line[..got].contains(&b'\n') {
                        got += stream.read(&mut line[got..]).await.unwrap();
                    }
                    stream.write_all(b"OK 1024\n").await.unwrap();
                    let mut decoder = FrameDecoder::new(MAX_FRAME);
                    let mut buf = [0u8; 4096];
                    loop {
                        let n = stream.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        decoder.extend(&buf[..n]);
                        while let Ok(Some(envelope)) = decoder.next_frame() {
                            let reply = |body| {
                                frame_bytes(&Envelope {
                                    id: envelope.id,
                                    body: Some(body),
                                })
                            };
                            let harness = |stream, frame| {
                                frame_bytes(&Envelope {
                                    id: 0,
                                    body: Some(Body::Harness(HarnessFrame {
                                        stream,
                                        frame: Some(frame),
                                    })),
                                })
                            };
                            match envelope.body {
                                Some(Body::Hello(_)) => {
                                    let ready = Ready {
                                        protocol_version: PROTOCOL_VERSION,
                                        ..Default::default()
                                    };
                                    stream.write_all(&reply(Body::Ready(ready))).await.unwrap();
                                }
                                Some(Body::DescribeHarness(_)) if think == Duration::MAX => {}
                                Some(Body::DescribeHarness(_)) => {
                                    let d = HarnessDescriptor {
                                        id: "fake".into(),
                                        ..Default::default()
                                    };
                                    stream
                                        .write_all(&reply(Body::HarnessDescriptor(d)))
                                        .await
                                        .unwrap();
                                }
                                Some(Body::Harness(HarnessFrame { stream: id, .. })) => {
                                    let event = harness_frame::Frame::Event(Default::default());
                                    let close = harness_frame::Frame::Close(StreamClose::default());
                                    tokio::time::sleep(think).await;
                                    stream.write_all(&harness(id, event)).await.unwrap();
                                    stream.write_all(&harness(id, close)).await.unwrap();
                                    if hang_up {
                                        return;
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                });
            }
        });
        opened
    }

    /// Describe, then one execution to its clean close.
    async fn turn(endpoint: &GuestEndpoint) {
        assert_eq!(endpoint.describe().await.unwrap().id, "fake");
        let mut stream = endpoint.connect().await.unwrap();
        stream
            .frames
            .send(ControllerFrame::default())
            .await
            .unwrap();
        assert!(stream.events.next().await.unwrap().is_ok());
        assert!(
            stream.events.next().await.is_none(),
            "a clean close ends the events"
        );
    }

    fn running() -> Liveness {
        Arc::new(|| VmmHealth::Running)
    }

    fn timeouts() -> GuestTimeouts {
        GuestTimeouts {
            ready: Duration::from_secs(5),
            reply: Duration::from_secs(5),
        }
    }

    fn endpoint(socket: &Path, kept: Option<GuestConn>) -> GuestEndpoint {
        GuestEndpoint::new(socket.to_owned(), timeouts(), running(), kept)
    }

    #[tokio::test]
    async fn turns_reuse_one_stream_while_the_guest_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        let opened = fake_guest(&socket, false);
        // The stream the VM answered Ready on serves the first turn too.
        let (ready, _) = GuestConn::ready(&socket, timeouts(), &running())
            .await
            .unwrap();
        let endpoint = endpoint(&socket, Some(ready));
        for _ in 0..3 {
            turn(&endpoint).await;
        }
        assert_eq!(opened.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_stream_the_guest_closed_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        let opened = fake_guest(&socket, true);
        let endpoint = endpoint(&socket, None);
        for _ in 0..3 {
            turn(&endpoint).await;
            // Let the hang-up reach this side before the next turn looks.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(opened.load(Ordering::SeqCst), 3);
    }

    /// Issue 34 (item 3, and the lane's failed python harness): every read of a guest stream
    /// was cut at a fixed 30 s, so a harness that thought longer (or started slower) failed
    /// its turn though the host's own deadlines allowed it. Only the guest agent's own
    /// answers are bound by the reply timeout now.
    #[tokio::test]
    async fn a_harness_may_think_longer_than_the_guest_agent_may_take_to_reply() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        fake_guest_thinking(&socket, false, Duration::from_millis(600));
        let timeouts = GuestTimeouts {
            ready: Duration::from_secs(5),
            reply: Duration::from_millis(200),
        };
        let endpoint = GuestEndpoint::new(socket, timeouts, running(), None);
        turn(&endpoint).await;
    }

    /// Waits on a guest whose VMM cannot run end within a second or two, naming why,
    /// however long the deadlines are; a VMM that is gone ends them too.
    #[tokio::test]
    async fn a_stalled_or_gone_vmm_ends_the_wait_on_its_guest() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        fake_guest_thinking(&socket, false, Duration::MAX);
        let patient = GuestTimeouts {
            ready: Duration::from_secs(60),
            reply: Duration::from_secs(60),
        };
        let health = Arc::new(Mutex::new(VmmHealth::Running));
        let seen = health.clone();
        let liveness: Liveness = Arc::new(move || seen.lock().unwrap().clone());
        let endpoint = GuestEndpoint::new(socket.clone(), patient, liveness.clone(), None);

        *health.lock().unwrap() = VmmHealth::Stalled("is stopped (SIGSTOP)".into());
        let described = tokio::time::timeout(Duration::from_secs(5), endpoint.describe()).await;
        let status = described.expect("the stall ended the wait").unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("SIGSTOP"), "{status:?}");

        *health.lock().unwrap() = VmmHealth::Running;
        let (mut conn, _) = GuestConn::ready(&socket, patient, &liveness).await.unwrap();
        *health.lock().unwrap() = VmmHealth::Gone;
        let described = tokio::time::timeout(Duration::from_secs(5), conn.describe()).await;
        assert!(
            matches!(described, Ok(Err(GuestError::VmmGone))),
            "{described:?}"
        );
    }

    /// A stop shorter than a tick (a debugger's look) is not taken for a stall.
    #[tokio::test]
    async fn a_brief_stop_is_ridden_out() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        fake_guest_thinking(&socket, false, Duration::from_millis(1100));
        let looks = Arc::new(AtomicUsize::new(0));
        let counted = looks.clone();
        // Stalled at every other look: never for a whole tick.
        let liveness: Liveness =
            Arc::new(move || match counted.fetch_add(1, Ordering::SeqCst) % 2 {
                0 => VmmHealth::Stalled("is stopped (SIGSTOP)".into()),
                _ => VmmHealth::Running,
            });
        let timeouts = GuestTimeouts {
            ready: Duration::from_secs(5),
            reply: Duration::from_secs(5),
        };
        let endpoint = GuestEndpoint::new(socket, timeouts, liveness, None);
        turn(&endpoint).await;
        assert!(looks.load(Ordering::SeqCst) >= 3, "the watch looked on");
    }
}
