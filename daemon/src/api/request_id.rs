//! One request id per RPC, on every log line the RPC causes.
//!
//! The id is the caller's `x-request-id` when it is a plausible id (so a fleet scheduler can
//! follow its own request across nodes), otherwise a fresh one. Each RPC runs in an `rpc`
//! span carrying it, and the tasks an RPC spawns stay in that span, so the session host,
//! placement, the runtime and the controller all log under it. The id is echoed in the
//! response headers.
//!
//! Refusals the caller caused (INVALID_ARGUMENT, NOT_FOUND, ABORTED, …) are logged at INFO;
//! only the host's own failures reach WARN. Nothing here is ever logged at ERROR: that level
//! is for the node itself being in trouble.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::HeaderValue;
use tonic::body::Body;
use tracing::Instrument;

pub const HEADER: &str = "x-request-id";
const MAX_LEN: usize = 64;

/// The caller's id when it is short and made of `[A-Za-z0-9._:-]` only (it goes into logs).
fn accepted(value: &HeaderValue) -> Option<String> {
    let s = value.to_str().ok()?;
    let plausible = !s.is_empty()
        && s.len() <= MAX_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    plausible.then(|| s.to_owned())
}

fn fresh() -> String {
    let bytes: [u8; 8] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a status code means the caller asked for something it cannot have (as opposed
/// to the host failing).
pub fn caused_by_caller(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(
        code,
        Ok | Cancelled
            | InvalidArgument
            | NotFound
            | AlreadyExists
            | PermissionDenied
            | ResourceExhausted
            | FailedPrecondition
            | Aborted
            | OutOfRange
            | Unauthenticated
            | DeadlineExceeded
    )
}

#[derive(Debug, Clone, Copy, Default)]
pub struct RequestIdLayer;

impl<S> tower::Layer<S> for RequestIdLayer {
    type Service = RequestId<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RequestId { inner }
    }
}

#[derive(Debug, Clone)]
pub struct RequestId<S> {
    inner: S,
}

impl<S> tower::Service<http::Request<Body>> for RequestId<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let id = req
            .headers()
            .get(HEADER)
            .and_then(accepted)
            .unwrap_or_else(fresh);
        let header = HeaderValue::from_str(&id).expect("checked or generated above");
        req.headers_mut().insert(HEADER, header.clone());
        let method = req.uri().path().to_owned();
        let span = tracing::info_span!("rpc", request_id = %id, method = %method);
        let response = {
            let _entered = span.enter();
            self.inner.call(req)
        };
        Box::pin(
            async move {
                let mut response = response.await?;
                response.headers_mut().insert(HEADER, header);
                // An error before any message travels in the headers (trailers-only); a
                // stream's later status is the host's to log where it knows why.
                let status = response
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map(tonic::Code::from);
                if let Some(code) = status.filter(|c| *c != tonic::Code::Ok) {
                    if caused_by_caller(code) {
                        tracing::info!(code = ?code, "rpc refused");
                    } else {
                        tracing::warn!(code = ?code, "rpc failed");
                    }
                }
                Ok(response)
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plausible_ids_are_taken_from_the_caller() {
        for ok in ["req-72", "a", "trace:01HZ.x_y", &"a".repeat(64)] {
            assert_eq!(
                accepted(&HeaderValue::from_str(ok).unwrap()).as_deref(),
                Some(ok)
            );
        }
        for bad in ["", "two words", "a\"b", "line\tbreak", &"a".repeat(65)] {
            assert_eq!(
                accepted(&HeaderValue::from_str(bad).unwrap()),
                None,
                "{bad:?}"
            );
        }
        let id = fresh();
        assert_eq!(id.len(), 16);
        assert_ne!(id, fresh());
    }

    #[test]
    fn only_host_failures_are_warnings() {
        assert!(caused_by_caller(tonic::Code::InvalidArgument));
        assert!(caused_by_caller(tonic::Code::Aborted));
        assert!(!caused_by_caller(tonic::Code::Internal));
        assert!(!caused_by_caller(tonic::Code::Unavailable));
    }
}
