//! `agentvm.guest.v1`: host ↔ guest-agent frames.

pub mod framing;

/// Generated from `proto/api/agentvm/guest/v1/guest.proto`.
pub use crate::agentvm::guest::v1;

/// The protocol version both ends put in Hello/Ready. A peer with another value is refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// The vsock port the guest agent and the test guest listen on.
pub const GUEST_AGENT_PORT: u32 = 1024;
