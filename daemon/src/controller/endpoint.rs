//! How the controller reaches a harness: `Describe` and one `Connect` stream per execution.
//!
//! [`GrpcEndpoint`] speaks upstream's gRPC service (local process, remote address);
//! [`InProcessEndpoint`] runs a harness of this binary over channels. The microVM runtime adds
//! one over the guest frame protocol. The controller sees only [`HarnessEndpoint`].

use std::pin::Pin;
use std::sync::Arc;
use tracing::Instrument;

use agentvm_harnesses::sdk::{Harness, HistoryCache, drive_with};
use agentvm_proto::v1::harness_client::HarnessClient;
use agentvm_proto::v1::{ControllerFrame, DescribeRequest, Event, HarnessDescriptor};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::transport::Channel;

/// Frames the host sends before it waits for the harness to read.
const FRAME_BUFFER: usize = 16;
const EVENT_BUFFER: usize = 64;

pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, Status>> + Send>>;

/// One open execution stream. Dropping `frames` half-closes the host side.
pub struct HarnessStream {
    pub frames: mpsc::Sender<ControllerFrame>,
    pub events: EventStream,
}

/// gRPC servers take messages up to 4 MiB unless configured otherwise (grpc-go, grpcio and
/// tonic alike), so that is what a harness can be sent; the rest is room for framing.
pub const DEFAULT_MAX_START_BYTES: usize = (4 << 20) - (16 << 10);

#[async_trait::async_trait]
pub trait HarnessEndpoint: Send + Sync {
    async fn describe(&self) -> Result<HarnessDescriptor, Status>;
    async fn connect(&self) -> Result<HarnessStream, Status>;
    /// The largest Start frame (encoded bytes: history, inputs, config) this harness can
    /// receive. A turn whose Start would be larger is refused before it is journaled.
    fn max_start_bytes(&self) -> usize {
        DEFAULT_MAX_START_BYTES
    }
}

/// A harness serving `agentsessions.v1.Harness` over gRPC.
#[derive(Clone)]
pub struct GrpcEndpoint {
    client: HarnessClient<Channel>,
}

impl GrpcEndpoint {
    pub fn new(channel: Channel) -> Self {
        Self {
            client: HarnessClient::new(channel),
        }
    }
}

#[async_trait::async_trait]
impl HarnessEndpoint for GrpcEndpoint {
    async fn describe(&self) -> Result<HarnessDescriptor, Status> {
        Ok(self
            .client
            .clone()
            .describe(DescribeRequest {})
            .await?
            .into_inner())
    }

    /// Hands out the frame sender at once. A gRPC server need not send response headers
    /// before it has read the first request message (upstream's harnesses read Start first),
    /// so waiting for them before sending Start would deadlock both sides. The call runs in
    /// a task that forwards the harness's events; its failure to start arrives as the first
    /// event, and dropping the event stream ends the call.
    async fn connect(&self) -> Result<HarnessStream, Status> {
        let (frame_tx, frame_rx) = mpsc::channel(FRAME_BUFFER);
        let (event_tx, event_rx) = mpsc::channel(EVENT_BUFFER);
        let mut client = self.client.clone();
        tokio::spawn(
            async move {
                let mut events = match client.connect(ReceiverStream::new(frame_rx)).await {
                    Ok(response) => response.into_inner(),
                    Err(status) => {
                        let _ = event_tx.send(Err(status)).await;
                        return;
                    }
                };
                loop {
                    tokio::select! {
                        event = events.message() => {
                            let forwarded = match event {
                                Ok(Some(event)) => event_tx.send(Ok(event)).await,
                                Ok(None) => return,
                                Err(status) => {
                                    let _ = event_tx.send(Err(status)).await;
                                    return;
                                }
                            };
                            if forwarded.is_err() {
                                return;
                            }
                        }
                        () = event_tx.closed() => return,
                    }
                }
            }
            .in_current_span(),
        );
        Ok(HarnessStream {
            frames: frame_tx,
            events: Box::pin(ReceiverStream::new(event_rx)),
        })
    }
}

/// A harness compiled into this process, reached over channels (tests, offline use).
#[derive(Clone)]
pub struct InProcessEndpoint {
    harness: Arc<dyn Harness>,
    /// What each session's executions brought this harness (for one that keeps it).
    history: Arc<HistoryCache>,
}

impl InProcessEndpoint {
    pub fn new(harness: Arc<dyn Harness>) -> Self {
        Self {
            harness,
            history: Arc::default(),
        }
    }
}

#[async_trait::async_trait]
impl HarnessEndpoint for InProcessEndpoint {
    async fn describe(&self) -> Result<HarnessDescriptor, Status> {
        Ok(self.harness.descriptor())
    }

    async fn connect(&self) -> Result<HarnessStream, Status> {
        let (frame_tx, frame_rx) = mpsc::channel::<ControllerFrame>(FRAME_BUFFER);
        let (event_tx, event_rx) = mpsc::channel(EVENT_BUFFER);
        let frames = Box::pin(tokio_stream::StreamExt::map(
            ReceiverStream::new(frame_rx),
            Ok::<_, Status>,
        ));
        let (harness, history) = (self.harness.clone(), self.history.clone());
        tokio::spawn(
            async move { drive_with(harness, frames, event_tx, Some(&history)).await }
                .in_current_span(),
        );
        Ok(HarnessStream {
            frames: frame_tx,
            events: Box::pin(ReceiverStream::new(event_rx)),
        })
    }
}
