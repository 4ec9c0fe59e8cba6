//! Time travel on real microVMs with the test guest's counter (its count lives only in guest
//! RAM): every completed turn of a memory-tier session is checkpointed, a fork at any
//! checkpointed seq continues from the count that turn left, retention keeps the last turns
//! and every Mth older one (each kept one still forks exactly), and what is not a
//! checkpoint is refused naming the seqs that are. Skipped, with the reason printed, where
//! there is no usable KVM.

mod support;

use std::time::{Duration, Instant};

use agentvm_proto::node::v1::node_client::NodeClient;
use agentvm_proto::node::v1::{Checkpoint, ListCheckpointsRequest};
use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{ExecUpdate, ForkRequest, event::Body, exec_update::Update, part};
use agentvmd::journal::verify::verify_chain;
use support::daemon::{kvm_unavailable, vmm_binary};
use support::{TestNode, replay, start_with};
use tonic::transport::Channel;

macro_rules! require_kvm {
    () => {
        if let Some(reason) = kvm_unavailable() {
            eprintln!("SKIPPED: {reason}; this test needs KVM");
            return;
        }
    };
}

async fn microvm_node() -> TestNode {
    let binary = vmm_binary();
    start_with(|cfg| {
        cfg.vmm_binary = Some(binary);
        cfg.ram_dir = if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm".into()
        } else {
            std::env::temp_dir()
        };
    })
    .await
}

/// A testguest session with `annotations`.
async fn create(
    c: &mut SessionsClient<Channel>,
    annotations: &[(&str, &str)],
) -> Result<String, tonic::Status> {
    support::create_annotated(c, "testguest", annotations).await
}

/// One counter turn; its answer.
async fn turn(c: &mut SessionsClient<Channel>, session: &str) -> String {
    let mut stream = c
        .exec(support::exec_text(session, "go"))
        .await
        .unwrap_or_else(|s| panic!("exec on {session}: {s}"))
        .into_inner();
    let mut out = String::new();
    while let Some(ExecUpdate { update }) = stream.message().await.unwrap() {
        if let Some(Update::Record(record)) = update
            && let Some(Body::Message(m)) = record.event.and_then(|e| e.body)
            && m.role == "assistant"
        {
            for p in m.parts {
                if let Some(part::Part::Text(t)) = p.part {
                    out.push_str(&t.text);
                }
            }
        }
    }
    out
}

