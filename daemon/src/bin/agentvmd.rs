//! agentvmd: one per node. Owns the journal and serves the agentsessions API.

use std::path::PathBuf;
use std::sync::Arc;

use agentvmd::config::{self, ListenAddr};
use agentvmd::journal::sqlite::{Durability, SqliteJournal};
use agentvmd::registry::store::RegistryStore;
use agentvmd::registry::{Registry, builtin_harnesses};
use agentvmd::server;
use anyhow::Context;
use clap::Parser;
use tracing::info;

#[derive(Parser, Debug)]
#[command(name = "agentvmd", version, about = "agentvm node daemon")]
struct Args {
    /// State directory (journal, snapshots). Default: /var/lib/agentvm as root,
    /// $XDG_STATE_HOME/agentvm otherwise.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Listener, `unix:PATH` or `HOST:PORT` (loopback). Default: unix:/run/agentvm/agentvmd.sock.
    #[arg(long)]
    listen: Option<ListenAddr>,
    /// Admin listener for the HarnessRegistry API (unix socket or loopback TCP).
    /// Default: admin.sock beside the API socket.
    #[arg(long)]
    admin_listen: Option<ListenAddr>,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let state_dir = args.state_dir.unwrap_or_else(config::default_state_dir);
    let listen = args.listen.unwrap_or_else(config::default_listen);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating state directory {}", state_dir.display()))?;
    let journal_path = config::journal_path(&state_dir);
    let _journal = SqliteJournal::open(&journal_path, Durability::Full)
        .with_context(|| format!("opening journal {}", journal_path.display()))?;
    info!(journal = %journal_path.display(), "journal open");
    let registry = Arc::new(Registry::new(
        builtin_harnesses(),
        RegistryStore::open(&journal_path)
            .with_context(|| format!("opening harness registry in {}", journal_path.display()))?,
    ));
    let admin_listen = args
        .admin_listen
        .unwrap_or_else(|| config::default_admin_listen(&listen));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let api = server::serve(
            &listen,
            server::api_routes().await?,
            0o660,
            stopped(stop_rx.clone()),
        );
        let admin = server::serve(
            &admin_listen,
            server::admin_routes(registry),
            0o600,
            stopped(stop_rx),
        );
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
        tokio::try_join!(api, admin).map(|_| ())
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGTERM; stop with SIGINT");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => info!("SIGINT: shutting down"),
    }
}
