//! Host-mediated model calls. The harness asks; the host invokes (live) or serves the
//! journaled completion (replay), and fingerprints every request for the I0 check.

pub mod input_hash;
pub mod openai;
pub mod provider;
