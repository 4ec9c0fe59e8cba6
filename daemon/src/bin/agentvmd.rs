//! agentvmd: one per node. Owns the journal and serves the agentsessions API.

#![forbid(unsafe_code)]

use agentvmd::config::{self, ListenAddr};
use agentvmd::model::openai::{OpenAiConfig, load_api_key};
use agentvmd::node::{Node, NodeConfig, find_in_path};
use agentvmd::runtime::microvm::flavour::VmmFlavour;
use agentvmd::server;
use agentvmd::settings::{LogFormat, Settings, ShutdownPolicy};
use agentvmd::tool_webhook::WebhookConfig;
use anyhow::Context;
use clap::Parser;
use tracing::info;

fn main() -> std::process::ExitCode {
    let cli = Settings::parse();
    let settings = match &cli.config {
        Some(path) => match Settings::from_file(path) {
            Ok(file) => cli.clone().over(file),
            Err(e) => {
                eprintln!("agentvmd: {e}");
                return std::process::ExitCode::from(2);
            }
        },
        None => cli.clone(),
    };
    let json = settings.log_format == Some(LogFormat::Json);
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    if json {
        tracing_subscriber::fmt()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(filter)
            .init();
    }
    let result = if cli.check_config {
        check(settings)
    } else {
        run(settings)
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentvmd: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// The node's configuration from the settings, defaults filled in.
fn node_config(s: &Settings) -> anyhow::Result<(NodeConfig, ListenAddr, ListenAddr)> {
    let state_dir = s
        .state_dir
        .clone()
        .unwrap_or_else(config::default_state_dir);
    let listen = s.listen.clone().unwrap_or_else(config::default_listen);
    let admin_listen = s
        .admin_listen
        .clone()
        .unwrap_or_else(|| config::default_admin_listen(&listen, &state_dir));
    let mut node_config = NodeConfig::new(state_dir);
    node_config.journal_url = s.journal_url.clone();
    if let Some(url) = &s.snapshot_url {
        let remote: agentvmd::runtime::microvm::remote::SnapshotRemote =
            url.parse().map_err(|e: String| anyhow::anyhow!(e))?;
        if let agentvmd::runtime::microvm::remote::SnapshotRemote::Dir(dir) = &remote {
            anyhow::ensure!(
                dir.is_dir(),
                "snapshot_url: {} is not a directory",
                dir.display()
            );
        }
        node_config.snapshot_remote = Some(remote);
    }
    if let Some(secs) = s.lease_secs {
        anyhow::ensure!(
            secs >= 3,
            "lease_secs: must be at least 3 (it beats every third)"
        );
        node_config.lease = std::time::Duration::from_secs(secs);
    }
    if let Some(name) = &s.node_name {
        anyhow::ensure!(
            !name.is_empty() && !name.chars().any(char::is_whitespace),
            "node_name: {name:?} must be non-empty, without spaces"
        );
        node_config.node_name = name.clone();
    }
    if let Some(bin) = &s.harness_bin {
        node_config.harness_command =
            vec![bin.display().to_string(), "harness".into(), "serve".into()];
    }
    let flavour = s.vmm_flavour.unwrap_or_default();
    node_config.vmm_flavour = flavour;
    node_config.image_dir = s.image_dir.clone();
    node_config.pvm_guest_kernels = s.pvm_guest_kernels.unwrap_or(false);
    node_config.vmm_binary = match (&s.vmm_binary, flavour) {
        (Some(bin), _) => Some(bin.clone()),
        (None, VmmFlavour::Agentvm) => node_config.vmm_binary.take(),
        (None, flavour) => find_in_path(flavour.default_binary()),
    };
    if let Some(dir) = &s.ram_dir {
        node_config.ram_dir = dir.clone();
    }
    if let Some(base) = s.vm_uid_base {
        node_config.vm_uid_base = base;
    }
    if let Some(size) = s.vmm_pool {
        node_config.vmm_pool = size;
    }
    if let Some(on) = s.templates {
        node_config.templates = on;
    }
    if let Some(on) = s.warm_templates {
        node_config.warm_templates = on;
    }
    if let Some(keep) = s.checkpoints_keep {
        node_config.checkpoints.keep_last = keep;
    }
    if let Some(every) = s.checkpoints_every {
        node_config.checkpoints.keep_every = every;
    }
    if let Some(mib) = s.min_free_disk_mib {
        node_config.min_free_disk_mib = mib;
    }
    if let Some(secs) = s.guest_ready_timeout_secs {
        anyhow::ensure!(secs > 0, "guest_ready_timeout_secs: must be at least 1");
        node_config.guest_ready_timeout = std::time::Duration::from_secs(secs);
    }
    if let Some(secs) = s.guest_reply_timeout_secs {
        anyhow::ensure!(secs > 0, "guest_reply_timeout_secs: must be at least 1");
        node_config.guest_reply_timeout = std::time::Duration::from_secs(secs);
    }
    if let Some(secs) = s.vmm_api_timeout_secs {
        anyhow::ensure!(secs > 0, "vmm_api_timeout_secs: must be at least 1");
        node_config.vmm_api_timeout = std::time::Duration::from_secs(secs);
    }
    if let Some(secs) = s.harness_idle_timeout_secs {
        anyhow::ensure!(secs > 0, "harness_idle_timeout_secs: must be at least 1");
        node_config.harness_idle_timeout = std::time::Duration::from_secs(secs);
    }
    node_config.tool_executor = s.tool_executor_url.clone().map(|url| WebhookConfig {
        url,
        timeout: std::time::Duration::from_secs(
            s.tool_executor_timeout_secs
                .unwrap_or(agentvmd::settings::DEFAULT_TOOL_EXECUTOR_TIMEOUT_SECS),
        ),
    });
    if let Some(path) = &s.auth_file {
        node_config.auth = Some(std::sync::Arc::new(
            agentvmd::api::auth::Authenticator::load(path).context("auth_file")?,
        ));
    }
    if let Some(base_url) = &s.openai_base_url {
        let key_env = s
            .openai_api_key_env
            .as_deref()
            .unwrap_or(agentvmd::settings::DEFAULT_OPENAI_API_KEY_ENV);
        let api_key = load_api_key(Some(key_env), s.openai_api_key_file.as_deref())
            .context("reading the OpenAI API key file")?;
        info!(base_url = %base_url, key = api_key.is_some(), "OpenAI-compatible provider configured");
        node_config.openai = Some(OpenAiConfig {
            base_url: base_url.clone(),
            api_key,
            timeout: std::time::Duration::from_secs(
                s.openai_timeout_secs
                    .unwrap_or(agentvmd::settings::DEFAULT_OPENAI_TIMEOUT_SECS),
            ),
        });
    }
    Ok((node_config, listen, admin_listen))
}

/// TLS for the Sessions listener, and the rules of who may listen where: nothing plaintext
/// beyond loopback (the admin listener never does), no network listener that asks nobody who
/// they are, and metrics beyond loopback only where scrapes authenticate.
fn listener_tls(
    s: &Settings,
    listen: &ListenAddr,
    admin_listen: &ListenAddr,
) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    admin_listen.check_plaintext().context("admin_listen")?;
    let read = |key: &str, p: &std::path::Path| {
        std::fs::read(p).with_context(|| format!("{key}: reading {}", p.display()))
    };
    let tls = match (&s.tls_cert, &s.tls_key) {
        (Some(cert), Some(key)) => {
            let identity = tonic::transport::Identity::from_pem(
                read("tls_cert", cert)?,
                read("tls_key", key)?,
            );
            let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
            if let Some(ca) = &s.tls_client_ca {
                tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read(
                    "tls_client_ca",
                    ca,
                )?));
            }
            Some(tls)
        }
        (None, None) if s.tls_client_ca.is_some() => {
            anyhow::bail!("tls_client_ca: needs tls_cert and tls_key")
        }
        (None, None) => None,
        _ => anyhow::bail!("tls_cert and tls_key: give both or neither"),
    };
    match (listen, &tls) {
        (ListenAddr::Unix(_), Some(_)) => {
            anyhow::bail!("tls_cert: TLS is for a TCP listen address; {listen} is a unix socket")
        }
        (_, None) => listen.check_plaintext().context("listen")?,
        // TLS proves the server to the client, not the client to the server: beyond
        // loopback, someone must be asked who they are.
        (ListenAddr::Tcp(addr), Some(_))
            if !addr.ip().is_loopback() && s.auth_file.is_none() && s.tls_client_ca.is_none() =>
        {
            anyhow::bail!(
                "listen: {listen} is reachable from the network, and with neither auth_file nor \
                 tls_client_ca every caller there could use every project; give one of them \
                 (or listen on loopback)"
            )
        }
        _ => {}
    }
    if let Some(addr) = s.metrics_listen
        && !addr.ip().is_loopback()
        && s.auth_file.is_none()
    {
        anyhow::bail!(
            "metrics_listen: {addr} is reachable from the network; metrics there need an \
             auth_file (scrapers then send an operator's bearer token), or listen on loopback"
        )
    }
    Ok(tls)
}

