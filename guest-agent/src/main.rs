//! `agentvm-guest`: PID 1 of a Linux guest image (or, with `--listen unix:PATH`, an ordinary
//! process for running a harness behind the guest protocol outside a VM).
#![deny(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentvm_guest::agent::Agent;
use agentvm_guest::bridge::GrpcLink;
use agentvm_guest::image::{IMAGE_CONFIG_PATH, ImageConfig};
use agentvm_guest::reaper::Reaper;
use agentvm_guest::supervisor::Supervisor;
use agentvm_guest::system::{LinuxSystem, RecordingSystem, System};
use agentvm_guest::transport::{Listen, Listener};
use agentvm_guest::{init, serve};
use agentvm_proto::guest::GUEST_AGENT_PORT;
use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
#[command(version, about = "agentvm's in-guest agent")]
struct Args {
    /// The image configuration (the harness to run).
    #[arg(long, default_value = IMAGE_CONFIG_PATH)]
    config: PathBuf,
    /// Where the host connects: vsock:PORT or unix:PATH.
    #[arg(long, default_value_t = format!("vsock:{GUEST_AGENT_PORT}"))]
    listen: String,
    /// The unix socket the harness serves agentsessions.v1.Harness on.
    #[arg(long, default_value = "/run/agentvm/harness.sock")]
    harness_socket: PathBuf,
    /// Do not start the harness: one already serves on --harness-socket.
    #[arg(long)]
    external_harness: bool,
    /// `log` makes restore notices and shutdown only log what they would do (for running
    /// outside a VM, where stepping the clock or powering off is not ours to do).
    #[arg(long, default_value = "linux")]
    system: String,
    /// How long a call waits for a starting harness, in milliseconds (as PID 1, the host's
    /// `agentvm.harness_ready_ms` on the kernel command line wins).
    #[arg(long, default_value_t = 30_000)]
    harness_ready_ms: u64,
}

fn main() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // As PID 1 its stderr is the VM's serial console, which the host keeps as a log file:
        // no colour codes there.
        .with_ansi(std::io::stderr().is_terminal() && std::process::id() != 1)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let pid1 = std::process::id() == 1;
    if pid1 {
        init::mount_filesystems();
        init::raise_limits();
    }
    let result = run(pid1);
    if let Err(e) = &result {
        tracing::error!(error = format!("{e:#}"), "agentvm-guest stopped");
    }
    if pid1 {
        // PID 1 must never exit (the kernel would panic): power the VM off instead.
        let e = LinuxSystem.power_off();
        tracing::error!(error = %e, "powering off failed; halting here");
        loop {
            std::thread::park();
        }
    }
    std::process::exit(if result.is_ok() { 0 } else { 1 });
}

fn run(pid1: bool) -> anyhow::Result<()> {
    let args = Args::parse();
    let listen: Listen = args.listen.parse().map_err(anyhow::Error::msg)?;
    let system: Arc<dyn System> = match args.system.as_str() {
        "linux" => Arc::new(LinuxSystem),
        "log" => Arc::new(LoggingSystem::default()),
        other => anyhow::bail!("--system {other:?}: linux or log"),
    };
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let boot = if pid1 {
        init::boot_params(&cmdline)
    } else {
        init::BootParams {
            boot_generation: 1,
            ..Default::default()
        }
    };
    if pid1
        && !boot.identity.hostname.is_empty()
        && let Err(e) = system.set_hostname(&boot.identity.hostname)
    {
        tracing::warn!(error = %e, "setting the hostname");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        if !pid1 {
            // Orphans of the harness come to us, as they would to PID 1.
            let _ = nix::sys::prctl::set_child_subreaper(true);
        }
        let reaper = Reaper::start().context("watching SIGCHLD")?;
        let supervisor = if args.external_harness {
            None
        } else {
            let config = ImageConfig::load(&args.config)?;
            if pid1 {
                // Into the container image's root first: the workspace mounts inside it.
                match agentvm_guest::rootfs::switch(&config) {
                    Ok(true) => tracing::info!("running in the image's root filesystem"),
                    Ok(false) => {}
                    Err(e) => anyhow::bail!("the image's root filesystem: {e}"),
                }
                match agentvm_guest::workspace::mount(&config) {
                    Ok(Some(at)) => tracing::info!(at = %at.display(), "workspace mounted"),
                    Ok(None) => {}
                    // The harness still starts: its turns will say what they cannot find.
                    Err(e) => tracing::error!(error = %e, "the workspace is not mounted"),
                }
                // In the image's root, whose /etc gets the name server.
                if let Some(network) = &boot.network {
                    match system.configure_network(network) {
                        Ok(()) => tracing::info!(address = %network.address, "network up"),
                        Err(e) => tracing::error!(error = %e, "the network is not set up"),
                    }
                }
            }
            if let Some(dir) = args.harness_socket.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            Some(Supervisor::start(
                &config,
                args.harness_socket.clone(),
                reaper,
            ))
        };
        let link = Arc::new(GrpcLink::new(
            args.harness_socket.clone(),
            supervisor.clone(),
            Duration::from_millis(boot.harness_ready_ms.unwrap_or(args.harness_ready_ms)),
        ));
        let agent = Agent::new(
            system,
            link,
            supervisor.clone(),
            boot.identity,
            boot.boot_generation,
        );
        let listener =
            Listener::bind(&listen).with_context(|| format!("listening on {listen:?}"))?;
        tracing::info!(?listen, "agentvm-guest ready");
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("watching SIGTERM")?;
        tokio::select! {
            served = serve(agent.clone(), listener) => served.context("accepting connections"),
            _ = agent.shut_down.notified() => Ok(()),
            _ = term.recv() => {
                if let Some(s) = &supervisor {
                    s.stop(Duration::from_secs(5)).await;
                }
                Ok(())
            }
        }
    })
}

/// `--system log`: restore notices and shutdown are logged, not applied.
#[derive(Default)]
struct LoggingSystem(RecordingSystem);

impl System for LoggingSystem {
    fn add_entropy(&self, entropy: &[u8]) -> Result<(), agentvm_guest::system::SystemError> {
        tracing::info!(bytes = entropy.len(), "would add entropy");
        self.0.add_entropy(entropy)
    }
    fn set_wall_clock(&self, unix_nanos: i64) -> Result<(), agentvm_guest::system::SystemError> {
        tracing::info!(unix_nanos, "would step the clock");
        self.0.set_wall_clock(unix_nanos)
    }
    fn set_hostname(&self, name: &str) -> Result<(), agentvm_guest::system::SystemError> {
        tracing::info!(name, "would set the hostname");
        self.0.set_hostname(name)
    }
    fn configure_network(
        &self,
        network: &agentvm_proto::guest::v1::Network,
    ) -> Result<(), agentvm_guest::system::SystemError> {
        tracing::info!(address = %network.address, "would set up the network");
        self.0.configure_network(network)
    }
    fn power_off(&self) -> agentvm_guest::system::SystemError {
        tracing::info!("would power off");
        self.0.power_off()
    }
}
