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
            .map_err(|e| unreachable_at(addr, &e)),
        ListenAddr::Unix(path) => {
            if !path.exists() {
                anyhow::bail!("no agentvmd at {addr}: the socket does not exist ({HOW_TO_POINT})");
            }
            let path = path.clone();
            Endpoint::from_static("http://agentvmd.invalid")
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        let stream = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(TokioIo::new(stream))
                    }
                }))
                .await
                .map_err(|e| unreachable_at(addr, &e))
        }
    }
}

/// How a user points the CLI at another daemon.
const HOW_TO_POINT: &str = "start agentvmd, or give the address it listens on with --addr or \
                            AGENTVM_ADDR";

/// A failed dial, said once: the transport's innermost cause (its outer layers repeat it).
fn unreachable_at(addr: &ListenAddr, e: &(dyn std::error::Error + 'static)) -> anyhow::Error {
    let mut cause = e;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    anyhow::anyhow!("cannot reach agentvmd at {addr}: {cause} ({HOW_TO_POINT})")
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

/// How the CLI authenticates to a node that asks it to (README: API security).
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// Sent as `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// For a TCP address: speak TLS, trusting this CA (PEM)…
    pub tls_ca: Option<std::path::PathBuf>,
    /// …and present this client certificate and key (PEM) for mutual TLS.
    pub tls_cert: Option<std::path::PathBuf>,
    pub tls_key: Option<std::path::PathBuf>,
}

/// Opens a channel to `addr` with `creds`' TLS settings (TCP only).
pub async fn connect_with(addr: &ListenAddr, creds: &Credentials) -> anyhow::Result<Channel> {
    let (ListenAddr::Tcp(sock), Some(ca)) = (addr, &creds.tls_ca) else {
        return connect(addr).await;
    };
    let read =
        |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let mut tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(read(ca)?));
    if sock.ip().is_loopback() {
        tls = tls.domain_name("localhost");
    }
    match (&creds.tls_cert, &creds.tls_key) {
        (Some(cert), Some(key)) => {
            tls = tls.identity(tonic::transport::Identity::from_pem(
                read(cert)?,
                read(key)?,
            ));
        }
        (None, None) => {}
        _ => anyhow::bail!("--tls-cert and --tls-key go together"),
    }
    Endpoint::from_shared(format!("https://{sock}"))
        .context("building endpoint")?
        .tls_config(tls)
        .context("configuring TLS")?
        .connect()
        .await
        .with_context(|| format!("connecting to {sock} over TLS"))
}

/// Adds the bearer token (if any) to every request.
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A channel whose requests carry the caller's token.
pub type AuthedChannel = tonic::service::interceptor::InterceptedService<Channel, Bearer>;

pub fn bearer(token: Option<String>) -> anyhow::Result<Bearer> {
    let value = token
        .map(|t| format!("Bearer {t}").parse())
        .transpose()
        .context("the token is not valid in a header")?;
    Ok(Bearer(value))
}
