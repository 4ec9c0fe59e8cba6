//! The `/metrics` endpoint: plain HTTP/1.1, GET only. On a node with an auth file a scrape
//! must carry an operator's bearer token (401 without a known one, 403 for a tenant's): the
//! figures are node-wide.
//!
//! Beside it, the probes operators point load balancers and supervisors at, open to all (a
//! probe carries no credential; they tell no more than gRPC health does): `/healthz`, 200
//! while the process serves; `/readyz`, 200 when the node takes new work (its journal
//! answers, its runtimes can start compute, it is not draining), else 503 with the reasons.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use super::exposition::{CONTENT_TYPE, NodeState, render};
use crate::api::auth::Authenticator;

pub type StateFn = Arc<dyn Fn() -> NodeState + Send + Sync>;
/// Whether the node takes new work; the reasons it does not.
pub type ReadyFn = Arc<dyn Fn() -> Result<(), Vec<String>> + Send + Sync>;

fn respond<B>(
    req: &Request<B>,
    state: &StateFn,
    ready: &ReadyFn,
    auth: Option<&Authenticator>,
) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String| {
        Response::builder()
            .status(status)
            .header("content-type", "text/plain; charset=utf-8")
            .header(hyper::header::CACHE_CONTROL, "no-store")
            .body(Full::new(Bytes::from(body)))
            .expect("plain response")
    };
    let plain = |status: StatusCode, body: &'static str| text(status, body.to_owned());
    let probe = matches!(req.uri().path(), "/healthz" | "/readyz");
    if probe && req.method() != Method::GET && req.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET /healthz or /readyz\n");
    }
    match req.uri().path() {
        "/healthz" => return plain(StatusCode::OK, "ok\n"),
        "/readyz" => {
            return match ready() {
                Ok(()) => plain(StatusCode::OK, "ready\n"),
                Err(why) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: {}\n", why.join("; ")),
                ),
            };
        }
        _ => {}
    }
    if let Some(auth) = auth {
        let header = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .map(|v| v.to_str().unwrap_or(""));
        match auth.bearer(header) {
            Err(_) => {
                let mut refused = plain(
                    StatusCode::UNAUTHORIZED,
                    "this node requires an operator's `authorization: Bearer <token>`\n",
                );
                refused.headers_mut().insert(
                    hyper::header::WWW_AUTHENTICATE,
                    hyper::header::HeaderValue::from_static("Bearer"),
                );
                return refused;
            }
            Ok(p) if !p.operator => {
                return plain(
                    StatusCode::FORBIDDEN,
                    "metrics are node-wide: the principal is not an operator\n",
                );
            }
            Ok(_) => {}
        }
    }
    if req.uri().path() != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "not found; metrics are at /metrics, probes at /healthz and /readyz\n",
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n");
    }
    let text = render(super::global(), &state());
    Response::builder()
        .header("content-type", CONTENT_TYPE)
        .body(Full::new(Bytes::from(text)))
        .expect("valid response")
}

/// Serves until the listener fails. Binding is the caller's, so a bad address is reported
/// before the daemon says it is ready.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: StateFn,
    ready: ReadyFn,
    auth: Option<Arc<Authenticator>>,
) -> std::io::Result<()> {
    loop {
        let (stream, peer): (_, SocketAddr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "metrics: accept");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // Small responses, each written at once: no waiting on Nagle.
        let _ = stream.set_nodelay(true);
        let (state, ready) = (state.clone(), ready.clone());
        let auth = auth.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = respond(&req, &state, &ready, auth.as_deref());
                async move { Ok::<_, Infallible>(response) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "metrics connection");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_an_auth_file_only_an_operator_scrapes() {
        let token_sha256 = |t: &str| {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(t.as_bytes()))
        };
        let auth = crate::toml_file::load_written(
            "auth.toml",
            &format!(
                "[[principal]]\nname = \"ops\"\nprojects = [\"*\"]\noperator = true\n\
                 token_sha256 = [\"{}\"]\n\n[[principal]]\nname = \"alice\"\n\
                 projects = [\"team-a\"]\ntoken_sha256 = [\"{}\"]\n",
                token_sha256("ops"),
                token_sha256("alice")
            ),
            Authenticator::load,
        )
        .unwrap();
        let state: StateFn = Arc::new(NodeState::default);
        let ready: ReadyFn = Arc::new(|| Err(vec!["draining".to_owned()]));
        let get = |path: &str, token: Option<&str>, auth: Option<&Authenticator>| {
            let mut req = Request::builder().uri(path);
            if let Some(t) = token {
                req = req.header("authorization", format!("Bearer {t}"));
            }
            respond(&req.body(()).unwrap(), &state, &ready, auth).status()
        };
        let scrape = |token, auth| get("/metrics", token, auth);
        assert_eq!(scrape(None, Some(&auth)), StatusCode::UNAUTHORIZED);
        assert_eq!(scrape(Some("guess"), Some(&auth)), StatusCode::UNAUTHORIZED);
        assert_eq!(scrape(Some("alice"), Some(&auth)), StatusCode::FORBIDDEN);
        assert_eq!(scrape(Some("ops"), Some(&auth)), StatusCode::OK);
        assert_eq!(scrape(None, None), StatusCode::OK);
        // Probes carry no credential.
        assert_eq!(get("/healthz", None, Some(&auth)), StatusCode::OK);
        assert_eq!(
            get("/readyz", None, Some(&auth)),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            get("/other", Some("ops"), Some(&auth)),
            StatusCode::NOT_FOUND
        );
    }
}
