//! The route table: endpoint → method, body rule and handler. Adding an endpoint
//! (`vm.snapshot`, `vm.restore`, …) is one row here plus a backend method.
//!
//! A handler runs in two phases: `prepare` decodes and validates the body on the async side
//! (no backend access, so a bad body never waits for the backend), and returns the [`Call`]
//! that the dispatcher later runs against the backend, one at a time, on a blocking thread.

use hyper::Method;
use serde::Serialize;

use super::backend::VmmBackend;
use crate::config::VmConfig;
use crate::endpoint;
use crate::error::ApiError;

/// The backend half of a request, run serialised on a blocking thread.
pub(super) type Call = Box<dyn FnOnce(&dyn VmmBackend) -> Result<Reply, ApiError> + Send>;

/// A successful answer.
#[derive(Debug)]
pub(super) enum Reply {
    /// 204, no body: the actions.
    NoContent,
    /// 200 with a JSON body.
    Json(Vec<u8>),
    /// 200, no body: `vmm.shutdown` (CH code answers 200 there, not 204).
    Ok,
}

/// The only method a route accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verb {
    Get,
    Put,
}

impl Verb {
    pub(super) fn matches(self, method: &Method) -> bool {
        match self {
            Verb::Get => method == Method::GET,
            Verb::Put => method == Method::PUT,
        }
    }

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "GET",
            Verb::Put => "PUT",
        }
    }
}

/// Whether a route takes a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyRule {
    /// Any body is a 400.
    Forbidden,
    /// A missing or empty body is a 400.
    Required,
    /// Either.
    Optional,
}

pub(super) struct Route {
    pub endpoint: &'static str,
    pub verb: Verb,
    pub body: BodyRule,
    /// Decodes the body (empty for `Forbidden`) into the backend call.
    pub prepare: fn(&[u8]) -> Result<Call, ApiError>,
    /// Once the call succeeds the server stops: no further call runs, `serve` returns.
    pub stops_server: bool,
    /// Runs beside the other calls instead of after them: it only waits for something
    /// another call started, and must not hold up the calls that follow.
    pub beside_others: bool,
}

const fn route(
    endpoint: &'static str,
    verb: Verb,
    body: BodyRule,
    prepare: fn(&[u8]) -> Result<Call, ApiError>,
) -> Route {
    Route {
        endpoint,
        verb,
        body,
        prepare,
        stops_server: false,
        beside_others: false,
    }
}

static ROUTES: &[Route] = &[
    route(endpoint::VMM_PING, Verb::Get, BodyRule::Forbidden, ping),
    route(endpoint::VM_INFO, Verb::Get, BodyRule::Forbidden, info),
    route(
        endpoint::VM_COUNTERS,
        Verb::Get,
        BodyRule::Forbidden,
        counters,
    ),
    route(endpoint::VM_CREATE, Verb::Put, BodyRule::Required, create),
    route(endpoint::VM_BOOT, Verb::Put, BodyRule::Forbidden, boot),
    route(endpoint::VM_PAUSE, Verb::Put, BodyRule::Forbidden, pause),
    route(endpoint::VM_RESUME, Verb::Put, BodyRule::Forbidden, resume),
    route(
        endpoint::VM_SHUTDOWN,
        Verb::Put,
        BodyRule::Forbidden,
        shutdown,
    ),
    route(endpoint::VM_DELETE, Verb::Put, BodyRule::Forbidden, delete),
    route(
        endpoint::VM_SNAPSHOT,
        Verb::Put,
        BodyRule::Required,
        snapshot,
    ),
    route(endpoint::VM_RESTORE, Verb::Put, BodyRule::Required, restore),
    route(endpoint::VM_FORK, Verb::Put, BodyRule::Required, fork),
    route(
        endpoint::VM_CHECKPOINT,
        Verb::Put,
        BodyRule::Required,
        checkpoint,
    ),
    Route {
        beside_others: true,
        ..route(
            endpoint::VM_CHECKPOINT_WAIT,
            Verb::Put,
            BodyRule::Optional,
            checkpoint_wait,
        )
    },
    route(
        endpoint::VM_EGRESS_ALLOW,
        Verb::Put,
        BodyRule::Required,
        egress_allow,
    ),
    route(
        endpoint::VM_EGRESS_REVOKE,
        Verb::Put,
        BodyRule::Required,
        egress_revoke,
    ),
    route(
        endpoint::VMM_RAM_DIR,
        Verb::Put,
        BodyRule::Required,
        ram_dir,
    ),
    Route {
        stops_server: true,
        ..route(
            endpoint::VMM_SHUTDOWN,
            Verb::Put,
            BodyRule::Forbidden,
            shutdown_vmm,
        )
    },
];

/// The route for an endpoint name (the path without `/api/v1/`).
pub(super) fn find(endpoint: &str) -> Option<&'static Route> {
    ROUTES.iter().find(|r| r.endpoint == endpoint)
}