/// `--check-config`: everything `run` would check before serving, without serving.
fn check(s: Settings) -> anyhow::Result<()> {
    let (node_config, listen, admin_listen) = node_config(&s)?;
    listener_tls(&s, &listen, &admin_listen)?;
    if let Some(bin) = &s.vmm_binary
        && !bin.is_file()
    {
        anyhow::bail!("vmm_binary: {} does not exist", bin.display());
    }
    if let Some(bin) = &s.harness_bin
        && !bin.is_file()
    {
        anyhow::bail!("harness_bin: {} does not exist", bin.display());
    }
    if let Some(dir) = &s.image_dir
        && !dir.is_dir()
    {
        anyhow::bail!("image_dir: {} is not a directory", dir.display());
    }
    if let Some(c) = &node_config.tool_executor {
        agentvmd::tool_webhook::WebhookExecutor::new(c.clone()).context("tool_executor_url")?;
    }
    print!("{}", s.effective_toml(&node_config, &listen, &admin_listen));
    println!("# configuration is valid");
    Ok(())
}

/// One agentvmd per state directory: two would both drive the same sessions and VMMs. The
/// lock is held until the process exits (the kernel drops it then, even on kill -9).
fn lock_state_dir(state_dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    agentvmd::private_dir::ensure(state_dir, agentvmd::private_dir::Use::Own)
        .context("state_dir")?;
    let path = state_dir.join("agentvmd.lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            anyhow::bail!(
                "state_dir {} is in use by another agentvmd (pid {}); one agentvmd per state \
                 directory",
                state_dir.display(),
                holder.trim()
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
    }
    file.set_len(0)?;
    file.rewind()?;
    write!(file, "{}", std::process::id())?;
    Ok(file)
}

