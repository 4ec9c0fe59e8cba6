//! The memory-tier scenarios of semantics.md §6 on real microVMs: the `microvm` runtime with
//! the test guest's counter (its count lives only in guest RAM), through the Sessions API.
//! Each test prints SKIPPED and returns when the machine has no usable KVM.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{
    ComputeState, CreateSessionRequest, ExecUpdate, ForkRequest, GetSessionRequest, ResumeRequest,
    Session, SuspendRequest, event::Body, exec_update::Update, lifecycle::Kind as LifecycleKind,
    part,
};
use agentvmd::journal::verify::verify_chain;
use support::daemon::{kvm_unavailable, vmm_binary};
use support::{TestNode, create_for, replay, start_with};
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

/// How a template's snapshot id starts (`runtime::microvm::templates::ID_PREFIX`).
const TEMPLATE: &str = agentvmd::runtime::microvm::templates::ID_PREFIX;

fn uid(s: &Session) -> String {
    s.metadata.as_ref().unwrap().uid.clone()
}

async fn create(c: &mut SessionsClient<Channel>) -> String {
    create_for(c, "testguest").await
}

/// One turn; returns the assistant's text output.
async fn turn(c: &mut SessionsClient<Channel>, session: &str) -> String {
    try_turn(c, session)
        .await
        .unwrap_or_else(|s| panic!("exec on {session}: {s}"))
}

/// A live fork: once its checkpoint is in its log, the parent answers turns while its
/// Fork(16) is still starting the children, and after, in the VMM it had; every child
/// continues from the parent's count at the fork. (A turn already running when a fork
/// begins is superseded, as by any checkpoint, and the fork refuses to cut a log that moved
/// meanwhile; so this parent is idle when the fork starts.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_keeps_answering_during_and_after_its_fork() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let (parent, pid) = counting_parent(&node, &mut c).await;
    let forking = {
        let mut c = c.clone();
        let parent = parent.clone();
        tokio::spawn(async move { fork(&mut c, &parent, 16).await })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !replay(&mut c, &parent).await.iter().any(|r| {
        matches!(r.event.as_ref().and_then(|e| e.body.as_ref()),
            Some(Body::Lifecycle(l)) if l.kind == LifecycleKind::LifecycleResume as i32)
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint in the parent's log"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut count = 1u64;
    let (mut during, mut busy) = (0, 0);
    while !forking.is_finished() {
        match try_turn(&mut c, &parent).await {
            Ok(answer) => {
                count += 1;
                assert_eq!(answer, count.to_string(), "the parent's count goes on");
                during += usize::from(!forking.is_finished());
            }
            // The moment between the checkpoint's record and its release of the parent.
            Err(s) if s.code() == tonic::Code::Aborted && busy < 3 => busy += 1,
            Err(s) => panic!("a turn on the parent during its fork: {s}"),
        }
    }
    let children = forking.await.unwrap();
    eprintln!("{during} turns answered during the fork ({busy} refused as busy)");
    assert!(
        during > 0,
        "the parent answered no turn while its children started"
    );
    assert_eq!(turn(&mut c, &parent).await, (count + 1).to_string());
    assert_eq!(
        vmm_pid(&node, &parent),
        pid,
        "the parent's VMM was not replaced"
    );
    assert_eq!(children.len(), 16);
    for child in &children {
        assert_eq!(turn(&mut c, child).await, "2", "child {child}");
    }
    verify_chain(&replay(&mut c, &parent).await).unwrap();
    for child in &children {
        c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: child.clone() })
            .await
            .unwrap();
    }
}

/// A counter session that has counted 1, and its VMM's pid.
async fn counting_parent(node: &TestNode, c: &mut SessionsClient<Channel>) -> (String, i32) {
    let parent = create(c).await;
    assert_eq!(turn(c, &parent).await, "1");
    (parent.clone(), vmm_pid(node, &parent))
}

/// A turn naming another harness than a memory-tier session's (or a memory-tier harness for
/// a stateless session) is refused before anything happens: the VM goes on running, nothing
/// is journaled, and the next turn continues the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_on_another_harness_than_a_memory_tier_session_s_changes_nothing() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let (session, pid) = counting_parent(&node, &mut c).await;
    assert_eq!(turn(&mut c, &session).await, "2");
    let log = replay(&mut c, &session).await;
    let mut other = support::exec_text(&session, "hi");
    other.harness = "echo".into();
    let refused = try_exec(&mut c, other).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert!(refused.message().contains("memory"), "{refused:?}");
    assert_eq!(replay(&mut c, &session).await, log, "nothing journaled");
    assert_eq!(vmm_pid(&node, &session), pid);
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the VM was stopped"
    );
    assert_eq!(compute(&mut c, &session).await, ComputeState::ComputeLive);
    assert_eq!(turn(&mut c, &session).await, "3");

    // The reverse: a stateless session is not switched onto a memory-tier harness.
    let echo = create_for(&mut c, "echo").await;
    try_turn(&mut c, &echo).await.unwrap();
    let log = replay(&mut c, &echo).await;
    let mut onto = support::exec_text(&echo, "hi");
    onto.harness = "testguest".into();
    let refused = try_exec(&mut c, onto).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert_eq!(replay(&mut c, &echo).await, log, "nothing journaled");
    for s in [session, echo] {
        c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: s })
            .await
            .unwrap();
    }
}

/// Runs `req` to its end; the status it failed with, if it did.
async fn try_exec(
    c: &mut SessionsClient<Channel>,
    req: agentvm_proto::v1::ExecRequest,
) -> Result<(), tonic::Status> {
    let mut stream = c.exec(req).await?.into_inner();
    while stream.message().await?.is_some() {}
    Ok(())
}

/// One turn, or the status it failed with.
async fn try_turn(c: &mut SessionsClient<Channel>, session: &str) -> Result<String, tonic::Status> {
    let mut stream = c
        .exec(support::exec_text(session, "go"))
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(ExecUpdate { update }) = stream.message().await? {
        if let Some(Update::Record(record)) = update
            && let Some(Body::Message(m)) = record.event.and_then(|e| e.body)
            && m.role == "assistant"
        {
            for p in m.parts {
                if let Some(part::Part::Text(t)) = p.part {
                    out.push(t.text);
                }
            }
        }
    }
    Ok(out.join(""))
}

