//! The harness side of the agent: the image's harness serves `agentsessions.v1.Harness` over
//! gRPC on a local unix socket, unchanged from how it would run anywhere else; the agent is
//! its client.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agentvm_proto::v1::harness_client::HarnessClient;
use agentvm_proto::v1::{ControllerFrame, DescribeRequest, Event, HarnessDescriptor};
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::supervisor::Supervisor;

pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, Status>> + Send>>;

/// How the agent reaches the harness.
#[async_trait::async_trait]
pub trait HarnessLink: Send + Sync {
    async fn describe(&self) -> Result<HarnessDescriptor, Status>;
    /// Opens one execution stream fed by `frames`.
    async fn connect(&self, frames: mpsc::Receiver<ControllerFrame>)
    -> Result<EventStream, Status>;
}

/// The harness's gRPC server on a unix socket, optionally started and watched by a
/// [`Supervisor`].
pub struct GrpcLink {
    socket: PathBuf,
    /// One HTTP/2 connection to the harness, shared by every call; replaced when a Describe
    /// goes unanswered on it.
    channel: std::sync::Mutex<Channel>,
    supervisor: Option<Arc<Supervisor>>,
    /// How long a call waits for a harness that is starting (or restarting).
    ready_timeout: Duration,
    /// How long the first attempt of a Describe waits on one connection.
    first_attempt: Duration,
    /// The harness incarnation (its restart count) last seen answering; `u32::MAX` = none.
    reached: AtomicU32,
}

impl GrpcLink {
    pub fn new(
        socket: PathBuf,
        supervisor: Option<Arc<Supervisor>>,
        ready_timeout: Duration,
    ) -> Self {
        Self {
            channel: std::sync::Mutex::new(lazy_channel(socket.clone())),
            socket,
            supervisor,
            ready_timeout,
            first_attempt: FIRST_ATTEMPT,
            reached: AtomicU32::new(u32::MAX),
        }
    }

    /// The same link, whose Describe gives up on a connection after `wait` (then twice that,
    /// and so on) rather than [`FIRST_ATTEMPT`].
    pub fn with_first_attempt(mut self, wait: Duration) -> Self {
        self.first_attempt = wait;
        self
    }

    fn channel(&self) -> Channel {
        self.channel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Drops the shared connection: the next call opens a new one.
    fn reconnect(&self) {
        *self.channel.lock().unwrap_or_else(|p| p.into_inner()) = lazy_channel(self.socket.clone());
    }

    fn incarnation(&self) -> u32 {
        self.supervisor.as_ref().map_or(0, |s| s.state().restarts)
    }

    /// The reason the harness will not come back, if it will not.
    fn down(&self) -> Option<Status> {
        let state = self.supervisor.as_ref()?.state();
        state
            .down
            .map(|why| Status::unavailable(format!("the harness is down: {why}")))
    }

    /// Retries `call` while the harness is unreachable but may yet come up.
    async fn retrying<T, F, Fut>(&self, mut call: F) -> Result<T, Status>
    where
        F: FnMut(HarnessClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.ready_timeout;
        let mut pause = Duration::from_millis(2);
        let mut patience = self.first_attempt;
        loop {
            if let Some(down) = self.down() {
                return Err(down);
            }
            let incarnation = self.incarnation();
            let attempt = call(HarnessClient::new(self.channel()));
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let Ok(answer) = tokio::time::timeout(patience.min(left), attempt).await else {
                // Unanswered on this connection: say what the harness is doing, and try a
                // new connection (a stuck one is the agent's to replace) while time is left.
                tracing::warn!(
                    waited_ms = patience.min(left).as_millis() as u64,
                    harness = %self.harness_threads(),
                    "the harness did not answer; trying a new connection"
                );
                if tokio::time::Instant::now() >= deadline {
                    return Err(Status::unavailable(format!(
                        "the harness did not answer within {:?}",
                        self.ready_timeout
                    )));
                }
                self.reconnect();
                patience *= 2;
                continue;
            };
            match answer {
                Ok(v) => {
                    self.reached.store(incarnation, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(s) if unreachable(&s) => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(Status::unavailable(format!(
                            "the harness did not answer within {:?}: {}",
                            self.ready_timeout,
                            s.message()
                        )));
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                other => return other,
            }
        }
    }
}

/// How long the first attempt of a call waits for an answer before the agent tries again on
/// a new connection (each later attempt waits twice as long as the one before).
const FIRST_ATTEMPT: Duration = Duration::from_secs(5);

fn lazy_channel(socket: PathBuf) -> Channel {
    Endpoint::from_static("http://harness.invalid").connect_with_connector_lazy(tower::service_fn(
        move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        },
    ))
}

impl GrpcLink {
    /// Each thread of the harness process, `TID:STATE:WCHAN`, for a log line about a harness
    /// that does not answer.
    fn harness_threads(&self) -> String {
        let Some(pid) = self.supervisor.as_ref().and_then(|s| s.state().pid) else {
            return "no harness process".into();
        };
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return format!("pid {pid}: gone");
        };
        let mut threads: Vec<String> = tasks
            .filter_map(|t| {
                let path = t.ok()?.path();
                let tid = path.file_name()?.to_string_lossy().into_owned();
                let stat = std::fs::read_to_string(path.join("stat")).unwrap_or_default();
                // The state follows the parenthesised command name.
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next())
                    .unwrap_or("?")
                    .to_owned();
                let wchan = std::fs::read_to_string(path.join("wchan")).unwrap_or_default();
                Some(format!("{tid}:{state}:{wchan}"))
            })
            .collect();
        threads.sort();
        format!("pid {pid} threads {}", threads.join(" "))
    }
}

/// A failure to reach the harness (not yet listening, or its connection broke when it died),
/// as opposed to an answer from it.
fn unreachable(s: &Status) -> bool {
    use std::error::Error;
    s.code() == tonic::Code::Unavailable
        || (s.code() == tonic::Code::Unknown && s.source().is_some())
}

#[async_trait::async_trait]
impl HarnessLink for GrpcLink {
    async fn describe(&self) -> Result<HarnessDescriptor, Status> {
        self.retrying(|mut c| async move {
            c.describe(DescribeRequest::default())
                .await
                .map(|r| r.into_inner())
        })
        .await
    }

    async fn connect(
        &self,
        frames: mpsc::Receiver<ControllerFrame>,
    ) -> Result<EventStream, Status> {
        if let Some(down) = self.down() {
            return Err(down);
        }
        // The stream consumes the frames, so it cannot be retried: a harness not yet seen
        // answering (just started or restarted) is waited for with a Describe first.
        if self.reached.load(Ordering::Relaxed) != self.incarnation() {
            self.describe().await?;
        }
        let mut client = HarnessClient::new(self.channel());
        let events = client
            .connect(ReceiverStream::new(frames))
            .await?
            .into_inner();
        Ok(Box::pin(events))
    }
}
