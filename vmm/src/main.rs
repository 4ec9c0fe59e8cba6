//! `agentvm-vmm`: one microVM per process.
//!
//! `agentvm-vmm --api-socket PATH` serves the Cloud Hypervisor REST API on PATH and waits for
//! `vm.create`/`vm.boot`. Given `--kernel` it also creates and boots that VM at once, and then
//! exits when the guest stops (one-shot mode, for tests and benchmarks); the API, if any,
//! serves meanwhile.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use agentvm_vmm::api::Vmm;
use agentvm_vmm::exit::ExitReason;
use agentvm_vmm_api::VmmBackend;
use agentvm_vmm_api::config::{
    ConsoleOutputMode, CpusConfig, MemoryConfig, PayloadConfig, SerialConfig, VmConfig, VsockConfig,
};
use anyhow::Context;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "agentvm-vmm",
    version,
    about = "KVM microVM monitor behind the Cloud Hypervisor REST API"
)]
struct Args {
    /// Serve the REST API on this unix socket (created with mode 0600).
    #[arg(long)]
    api_socket: Option<PathBuf>,
    /// Serve the REST API on this inherited descriptor, a unix socket already listening at
    /// --api-socket (bound by whoever started us, who also removes it).
    #[arg(long, requires = "api_socket")]
    api_fd: Option<i32>,
    /// Exit when this inherited descriptor (a pipe's read end) reads end-of-file, unless a
    /// VM was asked for by then: a VMM started ahead of its VM goes with the process that
    /// started it, one serving a VM outlives it.
    #[arg(long, requires = "api_socket")]
    exit_with_fd: Option<i32>,
    /// Boot this kernel at once: ELF vmlinux (PVH or 64-bit entry) or bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    #[arg(long)]
    initramfs: Option<PathBuf>,
    #[arg(long)]
    cmdline: Option<String>,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    memory_mib: u64,
    #[arg(long, default_value_t = 1)]
    cpus: u8,
    /// `off`, `null`, `tty` (our stdout) or a file path.
    #[arg(long, default_value = "tty")]
    serial: String,
    /// Hybrid vsock: `cid=N,socket=PATH`.
    #[arg(long)]
    vsock: Option<String>,
    /// Directory (a tmpfs) for guest RAM files; forks whose snapshot lies in the same
    /// filesystem link RAM instead of copying it. `none` uses memfds.
    #[arg(long, default_value = "/dev/shm")]
    ram_dir: String,
    /// Run without seccomp filters (for debugging; a node never should).
    #[arg(long)]
    no_seccomp: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Before any other thread exists, so every thread inherits it.
    if !args.no_seccomp
        && let Err(e) = agentvm_vmm::seccomp::enable()
    {
        eprintln!("agentvm-vmm: installing the seccomp filter: {e}");
        return ExitCode::FAILURE;
    }
    // Next: this starts creating the KVM VM in the background, the slowest step of a boot, so
    // it overlaps with everything else the process does before `vm.boot`.
    let vmm = Arc::new(Vmm::new());
    // `Targets` ("warn", "agentvm_vmm=debug,warn") rather than an EnvFilter: it needs no
    // regex engine, which would be a fifth of this binary's resident code, paid per VM.
    let filter: tracing_subscriber::filter::Targets = std::env::var("AGENTVM_VMM_LOG")
        .ok()
        .and_then(|spec| spec.parse().ok())
        .unwrap_or_else(|| {
            tracing_subscriber::filter::Targets::new().with_default(tracing::Level::WARN)
        });
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(filter)
        .init();
    match run(args, vmm) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("agentvm-vmm: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args, vmm: Arc<Vmm>) -> anyhow::Result<ExitCode> {
    vmm.set_ram_dir(match args.ram_dir.as_str() {
        "none" => None,
        dir => Some(PathBuf::from(dir)),
    });
    let inherited = args.api_fd.map(inherited_listener).transpose()?;
    let anchor = args
        .exit_with_fd
        .map(|fd| inherited_fd("--exit-with-fd", fd))
        .transpose()?;
    let one_shot = match args.kernel.clone() {
        Some(kernel) => Some(config_from_args(&args, kernel)?),
        None => None,
    };
    if one_shot.is_none() && args.api_socket.is_none() {
        anyhow::bail!("nothing to do: give --api-socket PATH, or --kernel to boot at once");
    }
    if let Some(config) = one_shot {
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("VM configuration from the command line")?;
        vmm.create(config).map_err(|e| anyhow::anyhow!("{e}"))?;
        vmm.boot().map_err(|e| anyhow::anyhow!("{e}"))?;
        if let Some(socket) = &args.api_socket {
            let socket = socket.clone();
            let api_vmm = vmm.clone();
            std::thread::Builder::new()
                .name("api".into())
                .spawn(move || {
                    if let Err(e) = serve_api(&socket, inherited, None, api_vmm) {
                        tracing::error!(error = %e, "API server");
                    }
                })
                .context("starting the API thread")?;
        }
        return Ok(match vmm.wait_stopped() {
            Some(ExitReason::VcpuFailure(why)) => {
                eprintln!("agentvm-vmm: {why}");
                ExitCode::FAILURE
            }
            _ => ExitCode::SUCCESS,
        });
    }
    let socket = args.api_socket.clone().unwrap_or_default();
    serve_api(&socket, inherited, anchor, vmm.clone())?;
    // vmm.shutdown or a signal ended the API: nothing may outlive the process. Exiting now
    // leaves the KVM VM's teardown to the kernel, after the reply has gone out.
    let _ = vmm.delete();
    std::process::exit(0)
}

/// The listening socket behind `--api-fd`, taken over by this process.
fn inherited_listener(fd: i32) -> anyhow::Result<std::os::unix::net::UnixListener> {
    inherited_fd("--api-fd", fd).map(std::os::unix::net::UnixListener::from)
}

/// The inherited descriptor `fd` that `flag` names, taken over by this process.
fn inherited_fd(flag: &str, fd: i32) -> anyhow::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    anyhow::ensure!(
        fd > 2,
        "{flag} {fd}: 0, 1 and 2 are stdin, stdout and stderr"
    );
    // SAFETY: F_GETFD only reads the descriptor table entry of `fd`.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        anyhow::bail!("{flag} {fd}: {}", std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is open (checked above) and was handed to this process for `flag`;
    // nothing else in the process has taken it, and the OwnedFd is its one owner from here.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // Not passed on to anything this process might start.
    // SAFETY: sets a flag on a descriptor this function owns.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(owned)
}