/// Fork(`count`) at the head; the children's uids.
async fn fork(c: &mut SessionsClient<Channel>, parent: &str, count: i32) -> Vec<String> {
    c.fork(ForkRequest {
        session: parent.into(),
        count,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|s| panic!("Fork({parent}, {count}): {s}"))
    .into_inner()
    .children
    .iter()
    .map(uid)
    .collect()
}

async fn compute(c: &mut SessionsClient<Channel>, session: &str) -> ComputeState {
    let s = c
        .get_session(GetSessionRequest {
            uid: session.into(),
        })
        .await
        .unwrap()
        .into_inner();
    ComputeState::try_from(s.compute_state).unwrap_or(ComputeState::Unspecified)
}

/// A confined microvm runtime in `dir` serving `harness` from `kernel` (64 MiB guests).
fn runtime_config(
    dir: &std::path::Path,
    harness: &str,
    kernel: PathBuf,
    ready_timeout: Duration,
) -> agentvmd::runtime::microvm::MicrovmConfig {
    agentvmd::runtime::microvm::MicrovmConfig {
        vmm_binary: vmm_binary(),
        flavour: Default::default(),
        run_dir: dir.join("vms"),
        ram_dir: dir.to_owned(),
        snapshot_dir: dir.join("snapshots"),
        images: vec![agentvmd::runtime::microvm::GuestImage {
            harness: harness.into(),
            kernel,
            cmdline: String::new(),
            memory_snapshot: true,
            ..Default::default()
        }],
        vcpus: 1,
        memory_mib: 64,
        guest_timeouts: agentvmd::runtime::microvm::guest::GuestTimeouts {
            ready: ready_timeout,
            reply: Duration::from_secs(30),
        },
        vmm_api_timeout: agentvmd::node::DEFAULT_VMM_API_TIMEOUT,
        confine: true,
        vm_uid_base: agentvmd::runtime::microvm::DEFAULT_VM_UID_BASE,
        memory_limit_mib: None,
        snapshot_remote: None,
        min_free_disk_bytes: 0,
        vmm_pool: 0,
        templates: true,
    }
}

/// Waits until `session` reads COLD (its lost VMM recorded), failing with `what` after
/// `within`.
async fn wait_cold(c: &mut SessionsClient<Channel>, session: &str, within: Duration, what: &str) {
    let deadline = std::time::Instant::now() + within;
    while compute(c, session).await != ComputeState::ComputeCold {
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn vm_dir(node: &TestNode, session: &str) -> PathBuf {
    node.dir.join("state").join("vms").join(session)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_75_counter_continues_across_suspend_and_resume_on_a_microvm() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    assert_eq!(turn(&mut c, &s).await, "2");
    assert!(
        vm_dir(&node, &s).join("api.sock").exists(),
        "a VMM runs the session"
    );

    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    wait_gone(&vm_dir(&node, &s), "a suspended session's VMM").await;
    assert_eq!(compute(&mut c, &s).await, ComputeState::ComputeCold);

    // Exec on a suspended memory session restores it first; the count lives on in guest RAM.
    assert_eq!(turn(&mut c, &s).await, "3");
    let records = replay(&mut c, &s).await;
    verify_chain(&records).unwrap();
    let suspend = records
        .iter()
        .find_map(|r| match r.event.as_ref()?.body.as_ref()? {
            Body::Lifecycle(l) if l.kind == LifecycleKind::LifecycleSuspend as i32 => {
                Some(l.clone())
            }
            _ => None,
        })
        .expect("a SUSPEND lifecycle record with its snapshot");
    assert!(suspend.snapshot_memory && suspend.snapshot_external_uri.starts_with("file://"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_76_forks_continue_from_the_parent_in_their_own_microvms() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let parent = create(&mut c).await;
    assert_eq!(turn(&mut c, &parent).await, "1");
    assert_eq!(turn(&mut c, &parent).await, "2");
    let children = fork(&mut c, &parent, 3).await;
    assert_eq!(children.len(), 3);
    for child in &children {
        assert!(
            vm_dir(&node, child).exists(),
            "each child runs in its own VMM"
        );
        assert_eq!(turn(&mut c, child).await, "3", "child {child}");
    }
    // Children diverge independently; the parent continues from its own state.
    assert_eq!(turn(&mut c, &children[0]).await, "4");
    assert_eq!(turn(&mut c, &children[1]).await, "4");
    assert_eq!(turn(&mut c, &parent).await, "3");
    for session in children.iter().chain([&parent]) {
        verify_chain(&replay(&mut c, session).await).unwrap();
    }
    for child in &children {
        c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: child.clone() })
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    for child in &children {
        assert!(
            !vm_dir(&node, child).exists(),
            "deleting a session stops its VMM"
        );
    }
}

/// A fork does not park the parent (upstream's does): it answers again at once, in the same
/// VMM, with its memory. Forked again (its RAM is now a shared base it runs over, so the
/// second fork is a layer on the first) and after a suspend (children start from that
/// snapshot), every child continues from the parent's state at its fork.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forked_parent_keeps_running_and_forks_again() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let (parent, pid) = counting_parent(&node, &mut c).await;
    let mut children = Vec::new();
    for expect in ["2", "3"] {
        let batch = fork(&mut c, &parent, 1).await;
        assert_eq!(compute(&mut c, &parent).await, ComputeState::ComputeLive);
        assert_eq!(
            vmm_pid(&node, &parent),
            pid,
            "the parent's VMM was not replaced"
        );
        children.extend(batch.iter().map(|child| (child.clone(), expect)));
        assert_eq!(
            turn(&mut c, &parent).await,
            expect,
            "the parent keeps its memory"
        );
    }
    c.suspend(SuspendRequest {
        session: parent.clone(),
    })
    .await
    .unwrap();
    let batch = fork(&mut c, &parent, 1).await;
    assert_eq!(compute(&mut c, &parent).await, ComputeState::ComputeCold);
    children.extend(batch.iter().map(|child| (child.clone(), "4")));
    for (child, expect) in &children {
        assert_eq!(turn(&mut c, child).await, *expect, "child {child}");
    }
    assert_eq!(turn(&mut c, &parent).await, "4");
    for session in children.iter().map(|(s, _)| s).chain([&parent]) {
        verify_chain(&replay(&mut c, session).await).unwrap();
    }
    for (child, _) in &children {
        c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: child.clone() })
            .await
            .unwrap();
    }
}

fn vmm_pid(node: &TestNode, session: &str) -> i32 {
    std::fs::read_to_string(vm_dir(node, session).join("vmm.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

async fn wait_gone(path: &std::path::Path, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} is still there"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn configure_microvm(cfg: &mut agentvmd::node::NodeConfig) {
    cfg.vmm_binary = Some(vmm_binary());
    cfg.ram_dir = if std::path::Path::new("/dev/shm").is_dir() {
        "/dev/shm".into()
    } else {
        std::env::temp_dir()
    };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_readopts_running_microvms() {
    require_kvm!();
    let node = support::start_with(configure_microvm).await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let pid = vmm_pid(&node, &s);

    let node = node.restart(configure_microvm).await;
    let mut c = node.c();
    assert_eq!(vmm_pid(&node, &s), pid, "the VMM outlived the daemon");
    // The same VM, with its count in RAM, serves the next turn.
    assert_eq!(turn(&mut c, &s).await, "2");
    // Suspend after the restart snapshots the adopted VM rather than losing it.
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    // Its VMM exits on its own after the reply (the kernel's teardown of its VM is not
    // waited for).
    wait_gone(&vm_dir(&node, &s), "the suspended session's VMM directory").await;
    assert_eq!(turn(&mut c, &s).await, "3");
    verify_chain(&replay(&mut c, &s).await).unwrap();
    c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: s.clone() })
        .await
        .unwrap();
}

/// Runs one turn and returns how it failed (its status message); panics if it succeeded.
async fn failed_turn(mut c: SessionsClient<Channel>, session: String) -> tonic::Status {
    let started = c.exec(support::exec_text(session.clone(), "go")).await;
    match started {
        Err(status) => status,
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("the turn on {session} succeeded"),
                    Err(status) => break status,
                }
            }
        }
    }
}

/// kill -9 of a VMM in the middle of a turn: the turn fails naming the cause, the log
/// records the lost compute (the session reads COLD, not a LIVE VM that is gone), and the
/// next turn continues from the last snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_vmm_fails_the_turn_then_the_session_continues_from_its_last_snapshot() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    assert_eq!(turn(&mut c, &s).await, "2");
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    assert_eq!(turn(&mut c, &s).await, "3");

    // Stopped first, so the next turn is surely in flight when the VMM dies.
    let pid = vmm_pid(&node, &s);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    );
    let in_flight = tokio::spawn(failed_turn(c.clone(), s.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let status = in_flight.await.unwrap();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("compute lost") && status.message().contains("VM"),
        "the failure names its cause: {status:?}"
    );
    // Issue: the next turn failed 2 times in 3 ("the session's VMM is not running") until
    // the exit was recorded. It now goes on at once, with no retry.
    assert_eq!(turn(&mut c, &s).await, "3");
    // Turn 3's memory died with the VMM: the log says so, before the turn that restored
    // count 2 and answered 3.
    let records = replay(&mut c, &s).await;
    let last_start = records
        .iter()
        .rposition(|r| {
            r.event.as_ref().map(|e| e.kind)
                == Some(agentvm_proto::v1::EventKind::EventExecutionStart as i32)
        })
        .unwrap();
    let Some(Body::Lifecycle(last)) = records[..last_start]
        .last()
        .and_then(|r| r.event.as_ref())
        .and_then(|e| e.body.clone())
    else {
        panic!("the record before the last turn is not a lifecycle record");
    };
    assert_eq!(last.kind, LifecycleKind::LifecycleSuspend as i32);
    assert!(last.detail.contains("compute lost"), "{}", last.detail);
    assert!(
        last.snapshot_memory,
        "it names the snapshot to continue from"
    );
    verify_chain(&replay(&mut c, &s).await).unwrap();
}

/// Issue: a corrupt snapshot answered UNAVAILABLE, a retryable code, for a condition that
/// never clears. Its digests catch it, the turn answers DATA_LOSS, the log records it once,
/// and the session can still be deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_snapshot_is_data_loss_recorded_once() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    let records = replay(&mut c, &s).await;
    let Some(Body::Lifecycle(suspend)) = records
        .last()
        .and_then(|r| r.event.as_ref())
        .and_then(|e| e.body.clone())
    else {
        panic!("no SUSPEND");
    };
    let memory = PathBuf::from(
        suspend
            .snapshot_external_uri
            .strip_prefix("file://")
            .unwrap(),
    )
    .join(agentvm_snapshot::manifest::MEMORY_FILE);
    {
        use std::io::{Seek, Write};
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&memory, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&memory)
            .unwrap();
        f.seek(std::io::SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[0x5a; 4096]).unwrap();
    }
    for attempt in 0..2 {
        let status = failed_turn(c.clone(), s.clone()).await;
        assert_eq!(
            status.code(),
            tonic::Code::DataLoss,
            "attempt {attempt}: {status:?}"
        );
        assert!(status.message().contains("digest"), "{status:?}");
    }
    let after = replay(&mut c, &s).await;
    let unusable: Vec<_> = after
        .iter()
        .filter(|r| {
            matches!(r.event.as_ref().and_then(|e| e.body.as_ref()),
                Some(Body::Lifecycle(l)) if l.detail.starts_with("snapshot unusable"))
        })
        .collect();
    assert_eq!(unusable.len(), 1, "recorded once: {after:?}");
    verify_chain(&after).unwrap();
    c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: s })
        .await
        .unwrap();
}

/// Issue 34 (item 3): a VMM stopped before or during a turn (SIGSTOP: alive, answering
/// nothing) held the turn until a deadline made for slow guests (30 s, then the harness idle
/// deadline) and was left stopped. It is now found within a second or two: the turn ends
/// UNAVAILABLE naming the stop, the VMM is killed, the loss recorded, and the very next turn
/// answers from the last snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_vmm_fails_the_turn_at_once_and_the_next_turn_recovers() {
    require_kvm!();
    let binary = vmm_binary();
    let node = start_with(|cfg| {
        cfg.vmm_binary = Some(binary);
        // Neither deadline may be what ends the turn.
        cfg.harness_idle_timeout = Duration::from_secs(120);
        cfg.guest_reply_timeout = Duration::from_secs(120);
    })
    .await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    assert_eq!(turn(&mut c, &s).await, "2");
    let pid = vmm_pid(&node, &s);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    );
    // The signal lands asynchronously: the suspend is asked once the kernel shows it stopped
    // (a suspend that starts before may rightly wait on the VMM's API).
    let stopped = (0..500).any(|_| {
        std::thread::sleep(Duration::from_millis(2));
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('T'))
        })
    });
    assert!(stopped, "VMM {pid} never showed as stopped");
    // A suspend cannot save what cannot run: refused at once, changing nothing.
    let refused = tokio::time::timeout(
        Duration::from_secs(5),
        c.suspend(SuspendRequest { session: s.clone() }),
    )
    .await
    .expect("the suspend of a stopped VMM waited out the API deadline")
    .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("SIGSTOP"), "{refused:?}");
    assert_eq!(compute(&mut c, &s).await, ComputeState::ComputeLive);
    let status = tokio::time::timeout(Duration::from_secs(30), failed_turn(c.clone(), s.clone()))
        .await
        .expect("the turn on a stopped VMM waited 30 s");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("compute lost") && status.message().contains("SIGSTOP"),
        "{status:?}"
    );
    let gone = (0..500).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        std::fs::read(format!("/proc/{pid}/cmdline")).map_or(true, |c| c.is_empty())
    });
    assert!(gone, "the stopped VMM {pid} was left");
    // Count 2 lived only in the stopped VM: the next turn restores 1 and answers 2.
    assert_eq!(turn(&mut c, &s).await, "2");
    let records = replay(&mut c, &s).await;
    assert!(
        records.iter().any(|r| matches!(
            r.event.as_ref().and_then(|e| e.body.as_ref()),
            Some(Body::Lifecycle(l)) if l.detail.starts_with("compute lost")
        )),
        "the loss is recorded"
    );
    verify_chain(&records).unwrap();
}

