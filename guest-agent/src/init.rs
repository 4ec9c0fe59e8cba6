//! PID 1 duties: the filesystems a Linux userland expects, limits, the hostname, and what the
//! host put on the kernel command line for us.

use agentvm_proto::guest::v1::Identity;
use nix::errno::Errno;
use nix::mount::MsFlags;
use nix::sys::resource::{Resource, setrlimit};

/// Mounts the API filesystems; each failure is logged and the rest go on (a guest without
/// /sys still runs a harness).
pub fn mount_filesystems() {
    for (source, target, fstype, flags, data) in [
        (
            "proc",
            "/proc",
            "proc",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            "",
        ),
        (
            "sysfs",
            "/sys",
            "sysfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            "",
        ),
        (
            "devtmpfs",
            "/dev",
            "devtmpfs",
            MsFlags::MS_NOSUID,
            "mode=0755",
        ),
        (
            "devpts",
            "/dev/pts",
            "devpts",
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            "gid=5,mode=0620,ptmxmode=0666",
        ),
        (
            "tmpfs",
            "/dev/shm",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "/tmp",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "/run",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            "mode=0755",
        ),
    ] {
        if let Err(e) = mount(source, target, fstype, flags, data) {
            tracing::warn!(target, error = %e, "mount failed");
        }
    }
}

fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: &str,
) -> std::io::Result<()> {
    std::fs::create_dir_all(target)?;
    match nix::mount::mount(Some(source), target, Some(fstype), flags, Some(data)) {
        // Already mounted (the kernel's devtmpfs automount) is fine.
        Ok(()) | Err(Errno::EBUSY) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Raises the open-files limit harnesses (language runtimes, many sockets) need.
pub fn raise_limits() {
    if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, 65_536, 65_536) {
        tracing::warn!(error = %std::io::Error::from(e), "raising RLIMIT_NOFILE");
    }
}

/// What the host says about this VM on the kernel command line (`agentvm.session=…`,
/// `agentvm.hostname=…`, `agentvm.vm_id=…`, `agentvm.cid=…`, `agentvm.boot_generation=…`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootParams {
    pub identity: Identity,
    pub boot_generation: u64,
    /// `agentvm.net=ADDRESS/PREFIX,GATEWAY,MAC`: the VM has a network interface to set up.
    pub network: Option<agentvm_proto::guest::v1::Network>,
    /// `agentvm.harness_ready_ms=…`: how long the host waits for this guest's harness, so
    /// the agent waits as long for it to start.
    pub harness_ready_ms: Option<u64>,
}

pub fn boot_params(cmdline: &str) -> BootParams {
    let mut p = BootParams {
        boot_generation: 1,
        ..Default::default()
    };
    for word in cmdline.split_whitespace() {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        match key {
            "agentvm.session" => p.identity.session_uid = value.to_owned(),
            "agentvm.hostname" => p.identity.hostname = value.to_owned(),
            "agentvm.vm_id" => p.identity.vm_id = value.to_owned(),
            "agentvm.cid" => p.identity.vsock_cid = value.parse().unwrap_or(0),
            "agentvm.net" => p.network = crate::net::Interface::from_cmdline(value),
            "agentvm.boot_generation" => p.boot_generation = value.parse().unwrap_or(1),
            "agentvm.harness_ready_ms" => p.harness_ready_ms = value.parse().ok(),
            _ => {}
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_params_come_from_the_command_line() {
        let p = boot_params(
            "console=ttyS0 agentvm.session=sess-1 agentvm.hostname=h1 agentvm.cid=7 \
             agentvm.vm_id=vm-9 agentvm.boot_generation=3 agentvm.cid=x=y \
             agentvm.harness_ready_ms=90000 quiet",
        );
        assert_eq!(p.harness_ready_ms, Some(90_000));
        assert_eq!(p.identity.session_uid, "sess-1");
        assert_eq!(p.identity.hostname, "h1");
        assert_eq!(p.identity.vm_id, "vm-9");
        assert_eq!(
            p.identity.vsock_cid, 0,
            "a malformed later value resets, never panics"
        );
        assert_eq!(p.boot_generation, 3);
        assert_eq!(boot_params("").boot_generation, 1);
        assert_eq!(
            boot_params("agentvm.harness_ready_ms=soon").harness_ready_ms,
            None
        );
    }
}
