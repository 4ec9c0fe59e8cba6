//! Protocol definitions shared by every agentvm process.
//!
//! - [`v1`]: the upstream `agentsessions.v1` contract (Sessions, Harness, HarnessRegistry),
//!   wire-compatible with the Go reference host.
//! - [`guest::v1`]: `agentvm.guest.v1`, the frame protocol between agentvmd and the guest agent,
//!   with its length-delimited framing in [`guest::framing`].
//! - [`canon`]: the one canonical serialization (proto3 JSON + RFC 8785) behind the journal's
//!   hash chain and the registry's spec digests.

#![forbid(unsafe_code)]

pub mod canon;
pub mod guest;

// The generated module tree mirrors the proto packages: `agentsessions::v1`, `agentvm::guest::v1`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/protos.rs"));
}
pub use generated::{agentsessions, agentvm};

/// `agentsessions.v1`, generated from `proto/api/*.proto`.
pub use generated::agentsessions::v1;

/// `agentvm.node.v1`: the node status a fleet scheduler polls.
pub mod node {
    pub use crate::generated::agentvm::node::v1;
}

/// The compiled descriptor set of every .proto in this crate (for reflection and proto3 JSON).
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("descriptor");