async fn checkpoints(node: &TestNode, session: &str) -> Vec<Checkpoint> {
    NodeClient::new(node.channel().await)
        .list_checkpoints(ListCheckpointsRequest {
            session: session.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .checkpoints
}

/// The checkpoints once the one of turn `turns` is recorded (they are taken after the END).
async fn checkpoints_through(node: &TestNode, session: &str, turns: u64) -> Vec<Checkpoint> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = checkpoints(node, session).await;
        if found.last().is_some_and(|c| c.turn == turns) {
            // Retention runs right after the record: give it its moment.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return checkpoints(node, session).await;
        }
        assert!(
            Instant::now() < deadline,
            "no checkpoint of turn {turns}: {found:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn fork_at(c: &mut SessionsClient<Channel>, parent: &str, at_seq: i64) -> String {
    c.fork(ForkRequest {
        session: parent.into(),
        count: 1,
        at_seq,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|s| panic!("Fork({parent} at {at_seq}): {s}"))
    .into_inner()
    .children[0]
        .metadata
        .as_ref()
        .unwrap()
        .uid
        .clone()
}

/// Checkpoint directories in the node's snapshot store.
fn stored_checkpoints(node: &TestNode) -> usize {
    let store = node.dir.join("state").join("snapshots");
    std::fs::read_dir(&store)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("ckpt."))
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_turn_is_a_fork_point_with_the_memory_it_had_then() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let parent = create(&mut c, &[]).await.unwrap();
    for n in 1..=10 {
        assert_eq!(turn(&mut c, &parent).await, n.to_string());
    }
    let kept = checkpoints_through(&node, &parent, 10).await;
    assert_eq!(
        kept.iter().map(|c| c.turn).collect::<Vec<_>>(),
        (1..=10).collect::<Vec<_>>()
    );
    // Each at its turn's END: the seq the log has there.
    let records = replay(&mut c, &parent).await;
    for checkpoint in &kept {
        let record = records.iter().find(|r| r.seq == checkpoint.seq).unwrap();
        assert!(
            matches!(
                record.event.as_ref().unwrap().kind(),
                agentvm_proto::v1::EventKind::EventEnd
            ),
            "{checkpoint:?} is not at an END"
        );
    }
    let at_three = fork_at(&mut c, &parent, kept[2].seq).await;
    let at_seven = fork_at(&mut c, &parent, kept[6].seq).await;
    assert_eq!(turn(&mut c, &at_three).await, "4");
    assert_eq!(turn(&mut c, &at_seven).await, "8");
    assert_eq!(turn(&mut c, &at_three).await, "5");
    assert_eq!(turn(&mut c, &parent).await, "11");
    for session in [&parent, &at_three, &at_seven] {
        verify_chain(&replay(&mut c, session).await).unwrap();
    }
    // Between two checkpoints: refused, naming the nearest seqs that fork.
    let refused = c
        .fork(ForkRequest {
            session: parent.clone(),
            count: 1,
            at_seq: kept[2].seq - 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    for seq in [kept[1].seq, kept[2].seq] {
        assert!(
            refused.message().contains(&seq.to_string()),
            "{}",
            refused.message()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_the_last_turns_and_every_mth_and_each_still_forks_exactly() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let parent = create(&mut c, &[("agentvm.dev/checkpoints", "3/4")])
        .await
        .unwrap();
    for n in 1..=12 {
        assert_eq!(turn(&mut c, &parent).await, n.to_string());
    }
    let kept = checkpoints_through(&node, &parent, 12).await;
    assert_eq!(
        kept.iter().map(|c| c.turn).collect::<Vec<_>>(),
        [4, 8, 10, 11, 12]
    );
    // The dropped ones were folded into the next and deleted.
    assert_eq!(stored_checkpoints(&node), kept.len());
    for (checkpoint, next) in kept.iter().zip(["5", "9", "11", "12", "13"]) {
        let child = fork_at(&mut c, &parent, checkpoint.seq).await;
        assert_eq!(
            turn(&mut c, &child).await,
            next,
            "a fork at turn {}",
            checkpoint.turn
        );
    }
    // Across a suspend: the resumed VMM starts a chain of its own, so the checkpoint before
    // it is dropped without a fold (and retention goes on past it).
    let resumed = create(&mut c, &[("agentvm.dev/checkpoints", "2")])
        .await
        .unwrap();
    assert_eq!(turn(&mut c, &resumed).await, "1");
    assert_eq!(turn(&mut c, &resumed).await, "2");
    checkpoints_through(&node, &resumed, 2).await;
    c.suspend(agentvm_proto::v1::SuspendRequest {
        session: resumed.clone(),
    })
    .await
    .unwrap();
    for n in 3..=5 {
        assert_eq!(turn(&mut c, &resumed).await, n.to_string());
    }
    let kept = checkpoints_through(&node, &resumed, 5).await;
    assert_eq!(kept.iter().map(|c| c.turn).collect::<Vec<_>>(), [4, 5]);
    for (checkpoint, next) in kept.iter().zip(["5", "6"]) {
        let child = fork_at(&mut c, &resumed, checkpoint.seq).await;
        assert_eq!(turn(&mut c, &child).await, next);
    }
    // Off: no checkpoint, and forks only at the head.
    let plain = create(&mut c, &[("agentvm.dev/checkpoints", "off")])
        .await
        .unwrap();
    assert_eq!(turn(&mut c, &plain).await, "1");
    assert_eq!(turn(&mut c, &plain).await, "2");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(checkpoints(&node, &plain).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_that_does_not_parse_is_refused_by_name() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let refused = create(&mut c, &[("agentvm.dev/checkpoints", "lots")])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("agentvm.dev/checkpoints"),
        "{}",
        refused.message()
    );
}

/// Item 5 (fleet): a suspended session's checkpoints go to the fleet's snapshot store with
/// it, so another node of the fleet forks it at a past turn from the published chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_node_forks_a_suspended_session_at_a_past_turn_from_the_fleet_store() {
    require_kvm!();
    let server = match agentvmd::testing::TestPostgres::start() {
        Ok(server) => server,
        Err(why) => {
            eprintln!("SKIPPED: {why}; this test needs PostgreSQL for the shared journal");
            return;
        }
    };
    server.create_database("time_travel_fleet").unwrap();
    let shared = tempfile::tempdir().unwrap();
    let remote = agentvmd::runtime::microvm::remote::SnapshotRemote::Dir(shared.path().into());
    let binary = vmm_binary();
    let node = |name: &'static str, uid_base: u32| {
        let (url, remote, binary) = (
            server.url("time_travel_fleet"),
            remote.clone(),
            binary.clone(),
        );
        start_with(move |cfg| {
            cfg.vmm_binary = Some(binary);
            cfg.ram_dir = "/dev/shm".into();
            cfg.journal_url = Some(url);
            cfg.node_name = name.into();
            cfg.snapshot_remote = Some(remote);
            cfg.vm_uid_base = uid_base;
        })
    };
    let base = agentvmd::runtime::microvm::DEFAULT_VM_UID_BASE;
    let a = node("node-a", base).await;
    let b = node("node-b", base + 65_536).await;
    let (mut ca, mut cb) = (a.c(), b.c());

    let parent = create(&mut ca, &[]).await.unwrap();
    for n in 1..=5 {
        assert_eq!(turn(&mut ca, &parent).await, n.to_string());
    }
    let kept = checkpoints_through(&a, &parent, 5).await;
    let in_fleet_store = |c: &Checkpoint| c.snapshot.contains(&*shared.path().to_string_lossy());
    assert!(!kept.iter().any(in_fleet_store), "{kept:?}");
    ca.suspend(agentvm_proto::v1::SuspendRequest {
        session: parent.clone(),
    })
    .await
    .unwrap();
    // Published with the suspend: every record names an archive of the fleet's store.
    let published = checkpoints(&b, &parent).await;
    assert_eq!(
        published.iter().map(|c| c.seq).collect::<Vec<_>>(),
        kept.iter().map(|c| c.seq).collect::<Vec<_>>()
    );
    assert!(published.iter().all(in_fleet_store), "{published:?}");
    // Node b has none of them, and forks at turns 2 and 4 from the fleet's store.
    assert_eq!(stored_checkpoints(&b), 0);
    let at_two = fork_at(&mut cb, &parent, kept[1].seq).await;
    let at_four = fork_at(&mut cb, &parent, kept[3].seq).await;
    assert_eq!(turn(&mut cb, &at_two).await, "3");
    assert_eq!(turn(&mut cb, &at_four).await, "5");
    // The parent goes on (on node b now) from where it was suspended.
    assert_eq!(turn(&mut cb, &parent).await, "6");
    for session in [&parent, &at_two, &at_four] {
        verify_chain(&replay(&mut cb, session).await).unwrap();
    }
    for session in [&at_two, &at_four, &parent] {
        cb.delete_session(agentvm_proto::v1::DeleteSessionRequest {
            uid: session.to_string(),
        })
        .await
        .unwrap();
    }
}