fn call(
    f: impl FnOnce(&dyn VmmBackend) -> Result<Reply, ApiError> + Send + 'static,
) -> Result<Call, ApiError> {
    Ok(Box::new(f))
}

fn json(value: &impl Serialize) -> Result<Reply, ApiError> {
    serde_json::to_vec(value)
        .map(Reply::Json)
        .map_err(|e| ApiError::internal(format!("encoding the response: {e}")))
}

fn no_content(result: Result<(), ApiError>) -> Result<Reply, ApiError> {
    result.map(|()| Reply::NoContent)
}

fn ping(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| json(&b.ping()))
}

fn info(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| json(&b.info()?))
}

fn counters(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| json(&b.counters()?))
}

fn create(body: &[u8]) -> Result<Call, ApiError> {
    let config = VmConfig::from_json(body)
        .map_err(|e| ApiError::bad_request("invalid VM config").caused_by(e.to_string()))?;
    call(move |b| no_content(b.create(config)))
}

fn boot(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| no_content(b.boot()))
}

fn pause(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| no_content(b.pause()))
}

fn resume(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| no_content(b.resume()))
}

fn shutdown(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| no_content(b.shutdown()))
}

fn delete(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| no_content(b.delete()))
}

/// Decodes a body naming the path of a bad field.
fn decode<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    crate::json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid {what}")).caused_by(e.to_string()))
}

fn url_field(field: &str, url: &str) -> Result<(), ApiError> {
    crate::types::dir_from_url(field, url)
        .map(drop)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

fn snapshot(body: &[u8]) -> Result<Call, ApiError> {
    let config: crate::types::VmSnapshotConfig = decode(body, "snapshot config")?;
    url_field("destination_url", &config.destination_url)?;
    call(move |b| no_content(b.snapshot(config)))
}

fn restore(body: &[u8]) -> Result<Call, ApiError> {
    let config: crate::types::RestoreConfig = decode(body, "restore config")?;
    url_field("source_url", &config.source_url)?;
    if !config.net_fds.is_empty() {
        return Err(ApiError::bad_request(
            "net_fds: agentvm-vmm opens taps by name (net_overrides); no FDs are accepted",
        ));
    }
    config
        .validate_net_overrides()
        .map_err(|e| ApiError::bad_request("invalid restore config").caused_by(e.to_string()))?;
    if let Some(socket) = &config.vsock_socket
        && (socket.as_os_str().is_empty() || socket.as_os_str().as_encoded_bytes().contains(&0))
    {
        return Err(ApiError::bad_request(
            "vsock_socket: must be a non-empty path",
        ));
    }
    call(move |b| no_content(b.restore(config)))
}

fn fork(body: &[u8]) -> Result<Call, ApiError> {
    let config: crate::types::VmForkConfig = decode(body, "fork config")?;
    url_field("destination_url", &config.destination_url)?;
    call(move |b| no_content(b.fork(config)))
}

fn checkpoint(body: &[u8]) -> Result<Call, ApiError> {
    let config: crate::types::VmCheckpointConfig = decode(body, "checkpoint config")?;
    url_field("destination_url", &config.destination_url)?;
    if let Some(base) = &config.base_url {
        url_field("base_url", base)?;
    }
    call(move |b| json(&b.checkpoint(config)?))
}

fn checkpoint_wait(body: &[u8]) -> Result<Call, ApiError> {
    let request: crate::types::VmCheckpointWait = match body.is_empty() {
        true => Default::default(),
        false => decode(body, "checkpoint wait")?,
    };
    if let Some(dir) = &request.destination_url {
        url_field("destination_url", dir)?;
    }
    call(move |b| json(&b.checkpoint_wait(request)?))
}

fn egress_allow(body: &[u8]) -> Result<Call, ApiError> {
    let request: crate::types::VmEgressAllow = decode(body, "egress rules")?;
    request
        .parse()
        .map_err(|e| ApiError::bad_request("invalid egress rules").caused_by(e.to_string()))?;
    call(move |b| no_content(b.egress_allow(request)))
}

fn egress_revoke(body: &[u8]) -> Result<Call, ApiError> {
    let request: crate::types::VmEgressAllow = decode(body, "egress rules")?;
    request
        .parse()
        .map_err(|e| ApiError::bad_request("invalid egress rules").caused_by(e.to_string()))?;
    call(move |b| no_content(b.egress_revoke(request)))
}

fn ram_dir(body: &[u8]) -> Result<Call, ApiError> {
    let request: crate::types::VmmRamDir = decode(body, "RAM directory")?;
    request
        .check()
        .map_err(|e| ApiError::bad_request("invalid RAM directory").caused_by(e))?;
    call(move |b| no_content(b.set_ram_dir(request)))
}

fn shutdown_vmm(_: &[u8]) -> Result<Call, ApiError> {
    call(|b| b.shutdown_vmm().map(|()| Reply::Ok))
}
