//! The gRPC front of agentvmd: the API listener (Sessions, health and reflection) and the admin
//! listener (HarnessRegistry), each on its own socket so the admin surface never shares the
//! client-facing one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentvm_proto::v1::harness_registry_server::HarnessRegistryServer;
use anyhow::Context;
use tokio::net::UnixListener;
use tokio::sync::Notify;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::Routes;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Server, ServerTlsConfig};
use tracing::{info, warn};

use crate::api::auth::Authenticator;
use crate::api::node_service::NodeService;
use crate::api::registry_service::RegistryService;
use crate::api::sessions_service::SessionsService;
use crate::config::ListenAddr;
use crate::registry::Registry;
use crate::session::SessionHost;

/// Removes a stale socket file left by a previous run, refusing to touch anything else.
fn clear_stale_socket(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        // A socket that still accepts connections belongs to a live process: replacing it
        // would cut that process off from its clients for good.
        Ok(meta)
            if meta.file_type().is_socket()
                && std::os::unix::net::UnixStream::connect(path).is_ok() =>
        {
            anyhow::bail!(
                "{} is in use: another process (another agentvmd?) answers on it; a second \
                 node on this host needs its own (--listen, --admin-listen)",
                path.display()
            )
        }
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display())),
        Ok(_) => anyhow::bail!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("inspecting {}", path.display())),
    }
}

/// Accepted TCP connections with Nagle's algorithm off: every reply is written as it is
/// produced, and one that leaves in two segments would otherwise wait ~40 ms for the
/// client's delayed ACK (measured: 3 ms turns took 44-50 ms over TCP).
fn tcp_incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

fn inode(path: &Path) -> Option<u64> {
    std::os::unix::fs::MetadataExt::ino(&std::fs::symlink_metadata(path).ok()?).into()
}

fn same_file(path: &Path, bound: Option<u64>) -> bool {
    bound.is_some() && inode(path) == bound
}

/// How long open connections get to finish after the shutdown signal before the server stops
/// anyway: an idle client holding a connection must not keep the daemon alive.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `server` until it ends, or until `DRAIN_TIMEOUT` after `signalled` fires.
async fn bounded_drain<F>(server: F, signalled: Arc<Notify>) -> Result<(), tonic::transport::Error>
where
    F: std::future::Future<Output = Result<(), tonic::transport::Error>>,
{
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => return r,
        () = signalled.notified() => {}
    }
    match tokio::time::timeout(DRAIN_TIMEOUT, server).await {
        Ok(r) => r,
        Err(_) => {
            warn!(timeout = ?DRAIN_TIMEOUT, "connections still open after drain timeout; closing");
            Ok(())
        }
    }
}

/// The routes of the Sessions API listener, open to whoever reaches the socket.
pub async fn api_routes(host: Arc<SessionHost>) -> anyhow::Result<Routes> {
    api_routes_with(host, None, None).await
}

/// Sessions (and, given, the node status service), health and reflection. With an
/// authenticator every Sessions, Node and reflection call must carry a credential (the
/// service list and schemas are no business of an anonymous caller); health stays open, as
/// load balancers and systemd-style probes carry none.
pub async fn api_routes_with(
    host: Arc<SessionHost>,
    node: Option<NodeService>,
    auth: Option<Arc<Authenticator>>,
) -> anyhow::Result<Routes> {
    // Serving starts here: first what a previous daemon left half done is recovered, then
    // compute that dies between requests is noticed.
    host.watch_compute().await;
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let mut served = vec!["", SESSIONS_SERVICE];
    if node.is_some() {
        served.push(NODE_SERVICE);
    }
    report_health(health_reporter, served, host.draining()).await;
    // Only what this listener serves: the descriptor set also holds the harness SPI and the
    // admin-only HarnessRegistry, which must not be advertised here (as upstream keeps them).
    // Both reflection versions: older grpcurl and grpc_cli ask for v1alpha.
    let reflection = reflection_builder()
        .build_v1()
        .context("building the reflection service")?;
    let reflection_v1alpha = reflection_builder()
        .build_v1alpha()
        .context("building the v1alpha reflection service")?;
    let check = move |mut req: tonic::Request<()>| {
        if let Some(auth) = &auth {
            let principal = auth.authenticate(&req)?;
            req.extensions_mut().insert(principal);
        }
        Ok(req)
    };
    let mut routes = Routes::new(health)
        .add_service(InterceptedService::new(reflection, check.clone()))
        .add_service(InterceptedService::new(reflection_v1alpha, check.clone()))
        .add_service(InterceptedService::new(
            SessionsService::new(host).into_server(),
            check.clone(),
        ));
    if let Some(node) = node {
        routes = routes.add_service(InterceptedService::new(node.into_server(), check));
    }
    Ok(routes)
}

const SESSIONS_SERVICE: &str = "agentsessions.v1.Sessions";
const NODE_SERVICE: &str = "agentvm.node.v1.Node";

fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(agentvm_proto::FILE_DESCRIPTOR_SET)
        .with_service_name(SESSIONS_SERVICE)
        .with_service_name(NODE_SERVICE)
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .with_service_name("grpc.reflection.v1alpha.ServerReflection")
}

