//! `agentvm-guest`: the agent inside every Linux guest. As PID 1 it sets the guest up, runs
//! the image's harness under a supervisor, and serves `agentvm.guest.v1` to the host on vsock
//! port 1024 — Hello/Ready, health, restore notices (entropy, clock, identity), shutdown —
//! bridging each harness stream to the harness's own `agentsessions.v1.Harness` gRPC server
//! on a local unix socket, so existing harnesses run unchanged.
//!
//! Outside a VM the same agent runs as an ordinary process listening on a unix socket.
#![deny(unsafe_code)]

pub mod agent;
pub mod bridge;
pub mod dirty;
pub mod egress;
pub mod image;
pub mod init;
pub mod net;
pub mod reaper;
pub mod rootfs;
pub mod supervisor;
mod sys;
pub mod system;
pub mod transport;
pub mod workspace;

use std::sync::Arc;

use nix::errno::Errno;

/// Accepts connections until the listener fails, each served on its own task.
pub async fn serve(agent: Arc<agent::Agent>, listener: transport::Listener) -> std::io::Result<()> {
    loop {
        let conn = match listener.accept().await {
            Ok(conn) => conn,
            // A connection that failed while being accepted is that connection's problem.
            Err(e) if is_transient(&e) => {
                tracing::warn!(error = %e, "accept");
                // Out of descriptors or memory: give the harness a moment to release some.
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        tokio::spawn(agent.clone().serve_connection(conn));
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    e.raw_os_error().map(Errno::from_raw).is_some_and(|errno| {
        matches!(
            errno,
            Errno::ECONNABORTED
                | Errno::EINTR
                | Errno::EPROTO
                | Errno::EMFILE
                | Errno::ENFILE
                | Errno::ENOBUFS
                | Errno::ENOMEM
        )
    })
}