/// A fork child whose VM dies before it ever suspends continues from the snapshot it was
/// cloned from (its FORK record names it), not from scratch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_child_whose_vmm_dies_continues_from_the_fork_snapshot() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let parent = create(&mut c).await;
    assert_eq!(turn(&mut c, &parent).await, "1");
    assert_eq!(turn(&mut c, &parent).await, "2");
    let child = uid(&c
        .fork(ForkRequest {
            session: parent.clone(),
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children[0]);
    assert_eq!(turn(&mut c, &child).await, "3");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(vmm_pid(&node, &child)),
        nix::sys::signal::Signal::SIGKILL,
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let records = replay(&mut c, &child).await;
        if let Some(Body::Lifecycle(l)) = records
            .last()
            .and_then(|r| r.event.as_ref())
            .and_then(|e| e.body.clone())
            && l.detail.contains("compute lost")
        {
            // Noticed while idle, by the exit watch, which knows how the VMM ended.
            assert!(l.detail.contains("signal 9"), "{}", l.detail);
            assert_eq!(compute(&mut c, &child).await, ComputeState::ComputeCold);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(turn(&mut c, &parent).await, "3");
    // The parent going does not take the snapshot the child's FORK record names: the child
    // still holds it, though its VM that was restored from it is gone.
    c.delete_session(agentvm_proto::v1::DeleteSessionRequest {
        uid: parent.clone(),
    })
    .await
    .unwrap();
    assert_eq!(turn(&mut c, &child).await, "3");
    // With the child gone too, nothing of either is left.
    c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: child })
        .await
        .unwrap();
    let snapshots: Vec<_> = std::fs::read_dir(node.dir.join("state/snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.') && !n.starts_with(TEMPLATE))
        .collect();
    assert!(snapshots.is_empty(), "left: {snapshots:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_never_becomes_ready_fails_create_and_leaves_nothing() {
    use agentvmd::runtime::microvm::MicrovmRuntime;
    use agentvmd::runtime::{Runtime, SessionSpec};
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("halt.elf");
    std::fs::write(
        &image,
        agentvm_testguest::synthetic::elf64(agentvm_testguest::synthetic::HALT64),
    )
    .unwrap();
    let runtime = MicrovmRuntime::new(runtime_config(
        dir.path(),
        "silent",
        image,
        Duration::from_secs(1),
    ))
    .unwrap();
    let started = std::time::Instant::now();
    let err = runtime
        .create(&SessionSpec {
            session_uid: "s-silent".into(),
            harness: "silent".into(),
            ..Default::default()
        })
        .await
        .map(drop)
        .expect_err("create must fail");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    assert!(err.to_string().contains("never became ready"), "{err}");
    assert!(
        !dir.path().join("vms/s-silent").exists(),
        "nothing left behind"
    );
    // Issue 34 (item 5): the console of a failed start went with its directory. It is
    // kept, and the error says where.
    let kept: Vec<_> = std::fs::read_dir(dir.path().join("failed-starts"))
        .expect("the console of the failed start is kept")
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(
        err.to_string().contains(&kept[0].display().to_string()),
        "{err}"
    );
    let leftover = std::process::Command::new("pgrep")
        .args(["-f", &dir.path().join("vms/s-silent").display().to_string()])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    assert!(leftover.is_empty(), "a VMM process is left: {leftover}");
}

/// Everything a node holds for its sessions: processes it started, its own fds, the
/// sockets and files under its state directory.
fn holdings(node: &TestNode) -> (usize, usize, usize) {
    let state = node.dir.join("state").display().to_string();
    let vmms = std::process::Command::new("pgrep")
        .args(["-f", &state])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or_default();
    let fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0);
    let files = walk(&node.dir.join("state/vms")) + walk(&node.dir.join("state/snapshots"));
    (vmms, fds, files)
}

fn walk(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| {
                    if e.path().is_dir() {
                        1 + walk(&e.path())
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_leaks_after_many_create_suspend_resume_fork_delete_cycles() {
    require_kvm!();
    let cycles: usize = std::env::var("AGENTVM_LEAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let node = microvm_node().await;
    let mut c = node.c();
    // Warm up once so lazily created state (connection pools, the snapshot store) is there.
    let warm = create(&mut c).await;
    turn(&mut c, &warm).await;
    c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: warm })
        .await
        .unwrap();
    let before = holdings(&node);
    for cycle in 0..cycles {
        let s = create(&mut c).await;
        assert_eq!(turn(&mut c, &s).await, "1", "cycle {cycle}");
        c.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
        assert_eq!(turn(&mut c, &s).await, "2", "cycle {cycle}");
        let children = c
            .fork(ForkRequest {
                session: s.clone(),
                count: 1,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .children;
        let child = uid(&children[0]);
        assert_eq!(turn(&mut c, &child).await, "3", "cycle {cycle}");
        for session in [child, s] {
            c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: session })
                .await
                .unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = holdings(&node);
    // The fd table is the whole test process's, shared with tests running beside this one,
    // so fds get a little slack either way; a per-cycle leak would show as hundreds.
    const FD_SLACK: usize = 16;
    let leaked = after.0 != before.0 || after.2 != before.2 || after.1 > before.1 + FD_SLACK;
    if leaked {
        let listing = std::process::Command::new("find")
            .arg(node.dir.join("state/snapshots"))
            .arg(node.dir.join("state/vms"))
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        eprintln!("left under state/:\n{listing}");
    }
    assert!(
        !leaked,
        "(VMM processes, daemon fds, files under vms/ and snapshots/): {before:?} before, \
         {after:?} after {cycles} cycles"
    );
}

/// On Cloud Hypervisor (PCI only) the virtio-mmio test guest cannot run: its sessions are
/// refused with the reason instead of booting a guest that never answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cloud_hypervisor_testguest_sessions_are_refused_by_name() {
    require_kvm!();
    let node = support::start_with(|cfg| {
        cfg.vmm_flavour = agentvmd::runtime::microvm::flavour::VmmFlavour::CloudHypervisor;
        // Never started: the refusal comes before any VMM would be.
        cfg.vmm_binary = Some("/bin/sh".into());
    })
    .await;
    let mut c = node.c();
    let session = create(&mut c).await;
    let err = c.exec(support::exec_text(session.clone(), "go")).await;
    let message = match err {
        Err(status) => status.message().to_owned(),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                match stream.message().await {
                    Err(status) => break status.message().to_owned(),
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("the turn ran on a VMM that cannot boot the test guest"),
                }
            }
        }
    };
    assert!(
        message.contains("testguest") && message.contains("cloud-hypervisor"),
        "{message}"
    );
    assert!(!node.dir.join("state/vms").join(&session).exists());
}

/// A daemon that starts over VMMs a previous one left watches the living ones from then on
/// and reports the dead ones (clearing their directories), so no session keeps claiming a
/// VM that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_runtime_watches_surviving_vmms_and_reports_dead_ones() {
    use agentvmd::runtime::microvm::MicrovmRuntime;
    use agentvmd::runtime::{Runtime, SessionSpec};
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("testguest.elf");
    std::fs::write(&image, agentvm_testguest::TESTGUEST_ELF).unwrap();
    let config = runtime_config(dir.path(), "testguest", image, Duration::from_secs(10));
    let before = MicrovmRuntime::new(config.clone()).unwrap();
    for session in ["s-dies", "s-lives"] {
        before
            .create(&SessionSpec {
                session_uid: session.into(),
                harness: "testguest".into(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let pid = |session: &str| -> i32 {
        std::fs::read_to_string(dir.path().join("vms").join(session).join("vmm.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let (dies, lives) = (pid("s-dies"), pid("s-lives"));
    drop(before);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dies),
        nix::sys::signal::Signal::SIGKILL,
    );
    // Until the pid is gone, the new runtime could still take it for alive.
    while std::path::Path::new(&format!("/proc/{dies}/cmdline")).exists()
        && !std::fs::read(format!("/proc/{dies}/cmdline"))
            .unwrap_or_default()
            .is_empty()
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let after = MicrovmRuntime::new(config).unwrap();
    let mut reports = after.compute_lost().expect("the microvm runtime reports");
    let first = tokio::time::timeout(Duration::from_secs(5), reports.recv())
        .await
        .expect("a report")
        .unwrap();
    assert_eq!(first.session_uid, "s-dies");
    assert!(
        first.reason.contains("gone when this daemon started"),
        "{}",
        first.reason
    );
    assert!(!dir.path().join("vms/s-dies").exists());

    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(lives),
        nix::sys::signal::Signal::SIGKILL,
    );
    let second = tokio::time::timeout(Duration::from_secs(5), reports.recv())
        .await
        .expect("the surviving VMM is watched")
        .unwrap();
    assert_eq!(second.session_uid, "s-lives");
    assert!(
        second.reason.contains(&format!("pid {lives}")),
        "{}",
        second.reason
    );
    // Its cgroups and RAM directory too (s-dies's directory went with its report).
    support::reap_vmms(&dir.path().join("vms"));
    support::remove_vm_cgroups("s-dies");
    let _ = std::fs::remove_dir_all(dir.path().join("vms/s-lives"));
}

/// One turn with `text` as input; returns the assistant's text output.
async fn say(c: &mut SessionsClient<Channel>, session: &str, text: &str) -> String {
    let mut stream = c
        .exec(support::exec_text(session, text))
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

/// A STATELESS_REPLAY harness in a microVM: suspend stops the VM without writing its RAM
/// anywhere, resume and a fork at an earlier point start fresh VMs that the host brings up to
/// date by replay, and a lost VM is simply replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_73_and_74_stateless_sessions_on_microvms_replay_suspend_and_resume() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let s = create_for(&mut c, "testguest-echo").await;
    assert_eq!(say(&mut c, &s, "one").await, "echo:one");
    let after_one = replay(&mut c, &s).await.last().unwrap().seq;
    assert_eq!(say(&mut c, &s, "two").await, "echo:two");
    assert!(vm_dir(&node, &s).exists());

    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    assert_eq!(compute(&mut c, &s).await, ComputeState::ComputeCold);
    wait_gone(&vm_dir(&node, &s), "a suspended stateless session's VMM").await;
    let snapshots = std::fs::read_dir(node.dir.join("state/snapshots"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != ".refs")
        .filter(|e| !e.file_name().to_string_lossy().starts_with(TEMPLATE))
        .count();
    assert_eq!(
        snapshots, 0,
        "a stateless session's RAM is never written out"
    );
    let Some(Body::Lifecycle(suspend)) = replay(&mut c, &s)
        .await
        .last()
        .and_then(|r| r.event.as_ref())
        .and_then(|e| e.body.clone())
    else {
        panic!("no SUSPEND record");
    };
    assert!(!suspend.snapshot_memory);

    // An explicit Resume boots a fresh VM; the log it continues is byte-identical.
    let suspended = replay(&mut c, &s).await;
    c.resume(ResumeRequest {
        session: s.clone(),
        boot: false,
    })
    .await
    .unwrap();
    assert_eq!(compute(&mut c, &s).await, ComputeState::ComputeLive);
    assert!(vm_dir(&node, &s).exists(), "Resume boots a fresh VM");
    let resumed = replay(&mut c, &s).await;
    assert_eq!(resumed[..suspended.len()], suspended[..]);
    let Some(Body::Lifecycle(resume)) = resumed.last().and_then(|r| r.event.clone()?.body) else {
        panic!("no RESUME record");
    };
    assert_eq!(resume.kind, LifecycleKind::LifecycleResume as i32);
    assert_eq!(say(&mut c, &s, "three").await, "echo:three");

    // Suspended again, Exec alone brings a fresh VM (no Resume needed).
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    wait_gone(&vm_dir(&node, &s), "the suspended session's VMM").await;
    assert_eq!(
        say(&mut c, &s, "three and a half").await,
        "echo:three and a half"
    );
    assert!(
        vm_dir(&node, &s).exists(),
        "a fresh VM serves the next turn"
    );

    // A replay fork at an earlier point: the child gets a VM of its own at its first turn.
    let child = uid(&c
        .fork(ForkRequest {
            session: s.clone(),
            count: 1,
            at_seq: after_one,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .children[0]);
    assert_eq!(say(&mut c, &child, "branch").await, "echo:branch");
    assert!(vm_dir(&node, &child).exists());

    // A lost VM is replaced at the next turn; nothing to restore.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(vmm_pid(&node, &s)),
        nix::sys::signal::Signal::SIGKILL,
    );
    wait_cold(
        &mut c,
        &s,
        Duration::from_secs(10),
        "the loss was never recorded",
    )
    .await;
    assert_eq!(say(&mut c, &s, "four").await, "echo:four");
    for session in [&s, &child] {
        verify_chain(&replay(&mut c, session).await).unwrap();
    }
}

/// A node with the microvm runtime serving the bundles in `images`.
async fn bundle_node(images: PathBuf) -> TestNode {
    bundle_node_with(images, true).await
}

/// As [`bundle_node`]; without `templates`, every session boots its image.
async fn bundle_node_with(images: PathBuf, templates: bool) -> TestNode {
    let binary = vmm_binary();
    start_with(move |cfg| {
        cfg.vmm_binary = Some(binary);
        cfg.image_dir = Some(images);
        cfg.ram_dir = std::env::temp_dir();
        cfg.templates = templates;
    })
    .await
}

/// Builds a bundle into `images/<name>` whose "kernel" is the test guest (it ignores the
/// initramfs and boots into its counter) — the whole bundle path of a Linux image, runnable
/// on this host.
fn testguest_bundle(images: &std::path::Path, name: &str) -> std::path::PathBuf {
    testguest_bundle_with(images, name, "")
}

/// As [`testguest_bundle`], with `vm` added to the image's `[vm]` table.
fn testguest_bundle_with(images: &std::path::Path, name: &str, vm: &str) -> std::path::PathBuf {
    let src = tempfile::tempdir().unwrap();
    let p = src.path();
    std::fs::write(p.join("vmlinux"), agentvm_testguest::TESTGUEST_ELF).unwrap();
    std::fs::write(p.join("agent"), agentvm_testguest::TESTGUEST_ELF).unwrap();
    std::fs::create_dir_all(p.join("harness")).unwrap();
    std::fs::write(p.join("harness/h"), agentvm_testguest::TESTGUEST_ELF).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p.join("harness/h"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(
        p.join("image.toml"),
        format!(
        "[harness]\ncommand = [\"/opt/harness/h\"]\nresumability = \"REQUIRES_MEMORY_SNAPSHOT\"\n\
         [vm]\nmemory_mib = 96\n{vm}\n\
         [build]\nkernel = \"vmlinux\"\nagent = \"agent\"\nharness_dir = \"harness\"\n",
        ),
    )
    .unwrap();
    let out = images.join(name);
    agentvmd::image::build(&p.join("image.toml"), &out, &Default::default()).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_bundles_in_the_image_dir_are_served_as_harnesses() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    testguest_bundle(&images, "tg-bundle");
    let tampered = testguest_bundle(&images, "tg-tampered");
    std::fs::write(
        tampered.join("initramfs.cpio"),
        b"not what the manifest says",
    )
    .unwrap();
    let node = bundle_node(images).await;
    let mut c = node.c();
    let s = create_for(&mut c, "tg-bundle").await;
    assert_eq!(turn(&mut c, &s).await, "1");
    assert_eq!(turn(&mut c, &s).await, "2");
    // The image's own memory size, and its initramfs, reached the VMM.
    let info = agentvm_vmm_api::client::VmmClient::new(vm_dir(&node, &s).join("api.sock"))
        .info()
        .await
        .unwrap();
    assert_eq!(info.config.memory.size, 96 << 20);
    // The metrics see the VM and what it costs.
    let state = (node.node.state_fn(true))();
    assert!(
        state
            .vmms
            .iter()
            .any(|(session, pss)| session == &s && *pss > 0),
        "{state:?}"
    );
    assert!(vmm_boots_observed() >= 1.0);
    assert!(
        info.config
            .payload
            .initramfs
            .unwrap()
            .ends_with("tg-bundle/initramfs.cpio")
    );
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    assert_eq!(turn(&mut c, &s).await, "3", "memory tier from image.toml");
    // A bundle that does not match its manifest is not served.
    let err = c
        .create_session(CreateSessionRequest {
            session: Some(Session {
                harness: "tg-tampered".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
}

/// The harnesses a node's status says it serves.
async fn served(node: &TestNode) -> Vec<String> {
    agentvm_proto::node::v1::node_client::NodeClient::new(node.channel().await)
        .get_status(agentvm_proto::node::v1::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .harnesses
}

/// A PVM host boots no ordinary Linux kernel: it lists a bundle whose kernel is Linux as a
/// harness it cannot run and refuses its sessions FAILED_PRECONDITION naming why, unless told
/// its bundles carry PVM guest kernels. (A bundle of the test guest, no Linux, it serves.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pvm_host_refuses_linux_bundles_it_cannot_boot() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let src = tempfile::tempdir().unwrap();
    let p = src.path();
    // An ELF that says it is Linux: enough for the node to take it for one.
    let mut linux = agentvm_testguest::TESTGUEST_ELF.to_vec();
    linux.extend_from_slice(b"Linux version 6.1.0 (builder@host)");
    std::fs::write(p.join("vmlinux"), &linux).unwrap();
    std::fs::write(p.join("agent"), agentvm_testguest::TESTGUEST_ELF).unwrap();
    std::fs::write(
        p.join("image.toml"),
        "[harness]\ncommand = [\"/opt/harness/agent\"]\nresumability = \"STATELESS_REPLAY\"\n[build]\nkernel = \"vmlinux\"\nagent = \"agent\"\nharness_binary = \"agent\"\n",
    )
    .unwrap();
    agentvmd::image::build(
        &p.join("image.toml"),
        &images.join("linux-app"),
        &Default::default(),
    )
    .unwrap();
    testguest_bundle(&images, "tg-bundle");
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    for pvm_guest_kernels in [false, true] {
        let binary = vmm_binary();
        let images = images.clone();
        let node = start_with(move |cfg| {
            cfg.vmm_binary = Some(binary);
            cfg.image_dir = Some(images);
            cfg.pvm_guest_kernels = pvm_guest_kernels;
        })
        .await;
        let mut c = node.c();
        let created = c
            .create_session(CreateSessionRequest {
                session: Some(Session {
                    harness: "linux-app".into(),
                    ..Default::default()
                }),
            })
            .await;
        match (pvm, pvm_guest_kernels) {
            (true, false) => {
                let err = created.unwrap_err();
                assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
                assert!(err.message().contains("PVM"), "{}", err.message());
                // The node lists only what it can run.
                assert!(!served(&node).await.contains(&"linux-app".to_owned()));
            }
            _ => {
                created.unwrap();
                assert!(served(&node).await.contains(&"linux-app".to_owned()));
            }
        }
        assert!(served(&node).await.contains(&"tg-bundle".to_owned()));
        create_for(&mut c, "tg-bundle").await;
    }
}

/// What the test guest last wrote to sector `n` of a disk file, up to the first NUL.
fn disk_text(path: &std::path::Path, n: usize) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let sector = &bytes[n * 512..(n + 1) * 512];
    text_of(sector)
}

fn text_of(sector: &[u8]) -> String {
    let end = sector.iter().position(|&b| b == 0).unwrap_or(512);
    String::from_utf8_lossy(&sector[..end]).into_owned()
}

/// The store's snapshots of `session`, oldest first.
fn snapshots_of(node: &TestNode, session: &str) -> Vec<PathBuf> {
    let mut found: Vec<(std::time::SystemTime, PathBuf)> =
        std::fs::read_dir(node.dir.join("state").join("snapshots"))
            .unwrap()
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                if !name.starts_with(session) || !e.path().join("manifest.json").exists() {
                    return None;
                }
                Some((e.metadata().ok()?.modified().ok()?, e.path()))
            })
            .collect();
    found.sort();
    found.into_iter().map(|(_, p)| p).collect()
}

/// Sector `n` of workspace disk 0 as a VM restored from `snapshot` onto `top` sees it.
fn restored_text(snapshot: &std::path::Path, top: &std::path::Path, n: u64) -> String {
    let mut sector = vec![0u8; 512];
    agentvm_snapshot::disk::read_restored(snapshot, "disk-0", top, &mut sector, n * 512).unwrap();
    text_of(&sector)
}

/// How many bytes of `path` are data (not holes).
fn data_bytes(path: &std::path::Path) -> u64 {
    agentvm_snapshot::pages::data_extents(&std::fs::File::open(path).unwrap())
        .unwrap()
        .iter()
        .map(|(_, len)| len)
        .sum()
}

/// Whether `path` holds no data at all (every block a hole).
fn holds_nothing(path: &std::path::Path) -> bool {
    data_bytes(path) == 0
}

/// A session's workspace disk follows it: written at boot and on every turn (the test guest
/// records its count in sector 2), kept by suspend, restored into the new VM, and copied to
/// each fork child, whose writes no other VM sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_disk_survives_suspend_and_each_fork_child_writes_its_own_copy() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    testguest_bundle_with(
        &images,
        "tg-disk",
        "cmdline = \"testguest.disk=5\"\nworkspace_mib = 1\nworkspace_fs = \"raw\"",
    );
    let node = bundle_node(images).await;
    let mut c = node.c();
    let s = create_for(&mut c, "tg-disk").await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let disk = |session: &str| vm_dir(&node, session).join("workspace.img");
    assert_eq!(
        disk_text(&disk(&s), 1),
        "testguest wrote 5",
        "the boot check"
    );
    assert_eq!(disk_text(&disk(&s), 2), "count=1");
    assert_eq!(std::fs::metadata(disk(&s)).unwrap().len(), 1 << 20);
    let info = agentvm_vmm_api::client::VmmClient::new(vm_dir(&node, &s).join("api.sock"))
        .info()
        .await
        .unwrap();
    assert_eq!(info.config.disks[0].serial.as_deref(), Some("workspace"));

    // Suspended, the VM and its directory are gone; the snapshot holds the disk. The
    // restored VM's own file holds only what it writes (its count), over the snapshot's copy.
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    assert_eq!(turn(&mut c, &s).await, "2", "restored with its memory");
    assert_eq!(disk_text(&disk(&s), 2), "count=2", "and its disk");
    assert_eq!(data_bytes(&disk(&s)), 4096, "the one block it wrote");
    let suspended = snapshots_of(&node, &s)
        .pop()
        .expect("the suspend's snapshot");
    assert_eq!(restored_text(&suspended, &disk(&s), 1), "testguest wrote 5");

    let children = fork(&mut c, &s, 2).await;
    assert_eq!(turn(&mut c, &children[0]).await, "3");
    assert_eq!(turn(&mut c, &children[1]).await, "3");
    assert_eq!(turn(&mut c, &children[1]).await, "4");
    assert_eq!(turn(&mut c, &s).await, "3");
    assert_eq!(turn(&mut c, &s).await, "4");
    assert_eq!(turn(&mut c, &s).await, "5");
    // Each VM wrote only its own disk.
    assert_eq!(disk_text(&disk(&children[0]), 2), "count=3");
    assert_eq!(disk_text(&disk(&children[1]), 2), "count=4");
    assert_eq!(disk_text(&disk(&s), 2), "count=5");
    // A child's file, too, holds only what the child wrote (its count's block, copied up
    // whole: the boot check's sector 1 shares it).
    for child in &children {
        assert_eq!(data_bytes(&disk(child)), 4096);
        assert_eq!(disk_text(&disk(child), 1), "testguest wrote 5");
    }
}

/// An image with an ext4 workspace: each session's disk starts as the bundle's formatted
/// template (the test guest leaves it alone without `testguest.disk`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ext4_workspace_starts_as_the_image_s_template() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let bundle = testguest_bundle_with(&images, "tg-ext4", "workspace_mib = 8");
    // Booted: a session from a template starts with an empty layer over the template's copy
    // (templates.rs's test shows that path).
    let node = bundle_node_with(images, false).await;
    let mut c = node.c();
    let s = create_for(&mut c, "tg-ext4").await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let disk = std::fs::read(vm_dir(&node, &s).join("workspace.img")).unwrap();
    assert_eq!(disk.len(), 8 << 20);
    assert_eq!(&disk[1080..1082], &[0x53, 0xef], "an ext4 superblock");
    assert_eq!(disk, std::fs::read(bundle.join("workspace.img")).unwrap());
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    assert_eq!(turn(&mut c, &s).await, "2");
    // The restored VM's file starts empty over the snapshot's copy, which is the template.
    let restored = vm_dir(&node, &s).join("workspace.img");
    assert_eq!(std::fs::metadata(&restored).unwrap().len(), 8 << 20);
    assert!(holds_nothing(&restored), "a restore copies no disk data");
    let suspended = snapshots_of(&node, &s)
        .pop()
        .expect("the suspend's snapshot");
    assert_eq!(std::fs::read(suspended.join("disk-0")).unwrap(), disk);
}

// ---------- Linux guests (where KVM can run them) ----------

/// Why a Linux guest cannot boot here, if it cannot.
fn linux_unavailable() -> Option<String> {
    if let Some(reason) = kvm_unavailable() {
        return Some(reason);
    }
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    if pvm
        && std::env::var_os("AGENTVM_TEST_KERNEL").is_none()
        && std::env::var_os("AGENTVM_TEST_IMAGE").is_none()
    {
        return Some(
            "/dev/kvm is PVM, which boots only a PVM guest kernel (feasibility-pvm.md); set \
             AGENTVM_TEST_KERNEL to one, or AGENTVM_TEST_IMAGE to a bundle built with it"
                .into(),
        );
    }
    None
}

/// The reference echo image as bundle `images/linux-echo`: `$AGENTVM_TEST_IMAGE` copied, or
/// built from `$AGENTVM_TEST_KERNEL` and the static binaries of `scripts/build-guest.sh`.
fn linux_echo_bundle(images: &std::path::Path) -> Result<(), String> {
    let out = images.join("linux-echo");
    if let Some(bundle) = std::env::var_os("AGENTVM_TEST_IMAGE") {
        std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
        for f in ["vmlinux", "initramfs.cpio", "image.toml", "manifest.json"] {
            std::fs::copy(std::path::Path::new(&bundle).join(f), out.join(f))
                .map_err(|e| format!("copying {f} of AGENTVM_TEST_IMAGE: {e}"))?;
        }
        return Ok(());
    }
    let kernel = std::env::var_os("AGENTVM_TEST_KERNEL").ok_or(
        "set AGENTVM_TEST_KERNEL=$(scripts/build-kernel.sh) (or AGENTVM_TEST_IMAGE to a bundle)",
    )?;
    let bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/x86_64-unknown-linux-gnu/release");
    for b in ["agentvm-guest", "agentvm-harness"] {
        if !bin.join(b).is_file() {
            return Err(format!("no static {b}: run scripts/build-guest.sh first"));
        }
    }
    let src = tempfile::tempdir().map_err(|e| e.to_string())?;
    let reference = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../images/echo/image.toml"),
    )
    .map_err(|e| e.to_string())?;
    let config = reference.split("[build]").next().unwrap().to_owned()
        + &format!(
            "[build]\nkernel = {:?}\nagent = {:?}\nharness_binary = {:?}\n",
            kernel.to_string_lossy(),
            bin.join("agentvm-guest").display().to_string(),
            bin.join("agentvm-harness").display().to_string()
        );
    std::fs::write(src.path().join("image.toml"), config).map_err(|e| e.to_string())?;
    agentvmd::image::build(&src.path().join("image.toml"), &out, &Default::default())
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linux_echo_image_answers_through_the_agent_and_resumes_by_replay() {
    if let Some(reason) = linux_unavailable() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    if let Err(reason) = linux_echo_bundle(&images) {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let binary = vmm_binary();
    let node = start_with(move |cfg| {
        cfg.vmm_binary = Some(binary);
        cfg.image_dir = Some(images);
    })
    .await;
    let mut c = node.c();
    let s = create_for(&mut c, "linux-echo").await;
    assert_eq!(say(&mut c, &s, "hello linux").await, "echo:hello linux");
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    assert!(
        !vm_dir(&node, &s).exists(),
        "a stateless image's VM is stopped"
    );
    assert_eq!(say(&mut c, &s, "again").await, "echo:again");
    verify_chain(&replay(&mut c, &s).await).unwrap();
}

// ---------- confinement ----------

/// The memory cgroup line of `pid` (v1 `N:memory:/path` or v2 `0::/path`).
fn memory_cgroup(pid: i32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    text.lines()
        .find(|l| {
            l.split(':')
                .nth(1)
                .is_some_and(|c| c.split(',').any(|c| c == "memory"))
        })
        .or_else(|| text.lines().find(|l| l.starts_with("0::")))
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmms_run_confined() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let pid = vmm_pid(&node, &s);
    let cgroup = memory_cgroup(pid);
    if cgroup.contains("agentvm-vms") {
        assert!(cgroup.ends_with(&format!("agentvm-vms/{s}")), "{cgroup}");
    } else {
        eprintln!("no memory cgroup on this host: {cgroup}");
    }
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).unwrap();
    assert_ne!(
        ns(&pid.to_string()),
        ns("self"),
        "a network namespace of its own"
    );
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let limit = |name: &str| {
        limits
            .lines()
            .find(|l| l.starts_with(name))
            .map(|l| l.split_whitespace().rev().nth(2).unwrap_or("").to_owned())
            .unwrap_or_default()
    };
    assert_eq!(limit("Max core file size"), "0", "{limits}");
    assert_eq!(limit("Max open files"), "8192", "{limits}");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert_eq!(environ, b"AGENTVM_VMM_LOG=warn\0", "a cleared environment");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let ids = |name: &str| -> Vec<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_default()
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect()
    };
    // A uid and gid of its own (all four of each), no supplementary groups.
    let uid = ids("Uid:")[0];
    assert!(
        uid >= agentvmd::runtime::microvm::DEFAULT_VM_UID_BASE,
        "{status}"
    );
    assert_eq!(ids("Uid:"), vec![uid; 4], "{status}");
    assert_eq!(ids("Gid:"), vec![uid; 4], "{status}");
    assert!(ids("Groups:").is_empty(), "{status}");
    // PID 1 of a PID namespace of its own.
    assert_eq!(ids("NSpid:"), vec![pid as u32, 1], "{status}");
    // Its root: a second session's VMM (another uid) and the daemon's state are not there;
    // its own directory, RAM directory and kernel are, at their usual paths.
    let other = create(&mut c).await;
    assert_eq!(turn(&mut c, &other).await, "1");
    let other_pid = vmm_pid(&node, &other);
    let other_uid = std::fs::read_to_string(format!("/proc/{other_pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("Uid:")
                .map(|v| v.split_whitespace().next().unwrap().to_owned())
        })
        .unwrap();
    assert_ne!(other_uid, uid.to_string(), "two VMMs share a uid");
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let seen = |host: &std::path::Path| root.join(host.strip_prefix("/").unwrap());
    let state = node.dir.join("state");
    assert!(seen(&vm_dir(&node, &s).join("api.sock")).exists());
    // What it started from: its image's template (read-only), or the kernel it booted.
    match std::fs::read_dir(state.join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(TEMPLATE)
        }) {
        Some(template) => assert!(seen(&template).is_dir(), "{}", template.display()),
        None => assert!(seen(&state.join("images/testguest.elf")).is_file()),
    }
    assert!(
        !seen(&vm_dir(&node, &other)).exists(),
        "another VM's directory is visible"
    );
    assert!(
        !seen(&state.join("journal.db")).exists(),
        "the journal is visible"
    );
    assert!(!root.join("etc/passwd").exists(), "/etc is visible");
    let mut vms: Vec<String> = std::fs::read_dir(seen(&state.join("vms")))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    vms.sort();
    assert_eq!(vms, vec![s.clone()]);
    let dev: std::collections::BTreeSet<String> = std::fs::read_dir(root.join("dev"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        dev.iter().all(
            |d| ["kvm", "net", "null", "zero", "urandom", "random", "shm"].contains(&d.as_str())
        ),
        "{dev:?}"
    );
    // /dev/net holds the tun device alone, the VM user's: it attaches to its own tap only.
    let tun = root.join("dev/net/tun");
    if std::path::Path::new("/dev/net/tun").exists() {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&tun).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600, "{}", tun.display());
        assert_ne!(meta.uid(), 0, "/dev/net/tun is the VM user's");
    }
    // Seccomp: every thread under the API filter and its clone3 refusal; vCPU and device
    // threads under a third, narrower one.
    let field = |status: &str, name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_default()
    };
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let status = std::fs::read_to_string(task.join("status")).unwrap();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap();
        assert_eq!(field(&status, "Seccomp:"), "2", "{comm}");
        let filters: u32 = field(&status, "Seccomp_filters:").parse().unwrap();
        // KVM's own worker threads in the process take whichever filters their creator had.
        if comm.starts_with("vcpu") || comm.starts_with("devices") {
            assert_eq!(filters, 3, "{}", comm.trim());
        } else {
            assert!(filters >= 2, "{}", comm.trim());
        }
    }
    // Deleting the session stops the VMM and removes its cgroup.
    c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: s.clone() })
        .await
        .unwrap();
    if let Some(path) = cgroup
        .splitn(3, ':')
        .nth(2)
        .filter(|p| p.contains("agentvm-vms"))
    {
        let dir = std::path::Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while dir.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "{} left behind",
                dir.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_over_its_memory_limit_kills_only_its_vmm() {
    use agentvm_proto::guest::v1::envelope::Body as Guest;
    use agentvmd::runtime::microvm::guest::GuestConn;
    require_kvm!();
    if !std::path::Path::new("/sys/fs/cgroup/memory/cgroup.procs").exists()
        && !std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
    {
        eprintln!("SKIPPED: no cgroup memory controller here");
        return;
    }
    let binary = vmm_binary();
    let node = start_with(move |cfg| {
        cfg.vmm_binary = Some(binary);
        cfg.ram_dir = "/dev/shm".into();
        // 256 MiB guests in 48 MiB: fine until the guest touches more.
        cfg.vmm_memory_limit_mib = Some(48);
    })
    .await;
    let mut c = node.c();
    let greedy = create(&mut c).await;
    let bystander = create(&mut c).await;
    assert_eq!(turn(&mut c, &greedy).await, "1");
    assert_eq!(turn(&mut c, &bystander).await, "1");
    let lost_before = agentvmd::metrics::global().vmm_lost.get();
    // The guest writes 128 MiB of its RAM.
    let mut conn = GuestConn::connect(
        &vm_dir(&node, &greedy).join("vsock.sock"),
        1024,
        Duration::from_secs(30),
        std::sync::Arc::new(|| agentvmd::runtime::microvm::guest::VmmHealth::Running),
    )
    .await
    .unwrap();
    conn.hello().await.unwrap();
    conn.send(Guest::DirtyMemory(agentvm_proto::guest::v1::DirtyMemory {
        mebibytes: 128,
        stamp: 7,
    }))
    .await
    .unwrap();
    wait_cold(
        &mut c,
        &greedy,
        Duration::from_secs(60),
        "the VMM was never killed for its memory",
    )
    .await;
    let records = replay(&mut c, &greedy).await;
    let Some(Body::Lifecycle(lost)) = records.last().and_then(|r| r.event.clone()?.body) else {
        panic!("no record of the loss");
    };
    assert!(
        lost.detail.contains("compute lost") && lost.detail.contains("signal 9"),
        "{}",
        lost.detail
    );
    assert!(agentvmd::metrics::global().vmm_lost.get() > lost_before);
    // The rest of the node carries on.
    assert_eq!(turn(&mut c, &bystander).await, "2");
    verify_chain(&records).unwrap();
}

/// Issue: an input over ~256 KiB broke the test guest's stream ("Broken pipe") after it was
/// journaled. The guest says in Ready how large a frame it reads, and a turn whose Start
/// would not fit is refused before anything is written; the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_larger_than_the_guest_reads_is_refused_before_it_is_journaled() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let before = replay(&mut c, &s).await;
    let big = "x".repeat(300 << 10);
    let status = match c.exec(support::exec_text(s.clone(), big)).await {
        Err(status) => status,
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("a 300 KiB turn on the test guest succeeded"),
                    Err(status) => break status,
                }
            }
        }
    };
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("HistoryTooLarge"), "{status:?}");
    assert_eq!(replay(&mut c, &s).await, before, "nothing was journaled");
    assert_eq!(
        turn(&mut c, &s).await,
        "2",
        "the guest and its count are intact"
    );
}