/// gRPC health for the whole server (`""`) and each service `served` by name: SERVING, and
/// NOT_SERVING once the node drains (a balancer then sends new work elsewhere).
async fn report_health(
    reporter: tonic_health::server::HealthReporter,
    served: Vec<&'static str>,
    mut draining: tokio::sync::watch::Receiver<bool>,
) {
    let status = |draining: bool| match draining {
        true => tonic_health::ServingStatus::NotServing,
        false => tonic_health::ServingStatus::Serving,
    };
    let now = *draining.borrow_and_update();
    for name in &served {
        reporter.set_service_status(*name, status(now)).await;
    }
    tokio::spawn(async move {
        while draining.changed().await.is_ok() {
            let now = *draining.borrow_and_update();
            for name in &served {
                reporter.set_service_status(*name, status(now)).await;
            }
        }
    });
}

/// The Sessions API listener's routes for a whole node: Sessions, health, reflection and
/// the node status service.
pub async fn node_routes(node: &crate::node::Node) -> anyhow::Result<Routes> {
    api_routes_with(
        node.host.clone(),
        Some(node.node_service()),
        node.auth.clone(),
    )
    .await
}

/// The routes of the admin listener: the harness registry.
pub fn admin_routes(registry: Arc<Registry>) -> Routes {
    Routes::new(HarnessRegistryServer::new(RegistryService::new(registry)))
}

/// Serves `routes` on `addr` until `shutdown` resolves. A unix socket gets `socket_mode`.
pub async fn serve(
    addr: &ListenAddr,
    routes: Routes,
    socket_mode: u32,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_bound(bind(addr, socket_mode).await?, routes, shutdown).await
}

/// A listening socket not yet served (so a daemon can say it is ready once all are bound).
pub enum Bound {
    Unix {
        path: PathBuf,
        listener: UnixListener,
    },
    Tcp(tokio::net::TcpListener),
}

/// Binds `addr`; a unix socket replaces a stale one and gets `socket_mode`.
pub async fn bind(addr: &ListenAddr, socket_mode: u32) -> anyhow::Result<Bound> {
    match addr {
        ListenAddr::Unix(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                crate::private_dir::ensure(dir, crate::private_dir::Use::SocketParent)
                    .context("the socket's directory")?;
            }
            clear_stale_socket(path)?;
            let listener =
                UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
            // The socket's permissions are its access control.
            std::fs::set_permissions(
                path,
                std::os::unix::fs::PermissionsExt::from_mode(socket_mode),
            )
            .with_context(|| format!("restricting {}", path.display()))?;
            Ok(Bound::Unix {
                path: path.clone(),
                listener,
            })
        }
        ListenAddr::Tcp(sock) => Ok(Bound::Tcp(
            tokio::net::TcpListener::bind(sock)
                .await
                .with_context(|| format!("binding {sock}"))?,
        )),
    }
}

/// Serves `routes` on a bound socket until `shutdown` resolves.
pub async fn serve_bound(
    bound: Bound,
    routes: Routes,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_bound_tls(bound, routes, None, shutdown).await
}

/// As [`serve_bound`], with TLS on a TCP socket (never on a unix one, whose permissions are
/// its protection).
pub async fn serve_bound_tls(
    bound: Bound,
    routes: Routes,
    tls: Option<ServerTlsConfig>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let signalled = Arc::new(Notify::new());
    let shutdown = {
        let signalled = Arc::clone(&signalled);
        async move {
            shutdown.await;
            signalled.notify_one();
        }
    };
    let mut builder = Server::builder();
    if let (Some(tls), Bound::Tcp(_)) = (tls, &bound) {
        builder = builder.tls_config(tls).context("configuring TLS")?;
    }
    let router = builder
        .layer(crate::api::request_id::RequestIdLayer)
        .layer(tower::util::MapResponseLayer::new(
            crate::api::status_limit::limit_status,
        ))
        .add_routes(routes);
    match bound {
        Bound::Unix { path, listener } => {
            info!(listen = %path.display(), "serving");
            // Removed at exit only while it is still this socket, not a later one's.
            let bound_inode = inode(&path);
            let result = bounded_drain(
                router.serve_with_incoming_shutdown(
                    tokio_stream::StreamExt::map(UnixListenerStream::new(listener), |conn| {
                        conn.map(crate::lenient_authority::LenientAuthority::new)
                    }),
                    shutdown,
                ),
                signalled,
            )
            .await;
            if same_file(&path, bound_inode) {
                let _ = std::fs::remove_file(&path);
            }
            result.context("gRPC server on unix socket")
        }
        Bound::Tcp(listener) => {
            info!(listen = ?listener.local_addr().ok(), "serving");
            bounded_drain(
                router.serve_with_incoming_shutdown(tcp_incoming(listener), shutdown),
                signalled,
            )
            .await
            .context("gRPC server on TCP")
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn tcp_connections_are_accepted_with_nagle_off() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::tcp_incoming(listener);
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(
            accepted.nodelay().unwrap(),
            "TCP_NODELAY on the server's side"
        );
    }
}
