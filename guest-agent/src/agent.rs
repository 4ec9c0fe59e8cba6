//! The agent's side of `agentvm.guest.v1`: one task per host connection, answering
//! Hello/Health/Restored/Describe/Shutdown and carrying harness streams to the harness.
//!
//! The host is trusted more than a guest would be, but its frames still cannot crash the
//! agent: a malformed or oversized frame, or one out of order, is answered with an error frame
//! and the connection is closed; the agent keeps serving new connections.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentvm_proto::guest::PROTOCOL_VERSION;
use agentvm_proto::guest::framing::{FrameDecoder, frame_bytes};
use agentvm_proto::guest::v1::envelope::Body;
use agentvm_proto::guest::v1::restored::Kind as RestoredKind;
use agentvm_proto::guest::v1::{
    DirtyMemoryDone, Envelope, GuestError, HarnessFrame, HealthReport, Identity, Ready, Restored,
    RestoredAck, StreamClose, harness_frame,
};
use agentvm_proto::v1::ControllerFrame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, RwLock, mpsc};
use tokio_stream::StreamExt;
use tonic::Code;

use crate::bridge::HarnessLink;
use crate::dirty::{DirtyRegion, spare_pages};
use crate::supervisor::Supervisor;
use crate::system::{MAX_ENTROPY, System};

/// Largest frame accepted from the host (a controller frame carries at most a model message
/// and a turn's history).
pub const MAX_FRAME: usize = 16 << 20;
/// Harness streams one connection may have open at once.
const MAX_STREAMS: usize = 64;
/// Frames buffered towards one harness stream before the connection waits.
const STREAM_BUFFER: usize = 32;

pub struct Agent {
    pub system: Arc<dyn System>,
    pub link: Arc<dyn HarnessLink>,
    pub supervisor: Option<Arc<Supervisor>>,
    pub version: String,
    pub boot_generation: u64,
    identity: Mutex<Identity>,
    restore_generation: AtomicU64,
    started: Instant,
    /// Restores take it exclusively: no harness traffic moves while the clock, entropy and
    /// identity change.
    restore_gate: RwLock<()>,
    /// Notified when the host asked for a shutdown and the harness has been stopped.
    pub shut_down: Notify,
    /// What the DirtyMemory hook stamps.
    dirty: Arc<Mutex<DirtyRegion>>,
}

impl Agent {
    pub fn new(
        system: Arc<dyn System>,
        link: Arc<dyn HarnessLink>,
        supervisor: Option<Arc<Supervisor>>,
        identity: Identity,
        boot_generation: u64,
    ) -> Arc<Self> {
        Arc::new(Agent {
            system,
            link,
            supervisor,
            version: format!("agentvm-guest {}", env!("CARGO_PKG_VERSION")),
            boot_generation,
            identity: Mutex::new(identity),
            restore_generation: AtomicU64::new(0),
            started: Instant::now(),
            restore_gate: RwLock::new(()),
            shut_down: Notify::new(),
            dirty: Arc::default(),
        })
    }

    pub fn restore_generation(&self) -> u64 {
        self.restore_generation.load(Ordering::SeqCst)
    }

