//! Serves any [`Harness`] as the `agentsessions.v1.Harness` gRPC service, and runs one as a
//! standalone process on a unix socket (what a guest image's harness command does).

use std::pin::Pin;
use std::sync::Arc;

use agentvm_proto::v1::harness_server::{Harness as HarnessService, HarnessServer};
use agentvm_proto::v1::{ControllerFrame, DescribeRequest, Event, HarnessDescriptor};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::sdk::{Harness, HistoryCache, drive_with};

/// Events buffered per stream before the harness waits for the host to read.
const EVENT_BUFFER: usize = 64;

pub struct GrpcHarness {
    harness: Arc<dyn Harness>,
    /// What each session's executions brought this process (for a harness that keeps it).
    history: Arc<HistoryCache>,
}

impl GrpcHarness {
    pub fn new(harness: Arc<dyn Harness>) -> Self {
        Self {
            harness,
            history: Arc::default(),
        }
    }

    pub fn into_service(self) -> HarnessServer<Self> {
        HarnessServer::new(self)
    }
}

#[tonic::async_trait]
impl HarnessService for GrpcHarness {
    async fn describe(
        &self,
        _request: Request<DescribeRequest>,
    ) -> Result<Response<HarnessDescriptor>, Status> {
        Ok(Response::new(self.harness.descriptor()))
    }

    type ConnectStream = Pin<Box<dyn Stream<Item = Result<Event, Status>> + Send>>;

    async fn connect(
        &self,
        request: Request<Streaming<ControllerFrame>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let frames = Box::pin(request.into_inner());
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let (harness, history) = (self.harness.clone(), self.history.clone());
        tokio::spawn(async move { drive_with(harness, frames, tx, Some(&history)).await });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves `harness` on the unix socket `path` until SIGTERM, on a runtime of its own: the
/// whole life of a standalone harness process (`agentvm-harness serve`, the lane's probe).
pub fn serve_on_unix_socket(harness: Arc<dyn Harness>, path: &str) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)?;
        tonic::transport::Server::builder()
            .add_service(GrpcHarness::new(harness).into_service())
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async {
                    if let Ok(mut term) =
                        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    {
                        term.recv().await;
                    }
                },
            )
            .await
            .map_err(std::io::Error::other)
    })
}