/// Resolves once `anchor` reads end-of-file while no VM was ever asked of `vmm`; never
/// otherwise (a VMM serving a VM outlives whoever started it).
async fn anchor_gone(anchor: Option<std::os::fd::OwnedFd>, vmm: Arc<Vmm>) {
    use tokio::io::AsyncReadExt;
    let Some(Ok(mut anchor)) = anchor.map(tokio::net::unix::pipe::Receiver::from_owned_fd) else {
        return std::future::pending().await;
    };
    let mut byte = [0u8; 1];
    // Nobody writes to it: only its end matters.
    while let Ok(1) = anchor.read(&mut byte).await {}
    if vmm.asked_for_vm() {
        return std::future::pending().await;
    }
    tracing::warn!("exiting: the process that started this VMM is gone and no VM was asked for");
}

fn serve_api(
    socket: &std::path::Path,
    inherited: Option<std::os::unix::net::UnixListener>,
    anchor: Option<std::os::fd::OwnedFd>,
    vmm: Arc<Vmm>,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        // Backend calls run one at a time anyway; one blocking thread keeps the process's
        // thread count fixed.
        .max_blocking_threads(1)
        // And it stays: a VMM waiting in a node's pool is claimed whenever a VM is needed,
        // and its first call should not pay for a new thread.
        .thread_keep_alive(std::time::Duration::from_secs(24 * 3600))
        .build()
        .context("starting the API runtime")?;
    runtime.block_on(async {
        let ours = inherited.is_none();
        let listener = match inherited {
            Some(listener) => agentvm_vmm_api::adopt_api_listener(listener)
                .with_context(|| format!("serving on the API socket {}", socket.display()))?,
            None => agentvm_vmm_api::bind_api_socket(socket)
                .with_context(|| format!("binding the API socket {}", socket.display()))?,
        };
        let anchor_vmm = vmm.clone();
        let stop = async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .ok();
            tokio::select! {
                _ = anchor_gone(anchor, anchor_vmm) => {}
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
        };
        let served = agentvm_vmm_api::serve_with_shutdown(listener, vmm, stop).await;
        if ours {
            let _ = std::fs::remove_file(socket);
        }
        served.with_context(|| format!("serving the API on {}", socket.display()))
    })
}

fn config_from_args(args: &Args, kernel: PathBuf) -> anyhow::Result<VmConfig> {
    let (mode, file) = match args.serial.as_str() {
        "off" => (ConsoleOutputMode::Off, None),
        "null" => (ConsoleOutputMode::Null, None),
        "tty" => (ConsoleOutputMode::Tty, None),
        path => (ConsoleOutputMode::File, Some(PathBuf::from(path))),
    };
    let mut config = VmConfig::with_kernel(kernel);
    config.cpus = CpusConfig {
        boot_vcpus: args.cpus,
        max_vcpus: args.cpus,
    };
    config.memory = MemoryConfig {
        size: args.memory_mib << 20,
        ..MemoryConfig::default()
    };
    config.payload = PayloadConfig {
        initramfs: args.initramfs.clone(),
        cmdline: args.cmdline.clone(),
        ..config.payload
    };
    config.serial = SerialConfig {
        mode,
        file,
        socket: None,
    };
    config.vsock = args.vsock.as_deref().map(parse_vsock).transpose()?;
    Ok(config)
}

fn parse_vsock(text: &str) -> anyhow::Result<VsockConfig> {
    let (mut cid, mut socket) = (None, None);
    for part in text.split(',') {
        match part.split_once('=') {
            Some(("cid", v)) => cid = Some(v.parse().context("--vsock cid")?),
            Some(("socket", v)) => socket = Some(PathBuf::from(v)),
            _ => anyhow::bail!("--vsock: unexpected `{part}` (want cid=N,socket=PATH)"),
        }
    }
    Ok(VsockConfig {
        cid: cid.context("--vsock needs cid=N")?,
        socket: socket.context("--vsock needs socket=PATH")?,
        id: None,
    })
}
