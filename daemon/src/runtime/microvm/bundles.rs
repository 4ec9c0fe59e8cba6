//! Guest image bundles installed on the node (`agentvm image build` output, one directory per
//! image under the image directory). Each becomes a built-in harness of the microvm runtime,
//! named after its directory, with the tier its `image.toml` declares.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use agentvm_guest::image::{ImageConfig, Resumability, WorkspaceFs};
use sha2::{Digest, Sha256};

use super::GuestImage;
use crate::image::{
    CONFIG_FILE, INITRAMFS_FILE, KERNEL_FILE, MANIFEST_FILE, PAGES_DIGEST, ROOTFS_FILE,
    WORKSPACE_FILE,
};

/// Why a directory under the image directory is not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub dir: PathBuf,
    pub why: String,
}

/// A harness name an image directory may have: it is what sessions name.
fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'-' | b'_' | b'.')
        })
}

/// Every bundle under `dir` (sorted by name), and the directories skipped with the reason.
/// Names in `reserved` (the built-in harnesses) are never taken by an image.
pub fn load(dir: &Path, reserved: &[&str]) -> (Vec<GuestImage>, Vec<Skipped>) {
    let mut images = Vec::new();
    let mut skipped = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (images, skipped);
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for path in dirs {
        match load_one(&path, reserved) {
            Ok(image) => images.push(image),
            Err(why) => skipped.push(Skipped { dir: path, why }),
        }
    }
    (images, skipped)
}

fn load_one(dir: &Path, reserved: &[&str]) -> Result<GuestImage, String> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("the directory name is not UTF-8")?;
    if !valid_name(name) {
        return Err(format!(
            "{name:?} is not a harness name (lowercase letters, digits, '-', '_', '.'; 63 at most)"
        ));
    }
    if reserved.contains(&name) {
        return Err(format!("{name:?} is a built-in harness name"));
    }
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest: serde_json::Value = std::fs::read(&manifest_path)
        .map_err(|e| format!("{}: {e}", manifest_path.display()))
        .and_then(|b| {
            serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", manifest_path.display()))
        })?;
    if manifest["format"] != crate::image::BUNDLE_FORMAT {
        return Err(format!(
            "{}: bundle format {} (this node reads {})",
            manifest_path.display(),
            manifest["format"],
            crate::image::BUNDLE_FORMAT
        ));
    }
    let mut digests = BTreeMap::new();
    let mut linux_kernel = false;
    for file in [KERNEL_FILE, INITRAMFS_FILE, CONFIG_FILE] {
        let want = manifest["files"][file]["sha256"]
            .as_str()
            .ok_or_else(|| format!("{}: no digest for {file}", manifest_path.display()))?;
        let path = dir.join(file);
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let got = hex::encode(Sha256::digest(&bytes));
        if got != want {
            return Err(format!(
                "{} does not match the manifest (sha256 {got}, manifest {want})",
                path.display()
            ));
        }
        if file == KERNEL_FILE {
            linux_kernel = is_linux_kernel(&bytes);
        }
        digests.insert(file, path);
    }
    let config = ImageConfig::load(&digests[CONFIG_FILE]).map_err(|e| e.to_string())?;
    let workspace_template = match (config.vm.workspace_mib, config.vm.workspace_fs) {
        (0, _) | (_, WorkspaceFs::Raw) => None,
        (mib, WorkspaceFs::Ext4) => Some(paged_file(
            dir,
            WORKSPACE_FILE,
            &manifest["files"][WORKSPACE_FILE],
            Some(u64::from(mib) << 20),
        )?),
    };
    let rootfs = match config.vm.rootfs {
        true => Some(paged_file(
            dir,
            ROOTFS_FILE,
            &manifest["files"][ROOTFS_FILE],
            None,
        )?),
        false => None,
    };
    Ok(GuestImage {
        harness: name.to_owned(),
        kernel: digests[KERNEL_FILE].clone(),
        initramfs: Some(digests[INITRAMFS_FILE].clone()),
        cmdline: config.vm.cmdline.clone(),
        memory_snapshot: config.harness.resumability == Resumability::RequiresMemorySnapshot,
        vcpus: Some(config.vm.vcpus),
        memory_mib: Some(u64::from(config.vm.memory_mib)),
        workspace_mib: u64::from(config.vm.workspace_mib),
        workspace_template,
        rootfs,
        network: image_network(&config.network)?,
        linux_kernel,
        cold_boot: config.vm.cold_boot,
        checkpoints: config.vm.checkpoints.clone(),
    })
}

/// Whether `kernel` is a Linux kernel: a bzImage (its setup header's "HdrS") or an ELF
/// vmlinux (its banner). What a PVM host cannot boot unless built as a PVM guest.
pub fn is_linux_kernel(kernel: &[u8]) -> bool {
    kernel.get(0x202..0x206) == Some(b"HdrS")
        || (kernel.starts_with(b"\x7fELF")
            && memchr::memmem::find(kernel, b"Linux version ").is_some())
}

/// The image's `[network]`, checked (again: a bundle is read from disk).
fn image_network(
    network: &agentvm_guest::image::NetworkConfig,
) -> Result<Option<super::network::ImageNetwork>, String> {
    if !network.enabled {
        return Ok(None);
    }
    Ok(Some(super::network::ImageNetwork {
        allow: network.entries().map_err(|e| format!("[network] {e}"))?,
        rate_limit_mbit: network.rate_limit_mbit,
    }))
}

/// A disk image of the bundle (a workspace template, a root filesystem), checked against
/// the manifest by its pages' digest: reading a large sparse image whole would cost the node
/// its size in memory. `size`, when given, is the size image.toml implies.
fn paged_file(
    dir: &Path,
    name: &str,
    entry: &serde_json::Value,
    size: Option<u64>,
) -> Result<PathBuf, String> {
    let path = dir.join(name);
    let (Some(want), Some(PAGES_DIGEST)) = (entry["sha256"].as_str(), entry["digest"].as_str())
    else {
        return Err(format!(
            "image.toml asks for {name} but the manifest lists no page digest of it (rebuild \
             the bundle with agentvm image build)"
        ));
    };
    let file = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let len = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if size.is_some_and(|size| size != len) || entry["size"].as_u64() != Some(len) {
        return Err(format!(
            "{} is {len} bytes, not what the manifest and image.toml say",
            path.display()
        ));
    }
    let (got, _) = agentvm_snapshot::pages::file_digest(&file)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if got != want {
        return Err(format!(
            "{} does not match the manifest (page sha256 {got}, manifest {want})",
            path.display()
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_kernels_are_told_from_other_payloads() {
        let mut bzimage = vec![0u8; 0x400];
        bzimage[0x202..0x206].copy_from_slice(b"HdrS");
        assert!(is_linux_kernel(&bzimage));
        let mut vmlinux = agentvm_testguest::TESTGUEST_ELF.to_vec();
        assert!(!is_linux_kernel(&vmlinux), "the test guest is no Linux");
        vmlinux.extend_from_slice(b"Linux version 6.1.0");
        assert!(is_linux_kernel(&vmlinux));
        assert!(!is_linux_kernel(b"Linux version 6.1.0, but no ELF"));
        assert!(!is_linux_kernel(&[]));
    }

    #[test]
    fn names_are_checked() {
        for ok in ["echo-linux", "a", "py3.11_agent"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "-x", "Upper", "with space", &"a".repeat(64)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
