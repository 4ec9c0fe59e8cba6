//! agentvmd: the per-node agentvm daemon, and the library behind the `agentvm` CLI.

#![deny(unsafe_code)]

pub mod api;
pub mod client;
pub mod clock;
pub mod config;
pub mod controller;
pub mod crash_point;
pub mod disk;
pub mod image;
pub mod journal;
pub mod json;
pub mod lenient_authority;
pub mod metrics;
pub mod model;
pub mod node;
pub mod private_dir;
pub mod quota;
pub mod registry;
pub mod runtime;
pub mod server;
pub mod session;
pub mod settings;
pub mod sys;
pub mod systemd;
pub mod testing;
pub mod toml_file;
pub mod tool_webhook;
