//! [`VmmClient`]: the agentvm-vmm (and Cloud Hypervisor) API over its unix socket.
//!
//! Every request opens a fresh connection and sends `Connection: close` (a reused keep-alive
//! connection was seen to hang on Cloud Hypervisor, vmm-api.md §1), and every call is bounded
//! by the client's timeout.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::Request;
use hyper::header::{CONNECTION, CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;
use tokio::time::Instant;

use crate::config::VmConfig;
use crate::endpoint;
use crate::error::ApiError;
use crate::json;
use crate::types::{VmCounters, VmInfo, VmState, VmmPingResponse};

/// Re-exported for [`VmmClient::request`].
pub use bytes::Bytes;
/// Re-exported for [`VmmClient::request`].
pub use hyper::Method;

/// Default bound on one call, connect to last body byte.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest response body read.
const MAX_RESPONSE_SIZE: usize = 16 << 20;
/// `wait_ready` polls this fast at first …
const READY_FIRST_DELAY: Duration = Duration::from_millis(1);
/// … and backs off to this.
const READY_MAX_DELAY: Duration = Duration::from_millis(20);

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be connected to (missing, refused, permission).
    #[error("connecting to the VMM API at {}: {source}", socket.display())]
    Connect {
        /// The API socket.
        socket: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The call did not complete within the timeout.
    #[error("{endpoint}: no answer within {after:?}")]
    Timeout {
        /// Endpoint called.
        endpoint: String,
        /// The timeout that expired.
        after: Duration,
    },
    /// The connection failed mid-exchange.
    #[error("{endpoint}: HTTP exchange failed: {source}")]
    Transport {
        /// Endpoint called.
        endpoint: String,
        /// Why.
        source: hyper::Error,
    },
    /// The VMM answered with an error status.
    #[error("{endpoint}: HTTP {status}: {}", messages.join(": "))]
    Api {
        /// Endpoint called.
        endpoint: String,
        /// HTTP status (400, 404, 409, 500, …).
        status: u16,
        /// The error chain from the body, outermost first (raw text if it was not a JSON
        /// string array).
        messages: Vec<String>,
    },
    /// A success response whose body could not be read or decoded.
    #[error("{endpoint}: bad response: {reason}")]
    BadResponse {
        /// Endpoint called.
        endpoint: String,
        /// What was wrong with it.
        reason: String,
    },
    /// The request could not be built (e.g. an endpoint name that is not a valid path).
    #[error("{endpoint}: invalid request: {reason}")]
    InvalidRequest {
        /// Endpoint called.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// `wait_ready` gave up.
    #[error("VMM API at {} not ready after {waited:?}: {last}", socket.display())]
    NotReady {
        /// The API socket.
        socket: PathBuf,
        /// How long it waited.
        waited: Duration,
        /// The last attempt's error.
        last: Box<ClientError>,
    },
}

impl ClientError {
    /// The HTTP status, for [`ClientError::Api`].
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The error as the [`ApiError`] the VMM sent, for [`ClientError::Api`].
    pub fn api_error(&self) -> Option<ApiError> {
        match self {
            ClientError::Api {
                status, messages, ..
            } => Some(ApiError {
                status: *status,
                messages: messages.clone(),
            }),
            _ => None,
        }
    }
}

/// A successful (2xx) answer of [`VmmClient::request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiResponse {
    /// 200 or 204 in practice.
    pub status: u16,
    /// The body, empty for 204.
    pub body: Bytes,
}

/// Client for one VMM's API socket. Cheap to clone; holds no connection.
#[derive(Debug, Clone)]
pub struct VmmClient {
    socket: PathBuf,
    timeout: Duration,
}

impl VmmClient {
    /// A client for the API socket at `socket`, with [`DEFAULT_TIMEOUT`].
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The same client with a different per-call timeout.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The API socket path.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `GET vmm.ping`.
    pub async fn ping(&self) -> Result<VmmPingResponse, ClientError> {
        self.get_json(endpoint::VMM_PING).await
    }

    /// `PUT vm.create`.
    pub async fn create(&self, config: &VmConfig) -> Result<(), ClientError> {
        self.put_json(endpoint::VM_CREATE, config).await
    }

    /// `PUT vm.boot`.
    pub async fn boot(&self) -> Result<(), ClientError> {
        self.put(endpoint::VM_BOOT).await
    }

    /// `GET vm.info`.
    pub async fn info(&self) -> Result<VmInfo, ClientError> {
        self.get_json(endpoint::VM_INFO).await
    }

    /// The VM's state from `GET vm.info`, reading nothing else of the answer: Cloud
    /// Hypervisor's `vm.info` carries config sections this crate's strict types refuse.
    pub async fn state(&self) -> Result<VmState, ClientError> {
        #[derive(serde::Deserialize)]
        struct StateOnly {
            state: VmState,
        }
        self.get_json::<StateOnly>(endpoint::VM_INFO)
            .await
            .map(|info| info.state)
    }

    /// `PUT vm.pause`.
    pub async fn pause(&self) -> Result<(), ClientError> {
        self.put(endpoint::VM_PAUSE).await
    }

    /// `PUT vm.resume`.
    pub async fn resume(&self) -> Result<(), ClientError> {
        self.put(endpoint::VM_RESUME).await
    }

    /// `PUT vm.shutdown`.
    pub async fn shutdown(&self) -> Result<(), ClientError> {
        self.put(endpoint::VM_SHUTDOWN).await
    }

    /// `PUT vm.delete`.
    pub async fn delete(&self) -> Result<(), ClientError> {
        self.put(endpoint::VM_DELETE).await
    }

    /// `GET vm.counters`.
    pub async fn counters(&self) -> Result<VmCounters, ClientError> {
        self.get_json(endpoint::VM_COUNTERS).await
    }

    /// `PUT vmm.shutdown`. The VMM answers 200 and then stops serving.
    pub async fn shutdown_vmm(&self) -> Result<(), ClientError> {
        self.put(endpoint::VMM_SHUTDOWN).await
    }

    /// `PUT vm.snapshot` of the paused VM into `dir` (which must exist).
    pub async fn snapshot(&self, dir: &std::path::Path) -> Result<(), ClientError> {
        let body = crate::types::VmSnapshotConfig {
            destination_url: format!("file://{}", dir.display()),
        };
        self.put_json(endpoint::VM_SNAPSHOT, &body).await
    }

    /// `PUT vm.restore` into this (fresh) VMM.
    pub async fn restore(&self, config: &crate::types::RestoreConfig) -> Result<(), ClientError> {
        self.put_json(endpoint::VM_RESTORE, config).await
    }

    /// `PUT vm.fork` (extension) of the paused VM into `dir` (which must exist); with
    /// `resume`, the VM runs again as soon as its RAM is frozen.
    pub async fn fork(&self, dir: &std::path::Path, resume: bool) -> Result<(), ClientError> {
        let body = crate::types::VmForkConfig {
            destination_url: format!("file://{}", dir.display()),
            resume,
        };
        self.put_json(endpoint::VM_FORK, &body).await
    }

    /// `PUT vm.checkpoint` (extension) of the running VM into `dir` (which must exist),
    /// layered on the last one, now at `base` if it was moved.
    pub async fn checkpoint(
        &self,
        dir: &std::path::Path,
        base: Option<&std::path::Path>,
    ) -> Result<crate::types::VmCheckpointReport, ClientError> {
        self.checkpoint_with(crate::types::VmCheckpointConfig {
            destination_url: format!("file://{}", dir.display()),
            base_url: base.map(|b| format!("file://{}", b.display())),
            fresh: false,
        })
        .await
    }

    /// `PUT vm.checkpoint` (extension) that starts a new run of checkpoints (`fresh`).
    pub async fn checkpoint_afresh(
        &self,
        dir: &std::path::Path,
    ) -> Result<crate::types::VmCheckpointReport, ClientError> {
        self.checkpoint_with(crate::types::VmCheckpointConfig {
            destination_url: format!("file://{}", dir.display()),
            base_url: None,
            fresh: true,
        })
        .await
    }

    async fn checkpoint_with(
        &self,
        body: crate::types::VmCheckpointConfig,
    ) -> Result<crate::types::VmCheckpointReport, ClientError> {
        let body = serde_json::to_vec(&body).map_err(|e| ClientError::InvalidRequest {
            endpoint: endpoint::VM_CHECKPOINT.to_owned(),
            reason: format!("encoding the body: {e}"),
        })?;
        let response = self
            .request(
                Method::PUT,
                endpoint::VM_CHECKPOINT,
                Some(Bytes::from(body)),
            )
            .await?;
        decode(endpoint::VM_CHECKPOINT, &response.body)
    }

    /// `PUT vm.checkpoint-wait` (extension): the checkpoint taken into `dir` (the last one
    /// taken if `None`), once durable.
    pub async fn checkpoint_wait(
        &self,
        dir: Option<&std::path::Path>,
    ) -> Result<crate::types::VmCheckpointReport, ClientError> {
        let body = match dir {
            Some(dir) => {
                let body = crate::types::VmCheckpointWait {
                    destination_url: Some(format!("file://{}", dir.display())),
                };
                let body = serde_json::to_vec(&body).map_err(|e| ClientError::InvalidRequest {
                    endpoint: endpoint::VM_CHECKPOINT_WAIT.to_owned(),
                    reason: format!("encoding the body: {e}"),
                })?;
                Some(Bytes::from(body))
            }
            None => None,
        };
        let response = self
            .request(Method::PUT, endpoint::VM_CHECKPOINT_WAIT, body)
            .await?;
        decode(endpoint::VM_CHECKPOINT_WAIT, &response.body)
    }

    /// `PUT vm.egress-allow` (extension): append `rules` to the egress policy of the net
    /// device `id` (the VM's first when `None`).
    pub async fn egress_allow(
        &self,
        id: Option<&str>,
        rules: &[crate::config::EgressRule],
    ) -> Result<(), ClientError> {
        self.put_rules(endpoint::VM_EGRESS_ALLOW, id, rules).await
    }

    /// `PUT vm.egress-revoke` (extension): take `rules` out of the egress policy of the net
    /// device `id` (the VM's first when `None`).
    pub async fn egress_revoke(
        &self,
        id: Option<&str>,
        rules: &[crate::config::EgressRule],
    ) -> Result<(), ClientError> {
        self.put_rules(endpoint::VM_EGRESS_REVOKE, id, rules).await
    }

    /// `vm.egress-allow` and `vm.egress-revoke` take the same body.
    async fn put_rules(
        &self,
        endpoint: &str,
        id: Option<&str>,
        rules: &[crate::config::EgressRule],
    ) -> Result<(), ClientError> {
        let body = crate::types::VmEgressAllow {
            id: id.map(str::to_owned),
            rules: rules.to_vec(),
        };
        self.put_json(endpoint, &body).await
    }

    /// `PUT vmm.ram-dir` (agentvm extension).
    pub async fn set_ram_dir(&self, path: Option<&std::path::Path>) -> Result<(), ClientError> {
        let body = crate::types::VmmRamDir {
            path: path.map(std::path::Path::to_path_buf),
        };
        self.put_json(endpoint::VMM_RAM_DIR, &body).await
    }

    /// `vm.pause`, where "already paused" counts as success: on a wrong-state answer (500, or
    /// 409 from Cloud Hypervisor v53 on) it reads the VM's state and returns Ok if the VM is
    /// `Paused`, else the original error.
    pub async fn pause_idempotent(&self) -> Result<(), ClientError> {
        self.idempotent(self.pause().await, VmState::Paused).await
    }

    /// `vm.resume`, where "already running" counts as success (see [`Self::pause_idempotent`]).
    pub async fn resume_idempotent(&self) -> Result<(), ClientError> {
        self.idempotent(self.resume().await, VmState::Running).await
    }

    async fn idempotent(
        &self,
        result: Result<(), ClientError>,
        target: VmState,
    ) -> Result<(), ClientError> {
        match result {
            Err(err) if matches!(err.status(), Some(ApiError::INTERNAL | ApiError::CONFLICT)) => {
                match self.state().await {
                    Ok(state) if state == target => Ok(()),
                    _ => Err(err),
                }
            }
            other => other,
        }
    }

    /// Polls `vmm.ping` until it answers, for at most `timeout`: every 1 ms at first, backing
    /// off to every 20 ms. An error status from the VMM is returned at once (it is up, but
    /// not well); connection failures and timeouts are retried.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<VmmPingResponse, ClientError> {
        let started = Instant::now();
        let remaining = || timeout.saturating_sub(started.elapsed());
        let mut delay = READY_FIRST_DELAY;
        loop {
            let attempt = self.timeout.min(remaining());
            let last = match self
                .call(Method::GET, endpoint::VMM_PING, None, attempt)
                .await
            {
                Ok(response) => return decode(endpoint::VMM_PING, &response.body),
                Err(err @ ClientError::Api { .. }) => return Err(err),
                Err(err) => err,
            };
            if remaining() <= delay {
                return Err(ClientError::NotReady {
                    socket: self.socket.clone(),
                    waited: started.elapsed(),
                    last: Box::new(last),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(READY_MAX_DELAY);
        }
    }

    /// `GET` `endpoint` and decode its JSON body.
    pub async fn get_json<T: DeserializeOwned>(&self, endpoint: &str) -> Result<T, ClientError> {
        let response = self.request(Method::GET, endpoint, None).await?;
        decode(endpoint, &response.body)
    }

    /// `PUT` `endpoint` without a body.
    pub async fn put(&self, endpoint: &str) -> Result<(), ClientError> {
        self.request(Method::PUT, endpoint, None).await.map(drop)
    }

    /// `PUT` `endpoint` with `body` as JSON.
    pub async fn put_json<T: Serialize + ?Sized>(
        &self,
        endpoint: &str,
        body: &T,
    ) -> Result<(), ClientError> {
        let body = serde_json::to_vec(body).map_err(|e| ClientError::InvalidRequest {
            endpoint: endpoint.to_owned(),
            reason: format!("encoding the body: {e}"),
        })?;
        self.request(Method::PUT, endpoint, Some(Bytes::from(body)))
            .await
            .map(drop)
    }

    /// Any call: `method` on `/api/v1/<endpoint>`, with `body` sent as JSON if given.
    /// 2xx is `Ok`; anything else is [`ClientError::Api`].
    pub async fn request(
        &self,
        method: Method,
        endpoint: &str,
        body: Option<Bytes>,
    ) -> Result<ApiResponse, ClientError> {
        self.call(method, endpoint, body, self.timeout).await
    }

    async fn call(
        &self,
        method: Method,
        endpoint: &str,
        body: Option<Bytes>,
        timeout: Duration,
    ) -> Result<ApiResponse, ClientError> {
        let (status, bytes) = tokio::time::timeout(timeout, self.exchange(method, endpoint, body))
            .await
            .map_err(|_| ClientError::Timeout {
                endpoint: endpoint.to_owned(),
                after: timeout,
            })??;
        if (200..300).contains(&status) {
            Ok(ApiResponse {
                status,
                body: bytes,
            })
        } else {
            let err = ApiError::from_body(status, &bytes);
            Err(ClientError::Api {
                endpoint: endpoint.to_owned(),
                status,
                messages: err.messages,
            })
        }
    }

    /// One request on a fresh connection: the status and the whole body.
    async fn exchange(
        &self,
        method: Method,
        endpoint: &str,
        body: Option<Bytes>,
    ) -> Result<(u16, Bytes), ClientError> {
        let mut builder = Request::builder()
            .method(method)
            .uri(endpoint::path(endpoint))
            .header(HOST, "localhost")
            .header(CONNECTION, "close");
        if body.is_some() {
            builder = builder.header(CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| ClientError::InvalidRequest {
                endpoint: endpoint.to_owned(),
                reason: e.to_string(),
            })?;

        let stream =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ClientError::Connect {
                    socket: self.socket.clone(),
                    source,
                })?;
        let transport = |source| ClientError::Transport {
            endpoint: endpoint.to_owned(),
            source,
        };
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(transport)?;
        let exchange = async {
            let response = sender.send_request(request).await.map_err(transport)?;
            let status = response.status().as_u16();
            let body = Limited::new(response.into_body(), MAX_RESPONSE_SIZE)
                .collect()
                .await
                .map_err(|e| ClientError::BadResponse {
                    endpoint: endpoint.to_owned(),
                    reason: format!("reading the body: {e}"),
                })?
                .to_bytes();
            Ok((status, body))
        };
        let mut exchange = std::pin::pin!(exchange);
        let mut connection = std::pin::pin!(connection);
        tokio::select! {
            result = &mut exchange => result,
            // The connection ended first (closed after the response, or failed): the
            // exchange now completes with the response or with the connection's error.
            _ = &mut connection => exchange.await,
        }
    }
}

fn decode<T: DeserializeOwned>(endpoint: &str, body: &[u8]) -> Result<T, ClientError> {
    json::from_slice(body).map_err(|e| ClientError::BadResponse {
        endpoint: endpoint.to_owned(),
        reason: e.to_string(),
    })
}