fn run(s: Settings) -> anyhow::Result<()> {
    let (node_config, listen, admin_listen) = node_config(&s)?;
    let tls = listener_tls(&s, &listen, &admin_listen)?;
    let state_dir = node_config.state_dir.clone();
    let _instance = lock_state_dir(&state_dir)?;
    let lease = node_config.lease;
    let fleet = node_config.journal_url.is_some();
    // A shared journal or snapshot store holds what other nodes' deletes leave here.
    let sweep_every = (fleet || node_config.snapshot_remote.is_some()).then(|| {
        std::time::Duration::from_secs(
            s.snapshot_sweep_secs
                .unwrap_or(agentvmd::settings::DEFAULT_SNAPSHOT_SWEEP_SECS)
                .max(1),
        )
    });
    let warm_templates = node_config.warm_templates;
    let node = Node::open(node_config)?;
    info!(state_dir = %state_dir.display(), "journal open");
    let advertise = s
        .advertise_address
        .clone()
        .unwrap_or_else(|| listen.to_string());
    let metrics_listen = s.metrics_listen;
    let metrics_session_labels = s.metrics_session_labels.unwrap_or(false);
    let shutdown_policy = s.shutdown_policy.unwrap_or_default();
    let shutdown_budget = std::time::Duration::from_secs(
        s.shutdown_timeout_secs
            .unwrap_or(agentvmd::settings::DEFAULT_SHUTDOWN_TIMEOUT_SECS),
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        // In a fleet, beat before anything else: recovery below works on what this node
        // still holds.
        let _heartbeat = match fleet {
            true => {
                let service = node.node_service();
                let status = std::sync::Arc::new(move || {
                    service
                        .status()
                        .ok()
                        .and_then(|s| agentvm_proto::canon::to_proto_json(&s).ok())
                        .map(|json| json.to_string())
                        .unwrap_or_default()
                });
                let beating = agentvmd::session::fleet::heartbeat(
                    node.host.clone(),
                    advertise,
                    lease / 3,
                    status,
                );
                Some(
                    beating
                        .await
                        .context("the first heartbeat into the journal")?,
                )
            }
            false => None,
        };
        let _sweeping = sweep_every
            .map(|every| agentvmd::session::sweep::sweeping(node.host.clone(), every, fleet));
        if let Some(addr) = metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding --metrics-listen {addr}"))?;
            info!(%addr, "metrics at /metrics, probes at /healthz and /readyz");
            agentvmd::metrics::name_sessions_in_exemplars(metrics_session_labels);
            tokio::spawn(agentvmd::metrics::server::serve(
                listener,
                node.state_fn(metrics_session_labels),
                node.ready_fn(),
                node.auth.clone(),
            ));
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let api_bound = server::bind(&listen, 0o660).await?;
        let admin_bound = server::bind(&admin_listen, 0o600).await?;
        // Built after recovery (which reaps VMMs of no session): templates start after it.
        let api_routes = server::node_routes(&node).await?;
        if let (true, Some(microvm)) = (warm_templates, node.microvm.clone()) {
            tokio::spawn(async move { microvm.warm_all().await });
        }
        let api = server::serve_bound_tls(api_bound, api_routes, tls, stopped(stop_rx.clone()));
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
        tokio::try_join!(api, admin)?;
        if shutdown_policy == ShutdownPolicy::Suspend {
            let actor = agentvmd::api::auth::node_actor(None, "shutdown");
            let (suspended, failed) = node.host.suspend_all(shutdown_budget, actor).await;
            info!(
                suspended,
                failed = failed.len(),
                "sessions suspended for shutdown"
            );
            for (session, why) in failed {
                tracing::warn!(%session, %why, "not suspended");
            }
        }
        node.host.settle().await;
        Ok(())
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
