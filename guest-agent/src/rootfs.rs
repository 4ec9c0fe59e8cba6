//! A container image's root filesystem: the read-only erofs disk every VM of the image
//! shares, with an overlay on tmpfs above it (writes stay in guest memory, so snapshots and
//! forks carry them), switched into as `/` before the harness starts.

use std::path::Path;

use nix::mount::MsFlags;

use crate::image::{ImageConfig, ROOTFS_SERIAL};
use crate::workspace::disk_with_serial;

/// Where the layers are put together, in the initramfs's /run.
const STAGING: &str = "/run/agentvm/root";

/// Switches into the image's root filesystem if it has one; returns whether it did. The
/// agent keeps running (it is static and already loaded); everything it and the harness
/// open afterwards is the image's.
pub fn switch(config: &ImageConfig) -> Result<bool, String> {
    if !config.vm.rootfs {
        return Ok(false);
    }
    let device = disk_with_serial(Path::new("/sys/block"), ROOTFS_SERIAL)?
        .ok_or_else(|| format!("no disk with serial {ROOTFS_SERIAL:?} in /sys/block"))?;
    let staging = Path::new(STAGING);
    let (lower, rw, new) = (
        staging.join("lower"),
        staging.join("rw"),
        staging.join("new"),
    );
    for dir in [&lower, &rw, &new] {
        mkdir(dir)?;
    }
    mount(&device, &lower, "erofs", MsFlags::MS_RDONLY, "")?;
    mount(
        Path::new("tmpfs"),
        &rw,
        "tmpfs",
        MsFlags::empty(),
        "mode=0755",
    )?;
    let (upper, work) = (rw.join("upper"), rw.join("work"));
    mkdir(&upper)?;
    mkdir(&work)?;
    let layers = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    mount(
        Path::new("overlay"),
        &new,
        "overlay",
        MsFlags::empty(),
        &layers,
    )?;
    let nosuid = MsFlags::MS_NOSUID;
    for (source, target, fstype, flags, data) in [
        (
            "proc",
            "proc",
            "proc",
            nosuid | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            "",
        ),
        (
            "sysfs",
            "sys",
            "sysfs",
            nosuid | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            "",
        ),
        ("devtmpfs", "dev", "devtmpfs", nosuid, "mode=0755"),
        (
            "devpts",
            "dev/pts",
            "devpts",
            nosuid | MsFlags::MS_NOEXEC,
            "gid=5,mode=0620,ptmxmode=0666",
        ),
        (
            "tmpfs",
            "dev/shm",
            "tmpfs",
            nosuid | MsFlags::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "tmp",
            "tmpfs",
            nosuid | MsFlags::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "run",
            "tmpfs",
            nosuid | MsFlags::MS_NODEV,
            "mode=0755",
        ),
    ] {
        let at = new.join(target);
        mkdir(&at)?;
        mount(Path::new(source), &at, fstype, flags, data)?;
    }
    // switch_root's way: the new root is moved over the initramfs's, which stays beneath.
    std::env::set_current_dir(&new).map_err(|e| format!("entering {}: {e}", new.display()))?;
    nix::mount::mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|e| format!("moving the new root over /: {e}"))?;
    nix::unistd::chroot(".").map_err(|e| format!("chroot into the new root: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| format!("entering the new root: {e}"))?;
    Ok(true)
}

fn mkdir(path: &Path) -> Result<(), String> {
    std::fs::create_dir_all(path).map_err(|e| format!("creating {}: {e}", path.display()))
}

fn mount(
    source: &Path,
    target: &Path,
    fstype: &str,
    flags: MsFlags,
    data: &str,
) -> Result<(), String> {
    nix::mount::mount(
        Some(source),
        target,
        Some(fstype),
        flags,
        (!data.is_empty()).then_some(data),
    )
    .map_err(|e| {
        format!(
            "mounting {} ({fstype}) at {}: {e}",
            source.display(),
            target.display()
        )
    })
}
