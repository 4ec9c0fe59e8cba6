//! `manifest.json`: what a snapshot directory holds and where it may be restored.
//!
//! Read strictly: an unknown field is an error, and the format version is checked before
//! anything else so a snapshot from a newer build says so instead of failing on some field.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::SnapshotError;

/// Bumped on any change a reader of the previous version could not handle.
pub const FORMAT_VERSION: u32 = 1;

pub const MANIFEST_FILE: &str = "manifest.json";
pub const CONFIG_FILE: &str = "config.json";
pub const STATE_FILE: &str = "state.json";
pub const MEMORY_FILE: &str = "memory";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    pub created_unix_ms: u64,
    /// The VMM build that wrote the snapshot.
    pub vmm_version: String,
    pub host: HostIdentity,
    /// Every file of the snapshot but the manifest itself.
    pub files: BTreeMap<String, FileEntry>,
    pub memory: MemoryLayout,
}

/// What must match for a restore: KVM flavour and CPU. The kernel release is recorded for
/// diagnosis; a different one alone does not refuse a restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostIdentity {
    /// `PVM`, `VMX` or `SVM`: guest state of one cannot be loaded into another.
    pub kvm_flavour: String,
    pub cpu_vendor: String,
    /// `family/model/stepping` and the model name, as /proc/cpuinfo reports them.
    pub cpu_model: String,
    pub kernel_release: String,
}

impl HostIdentity {
    /// This machine, for a VMM of `kvm_flavour`.
    pub fn current(kvm_flavour: &str) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .take_while(|l| !l.is_empty())
                .find_map(|l| {
                    let (key, value) = l.split_once(':')?;
                    (key.trim() == name).then(|| value.trim().to_owned())
                })
                .unwrap_or_default()
        };
        let kernel_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        Self {
            kvm_flavour: kvm_flavour.to_owned(),
            cpu_vendor: field("vendor_id"),
            cpu_model: format!(
                "{}/{}/{} {}",
                field("cpu family"),
                field("model"),
                field("stepping"),
                field("model name")
            ),
            kernel_release,
        }
    }

    /// Why a snapshot taken on `self` cannot be restored on `here`, if it cannot.
    pub fn incompatibility(&self, here: &HostIdentity) -> Option<String> {
        if self.kvm_flavour != here.kvm_flavour {
            return Some(format!(
                "taken under KVM flavour {}, this host is {}",
                self.kvm_flavour, here.kvm_flavour
            ));
        }
        if self.cpu_vendor != here.cpu_vendor || self.cpu_model != here.cpu_model {
            return Some(format!(
                "taken on CPU {} {}, this host has {} {}",
                self.cpu_vendor, self.cpu_model, here.cpu_vendor, here.cpu_model
            ));
        }
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DigestKind {
    /// SHA-256 of the file's bytes.
    Bytes,
    /// SHA-256 over the non-zero 4 KiB pages (see `pages`): holes and written zeros alike.
    Pages,
    /// SHA-256 over every 4 KiB page stored in the file, zero pages included: in a layered
    /// memory file a stored page of zeros overrides the base, a hole does not.
    LayerPages,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub size: u64,
    pub digest: DigestKind,
    pub sha256: String,
    /// The file's identity when its digest was computed. A file whose inode, size, mtime and
    /// ctime are unchanged since is not rehashed at restore; any write changes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stamp: Option<FileStamp>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileStamp {
    pub dev: u64,
    pub inode: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl FileStamp {
    pub fn of(metadata: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            dev: metadata.dev(),
            inode: metadata.ino(),
            size: metadata.len(),
            mtime_ns: metadata.mtime() * 1_000_000_000 + metadata.mtime_nsec(),
            ctime_ns: metadata.ctime() * 1_000_000_000 + metadata.ctime_nsec(),
        }
    }
}

/// Guest RAM: its size, and the snapshot it is layered on, if any. A layered `memory` file
/// holds only the pages that changed since the base; its holes mean "as in the base".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryLayout {
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<BaseRef>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaseRef {
    /// The base snapshot's directory (absolute).
    pub dir: PathBuf,
    /// SHA-256 of the base's manifest.json when the layer was taken.
    pub manifest_sha256: String,
    /// SHA-256 of what the base holds (its files' digests and its memory size), which is
    /// what a layer on it depends on: a base whose contents changed is refused, while one
    /// whose own base was re-pointed (a merge below it, composing the same memory) is not.
    /// Without it (older snapshots) the base's manifest must be unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_sha256: Option<String>,
}

impl Manifest {
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising these plain structs cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// Parses a manifest, checking the format version before the fields.
    pub fn from_json(bytes: &[u8]) -> Result<Self, SnapshotError> {
        #[derive(Deserialize)]
        struct VersionOnly {
            format_version: Option<u32>,
        }
        let version = serde_json::from_slice::<VersionOnly>(bytes)
            .map_err(|e| SnapshotError::Manifest(e.to_string()))?
            .format_version
            .ok_or_else(|| SnapshotError::Manifest("format_version is missing".into()))?;
        if version != FORMAT_VERSION {
            return Err(SnapshotError::FormatVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        serde_json::from_slice(bytes).map_err(|e| SnapshotError::Manifest(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            created_unix_ms: 1,
            vmm_version: "0.1.0".into(),
            host: HostIdentity::current("PVM"),
            files: BTreeMap::new(),
            memory: MemoryLayout {
                size: 1 << 20,
                base: None,
            },
        }
    }

    #[test]
    fn round_trips_and_refuses_other_versions_and_fields() {
        let m = manifest();
        assert_eq!(Manifest::from_json(&m.to_json()).unwrap(), m);
        let mut newer: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        newer["format_version"] = 2.into();
        let err = Manifest::from_json(newer.to_string().as_bytes()).unwrap_err();
        assert!(matches!(
            err,
            SnapshotError::FormatVersion {
                found: 2,
                supported: 1
            }
        ));
        let mut extra: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        extra["surprise"] = true.into();
        assert!(matches!(
            Manifest::from_json(extra.to_string().as_bytes()),
            Err(SnapshotError::Manifest(_))
        ));
        assert!(Manifest::from_json(b"{}").is_err());
        assert!(Manifest::from_json(b"not json").is_err());
    }

    #[test]
    fn host_identity_compatibility() {
        let here = HostIdentity::current("PVM");
        assert!(here.incompatibility(&here).is_none());
        let vmx = HostIdentity {
            kvm_flavour: "VMX".into(),
            ..here.clone()
        };
        assert!(vmx.incompatibility(&here).unwrap().contains("VMX"));
        let other_cpu = HostIdentity {
            cpu_model: "6/85/7 Other".into(),
            ..here.clone()
        };
        assert!(other_cpu.incompatibility(&here).is_some());
        let other_kernel = HostIdentity {
            kernel_release: "1.0".into(),
            ..here.clone()
        };
        assert!(other_kernel.incompatibility(&here).is_none());
        assert!(!here.cpu_vendor.is_empty(), "{here:?}");
    }
}
