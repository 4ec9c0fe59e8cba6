//! The session's workspace disk: found among the virtio disks by its serial and mounted
//! where the image says, before the harness starts.

use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

use crate::image::{ImageConfig, WORKSPACE_SERIAL, WorkspaceFs};

/// Mounts the workspace if the image has an ext4 one; returns where. A raw workspace is
/// the harness's to use (it finds it by its serial, as [`disk_with_serial`] does).
pub fn mount(config: &ImageConfig) -> Result<Option<PathBuf>, String> {
    if config.vm.workspace_mib == 0 || config.vm.workspace_fs == WorkspaceFs::Raw {
        return Ok(None);
    }
    let device = disk_with_serial(Path::new("/sys/block"), WORKSPACE_SERIAL)?
        .ok_or_else(|| format!("no disk with serial {WORKSPACE_SERIAL:?} in /sys/block"))?;
    let target = &config.vm.workspace_mount;
    std::fs::create_dir_all(target).map_err(|e| format!("creating {}: {e}", target.display()))?;
    nix::mount::mount(
        Some(&device),
        target,
        Some("ext4"),
        MsFlags::MS_NOATIME | MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        None::<&str>,
    )
    .map_err(|e| {
        format!(
            "mounting {} (ext4) at {}: {e}",
            device.display(),
            target.display()
        )
    })?;
    // The harness's own, when it runs as a user of its own (a container image's User).
    let (uid, gid) = (config.harness.uid, config.harness.gid);
    if (uid, gid) != (0, 0) {
        std::os::unix::fs::chown(target, Some(uid), Some(gid))
            .map_err(|e| format!("giving {} to {uid}:{gid}: {e}", target.display()))?;
    }
    Ok(Some(target.clone()))
}

/// The block device whose serial is `serial`, among those in `sys_block`.
pub fn disk_with_serial(sys_block: &Path, serial: &str) -> Result<Option<PathBuf>, String> {
    let entries =
        std::fs::read_dir(sys_block).map_err(|e| format!("{}: {e}", sys_block.display()))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    Ok(names
        .into_iter()
        .find(|name| {
            std::fs::read_to_string(sys_block.join(name).join("serial"))
                .is_ok_and(|found| found.trim_end_matches(['\n', '\0']) == serial)
        })
        .map(|name| Path::new("/dev").join(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_is_the_disk_with_its_serial() {
        let sys = tempfile::tempdir().unwrap();
        for (name, serial) in [("vda", "rootfs\n"), ("vdb", "workspace\n"), ("loop0", "")] {
            std::fs::create_dir(sys.path().join(name)).unwrap();
            std::fs::write(sys.path().join(name).join("serial"), serial).unwrap();
        }
        std::fs::create_dir(sys.path().join("vdc")).unwrap();
        let find = |dir: &Path| disk_with_serial(dir, WORKSPACE_SERIAL);
        assert_eq!(find(sys.path()).unwrap(), Some(PathBuf::from("/dev/vdb")));
        assert_eq!(
            disk_with_serial(sys.path(), "rootfs").unwrap(),
            Some(PathBuf::from("/dev/vda"))
        );
        std::fs::write(sys.path().join("vdb/serial"), "workspace-2\n").unwrap();
        assert_eq!(find(sys.path()).unwrap(), None);
        assert!(find(&sys.path().join("missing")).is_err());
    }
}