    pub fn identity(&self) -> Identity {
        self.identity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn harness_state(&self) -> (bool, u32) {
        match &self.supervisor {
            Some(s) => {
                let st = s.state();
                (st.running, st.restarts)
            }
            // A harness the agent does not start is assumed to be there.
            None => (true, 0),
        }
    }

    fn ready(&self) -> Ready {
        Ready {
            protocol_version: PROTOCOL_VERSION,
            agent_version: self.version.clone(),
            boot_generation: self.boot_generation,
            restore_generation: self.restore_generation(),
            identity: Some(self.identity()),
            harness_running: self.harness_state().0,
            max_frame_bytes: MAX_FRAME as u32,
        }
    }

    fn health(&self) -> HealthReport {
        let (running, restarts) = self.harness_state();
        HealthReport {
            uptime_ms: self.started.elapsed().as_millis() as u64,
            harness_running: running,
            harness_restarts: restarts,
            restore_generation: self.restore_generation(),
        }
    }

    /// Applies a restore notice: entropy, clock and identity before anything else moves.
    async fn apply_restored(&self, notice: Restored) -> Result<RestoredAck, GuestError> {
        let invalid = |m: String| GuestError {
            code: Code::InvalidArgument as i32,
            message: m,
        };
        if notice.entropy.is_empty() || notice.entropy.len() > MAX_ENTROPY {
            return Err(invalid(format!(
                "restored.entropy: {} bytes; 1 to {MAX_ENTROPY} expected",
                notice.entropy.len()
            )));
        }
        if RestoredKind::try_from(notice.kind).unwrap_or(RestoredKind::Unspecified)
            == RestoredKind::Unspecified
        {
            return Err(invalid("restored.kind: RESTORED or FORKED expected".into()));
        }
        // Checked before anything is applied: a bad notice changes nothing.
        if let Some(network) = &notice.network {
            crate::net::Interface::parse(network).map_err(|e| invalid(format!("restored.{e}")))?;
        }
        let current = self.restore_generation();
        if notice.generation == current {
            // The host repeating a notice it is not sure arrived: already applied.
            return Ok(RestoredAck {
                generation: current,
            });
        }
        if notice.generation < current {
            return Err(invalid(format!(
                "restored.generation: {} is older than the applied {current}",
                notice.generation
            )));
        }
        let _exclusive = self.restore_gate.write().await;
        let failed = |e: crate::system::SystemError| GuestError {
            code: Code::Internal as i32,
            message: e.to_string(),
        };
        self.system.add_entropy(&notice.entropy).map_err(failed)?;
        if notice.wall_clock_unix_nanos != 0 {
            self.system
                .set_wall_clock(notice.wall_clock_unix_nanos)
                .map_err(failed)?;
        }
        if let Some(identity) = notice.identity {
            if !identity.hostname.is_empty() {
                self.system
                    .set_hostname(&identity.hostname)
                    .map_err(failed)?;
            }
            *self.identity.lock().unwrap_or_else(|p| p.into_inner()) = identity;
        }
        if let Some(network) = &notice.network {
            self.system.configure_network(network).map_err(failed)?;
        }
        self.restore_generation
            .store(notice.generation, Ordering::SeqCst);
        // After the kernel's RNG is reseeded, so what the harness reseeds from is fresh.
        if let Some(supervisor) = &self.supervisor {
            supervisor.signal_restored();
        }
        tracing::info!(
            generation = notice.generation,
            kind = notice.kind,
            "restore applied"
        );
        Ok(RestoredAck {
            generation: notice.generation,
        })
    }

    /// Serves one host connection until it ends or breaks the protocol.
    pub async fn serve_connection<S>(self: Arc<Self>, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (mut reader, mut writer) = tokio::io::split(stream);
        let (out, mut outgoing) = mpsc::channel::<Envelope>(64);
        let writer_task = tokio::spawn(async move {
            while let Some(envelope) = outgoing.recv().await {
                if writer.write_all(&frame_bytes(&envelope)).await.is_err() {
                    return;
                }
            }
            let _ = writer.shutdown().await;
        });
        let mut conn = Connection {
            agent: self,
            out,
            streams: Arc::default(),
            tasks: Vec::new(),
            greeted: false,
        };
        let mut decoder = FrameDecoder::new(MAX_FRAME);
        let mut buf = vec![0u8; 64 << 10];
        'read: loop {
            loop {
                match decoder.next_frame() {
                    Ok(Some(envelope)) => {
                        if let Err(e) = conn.handle(envelope).await {
                            conn.reply(0, Body::Error(e)).await;
                            break 'read;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let e = GuestError {
                            code: Code::InvalidArgument as i32,
                            message: format!("bad frame: {e}"),
                        };
                        conn.reply(0, Body::Error(e)).await;
                        break 'read;
                    }
                }
            }
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => decoder.extend(&buf[..n]),
            }
        }
        // Closing: every stream of this connection is cancelled, which the harness sees as
        // its Connect call being cancelled (a restore cut them all; nobody will read them).
        conn.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        for task in conn.tasks.drain(..) {
            task.abort();
        }
        drop(conn);
        let _ = writer_task.await;
    }
}

type Streams = Arc<Mutex<HashMap<u64, mpsc::Sender<ControllerFrame>>>>;

struct Connection {
    agent: Arc<Agent>,
    out: mpsc::Sender<Envelope>,
    streams: Streams,
    tasks: Vec<tokio::task::AbortHandle>,
    greeted: bool,
}

fn protocol(message: impl Into<String>) -> GuestError {
    GuestError {
        code: Code::FailedPrecondition as i32,
        message: message.into(),
    }
}

impl Connection {
    async fn reply(&self, id: u64, body: Body) {
        let _ = self
            .out
            .send(Envelope {
                id,
                body: Some(body),
            })
            .await;
    }

