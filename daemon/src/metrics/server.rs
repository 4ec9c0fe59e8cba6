//! The `/metrics` endpoint: plain HTTP/1.1, GET only.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use super::exposition::{NodeState, render};

pub type StateFn = Arc<dyn Fn() -> NodeState + Send + Sync>;

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn respond(req: &Request<hyper::body::Incoming>, state: &StateFn) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, body: &'static str| {
        Response::builder()
            .status(status)
            .header("content-type", "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("static response")
    };
    if req.uri().path() != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "not found; metrics are at /metrics\n",
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
pub async fn serve(listener: tokio::net::TcpListener, state: StateFn) -> std::io::Result<()> {
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
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = respond(&req, &state);
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
