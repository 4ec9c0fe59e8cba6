//! agentvm-snapshot: the snapshot directory format and where snapshots live.
//!
//! A snapshot directory holds `config.json` (the VM config), `state.json` (vCPU, interrupt
//! controller, clock and device state, [`state`]), `memory` (guest RAM, sparse: holes where
//! the guest never wrote, or — for a layered snapshot — where it did not write since its
//! base) and `manifest.json` ([`manifest`]: format version, size and digest of every file,
//! the host identity it may be restored on, the base it is layered on).
//!
//! [`dir`] writes and opens directories with their digests checked, [`pages`] handles guest
//! memory files, [`archive`] moves a snapshot between nodes, and [`store`] keeps them with
//! reference counts.

#![forbid(unsafe_code)]

pub mod archive;
pub mod dir;
pub mod disk;
pub mod manifest;
pub mod merge;
pub mod pages;
pub mod state;
pub mod store;

pub use dir::{Snapshot, SnapshotWriter};
pub use manifest::{HostIdentity, Manifest};
pub use store::LocalStore;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("manifest.json: {0}")]
    Manifest(String),
    #[error(
        "snapshot format version {found} is not supported (this build reads version {supported})"
    )]
    FormatVersion { found: u32, supported: u32 },
    #[error("{0} is listed in the manifest but missing")]
    MissingFile(String),
    #[error("{file} is {found} bytes, the manifest says {expected}")]
    SizeMismatch {
        file: String,
        expected: u64,
        found: u64,
    },
    #[error("{file} does not match its digest (manifest {expected}, file {found})")]
    DigestMismatch {
        file: String,
        expected: String,
        found: String,
    },
    #[error("snapshot cannot be restored on this host: {0}")]
    Incompatible(String),
    #[error("base snapshot {dir}: {reason}")]
    Base { dir: String, reason: String },
    #[error("{0} already holds a snapshot")]
    Exists(String),
    #[error("{0} is not a directory")]
    NotADirectory(String),
    #[error("state.json: {0}")]
    State(String),
    #[error("archive: {0}")]
    Archive(String),
    #[error("snapshot {0} not found")]
    NotFound(String),
    #[error("invalid {kind} {name:?}: use 1-128 of [A-Za-z0-9._-], not starting with '.'")]
    InvalidName { kind: String, name: String },
    #[error("snapshot {id} is in use (holders {holders:?}, layered snapshots {dependents:?})")]
    InUse {
        id: String,
        holders: Vec<String>,
        dependents: Vec<String>,
    },
}
