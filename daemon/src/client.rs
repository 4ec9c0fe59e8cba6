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
