//! Plumbing one VM's network: the tap, veth pair, addresses and routes inside its VMM's
//! network namespace, the host's end of the veth, and the resolver's socket on the tap's
//! address. Done by Debian's `ip` (one batch per namespace) from a thread that has joined
//! the VMM's namespace: the namespace belongs to the VMM, and goes with it.

use std::fs::File;
use std::io::Write;
use std::net::UdpSocket;
use std::os::unix::fs::MetadataExt;
use std::process::{Command, Stdio};

use nix::sched::CloneFlags;

use super::{Slot, TAP};

/// Why a VM's network was not set up.
#[derive(Debug)]
pub enum SetUpError {
    /// Another VM (perhaps another daemon's) holds the slot: its veth name exists.
    Taken,
    Failed(String),
}

impl From<String> for SetUpError {
    fn from(reason: String) -> Self {
        Self::Failed(reason)
    }
}

/// Sets up `slot` for the VMM `pid`; returns the resolver's socket (bound in the VMM's
/// namespace, on the gateway's port 53). The slot is claimed first, by creating its veth
/// pair on the host: a name that exists means another VM has it. Runs on a thread of its
/// own, which it spends.
pub fn set_up(pid: u32, slot: &Slot) -> Result<UdpSocket, SetUpError> {
    let namespace = File::open(format!("/proc/{pid}/ns/net"))
        .map_err(|e| format!("the VMM's network namespace: {e}"))?;
    let own = File::open("/proc/self/ns/net").map_err(|e| format!("/proc/self/ns/net: {e}"))?;
    let same = |a: &File, b: &File| match (a.metadata(), b.metadata()) {
        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
        _ => false,
    };
    if same(&namespace, &own) {
        return Err(
            "guest networking needs jailed VMMs (each in a network namespace of its own)"
                .to_owned()
                .into(),
        );
    }
    let uid = vmm_uid(pid)?;
    if let Err(e) = ip_batch(&format!(
        "link add {veth} type veth peer name eth0 netns /proc/{pid}/ns/net\n",
        veth = slot.host_veth()
    )) {
        return Err(match e.contains("File exists") {
            true => SetUpError::Taken,
            false => SetUpError::Failed(format!("on the host: {e}")),
        });
    }
    let slot = *slot;
    let socket = std::thread::spawn(move || -> Result<UdpSocket, String> {
        nix::sched::setns(&namespace, CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("joining the VMM's network namespace: {e}"))?;
        ip_batch(&format!(
            "link set lo up\n\
             tuntap add dev {TAP} mode tap user {uid}\n\
             address add {gateway}/30 dev {TAP}\n\
             link set {TAP} up\n\
             address add {inner}/30 dev eth0\n\
             link set eth0 up\n\
             route add default via {outer}\n",
            gateway = slot.gateway(),
            inner = slot.namespace_end(),
            outer = slot.host_end(),
        ))
        .map_err(|e| format!("in the VMM's namespace: {e}"))?;
        forward_ipv4().map_err(|e| format!("in the VMM's namespace: {e}"))?;
        bind_resolver_here(&slot)
    })
    .join()
    .map_err(|_| "the network set-up thread panicked".to_owned())??;
    ip_batch(&format!(
        "address add {outer}/30 dev {veth}\n\
         link set {veth} up\n\
         route add {block}/30 via {inner} dev {veth}\n",
        outer = slot.host_end(),
        veth = slot.host_veth(),
        block = slot.guest_block(),
        inner = slot.namespace_end(),
    ))
    .map_err(|e| format!("on the host: {e}"))?;
    forward_ipv4().map_err(|e| format!("on the host: {e}"))?;
    Ok(socket)
}

/// A new resolver socket for the VMM `pid` whose network `slot` set up earlier (by a daemon
/// that has since restarted: its socket went with it).
pub fn rebind_resolver(pid: u32, slot: &Slot) -> Result<UdpSocket, String> {
    let namespace = File::open(format!("/proc/{pid}/ns/net"))
        .map_err(|e| format!("the VMM's network namespace: {e}"))?;
    let slot = *slot;
    std::thread::spawn(move || {
        nix::sched::setns(&namespace, CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("joining the VMM's network namespace: {e}"))?;
        bind_resolver_here(&slot)
    })
    .join()
    .map_err(|_| "the resolver thread panicked".to_owned())?
}

/// The resolver's socket on the slot's gateway, in the calling thread's namespace.
fn bind_resolver_here(slot: &Slot) -> Result<UdpSocket, String> {
    let socket = UdpSocket::bind((slot.gateway(), 53))
        .map_err(|e| format!("binding the resolver to {}:53: {e}", slot.gateway()))?;
    socket
        .set_nonblocking(true)
        .map_err(|e| format!("the resolver's socket: {e}"))?;
    Ok(socket)
}

/// The uid the VMM runs as (its tap must be its own to attach to).
fn vmm_uid(pid: u32) -> Result<u32, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("the VMM's status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|euid| euid.parse().ok())
        .ok_or_else(|| "the VMM's status names no uid".to_owned())
}

/// Routing between the tap, the veth and the host's interfaces. In a VMM's namespace the
/// setting is its own; on the host it is what routing to any guest needs. A router does
/// not take source-routed packets (a guest must not pick its own path through the host).
fn forward_ipv4() -> Result<(), String> {
    for (path, value, what) in [
        (
            "/proc/sys/net/ipv4/conf/all/accept_source_route",
            "0",
            "refusing source-routed packets",
        ),
        (
            "/proc/sys/net/ipv4/ip_forward",
            "1",
            "enabling IPv4 forwarding",
        ),
    ] {
        if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == value) {
            continue;
        }
        std::fs::write(path, value).map_err(|e| format!("{what}: {e}"))?;
    }
    Ok(())
}

/// iproute2's `ip` where Debian puts it (a busybox `ip` earlier on PATH lacks `-batch`).
fn ip_program() -> &'static str {
    const DEBIAN: &str = "/sbin/ip";
    match std::path::Path::new(DEBIAN).exists() {
        true => DEBIAN,
        false => "ip",
    }
}

/// Runs `commands` through one `ip -batch -`; its error output names the failing line.
fn ip_batch(commands: &str) -> Result<(), String> {
    let mut child = Command::new(ip_program())
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running ip (iproute2): {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(commands.as_bytes())
            .map_err(|e| format!("feeding ip: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for ip: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "ip -batch failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}
