//! agentvmd: the per-node agentvm daemon, and the library behind the `agentvm` CLI.

pub mod journal;
