//! `agentvm harness serve NAME --listen ADDR`: runs a reference harness as a standalone
//! `agentsessions.v1.Harness` server (what the process runtime starts per session).

use agentvm_harnesses::server::GrpcHarness;
use agentvmd::config::ListenAddr;
use agentvmd::server;
use anyhow::Context;
use tonic::service::Routes;

pub fn serve(name: &str, listen: &ListenAddr) -> anyhow::Result<()> {
    let harness = agentvm_harnesses::builtin(name)
        .with_context(|| format!("no built-in harness named {name:?} (echo, counter, chat)"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let routes = Routes::new(GrpcHarness::new(harness).into_service());
        server::serve(listen, routes, 0o600, async {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        })
        .await
    })
}
