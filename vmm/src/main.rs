//! `agentvm-vmm`: one microVM per process.
//!
//! `agentvm-vmm --api-socket PATH` serves the Cloud Hypervisor REST API on PATH and waits for
//! `vm.create`/`vm.boot`. Given `--kernel`, it boots that VM at once (one-shot, for tests and
//! benchmarks) and exits when the guest shuts down, unless an API socket keeps it alive.

use std::path::PathBuf;
use std::process::ExitCode;

use agentvm_vmm::vm::{RamSpec, SerialSpec, Vm, VmSpec, VsockSpec};
use anyhow::Context;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "agentvm-vmm", version, about = "KVM microVM monitor")]
struct Args {
    /// Kernel to boot at once (one-shot mode): ELF vmlinux (PVH or 64-bit entry) or bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    #[arg(long)]
    initramfs: Option<PathBuf>,
    #[arg(long, default_value = "")]
    cmdline: String,
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
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AGENTVM_VMM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("agentvm-vmm: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<ExitCode> {
    let kernel = args
        .kernel
        .clone()
        .context("nothing to do: give --kernel (one-shot) or --api-socket")?;
    let spec = VmSpec {
        vcpus: args.cpus,
        memory_bytes: args.memory_mib << 20,
        ram: RamSpec::default(),
        kernel,
        initramfs: args.initramfs.clone(),
        cmdline: args.cmdline.clone(),
        serial: match args.serial.as_str() {
            "off" => SerialSpec::Off,
            "null" => SerialSpec::Null,
            "tty" => SerialSpec::Stdout,
            path => SerialSpec::File(path.into()),
        },
        vsock: args.vsock.as_deref().map(parse_vsock).transpose()?,
    };
    let vm = Vm::boot(&spec).context("booting the VM")?;
    vm.exit_signal()
        .event()
        .read()
        .context("waiting for the VM to exit")?;
    let reason = vm.exit_signal().reason();
    vm.stop();
    match reason {
        Some(agentvm_vmm::exit::ExitReason::VcpuFailure(why)) => {
            eprintln!("agentvm-vmm: {why}");
            Ok(ExitCode::FAILURE)
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

fn parse_vsock(text: &str) -> anyhow::Result<VsockSpec> {
    let (mut cid, mut socket) = (None, None);
    for part in text.split(',') {
        match part.split_once('=') {
            Some(("cid", v)) => cid = Some(v.parse().context("--vsock cid")?),
            Some(("socket", v)) => socket = Some(PathBuf::from(v)),
            _ => anyhow::bail!("--vsock: unexpected `{part}` (want cid=N,socket=PATH)"),
        }
    }
    Ok(VsockSpec {
        cid: cid.context("--vsock needs cid=N")?,
        socket: socket.context("--vsock needs socket=PATH")?,
    })
}