/// Issue: a draining node (`--shutdown-policy suspend`) suspended one session at a time and
/// left fork children's VMMs running (children read COLD until their first turn). Every
/// VMM is covered now, and each session goes on afterwards from where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_all_covers_fork_children_and_every_session_goes_on() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let parent = create(&mut c).await;
    assert_eq!(turn(&mut c, &parent).await, "1");
    let other = create(&mut c).await;
    assert_eq!(turn(&mut c, &other).await, "1");
    assert_eq!(turn(&mut c, &parent).await, "2");
    let children = fork(&mut c, &parent, 3).await;
    assert_eq!(turn(&mut c, &parent).await, "3", "the parent runs again");
    let all: Vec<&String> = children.iter().chain([&parent, &other]).collect();
    for s in &all {
        assert!(vm_dir(&node, s).exists(), "{s} runs in a VMM of its own");
    }
    let (suspended, failed) = node
        .node
        .host
        .suspend_all(
            Duration::from_secs(60),
            agentvmd::api::auth::node_actor(None, "test"),
        )
        .await;
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(suspended, all.len());
    for s in &all {
        assert!(!vm_dir(&node, s).exists(), "{s}'s VMM still runs");
        assert_eq!(compute(&mut c, s).await, ComputeState::ComputeCold);
    }
    assert_eq!(turn(&mut c, &parent).await, "4");
    assert_eq!(turn(&mut c, &other).await, "2");
    for child in &children {
        assert_eq!(turn(&mut c, child).await, "3", "child {child}");
    }
}

