//! The Prometheus endpoint, scraped and parsed: the figures move when sessions are created,
//! run and forked. One test in this binary: the counters are process-wide.

use std::collections::BTreeMap;

use agentvm_proto::v1::ForkRequest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod support;

async fn http(addr: std::net::SocketAddr, request_line: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("{request_line}\r\nHost: node\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let status = raw[9..12].parse().unwrap();
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `name{labels}` → value, for every sample line; panics on a line that does not parse.
async fn scrape(addr: std::net::SocketAddr) -> BTreeMap<String, f64> {
    let (status, body) = http(addr, "GET /metrics HTTP/1.1").await;
    assert_eq!(status, 200);
    body.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').unwrap();
            assert!(name.starts_with("agentvm_"), "{l}");
            (
                name.to_owned(),
                value.parse().unwrap_or_else(|_| panic!("{l}")),
            )
        })
        .collect()
}

fn get(m: &BTreeMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

#[tokio::test]
async fn metrics_are_scraped_and_move_with_sessions_turns_and_forks() {
    let node = support::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(agentvmd::metrics::server::serve(
        listener,
        node.node.state_fn(false),
        node.node.ready_fn(),
        None,
    ));
    let before = scrape(addr).await;
    assert_eq!(get(&before, "agentvm_build_info{version=\"0.1.0\"}"), 1.0);

    let mut c = node.c();
    let uid = support::create_for(&mut c, "echo").await;
    let mut stream = c
        .exec(support::exec_text(uid.clone(), "hi"))
        .await
        .unwrap()
        .into_inner();
    while stream.message().await.unwrap().is_some() {}
    c.fork(ForkRequest {
        session: uid,
        count: 2,
        ..Default::default()
    })
    .await
    .unwrap();

    let after = scrape(addr).await;
    let delta = |k: &str| get(&after, k) - get(&before, k);
    assert_eq!(
        get(&after, "agentvm_sessions{compute_state=\"live\"}")
            + get(&after, "agentvm_sessions{compute_state=\"none\"}")
            + get(&after, "agentvm_sessions{compute_state=\"cold\"}"),
        3.0,
        "{after:#?}"
    );
    assert_eq!(
        delta("agentvm_executions_total{outcome=\"completed\"}"),
        1.0
    );
    assert_eq!(delta("agentvm_fork_children_total"), 2.0);
    assert_eq!(delta("agentvm_fork_seconds_count"), 1.0);
    assert!(
        delta("agentvm_journal_append_seconds_count") >= 4.0,
        "{after:#?}"
    );
    assert_eq!(
        get(&after, "agentvm_journal_append_seconds_bucket{le=\"+Inf\"}"),
        get(&after, "agentvm_journal_append_seconds_count")
    );

    assert_eq!(http(addr, "GET /other HTTP/1.1").await.0, 404);
    assert_eq!(http(addr, "POST /metrics HTTP/1.1").await.0, 405);

    // The probes: up, and ready until the node drains (then 503, saying why).
    assert_eq!(
        http(addr, "GET /healthz HTTP/1.1").await,
        (200, "ok\n".into())
    );
    assert_eq!(
        http(addr, "GET /readyz HTTP/1.1").await,
        (200, "ready\n".into())
    );
    assert_eq!(http(addr, "POST /readyz HTTP/1.1").await.0, 405);
    node.node.host.start_draining();
    let (status, body) = http(addr, "GET /readyz HTTP/1.1").await;
    assert_eq!(status, 503);
    assert!(body.contains("draining"), "{body}");
    assert_eq!(http(addr, "GET /healthz HTTP/1.1").await.0, 200);
}
