//! Time travel through the Sessions API on microVMs with the test guest's counter: what a
//! checkpoint at every turn's end costs a client (END → next turn's first record and whole
//! turn, back to back, with checkpoints on and off), fork at a past turn against fork at
//! the head (→ the child's first turn answered), and the storage a session's checkpoints
//! take after 100 turns with the default retention (the last 32 and every 10th).
//!
//! `cargo build --release -p agentvm-vmm && cargo bench -p agentvmd --bench time_travel`
//! (the VMM is taken from beside this benchmark; `AGENTVM_VMM_BIN` overrides it).

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentvm_proto::node::v1::ListCheckpointsRequest;
use agentvm_proto::node::v1::node_client::NodeClient;
use agentvm_proto::v1::ForkRequest;
use agentvm_proto::v1::sessions_client::SessionsClient;
use tonic::transport::Channel;

fn summary(name: &str, unit: &str, mut xs: Vec<f64>) {
    xs.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{name:<52} min {:>8.2}  median {:>8.2}  max {:>8.2}  {unit}  (n={})",
        xs[0],
        xs[xs.len() / 2],
        xs[xs.len() - 1],
        xs.len()
    );
}

fn vmm_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("AGENTVM_VMM_BIN") {
        return bin.into();
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("agentvm-vmm")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn create(c: &mut SessionsClient<Channel>, checkpoints: &str) -> String {
    support::create_annotated(c, "testguest", &[("agentvm.dev/checkpoints", checkpoints)])
        .await
        .unwrap()
}

/// One turn: (time to its first record, time to the end of its stream).
async fn turn(c: &mut SessionsClient<Channel>, session: &str) -> (Duration, Duration) {
    let start = Instant::now();
    let mut stream = c
        .exec(support::exec_text(session, "go"))
        .await
        .unwrap()
        .into_inner();
    let mut first = None;
    while let Some(update) = stream.message().await.unwrap() {
        if first.is_none()
            && matches!(
                update.update,
                Some(agentvm_proto::v1::exec_update::Update::Record(_))
            )
        {
            first = Some(start.elapsed());
        }
    }
    (first.unwrap_or_default(), start.elapsed())
}

async fn fork_and_answer(c: &mut SessionsClient<Channel>, parent: &str, at_seq: i64) -> f64 {
    let start = Instant::now();
    let child = c
        .fork(ForkRequest {
            session: parent.into(),
            count: 1,
            at_seq,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children[0]
        .metadata
        .as_ref()
        .unwrap()
        .uid
        .clone();
    turn(c, &child).await;
    let took = ms(start.elapsed());
    let _ = c
        .delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: child })
        .await;
    took
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    if let Some(reason) = support::daemon::kvm_unavailable() {
        println!("SKIPPED: {reason}; the time-travel benchmarks need KVM");
        return;
    }
    let binary = vmm_binary();
    if !binary.is_file() {
        println!(
            "SKIPPED: no VMM at {} (cargo build -p agentvm-vmm first, or set AGENTVM_VMM_BIN)",
            binary.display()
        );
        return;
    }
    let (turns, forks) = if quick { (12, 2) } else { (100, 20) };
    let node = support::start_with(|cfg| {
        cfg.vmm_binary = Some(binary.clone());
        cfg.ram_dir = "/dev/shm".into();
    })
    .await;
    let mut c = node.c();

    // Back-to-back turns: each Exec is sent the moment the last one's stream ends.
    for (label, retention) in [("checkpoints off", "off"), ("checkpoints on", "32/10")] {
        let session = create(&mut c, retention).await;
        turn(&mut c, &session).await;
        let (mut first, mut whole) = (Vec::new(), Vec::new());
        for _ in 0..turns {
            let (f, w) = turn(&mut c, &session).await;
            first.push(ms(f));
            whole.push(ms(w));
        }
        summary(
            &format!("back-to-back turn, {label}: first record"),
            "ms",
            first,
        );
        summary(
            &format!("back-to-back turn, {label}: whole turn"),
            "ms",
            whole,
        );
    }

    // A session of `turns` turns with the default retention, paced like an agent's turns.
    let session = create(&mut c, "32/10").await;
    for _ in 0..turns {
        turn(&mut c, &session).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let checkpoints = NodeClient::new(node.channel().await)
        .list_checkpoints(ListCheckpointsRequest {
            session: session.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .checkpoints;
    let bytes: u64 = checkpoints.iter().map(|c| c.bytes).sum();
    println!(
        "after {turns} turns: {} checkpoints kept, {:.2} MiB on disk ({:.1} KiB each)",
        checkpoints.len(),
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / 1024.0 / checkpoints.len().max(1) as f64
    );

    // Fork → the child's first turn answered: at the head, and at a turn ten back.
    let head = checkpoints.last().unwrap().seq;
    let past = checkpoints[checkpoints.len().saturating_sub(11)].seq;
    let (mut at_head, mut at_past) = (Vec::new(), Vec::new());
    for _ in 0..forks {
        at_head.push(fork_and_answer(&mut c, &session, head).await);
        at_past.push(fork_and_answer(&mut c, &session, past).await);
    }
    summary("fork at the head → child answered", "ms", at_head);
    summary("fork ten turns back → child answered", "ms", at_past);
}