/// Skips (saying why) where a networked microVM cannot run: no KVM, or no way to plumb its
/// network.
macro_rules! require_guest_network {
    () => {
        require_kvm!();
        if let Some(reason) = network_unavailable() {
            eprintln!("SKIPPED: {reason}");
            return;
        }
    };
}

/// Why a guest network cannot be plumbed here, if it cannot (it needs root for namespaces
/// and the tap, /dev/net/tun, and iproute2's `ip`).
fn network_unavailable() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("guest networking needs root".into());
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("there is no /dev/net/tun".into());
    }
    if !std::path::Path::new("/sbin/ip").exists() {
        return Some("there is no /sbin/ip (iproute2)".into());
    }
    None
}

/// Asks the resolver on `gateway` (from inside the network namespace of process `pid`) for
/// `name`'s A record; the response code and the addresses answered.
fn ask_resolver(
    pid: i32,
    gateway: std::net::Ipv4Addr,
    name: &str,
) -> (u8, Vec<std::net::Ipv4Addr>) {
    let namespace = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
    let name = name.to_owned();
    std::thread::spawn(move || {
        nix::sched::setns(&namespace, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let socket = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut query = vec![0xab, 0xcd, 0x01, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            query.push(label.len() as u8);
            query.extend_from_slice(label.as_bytes());
        }
        query.extend_from_slice(&[0, 0, 1, 0, 1]);
        socket.send_to(&query, (gateway, 53)).unwrap();
        let mut reply = [0u8; 512];
        let n = socket.recv(&mut reply).expect("the resolver answers");
        let reply = &reply[..n];
        assert_eq!(&reply[..2], &[0xab, 0xcd], "the query's id");
        let answers = u16::from_be_bytes([reply[6], reply[7]]) as usize;
        let addresses = (0..answers)
            .map(|i| {
                let at = query.len() + i * 16 + 12;
                std::net::Ipv4Addr::new(reply[at], reply[at + 1], reply[at + 2], reply[at + 3])
            })
            .collect();
        (reply[3] & 0x0f, addresses)
    })
    .join()
    .unwrap()
}

/// A node serving `tg-net`: the test guest with a network that allows `localhost:8080`
/// (a name whose answer must open nothing) and `192.0.2.0/24:443` (the returned directory
/// holds the node's files).
async fn networked_node() -> (tempfile::TempDir, TestNode) {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    testguest_bundle_with(
        &images,
        "tg-net",
        "\n[network]\nenabled = true\nallow = [\"localhost:8080\", \"192.0.2.0/24:443\"]\n",
    );
    (dir, bundle_node(images).await)
}

/// The network device of `session`'s VM, as its VMM reports it.
async fn net_of(node: &TestNode, session: &str) -> agentvm_vmm_api::config::NetConfig {
    let api = vm_dir(node, session).join("api.sock");
    let info = agentvm_vmm_api::client::VmmClient::new(api)
        .info()
        .await
        .unwrap();
    info.config.net[0].clone()
}

/// A VM of an image with `[network]` gets a tap in its VMM's namespace, an address of its
/// own and the egress policy on its device; its resolver answers only allowed names; a fork
/// child gets another address and MAC; and everything goes with the sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_networked_vm_gets_its_own_address_policy_and_resolver() {
    require_guest_network!();
    let (_dir, node) = networked_node().await;
    let mut c = node.c();
    let s = create_for(&mut c, "tg-net").await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let net = net_of(&node, &s).await;
    assert_eq!(net.tap, "tap0");
    let policy = net.egress.clone().expect("an egress policy");
    assert_eq!(policy.allow.len(), 1, "the address entry: {policy:?}");
    assert_eq!(policy.allow[0].cidr, "192.0.2.0/24");
    assert_eq!(policy.allow[0].ports.as_deref(), Some("443"));
    // Its record (slot, allow list) is root's, beside the VMM directories, not in the
    // VMM's own, where the VMM could widen its list for the next daemon.
    let vms = vm_dir(&node, &s).parent().unwrap().to_owned();
    let record = vms.join(".networks").join(format!("{s}.json"));
    assert!(record.is_file(), "{}", record.display());
    {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(vms.join(".networks")).unwrap().uid(), 0);
    }
    assert!(!vm_dir(&node, &s).join("network.json").exists());
    let pid = vmm_pid(&node, &s);
    assert_eq!(
        ask_resolver(pid, policy.gateway_ip, "example.com").0,
        5,
        "a name the image does not allow is REFUSED"
    );
    // An allowed name whose answer is not the internet (loopback here; the host, another
    // VM or the metadata address alike) gets no address, and the device no rule for it.
    let (code, addresses) = ask_resolver(pid, policy.gateway_ip, "localhost");
    assert_eq!(code, 0);
    assert!(addresses.is_empty(), "{addresses:?}");
    let after = net_of(&node, &s).await.egress.unwrap();
    assert_eq!(after.allow, policy.allow, "no rule was learned");
    // From the host (routed to every gateway), the resolver answers nothing.
    let host = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    host.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let query = [
        0xab, 0xcd, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 9, b'l', b'o', b'c', b'a', b'l', b'h', b'o',
        b's', b't', 0, 0, 1, 0, 1,
    ];
    host.send_to(&query, (policy.gateway_ip, 53)).unwrap();
    assert!(
        host.recv(&mut [0u8; 512]).is_err(),
        "the resolver answered the host"
    );

    let children = fork(&mut c, &s, 1).await;
    assert_eq!(turn(&mut c, &children[0]).await, "2");
    let child = net_of(&node, &children[0]).await;
    let child_policy = child.egress.clone().unwrap();
    assert_ne!(
        child_policy.guest_ip, policy.guest_ip,
        "a child's own address"
    );
    assert_ne!(child.mac, net.mac, "and MAC");
    assert_eq!(turn(&mut c, &s).await, "2", "the parent runs on");

    // The sessions' namespaces, veths and resolvers go with them. A VM's host veth is
    // named after its slot, the /29 its address is in.
    let veth = |guest: std::net::Ipv4Addr| {
        let slot = (u32::from(guest) - u32::from(std::net::Ipv4Addr::new(10, 77, 0, 0))) / 8;
        std::path::Path::new("/sys/class/net").join(format!("avn{slot}"))
    };
    let ours = [veth(policy.guest_ip), veth(child_policy.guest_ip)];
    let veths = || ours.iter().filter(|v| v.exists()).count();
    assert_eq!(veths(), 2, "{ours:?}");
    for session in children.iter().chain([&s]) {
        c.delete_session(agentvm_proto::v1::DeleteSessionRequest {
            uid: session.clone(),
        })
        .await
        .unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while veths() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "veths left behind: {}",
            veths()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A session narrows its image's egress list with the `agentvm.dev/egress-allow` annotation
/// (its fork children too), and can never widen it: a list that does not parse is refused
/// at create, naming the field; one the image does not cover fails the session's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_narrows_its_image_s_egress_list_and_cannot_widen_it() {
    require_guest_network!();
    let (_dir, node) = networked_node().await;
    let mut c = node.c();
    let create = |allow: &str| {
        let mut c = node.c();
        let allow = allow.to_owned();
        async move {
            c.create_session(agentvm_proto::v1::CreateSessionRequest {
                session: Some(agentvm_proto::v1::Session {
                    harness: "tg-net".into(),
                    annotations: [("agentvm.dev/egress-allow".to_owned(), allow)].into(),
                    ..Default::default()
                }),
            })
            .await
            .map(|r| r.into_inner().metadata.unwrap().uid)
        }
    };
    let policy_of = |session: &str| {
        let node = &node;
        let session = session.to_owned();
        async move { net_of(node, &session).await.egress.unwrap() }
    };

    // Narrowed to the name alone: the address block is gone, the name still resolves.
    let named = create("localhost:8080").await.unwrap();
    assert_eq!(turn(&mut c, &named).await, "1");
    let policy = policy_of(&named).await;
    assert!(policy.allow.is_empty(), "{policy:?}");
    let (code, _) = ask_resolver(vmm_pid(&node, &named), policy.gateway_ip, "localhost");
    assert_eq!(code, 0);

    // Narrowed to nothing: the resolver refuses the image's name, in a fork child too.
    let nothing = create("").await.unwrap();
    assert_eq!(turn(&mut c, &nothing).await, "1");
    let policy = policy_of(&nothing).await;
    let (code, _) = ask_resolver(vmm_pid(&node, &nothing), policy.gateway_ip, "localhost");
    assert_eq!(code, 5);
    let children = fork(&mut c, &nothing, 1).await;
    assert_eq!(turn(&mut c, &children[0]).await, "2");
    let child = policy_of(&children[0]).await;
    let (code, _) = ask_resolver(vmm_pid(&node, &children[0]), child.gateway_ip, "localhost");
    assert_eq!(code, 5, "a fork child keeps its parent's narrowed list");

    // Wider than the image, or not a list at all.
    let wider = create("example.com").await.unwrap();
    let err = try_turn(&mut c, &wider).await.unwrap_err();
    assert!(
        err.message().contains("agentvm.dev/egress-allow")
            && err.message().contains("not within the image"),
        "{err}"
    );
    let err = create("10.0.0.1/8").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message()
            .contains("session.annotations[\"agentvm.dev/egress-allow\"]"),
        "{err}"
    );
    for session in children.iter().chain([&named, &nothing, &wider]) {
        c.delete_session(agentvm_proto::v1::DeleteSessionRequest {
            uid: session.clone(),
        })
        .await
        .unwrap();
    }
}

