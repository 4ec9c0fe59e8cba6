//! The API server: HTTP/1.1 over a unix socket, routed to a [`VmmBackend`].
//!
//! Behaviour follows Cloud Hypervisor v53 (vmm-api.md §1–§2): `/api/v1/<endpoint>`, unknown
//! path → 404, wrong method → 400, a body on a body-less action or none on `vm.create` → 400,
//! bodies over 4 MiB → 400, actions → 204, `vmm.ping`/`vm.info`/`vm.counters` → 200 JSON,
//! `vmm.shutdown` → 200 and the server stops. Errors are a JSON array of strings.
//!
//! Backend calls run one at a time on blocking threads. Connections are independent: a slow
//! or broken client only costs its own connection (headers must arrive within
//! [`ServerConfig::header_read_timeout`], bodies within [`ServerConfig::body_read_timeout`]).

mod backend;
mod request;
mod routes;
mod socket;

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use nix::errno::Errno;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{Instrument, debug, warn};

pub use backend::VmmBackend;
pub use socket::{adopt_api_listener, bind_api_listener, bind_api_socket};

use request::Dispatcher;

/// Largest request body accepted, as in CH: 4 MiB.
pub const MAX_BODY_SIZE: usize = 4 << 20;

/// Longer timeouts are cut to this (a year).
const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Limits and timeouts of a server. `Default` is what agentvm-vmm uses.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// A connection must deliver a complete request head within this time, counted from when
    /// the server starts waiting for it (so it also bounds idle keep-alive connections).
    pub header_read_timeout: Duration,
    /// A request body must arrive completely within this time.
    pub body_read_timeout: Duration,
    /// Bodies larger than this are refused with 400 (reading stops at the limit).
    pub max_body_size: usize,
    /// Connections served at once; further clients wait in the listen backlog.
    pub max_connections: usize,
    /// After a stop, how long open connections get to finish their current request.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            max_body_size: MAX_BODY_SIZE,
            max_connections: 256,
            shutdown_grace: Duration::from_secs(2),
        }
    }
}

/// Serves the API on `listener` until `vmm.shutdown` succeeds.
pub async fn serve(listener: UnixListener, backend: Arc<dyn VmmBackend>) -> io::Result<()> {
    serve_with(
        listener,
        backend,
        ServerConfig::default(),
        std::future::pending(),
    )
    .await
}

/// Serves the API until `vmm.shutdown` succeeds or `shutdown` completes (e.g. on SIGTERM).
pub async fn serve_with_shutdown(
    listener: UnixListener,
    backend: Arc<dyn VmmBackend>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    serve_with(listener, backend, ServerConfig::default(), shutdown).await
}

/// Serves the API with explicit limits until `vmm.shutdown` succeeds or `shutdown` completes.
///
/// On stop: the listener is closed, no further backend call starts (a request still queued
/// gets 500 "the VMM is shutting down"), open connections finish their current response
/// (the `vmm.shutdown` 200 included) for up to [`ServerConfig::shutdown_grace`], and the rest
/// are dropped. A backend call already running on its blocking thread is not interrupted.
///
/// Returns `Err` only if the listener itself fails (e.g. it was closed under us); failed
/// connections are logged and dropped.
pub async fn serve_with(
    listener: UnixListener,
    backend: Arc<dyn VmmBackend>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let dispatcher = Arc::new(Dispatcher::new(backend, config));
    let max_connections = dispatcher.config().max_connections.max(1);
    let grace = dispatcher.config().shutdown_grace;
    let mut stop = dispatcher.stop_signal();
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    // Request logs carry whatever span the caller serves in (e.g. the VM id).
    let span = tracing::Span::current();

    let result = loop {
        tokio::select! {
            biased;
            () = stopped(&mut stop) => break Ok(()),
            () = &mut shutdown => {
                debug!("vmm api: shutdown requested");
                dispatcher.request_stop();
                break Ok(());
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept(), if connections.len() < max_connections => {
                match accepted {
                    Ok((stream, _)) => {
                        connections.spawn(
                            serve_connection(stream, Arc::clone(&dispatcher))
                                .instrument(span.clone()),
                        );
                    }
                    Err(e) if is_listener_broken(&e) => {
                        warn!(error = %e, "vmm api: listener failed");
                        dispatcher.request_stop();
                        break Err(e);
                    }
                    Err(e) => {
                        // Out of descriptors or memory, or the client gave up: try again shortly.
                        warn!(error = %e, "vmm api: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
    };
    drop(listener);

    let drained = tokio::time::timeout(grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        debug!(
            remaining = connections.len(),
            "vmm api: dropping connections still open after the grace period"
        );
    }
    connections.shutdown().await;
    debug!("vmm api: stopped");
    result
}

/// Serves one connection until the client leaves, it fails, or the server stops (then the
/// current response is finished first).
async fn serve_connection(stream: UnixStream, dispatcher: Arc<Dispatcher>) {
    let mut stop = dispatcher.stop_signal();
    // hyper adds this to `now()`; keep absurd values from overflowing.
    let header_read_timeout = dispatcher.config().header_read_timeout.min(MAX_TIMEOUT);
    let service = service_fn(move |req| {
        let dispatcher = Arc::clone(&dispatcher);
        async move { Ok::<_, std::convert::Infallible>(dispatcher.handle(req).await) }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = stopped(&mut stop) => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = result {
        debug!(error = %e, "vmm api: connection ended with an error");
    }
}

/// Completes once the stop flag is set (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopping| *stopping).await;
}

/// Accept errors that will not go away by waiting.
fn is_listener_broken(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(e) if [Errno::EBADF, Errno::EINVAL, Errno::ENOTSOCK, Errno::EOPNOTSUPP]
            .contains(&Errno::from_raw(e))
    )
}
