//! Dialing agentvmd (or any gRPC server) at a [`ListenAddr`], unix sockets included.

use anyhow::Context;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::config::ListenAddr;

/// Opens a channel to `addr`. For unix sockets the URI is a placeholder; the connector
/// dials the path.
pub async fn connect(addr: &ListenAddr) -> anyhow::Result<Channel> {
    match addr {
        ListenAddr::Tcp(sock) => Endpoint::from_shared(format!("http://{sock}"))
            .context("building endpoint")?
            .connect()
            .await
            .with_context(|| format!("connecting to {sock}")),
        ListenAddr::Unix(path) => {
            let path = path.clone();
            let shown = path.display().to_string();
            Endpoint::from_static("http://agentvmd.invalid")
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        let stream = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(TokioIo::new(stream))
                    }
                }))
                .await
                .with_context(|| format!("connecting to unix:{shown}"))
        }
    }
}

/// Dials a harness placement address: `unix:///abs`, `unix://rel` (a path) or `host:port`.
/// Unlike [`connect`], TCP is not limited to loopback: a registered harness may live anywhere
/// the operator put it.
pub async fn connect_address(address: &str) -> anyhow::Result<Channel> {
    if let Some(path) = address.strip_prefix("unix://") {
        return connect(&ListenAddr::Unix(path.into())).await;
    }
    Endpoint::from_shared(format!("http://{address}"))
        .with_context(|| format!("harness address {address:?}"))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("connecting to {address}"))
}