/// The pooled VMMs waiting in `node`'s run directory: (slot, pid) of each that has started.
fn pooled_vmms(node: &TestNode) -> Vec<(PathBuf, i32)> {
    let run = node.dir.join("state").join("vms");
    std::fs::read_dir(&run)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".pool-"))
        .filter_map(|e| {
            let pid = std::fs::read_to_string(e.path().join("vmm.pid")).ok()?;
            Some((e.path(), pid.trim().parse().ok()?))
        })
        .collect()
}

async fn until_pooled(node: &TestNode, count: usize) -> Vec<(PathBuf, i32)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let pooled = pooled_vmms(node);
        if pooled.len() == count {
            return pooled;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} pooled VMMs, expected {count}",
            pooled.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_start_in_pooled_vmms_and_the_rest_end_with_the_node() {
    const POOL: usize = 2;
    require_kvm!();
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED: the VMM pool holds jailed VMMs, which need root");
        return;
    }
    let binary = vmm_binary();
    let node = start_with(|cfg| {
        cfg.vmm_binary = Some(binary);
        cfg.vmm_pool = POOL;
    })
    .await;
    let mut c = node.c();
    let waiting = until_pooled(&node, POOL).await;
    for (_, pid) in &waiting {
        // Jailed already: a uid of its own, PID 1 of its own PID namespace.
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert!(
            status
                .lines()
                .any(|l| l.starts_with("NSpid:") && l.ends_with("\t1")),
            "{status}"
        );
    }
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let pid = vmm_pid(&node, &s);
    assert!(
        waiting.iter().any(|(_, p)| *p == pid),
        "the session's VMM {pid} is not one the pool held: {waiting:?}"
    );
    let (slot, _) = waiting.iter().find(|(_, p)| *p == pid).unwrap();
    assert!(!slot.exists(), "a claimed VMM's slot stays");
    // It serves the session's own socket now, and answers as that session's VMM.
    assert!(vm_dir(&node, &s).join("api.sock").exists());
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let seen = |host: &std::path::Path| root.join(host.strip_prefix("/").unwrap());
    assert!(
        seen(&vm_dir(&node, &s).join("api.sock")).exists(),
        "its directory is not shown to it"
    );

    // The pool refills; suspend, resume and a fork take from it too.
    let refilled = until_pooled(&node, POOL).await;
    assert!(refilled.iter().all(|(_, p)| *p != pid));
    c.suspend(SuspendRequest { session: s.clone() })
        .await
        .unwrap();
    wait_gone(&vm_dir(&node, &s), "a suspended session's VMM").await;
    let waiting = until_pooled(&node, POOL).await;
    assert_eq!(turn(&mut c, &s).await, "2");
    let resumed = vmm_pid(&node, &s);
    assert!(
        waiting.iter().any(|(_, p)| *p == resumed),
        "the resumed VMM {resumed} is not one the pool held: {waiting:?}"
    );
    let children = fork(&mut c, &s, 3).await;
    for child in &children {
        assert_eq!(turn(&mut c, child).await, "3", "{child}");
    }
    assert_eq!(turn(&mut c, &s).await, "3");

    // The node stops: VMMs no session claimed go with it, and their slots.
    let waiting = until_pooled(&node, POOL).await;
    node.node.host.settle().await;
    for (slot, pid) in waiting {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "pooled VMM {pid} outlived the node"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!slot.exists(), "{} stays", slot.display());
    }
    // Sessions' VMMs are not the pool's to stop.
    assert!(std::path::Path::new(&format!("/proc/{resumed}")).exists());
}

