//! The Cloud Hypervisor REST subset agentvm-vmm serves (see `shared/spec/vmm-api.md`).
//!
//! - [`config`]: the `VmConfig` subset agentvm-vmm supports, with CH's JSON names and defaults,
//!   plus validation that names the offending field.
//! - [`types`]: the other request/response bodies (`VmInfo`, `VmmPingResponse`, …).
//! - [`error`]: [`ApiError`], the status + message chain every failure travels as.
//! - [`endpoint`]: endpoint names and paths, shared by both ends.
//! - [`json`]: JSON decoding that names the path of a bad field.
//! - [`server`]: HTTP/1.1 over a unix socket, routed to a [`VmmBackend`].
//! - [`client`]: [`VmmClient`], one fresh connection per request.

#![forbid(unsafe_code)]

pub mod client;
pub mod config;
pub mod endpoint;
pub mod error;
pub mod json;
pub mod server;
pub mod types;

pub use client::{ClientError, VmmClient};
pub use config::{ConfigError, VmConfig};
pub use error::ApiError;
pub use server::{
    ServerConfig, VmmBackend, adopt_api_listener, bind_api_listener, bind_api_socket, serve,
    serve_with, serve_with_shutdown,
};
pub use types::{VmCounters, VmInfo, VmState, VmmPingResponse};
