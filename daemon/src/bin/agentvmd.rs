//! agentvmd: one per node. Owns the journal and serves the agentsessions API.

use std::path::PathBuf;

use agentvmd::config::{self, ListenAddr};
use agentvmd::model::openai::{OpenAiConfig, load_api_key};
use agentvmd::node::{Node, NodeConfig, find_in_path};
use agentvmd::runtime::microvm::flavour::VmmFlavour;
use agentvmd::server;
use agentvmd::tool_webhook::WebhookConfig;
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
    /// Program that serves a built-in harness for the process runtime, invoked as
    /// `PROGRAM harness serve NAME --listen unix:PATH`. Default: `agentvm` beside agentvmd.
    #[arg(long)]
    harness_bin: Option<PathBuf>,
    /// The VMM binary the microvm runtime starts, one per session. Default: `agentvm-vmm`
    /// beside agentvmd, or `cloud-hypervisor` on PATH; the runtime is left out if missing.
    #[arg(long)]
    vmm_binary: Option<PathBuf>,
    /// Which VMM that is: `agentvm` (forks copy-on-write) or `cloud-hypervisor` (v52 or
    /// later; forks by snapshot and full restore).
    #[arg(long, default_value = "agentvm")]
    vmm_flavour: VmmFlavour,
    /// Directory for guest RAM files; a tmpfs lets a fork link RAM instead of copying it.
    #[arg(long, default_value = "/dev/shm")]
    ram_dir: PathBuf,
    /// Guest image bundles (`agentvm image build -o DIR/NAME`), each served as harness NAME
    /// on the microvm runtime (default: STATE_DIR/images).
    #[arg(long)]
    image_dir: Option<PathBuf>,
    /// OpenAI-compatible endpoint (up to the version path, e.g. https://api.openai.com/v1)
    /// serving every model except the built-in `echo`.
    #[arg(long)]
    openai_base_url: Option<String>,
    /// Environment variable holding the endpoint's API key.
    #[arg(long, default_value = "OPENAI_API_KEY")]
    openai_api_key_env: String,
    /// File holding the API key (first line); takes precedence over the variable.
    #[arg(long)]
    openai_api_key_file: Option<PathBuf>,
    /// Per-request timeout of model calls, in seconds.
    #[arg(long, default_value_t = 600)]
    openai_timeout_secs: u64,
    /// HTTP endpoint that executes host-mediated tool calls (JSON POST, deduplicated by its
    /// Idempotency-Key header); without it such calls fail with MissingToolExecutor.
    #[arg(long)]
    tool_executor_url: Option<String>,
    /// Serve Prometheus metrics (families agentvm_*) at http://HOST:PORT/metrics.
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Per-call timeout of the tool executor, in seconds.
    #[arg(long, default_value_t = 60)]
    tool_executor_timeout_secs: u64,
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
    let mut node_config = NodeConfig::new(state_dir.clone());
    if let Some(bin) = &args.harness_bin {
        node_config.harness_command =
            vec![bin.display().to_string(), "harness".into(), "serve".into()];
    }
    node_config.vmm_flavour = args.vmm_flavour;
    node_config.image_dir = args.image_dir.clone();
    node_config.vmm_binary = match (&args.vmm_binary, args.vmm_flavour) {
        (Some(bin), _) => Some(bin.clone()),
        (None, VmmFlavour::Agentvm) => node_config.vmm_binary.take(),
        (None, flavour) => find_in_path(flavour.default_binary()),
    };
    node_config.ram_dir = args.ram_dir.clone();
    node_config.tool_executor = args.tool_executor_url.clone().map(|url| WebhookConfig {
        url,
        timeout: std::time::Duration::from_secs(args.tool_executor_timeout_secs),
    });
    if let Some(base_url) = &args.openai_base_url {
        let api_key = load_api_key(
            Some(&args.openai_api_key_env),
            args.openai_api_key_file.as_deref(),
        )
        .context("reading the OpenAI API key file")?;
        info!(base_url = %base_url, key = api_key.is_some(), "OpenAI-compatible provider configured");
        node_config.openai = Some(OpenAiConfig {
            base_url: base_url.clone(),
            api_key,
            timeout: std::time::Duration::from_secs(args.openai_timeout_secs),
        });
    }
    let node = Node::open(node_config)?;
    info!(state_dir = %state_dir.display(), "journal open");
    let admin_listen = args
        .admin_listen
        .unwrap_or_else(|| config::default_admin_listen(&listen));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        if let Some(addr) = args.metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding --metrics-listen {addr}"))?;
            info!(%addr, "metrics at /metrics");
            tokio::spawn(agentvmd::metrics::server::serve(listener, node.state_fn()));
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let api_bound = server::bind(&listen, 0o660).await?;
        let admin_bound = server::bind(&admin_listen, 0o600).await?;
        let api = server::serve_bound(
            api_bound,
            server::api_routes(node.host.clone()).await?,
            stopped(stop_rx.clone()),
        );
        let admin = server::serve_bound(
            admin_bound,
            server::admin_routes(node.registry.clone()),
            stopped(stop_rx),
        );
        // Both sockets accept connections from here on: tell systemd (Type=notify).
        let notifier = std::sync::Arc::new(
            agentvmd::systemd::Notifier::from_env().context("reading NOTIFY_SOCKET")?,
        );
        if notifier.enabled() {
            notifier
                .notify(&format!("READY=1\nSTATUS=serving on {listen}"))
                .context("notifying systemd")?;
            if let Some(period) = agentvmd::systemd::watchdog_interval() {
                let notifier = notifier.clone();
                tokio::spawn(async move {
                    let mut tick = tokio::time::interval(period / 2);
                    loop {
                        tick.tick().await;
                        if let Err(e) = notifier.notify("WATCHDOG=1") {
                            tracing::warn!(error = %e, "watchdog ping");
                        }
                    }
                });
            }
        }
        tokio::spawn(async move {
            shutdown_signal().await;
            if let Err(e) = notifier.notify("STOPPING=1") {
                tracing::warn!(error = %e, "notifying systemd of the stop");
            }
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