/// Issue: a test-guest session suspended and resumed 150 times held 150 snapshots (27 MiB)
/// until it was deleted. Once a newer SUSPEND is recorded, the snapshots nothing needs go:
/// the store keeps the current snapshot and the layers under it (flattened every few), and
/// a fork child keeps the snapshot it was cloned from however often its parent moves on.
/// (Without turn checkpoints: each keeps the snapshot its VM was resumed from, for as long
/// as retention keeps it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_snapshots_are_reclaimed_and_what_a_child_needs_stays() {
    require_kvm!();
    let node = microvm_node().await;
    let mut c = node.c();
    let s = support::create_annotated(&mut c, "testguest", &[("agentvm.dev/checkpoints", "off")])
        .await
        .unwrap();
    let store = node.dir.join("state/snapshots");
    let snapshots_of = |session: &str| {
        std::fs::read_dir(&store)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with(session))
            .count()
    };
    let mut held = Vec::new();
    for i in 1..=20 {
        assert_eq!(turn(&mut c, &s).await, i.to_string());
        c.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
        held.push(snapshots_of(&s));
    }
    // A restore reads at most FLATTEN_AT (8) layers: that is all a session keeps.
    assert!(held.iter().all(|&n| (1..=8).contains(&n)), "{held:?}");

    let child = fork(&mut c, &s, 1).await.remove(0);
    for i in 21..=30 {
        assert_eq!(turn(&mut c, &s).await, i.to_string());
        c.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
    }
    // The parent's current chain, and the one under the child's clone source: 8 each at most.
    assert!(snapshots_of(&s) <= 16, "{}", snapshots_of(&s));
    // The snapshot the child's FORK record names (what it goes back to, should its VM be
    // lost before it suspends) is the parent's, superseded since, and still there.
    let cloned_from = replay(&mut c, &child)
        .await
        .iter()
        .rev()
        .find_map(|r| match r.event.as_ref()?.body.as_ref()? {
            Body::Lifecycle(l) if l.kind == LifecycleKind::LifecycleFork as i32 => {
                Some(l.snapshot_external_uri.clone())
            }
            _ => None,
        })
        .expect("the child's FORK record");
    let cloned_from = PathBuf::from(cloned_from.strip_prefix("file://").unwrap());
    assert!(cloned_from.starts_with(&store), "{}", cloned_from.display());
    assert!(
        cloned_from.is_dir(),
        "{} was reclaimed",
        cloned_from.display()
    );
    c.suspend(SuspendRequest {
        session: child.clone(),
    })
    .await
    .unwrap();
    assert_eq!(turn(&mut c, &child).await, "21");
    assert_eq!(turn(&mut c, &s).await, "31");
    verify_chain(&replay(&mut c, &s).await).unwrap();
}