    /// Handles one frame; an error closes the connection after it is sent.
    async fn handle(&mut self, envelope: Envelope) -> Result<(), GuestError> {
        let id = envelope.id;
        let Some(body) = envelope.body else {
            return Err(protocol("a frame without a body"));
        };
        if !self.greeted {
            let Body::Hello(hello) = body else {
                return Err(protocol("the first frame must be Hello"));
            };
            if hello.protocol_version != PROTOCOL_VERSION {
                return Err(protocol(format!(
                    "protocol version {}; this agent speaks {PROTOCOL_VERSION}",
                    hello.protocol_version
                )));
            }
            self.greeted = true;
            self.reply(id, Body::Ready(self.agent.ready())).await;
            return Ok(());
        }
        match body {
            Body::Hello(_) => return Err(protocol("Hello twice on one connection")),
            Body::HealthCheck(_) => {
                self.reply(id, Body::HealthReport(self.agent.health()))
                    .await
            }
            Body::Restored(notice) => match self.agent.apply_restored(notice).await {
                Ok(ack) => self.reply(id, Body::RestoredAck(ack)).await,
                Err(e) => self.reply(id, Body::Error(e)).await,
            },
            Body::DescribeHarness(_) => {
                let _shared = self.agent.restore_gate.read().await;
                let reply = match self.agent.link.describe().await {
                    Ok(d) => Body::HarnessDescriptor(d),
                    Err(s) => Body::Error(GuestError {
                        code: s.code() as i32,
                        message: s.message().to_owned(),
                    }),
                };
                self.reply(id, reply).await;
            }
            Body::Harness(frame) => self.harness(frame).await?,
            Body::Shutdown(s) => {
                tracing::info!(reason = %s.reason, grace_ms = s.grace_ms, "shutdown requested");
                let agent = self.agent.clone();
                tokio::spawn(async move {
                    if let Some(sup) = &agent.supervisor {
                        sup.stop(Duration::from_millis(u64::from(s.grace_ms.max(1))))
                            .await;
                    }
                    agent.shut_down.notify_waiters();
                    let e = agent.system.power_off();
                    tracing::error!(error = %e, "could not power off");
                });
            }
            Body::DirtyMemory(request) => {
                let region = self.agent.dirty.clone();
                // Touching up to gigabytes page by page: off the connection's worker.
                let done = tokio::task::spawn_blocking(move || {
                    let mut region = region.lock().unwrap_or_else(|p| p.into_inner());
                    region.apply(request.mebibytes, request.stamp, spare_pages())
                })
                .await;
                let reply = match done {
                    Ok((pages, mismatched)) => {
                        Body::DirtyMemoryDone(DirtyMemoryDone { pages, mismatched })
                    }
                    Err(e) => Body::Error(GuestError {
                        code: Code::Internal as i32,
                        message: format!("dirty_memory: {e}"),
                    }),
                };
                self.reply(id, reply).await;
            }
            Body::Ready(_)
            | Body::RestoredAck(_)
            | Body::HealthReport(_)
            | Body::HarnessDescriptor(_)
            | Body::Error(_)
            | Body::DirtyMemoryDone(_) => {
                return Err(protocol("a guest-to-host frame sent by the host"));
            }
        }
        Ok(())
    }

    async fn harness(&mut self, frame: HarnessFrame) -> Result<(), GuestError> {
        let stream = frame.stream;
        match frame.frame {
            Some(harness_frame::Frame::Controller(cf)) => {
                let existing = self
                    .streams
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&stream)
                    .cloned();
                let tx = match existing {
                    Some(tx) => tx,
                    None => self.open_stream(stream)?,
                };
                // A stream whose harness side already ended drops what still arrives.
                let _ = tx.send(cf).await;
            }
            Some(harness_frame::Frame::Close(_)) => {
                self.streams
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&stream);
            }
            Some(harness_frame::Frame::Event(_)) => {
                return Err(protocol(format!(
                    "stream {stream}: the host sent a harness event"
                )));
            }
            None => return Err(protocol(format!("stream {stream}: an empty harness frame"))),
        }
        Ok(())
    }

    fn open_stream(&mut self, stream: u64) -> Result<mpsc::Sender<ControllerFrame>, GuestError> {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if streams.len() >= MAX_STREAMS {
            return Err(GuestError {
                code: Code::ResourceExhausted as i32,
                message: format!("more than {MAX_STREAMS} harness streams on one connection"),
            });
        }
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        streams.insert(stream, tx.clone());
        drop(streams);
        let agent = self.agent.clone();
        let out = self.out.clone();
        let streams = self.streams.clone();
        self.tasks.retain(|t| !t.is_finished());
        let task = tokio::spawn(async move {
            let connected = {
                let _shared = agent.restore_gate.read().await;
                agent.link.connect(rx).await
            };
            let close = {
                match connected {
                    Ok(mut events) => loop {
                        match events.next().await {
                            Some(Ok(event)) => {
                                let frame = HarnessFrame {
                                    stream,
                                    frame: Some(harness_frame::Frame::Event(event)),
                                };
                                let sent = out
                                    .send(Envelope {
                                        id: 0,
                                        body: Some(Body::Harness(frame)),
                                    })
                                    .await;
                                if sent.is_err() {
                                    return;
                                }
                            }
                            Some(Err(s)) => {
                                break StreamClose {
                                    code: s.code() as i32,
                                    message: s.message().to_owned(),
                                };
                            }
                            None => break StreamClose::default(),
                        }
                    },
                    Err(s) => StreamClose {
                        code: s.code() as i32,
                        message: s.message().to_owned(),
                    },
                }
            };
            streams
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&stream);
            let _ = out
                .send(Envelope {
                    id: 0,
                    body: Some(Body::Harness(HarnessFrame {
                        stream,
                        frame: Some(harness_frame::Frame::Close(close)),
                    })),
                })
                .await;
        });
        self.tasks.push(task.abort_handle());
        Ok(tx)
    }
}
