//! Round trips through the guest agent over a unix socket, as the host makes them inside a
//! VM over vsock: Hello → Ready on a fresh connection, HealthCheck → HealthReport, and one
//! whole execution bridged to the echo harness's gRPC server (Start, its MODEL_CALL, the
//! model's answer, END and the stream's close). Prints min / median / max in µs.
//!
//! `cargo bench -p agentvm-guest --bench bridge`

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentvm_guest::agent::Agent;
use agentvm_guest::bridge::GrpcLink;
use agentvm_guest::system::RecordingSystem;
use agentvm_guest::transport::{Listen, Listener};
use agentvm_proto::guest::v1::envelope::Body;
use agentvm_proto::guest::v1::{HealthCheck, Identity};
use tokio::net::UnixStream;

#[path = "../tests/support/mod.rs"]
mod support;
use support::HostConn;

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{name:40} n={:<5} min {:>8.1} µs  median {:>8.1} µs  max {:>8.1} µs",
        samples.len(),
        us(samples[0]),
        us(samples[samples.len() / 2]),
        us(samples[samples.len() - 1])
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this too, with fewer rounds.
    let quick = !std::env::args().any(|a| a == "--bench");
    let rounds = if quick { 20 } else { 2000 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let dir = tempfile::tempdir().unwrap();
        let harness = support::serve_harness(dir.path(), "echo").await;
        let link = Arc::new(GrpcLink::new(harness, None, Duration::from_secs(5)));
        let agent = Agent::new(
            Arc::new(RecordingSystem::default()),
            link,
            None,
            Identity::default(),
            1,
        );
        let socket = dir.path().join("agent.sock");
        let listener = Listener::bind(&Listen::Unix(socket.clone())).unwrap();
        tokio::spawn(agentvm_guest::serve(agent, listener));

        let mut connects = Vec::new();
        for _ in 0..rounds / 10 + 1 {
            let t = Instant::now();
            let mut host = HostConn::new(UnixStream::connect(&socket).await.unwrap());
            host.hello().await;
            connects.push(t.elapsed());
        }
        report("connect + Hello/Ready", connects);

        let mut host = HostConn::new(UnixStream::connect(&socket).await.unwrap());
        host.hello().await;
        let mut health = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            match host.call(Body::HealthCheck(HealthCheck {})).await {
                Body::HealthReport(_) => {}
                other => panic!("{other:?}"),
            }
            health.push(t.elapsed());
        }
        report("HealthCheck round trip", health);

        let mut turns = Vec::new();
        for i in 0..rounds / 2 + 1 {
            let t = Instant::now();
            let turn = host
                .execute(i as u64 + 1, &format!("{:016x}", i + 1), "ping")
                .await;
            assert_eq!(turn.close.0, 0, "{turn:?}");
            turns.push(t.elapsed());
        }
        report("execution via the bridge (echo harness)", turns);
    });
}