/// The node's status, as an operator reads it.
async fn node_status(node: &TestNode) -> agentvm_proto::node::v1::NodeStatus {
    agentvm_proto::node::v1::node_client::NodeClient::new(node.channel().await)
        .get_status(agentvm_proto::node::v1::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// Issue 36: every session of an image starts from its template, the image's VM booted
/// once and saved; each is still its own VM (own counter, own Restored notice, own disk).
/// A changed key part (here the VMM binary) makes a new template, and the old one goes once
/// no session maps it; `cold_boot = true` boots; `image warm` makes one ahead of time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_starts_from_its_image_s_template() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    testguest_bundle_with(&images, "tg-disk", "workspace_mib = 8");
    testguest_bundle_with(&images, "tg-cold", "cold_boot = true");
    let node = bundle_node(images.clone()).await;
    let mut c = node.c();
    let a = create(&mut c).await;
    let b = create(&mut c).await;
    assert_eq!(turn(&mut c, &a).await, "1");
    assert_eq!(turn(&mut c, &a).await, "2");
    assert_eq!(turn(&mut c, &b).await, "1", "b is not a's VM");
    let status = node_status(&node).await;
    assert_eq!(
        status.vm_starts.get(&a).map(String::as_str),
        Some("template")
    );
    assert_eq!(
        status.vm_starts.get(&b).map(String::as_str),
        Some("template")
    );
    let testguest: Vec<_> = status
        .templates
        .iter()
        .filter(|t| t.harness == "testguest")
        .collect();
    assert_eq!(testguest.len(), 1, "one template: {:?}", status.templates);
    let first = testguest[0].clone();
    assert!(first.current && first.sessions == 2, "{first:?}");
    assert!(first.id.starts_with(TEMPLATE), "{first:?}");
    // Each VM was told who it is after its restore, before its first turn.
    for s in [&a, &b] {
        let serial = std::fs::read_to_string(vm_dir(&node, s).join("serial.log")).unwrap();
        assert!(
            serial.contains(agentvm_testguest::markers::RESTORED),
            "{s}: {serial}"
        );
    }
    // A disk image: each session's disk is its own layer over the template's copy.
    let d1 = create_for(&mut c, "tg-disk").await;
    let d2 = create_for(&mut c, "tg-disk").await;
    assert_eq!(turn(&mut c, &d1).await, "1");
    assert_eq!(turn(&mut c, &d2).await, "1");
    assert_ne!(
        std::fs::canonicalize(vm_dir(&node, &d1).join("workspace.img")).unwrap(),
        std::fs::canonicalize(vm_dir(&node, &d2).join("workspace.img")).unwrap()
    );
    // cold_boot: booted, and no template made for it.
    let cold = create_for(&mut c, "tg-cold").await;
    assert_eq!(turn(&mut c, &cold).await, "1");
    let status = node_status(&node).await;
    assert_eq!(
        status.vm_starts.get(&cold).map(String::as_str),
        Some("boot")
    );
    assert!(
        !status.templates.iter().any(|t| t.harness == "tg-cold"),
        "{:?}",
        status.templates
    );
    // Warming: made once, there the second time; a cold_boot image or an unknown one refused.
    let mut nodes = agentvm_proto::node::v1::node_client::NodeClient::new(node.channel().await);
    let warm = |harness: &str| agentvm_proto::node::v1::WarmImageRequest {
        harness: harness.into(),
    };
    let refused = nodes.warm_image(warm("no-such-image")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
    let refused = nodes.warm_image(warm("tg-cold")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains("cold_boot"), "{refused:?}");
    let again = nodes
        .warm_image(warm("testguest"))
        .await
        .unwrap()
        .into_inner();
    assert!(!again.made && again.template == first.id, "{again:?}");
    let made = nodes
        .warm_image(warm("testguest-echo"))
        .await
        .unwrap()
        .into_inner();
    assert!(made.made, "{made:?}");

    // Another VMM binary (the same program with bytes after it): another template.
    let upgraded = dir.path().join("agentvm-vmm-upgraded");
    let mut bytes = std::fs::read(vmm_binary()).unwrap();
    bytes.extend_from_slice(b"\0upgraded");
    std::fs::write(&upgraded, bytes).unwrap();
    std::fs::set_permissions(
        &upgraded,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    for s in [&a, &b, &d1, &d2, &cold] {
        c.delete_session(agentvm_proto::v1::DeleteSessionRequest { uid: s.clone() })
            .await
            .unwrap();
    }
    let node = node
        .restart(move |cfg| {
            cfg.vmm_binary = Some(upgraded);
            cfg.image_dir = Some(images);
            cfg.ram_dir = std::env::temp_dir();
        })
        .await;
    let mut c = node.c();
    let s = create(&mut c).await;
    assert_eq!(turn(&mut c, &s).await, "1");
    let status = node_status(&node).await;
    let now: Vec<_> = status
        .templates
        .iter()
        .filter(|t| t.harness == "testguest")
        .collect();
    assert_eq!(now.len(), 1, "{:?}", status.templates);
    assert_ne!(now[0].id, first.id, "a new VMM makes a new template");
    assert!(
        !node.dir.join("state/snapshots").join(&first.id).exists(),
        "the old template went with its sessions"
    );
}

/// `[vm] checkpoints` in image.toml sets which turns of the image's sessions stay fork
/// points; a session's `agentvm.dev/checkpoints` annotation still overrides it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_sets_its_sessions_checkpoint_retention() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    testguest_bundle_with(&images, "tg-keep2", "checkpoints = \"2\"");
    let node = bundle_node(images).await;
    let mut c = node.c();
    let by_image = create_for(&mut c, "tg-keep2").await;
    let annotated =
        support::create_annotated(&mut c, "tg-keep2", &[("agentvm.dev/checkpoints", "off")])
            .await
            .unwrap();
    for n in 1..=4 {
        assert_eq!(turn(&mut c, &by_image).await, n.to_string());
        assert_eq!(turn(&mut c, &annotated).await, n.to_string());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let turns = loop {
        let turns = checkpointed_turns(&node, &by_image).await;
        if turns == [3, 4] || std::time::Instant::now() > deadline {
            break turns;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(turns, [3, 4], "the image keeps the last 2");
    let none = checkpointed_turns(&node, &annotated).await;
    assert!(none.is_empty(), "the annotation turned them off: {none:?}");
}

/// The turns `session` can be forked at (its checkpoints), oldest first.
async fn checkpointed_turns(node: &TestNode, session: &str) -> Vec<u64> {
    agentvm_proto::node::v1::node_client::NodeClient::new(node.channel().await)
        .list_checkpoints(agentvm_proto::node::v1::ListCheckpointsRequest {
            session: session.to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
        .checkpoints
        .iter()
        .map(|c| c.turn)
        .collect()
}

/// How many VMM boots the process's metrics observed (their histogram's count).
fn vmm_boots_observed() -> f64 {
    let text =
        agentvmd::metrics::exposition::render(agentvmd::metrics::global(), &Default::default());
    text.lines()
        .find_map(|l| l.strip_prefix("agentvm_vmm_boot_seconds_count "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}
