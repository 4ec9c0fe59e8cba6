//! Turn benchmarks through the Sessions API: a node assembled as agentvmd assembles it
//! (sqlite journal with an fsync per commit, the process runtime running `agentvm harness
//! serve echo`), a gRPC client on the unix socket. Prints per-turn latency (min / p50 / p99 /
//! max over all turns) and turns per second with concurrent sessions.
//!
//! `cargo bench -p agentvmd --bench turns`

use std::time::{Duration, Instant};

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    CreateSessionRequest, ExecRequest, Message, Part, Session, TextPart, part,
};
use agentvmd::config::ListenAddr;
use agentvmd::node::{Node, NodeConfig};
use tonic::transport::Channel;

async fn start(dir: &std::path::Path) -> (Node, SessionsClient<Channel>) {
    let mut cfg = NodeConfig::new(dir.join("state"));
    cfg.harness_command = vec![
        env!("CARGO_BIN_EXE_agentvm").into(),
        "harness".into(),
        "serve".into(),
    ];
    let node = Node::open(cfg).unwrap();
    let socket = dir.join("api.sock");
    let addr = ListenAddr::Unix(socket.clone());
    let routes = agentvmd::server::api_routes(node.host.clone())
        .await
        .unwrap();
    {
        let addr = addr.clone();
        tokio::spawn(async move {
            agentvmd::server::serve(&addr, routes, 0o600, std::future::pending())
                .await
                .unwrap();
        });
    }
    while !socket.exists() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let channel = agentvmd::client::connect(&addr).await.unwrap();
    (node, SessionsClient::new(channel))
}

async fn create(c: &mut SessionsClient<Channel>) -> String {
    c.create_session(CreateSessionRequest {
        session: Some(Session {
            harness: "echo".into(),
            ..Default::default()
        }),
    })
    .await
    .unwrap()
    .into_inner()
    .metadata
    .unwrap()
    .uid
}

/// One turn, start of request to end of stream.
async fn turn(c: &mut SessionsClient<Channel>, uid: &str, i: usize) -> Duration {
    turn_with(c, uid, format!("turn {i}")).await
}

/// One turn with `text` as its input.
async fn turn_with(c: &mut SessionsClient<Channel>, uid: &str, text: String) -> Duration {
    let start = Instant::now();
    let mut stream = c
        .exec(ExecRequest {
            session: uid.to_owned(),
            inputs: vec![Message {
                role: "user".into(),
                parts: vec![Part {
                    part: Some(part::Part::Text(TextPart { text })),
                }],
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    while stream.message().await.unwrap().is_some() {}
    start.elapsed()
}

/// One echo session run to `turns` turns of `input_bytes` inputs, its turn latency at marks
/// along the way (the 11 turns ending at each mark). Echo is stateless and keeps its history
/// (`incremental_history`): a turn must cost the same at turn 2,000 as at turn 10.
async fn long_session(c: &mut SessionsClient<Channel>, turns: usize, input_bytes: usize) {
    let uid = create(c).await;
    let mut latency = Vec::with_capacity(turns);
    for i in 0..turns {
        let mut text = format!("turn {i} ");
        text.extend(std::iter::repeat_n(
            'x',
            input_bytes.saturating_sub(text.len()),
        ));
        latency.push(turn_with(c, &uid, text).await);
    }
    let label = match input_bytes {
        0..1024 => "echo".to_owned(),
        n => format!("echo, {} KiB inputs", n >> 10),
    };
    let mut medians = Vec::new();
    for mark in [10, 100, 500, 1000, 2000, turns] {
        if mark > turns || medians.iter().any(|(m, _)| *m == mark) {
            continue;
        }
        let mut window = latency[mark.saturating_sub(11)..mark].to_vec();
        window.sort();
        medians.push((mark, window[window.len() / 2]));
        report(&format!("long session ({label}), turn {mark}"), window);
    }
    if let (Some((_, first)), Some((last, at_last))) = (medians.first(), medians.last()) {
        println!(
            "{:<44} {:>7.2}  (median turn {last} / median turn 10)",
            format!("long session ({label}), growth"),
            at_last.as_secs_f64() / first.as_secs_f64()
        );
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(name: &str, mut xs: Vec<Duration>) {
    xs.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{name:<44} min {:>7.2}  p50 {:>7.2}  p99 {:>7.2}  max {:>7.2}  ms  (n={})",
        ms(xs[0]),
        ms(percentile(&xs, 0.5)),
        ms(percentile(&xs, 0.99)),
        ms(xs[xs.len() - 1]),
        xs.len()
    );
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this too, with fewer turns.
    let quick = !std::env::args().any(|a| a == "--bench");
    let (turns, concurrent_turns) = if quick { (10, 4) } else { (300, 50) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let (_node, mut c) = start(dir.path()).await;

        // The first turn of a session also starts its harness process.
        let mut cold = Vec::new();
        for _ in 0..if quick { 2 } else { 20 } {
            let uid = create(&mut c).await;
            cold.push(turn(&mut c, &uid, 0).await);
        }
        report("first turn (starts the harness process)", cold);

        let uid = create(&mut c).await;
        turn(&mut c, &uid, 0).await;
        let mut warm = Vec::with_capacity(turns);
        for i in 1..=turns {
            warm.push(turn(&mut c, &uid, i).await);
        }
        report("turn, echo harness, one session", warm);

        let long_turns = std::env::var("AGENTVM_BENCH_LONG_TURNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(if quick { 20 } else { 2000 });
        long_session(&mut c, long_turns, 10).await;
        long_session(&mut c, long_turns, 8 << 10).await;

        for sessions in [4usize, 16] {
            let mut uids = Vec::new();
            for _ in 0..sessions {
                let uid = create(&mut c).await;
                turn(&mut c, &uid, 0).await;
                uids.push(uid);
            }
            let start = Instant::now();
            let tasks: Vec<_> = uids
                .into_iter()
                .map(|uid| {
                    let mut c = c.clone();
                    tokio::spawn(async move {
                        let mut lat = Vec::with_capacity(concurrent_turns);
                        for i in 1..=concurrent_turns {
                            lat.push(turn(&mut c, &uid, i).await);
                        }
                        lat
                    })
                })
                .collect();
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            let elapsed = start.elapsed().as_secs_f64();
            let rate = all.len() as f64 / elapsed;
            report(&format!("turn, {sessions} concurrent sessions"), all);
            println!(
                "{:<44} {rate:>10.0} turns/s",
                format!("throughput, {sessions} concurrent sessions")
            );
        }
    });
}
