//! One request, start to finish: route, read the body, decode, run the backend call
//! (serialised), answer. Every failure becomes an [`ApiError`] answered as a JSON string array.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};
use tokio::sync::{Mutex, watch};
use tracing::debug;

use super::ServerConfig;
use super::backend::VmmBackend;
use super::routes::{self, BodyRule, Reply, Route};
use crate::endpoint;
use crate::error::ApiError;

/// State shared by every connection of one server.
pub(super) struct Dispatcher {
    backend: Arc<dyn VmmBackend>,
    /// Held for the whole of each backend call: one call at a time, in arrival order.
    calls: Arc<Mutex<()>>,
    /// Becomes true once the server is stopping; no backend call starts after that.
    stop: watch::Sender<bool>,
    config: ServerConfig,
}

impl Dispatcher {
    pub(super) fn new(backend: Arc<dyn VmmBackend>, config: ServerConfig) -> Self {
        Self {
            backend,
            calls: Arc::new(Mutex::new(())),
            stop: watch::Sender::new(false),
            config,
        }
    }

    pub(super) fn config(&self) -> &ServerConfig {
        &self.config
    }

    pub(super) fn request_stop(&self) {
        self.stop.send_replace(true);
    }

    pub(super) fn is_stopping(&self) -> bool {
        *self.stop.borrow()
    }

    pub(super) fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Answers one request. Never fails: errors become error responses.
    pub(super) async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let started = Instant::now();
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let (response, error) = match self.respond(req).await {
            Ok(reply) => (reply_response(reply), None),
            Err(err) => {
                let response = error_response(&err);
                (response, Some(err.messages.join(": ")))
            }
        };
        debug!(
            %method,
            path,
            status = response.status().as_u16(),
            duration_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
            error,
            "vmm api request"
        );
        response
    }

    async fn respond(self: &Arc<Self>, req: Request<Incoming>) -> Result<Reply, ApiError> {
        let path = req.uri().path();
        let route = endpoint::from_path(path)
            .and_then(routes::find)
            .ok_or_else(|| ApiError::not_found(format!("unknown API path {path}")))?;
        if !route.verb.matches(req.method()) {
            return Err(ApiError::bad_request(format!(
                "method {} is not allowed for {path} (use {})",
                req.method(),
                route.verb.as_str()
            )));
        }
        let body = self.read_body(route, req.into_body()).await?;
        let call =
            (route.prepare)(&body).map_err(|e| e.context(format!("{} failed", route.endpoint)))?;
        self.run(route, call)
            .await
            .map_err(|e| e.context(format!("{} failed", route.endpoint)))
    }

    /// Reads the whole body, at most `max_body_size` bytes, within `body_read_timeout`,
    /// and enforces the route's body rule.
    async fn read_body(&self, route: &Route, body: Incoming) -> Result<Bytes, ApiError> {
        let max = self.config.max_body_size;
        let too_large = || {
            ApiError::bad_request(format!(
                "request body for {} exceeds the {max}-byte limit",
                route.endpoint
            ))
        };
        // A declared length over the limit is refused without reading a byte.
        if body.size_hint().lower() > u64::try_from(max).unwrap_or(u64::MAX) {
            return Err(too_large());
        }
        let collected = tokio::time::timeout(
            self.config.body_read_timeout,
            Limited::new(body, max).collect(),
        )
        .await
        .map_err(|_| {
            ApiError::bad_request(format!(
                "timed out reading the request body for {}",
                route.endpoint
            ))
        })?;
        let bytes = match collected {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<LengthLimitError>() => return Err(too_large()),
            Err(e) => {
                return Err(ApiError::bad_request(format!(
                    "reading the request body for {}: {e}",
                    route.endpoint
                )));
            }
        };
        match (route.body, bytes.is_empty()) {
            (BodyRule::Forbidden, false) => Err(ApiError::bad_request(format!(
                "{} takes no request body",
                route.endpoint
            ))),
            (BodyRule::Required, true) => Err(ApiError::bad_request(format!(
                "{} requires a JSON request body",
                route.endpoint
            ))),
            _ => Ok(bytes),
        }
    }

    /// Runs `call` on a blocking thread once every earlier call has finished. The lock guard
    /// travels with the call, so a client hanging up mid-call cannot let the next one overlap.
    /// A call that runs `beside_others` takes no turn.
    async fn run(self: &Arc<Self>, route: &Route, call: routes::Call) -> Result<Reply, ApiError> {
        let guard = match route.beside_others {
            true => None,
            false => Some(Arc::clone(&self.calls).lock_owned().await),
        };
        let this = Arc::clone(self);
        let stops_server = route.stops_server;
        let span = tracing::Span::current();
        let joined = tokio::task::spawn_blocking(move || {
            let _guard = guard;
            let _span = span.enter();
            if this.is_stopping() {
                return Err(ApiError::internal("the VMM is shutting down"));
            }
            let result = call(&*this.backend);
            if stops_server && result.is_ok() {
                this.request_stop();
            }
            result
        })
        .await;
        match joined {
            Ok(result) => result,
            Err(e) if e.is_panic() => Err(ApiError::internal("the VMM backend panicked")),
            Err(_) => Err(ApiError::internal("the VMM backend call was cancelled")),
        }
    }
}

fn reply_response(reply: Reply) -> Response<Full<Bytes>> {
    match reply {
        Reply::NoContent => with_status(Response::new(Full::default()), StatusCode::NO_CONTENT),
        Reply::Ok => Response::new(Full::default()),
        Reply::Json(body) => json_response(StatusCode::OK, body),
    }
}

fn error_response(err: &ApiError) -> Response<Full<Bytes>> {
    let status = StatusCode::from_u16(err.status)
        .ok()
        .filter(|s| s.is_client_error() || s.is_server_error())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, err.to_body())
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = with_status(Response::new(Full::new(Bytes::from(body))), status);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn with_status(mut response: Response<Full<Bytes>>, status: StatusCode) -> Response<Full<Bytes>> {
    *response.status_mut() = status;
    response
}
