//! Nodes sharing a PostgreSQL journal: real agentvmd processes with state directories of
//! their own, a real PostgreSQL server started by the test. A session is held by one node
//! at a time; the others route calls to it while it beats, and take the session over once
//! its heartbeats stop for a lease (a stateless session continues by replay).

mod support;

use std::time::{Duration, Instant};

use agentvmd::testing::{TestPostgres, TestS3};
use support::daemon::{Daemon, cli, kvm_unavailable, start_daemon_env, vmm_binary};

/// Short for a quick test, long enough that a heartbeat delayed on a loaded machine does not
/// lose a node its sessions.
const LEASE_SECS: u64 = 5;

fn node(dir: &std::path::Path, name: &str, url: &str) -> Daemon {
    node_env(dir, name, url, &[], &[])
}

/// A node of the fleet on journal `url`, with `extra` flags and `env` added.
fn node_env(
    dir: &std::path::Path,
    name: &str,
    url: &str,
    extra: &[&str],
    env: &[(String, String)],
) -> Daemon {
    let lease = LEASE_SECS.to_string();
    let mut args = vec![
        "--journal-url",
        url,
        "--node-name",
        name,
        "--lease-secs",
        &lease,
    ];
    args.extend(extra);
    start_daemon_env(dir, &args, env)
}

/// A node of the fleet running microVMs, publishing snapshots to `snapshot_url`. Two nodes
/// on one host take VM uids from ranges of their own (`uid_base`).
fn microvm_node(
    dir: &std::path::Path,
    name: &str,
    url: &str,
    snapshot_url: &str,
    uid_base: &str,
    extra: &[&str],
    env: &[(String, String)],
) -> Daemon {
    let vmm = vmm_binary();
    let mut args = vec![
        "--vmm-binary",
        vmm.to_str().unwrap(),
        "--snapshot-url",
        snapshot_url,
        "--vm-uid-base",
        uid_base,
    ];
    args.extend(extra);
    node_env(dir, name, url, &args, env)
}

fn postgres() -> Option<TestPostgres> {
    match TestPostgres::start() {
        Ok(server) => Some(server),
        Err(why) => {
            println!("SKIPPED: no PostgreSQL server to test against: {why}");
            None
        }
    }
}

/// What microVM nodes of one fleet share: a fresh database on a test PostgreSQL server and
/// a shared snapshot directory. `None` (the reason printed) without KVM or PostgreSQL.
struct MicrovmFleet {
    _server: TestPostgres,
    url: String,
    store: SharedStore,
    snapshot_url: String,
}

impl MicrovmFleet {
    fn start(db: &str) -> Option<Self> {
        if let Some(why) = kvm_unavailable() {
            println!("SKIPPED: {why}");
            return None;
        }
        let server = postgres()?;
        server.create_database(db).unwrap();
        let store = SharedStore::Dir(tempfile::tempdir().unwrap());
        Some(Self {
            url: server.url(db),
            snapshot_url: store.url(),
            store,
            _server: server,
        })
    }

    /// A node of it, with `extra` flags.
    fn node(&self, dir: &std::path::Path, name: &str, uid_base: &str, extra: &[&str]) -> Daemon {
        microvm_node(
            dir,
            name,
            &self.url,
            &self.snapshot_url,
            uid_base,
            extra,
            &[],
        )
    }
}

/// Creates a session of `harness` through `d`; its uid.
fn create_on(d: &Daemon, harness: &str) -> String {
    let (ok, out, err) = cli(d, &["--json", "create", "--harness", harness]);
    assert!(ok, "{err}");
    let created: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    created["metadata"]["uid"].as_str().unwrap().to_owned()
}

fn exec(d: &Daemon, uid: &str, input: &str) -> (bool, String, String) {
    cli(d, &["exec", "--session", uid, "-i", input])
}

/// Two nodes on a fresh journal database, and an echo session node-a created and ran a
/// turn of ("echo:hello"). Bound in this order, they drop nodes first, server last.
struct TwoNodes {
    server: TestPostgres,
    url: String,
    dir_a: tempfile::TempDir,
    dir_b: tempfile::TempDir,
    a: Daemon,
    b: Daemon,
    uid: String,
}

fn two_nodes(db: &str) -> Option<TwoNodes> {
    let server = postgres()?;
    server.create_database(db).unwrap();
    let url = server.url(db);
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = node(dir_a.path(), "node-a", &url);
    let b = node(dir_b.path(), "node-b", &url);
    let uid = create_on(&a, "echo");
    let (ok, out, err) = exec(&a, &uid, "hello");
    assert!(ok && out.contains("echo:hello"), "{out}{err}");
    Some(TwoNodes {
        server,
        url,
        dir_a,
        dir_b,
        a,
        b,
        uid,
    })
}

#[test]
fn a_session_moves_to_another_node_only_when_its_holder_is_gone() {
    let Some(TwoNodes {
        server: _server,
        url,
        dir_a,
        dir_b: _dir_b,
        a,
        b,
        uid,
    }) = two_nodes("fleet")
    else {
        return;
    };

    // Every node reads every session; node-b is told where the session lives.
    let (ok, out, err) = cli(&b, &["get", &uid]);
    assert!(ok, "{err}");
    assert!(out.contains(&uid), "{out}");
    let (ok, _, err) = exec(&b, &uid, "too soon");
    assert!(!ok, "node-b ran a turn of a session node-a holds");
    assert!(
        err.contains("HeldByAnotherNode") && err.contains("node-a") && err.contains(&a.addr()),
        "{err}"
    );
    let (ok, out, err) = cli(&b, &["node", "list"]);
    assert!(ok, "{err}");
    for (name, node) in [("node-a", &a), ("node-b", &b)] {
        let line = out
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing:\n{out}"));
        assert!(
            line.contains(" yes ") && line.contains(&node.addr()),
            "{line}"
        );
    }

    // node-a dies; once its lease runs out node-b takes the session over and replays it.
    drop(a);
    let died = Instant::now();
    let moved = loop {
        let (ok, out, err) = exec(&b, &uid, "again");
        if ok {
            break out;
        }
        assert!(err.contains("HeldByAnotherNode"), "{err}");
        assert!(
            died.elapsed() < Duration::from_secs(LEASE_SECS * 4),
            "node-b never took the session over: {err}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(moved.contains("echo:again"), "{moved}");
    assert!(
        died.elapsed() >= Duration::from_secs(LEASE_SECS) - Duration::from_millis(500),
        "taken over after {:?}, before node-a's lease ran out",
        died.elapsed()
    );
    let (ok, out, err) = cli(&b, &["verify", &uid]);
    assert!(ok && out.contains("chain intact"), "{out}{err}");

    // node-a comes back: the session is node-b's now, and node-a says so.
    let a = node(dir_a.path(), "node-a", &url);
    let (ok, _, err) = exec(&a, &uid, "mine?");
    assert!(!ok && err.contains("node-b"), "{err}");
    let (ok, out, err) = exec(&b, &uid, "still here");
    assert!(ok && out.contains("echo:still here"), "{out}{err}");

    // Draining node-b (asked through node-a) hands the session back to the fleet at once.
    let (ok, out, err) = cli(&a, &["node", "drain", "node-b"]);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("1 suspended") && out.contains("released"),
        "{out}"
    );
    let (ok, _, err) = exec(&b, &uid, "on a draining node");
    assert!(!ok && err.contains("NodeDraining"), "{err}");

    // Released, it goes to whichever node asks first: of two asking at once, one runs the
    // turn; the other is told who holds the session, or (when it got as far as a fence the
    // winner then superseded) its turn is aborted.
    let dir_c = tempfile::tempdir().unwrap();
    let c = node(dir_c.path(), "node-c", &url);
    let (from_a, from_c) = std::thread::scope(|s| {
        let on_a = s.spawn(|| exec(&a, &uid, "raced on a"));
        let on_c = s.spawn(|| exec(&c, &uid, "raced on c"));
        (on_a.join().unwrap(), on_c.join().unwrap())
    });
    let winners = [&from_a, &from_c].iter().filter(|r| r.0).count();
    assert_eq!(winners, 1, "a: {from_a:?}\nc: {from_c:?}");
    let loser = if from_a.0 { &from_c } else { &from_a };
    assert!(
        loser.2.contains("HeldByAnotherNode") || loser.2.contains("Aborted"),
        "{}",
        loser.2
    );
    let (ok, out, err) = cli(&c, &["replay", &uid]);
    assert!(ok, "{err}");
    for turn in ["echo:hello", "echo:again", "echo:still here"] {
        assert!(out.contains(turn), "{turn} missing from:\n{out}");
    }
    let raced = ["echo:raced on a", "echo:raced on c"]
        .iter()
        .filter(|t| out.contains(*t))
        .count();
    assert_eq!(raced, 1, "{out}");
    let (ok, out, err) = cli(&c, &["verify", &uid]);
    assert!(ok && out.contains("chain intact"), "{out}{err}");
}

/// The fleet's snapshot store under test: a shared directory or an S3-compatible server.
enum SharedStore {
    Dir(tempfile::TempDir),
    S3(TestS3),
}

impl SharedStore {
    fn url(&self) -> String {
        match self {
            Self::Dir(dir) => format!("file://{}", dir.path().display()),
            Self::S3(server) => server.url("fleet"),
        }
    }

    fn env(&self) -> Vec<(String, String)> {
        match self {
            Self::Dir(_) => Vec::new(),
            Self::S3(server) => server.env(),
        }
    }

    /// Makes the store unreachable; `reconnect` undoes it.
    fn cut(&mut self) {
        match self {
            Self::Dir(dir) => {
                std::fs::rename(dir.path(), dir.path().with_extension("away")).unwrap()
            }
            Self::S3(server) => server.pause(),
        }
    }

    fn reconnect(&mut self) {
        match self {
            Self::Dir(dir) => {
                std::fs::rename(dir.path().with_extension("away"), dir.path()).unwrap()
            }
            Self::S3(server) => server.resume().unwrap(),
        }
    }

    /// The names of the archives the store holds.
    fn published(&self) -> Vec<String> {
        match self {
            Self::Dir(dir) => std::fs::read_dir(dir.path())
                .unwrap()
                .filter_map(|e| e.ok())
                .flat_map(|session| std::fs::read_dir(session.path()).unwrap())
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
            Self::S3(server) => server.objects(),
        }
    }
}

/// The file name of a published archive.
fn archive_name(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or(key)
}

/// Whether a published archive is an image's template (the fleet keeps it while an image
/// has it, whatever becomes of sessions).
fn is_template(key: &str) -> bool {
    archive_name(key).starts_with(agentvmd::runtime::microvm::templates::ID_PREFIX)
}

/// Published archives of sessions: the suspends' snapshots, and the turns' checkpoints.
fn suspends_and_checkpoints(published: Vec<String>) -> (Vec<String>, Vec<String>) {
    let (checkpoints, suspends) = published
        .into_iter()
        .filter(|key| !is_template(key))
        .partition(|key| archive_name(key).starts_with("ckpt."));
    (suspends, checkpoints)
}

/// The snapshots a node's store holds.
fn stored(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir.join("state/snapshots"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        // A node's templates are its own, kept for its next sessions.
        .filter(|name| {
            !name.starts_with('.')
                && !name.starts_with(agentvmd::runtime::microvm::templates::ID_PREFIX)
        })
        .collect()
}

/// The counter harness keeps its count only in guest RAM: suspended on node-a, whose
/// snapshot goes to the fleet's shared store, it answers its next turn on node-b from
/// where it was, restored from that snapshot. A suspend that cannot publish (the store
/// unreachable) fails, says why, and leaves the VM running. Suspended again on node-b, it
/// is published as a layer on node-a's archive (only what changed travels), and its forks
/// on node-a fetch only that layer. Deleted, the session and its children leave no
/// archive in the fleet's store and no snapshot on either node.
fn a_memory_session_moves_through(mut store: SharedStore, db: &str) {
    if let Some(why) = kvm_unavailable() {
        println!("SKIPPED: {why}");
        return;
    }
    let Some(server) = postgres() else { return };
    server.create_database(db).unwrap();
    let url = server.url(db);
    let snapshot_url = store.url();
    let env = store.env();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let node = |dir: &std::path::Path, name: &str, uid_base: &str| {
        microvm_node(
            dir,
            name,
            &url,
            &snapshot_url,
            uid_base,
            &["--snapshot-sweep-secs", "1"],
            &env,
        )
    };
    let a = node(dir_a.path(), "node-a", "1879048192");
    let b = node(dir_b.path(), "node-b", "1879179264");
    let uid = create_on(&a, "testguest");
    let count = |d: &Daemon| -> String {
        let (ok, out, err) = exec(d, &uid, "tick");
        assert!(ok, "{out}{err}");
        out
    };
    let first = count(&a);
    store.cut();
    let (ok, out, err) = cli(&a, &["suspend", &uid]);
    store.reconnect();
    assert!(!ok && err.contains("publishing"), "{out}{err}");
    let (ok, out, err) = cli(&a, &["get", &uid]);
    assert!(ok && out.contains("compute=LIVE"), "{out}{err}");
    let second = count(&a);
    let (ok, out, err) = cli(&a, &["suspend", &uid]);
    assert!(ok && out.contains("compute=COLD"), "{out}{err}");
    // The suspend's snapshot, and the checkpoints of both turns with it (the second a layer
    // on the first): node-b could fork it at either turn.
    let (published, checkpoints) = suspends_and_checkpoints(store.published());
    assert!(
        published.len() == 1 && published[0].ends_with(".agvmsnap"),
        "{published:?}"
    );
    assert!(
        checkpoints.len() == 2 && checkpoints.iter().any(|name| name.contains('@')),
        "{checkpoints:?}"
    );
    let third = count(&b);
    assert!(
        first.contains("assistant: 1") && second.contains("assistant: 2"),
        "{first}\n{second}"
    );
    assert!(
        third.contains("assistant: 3"),
        "node-b did not go on from node-a's count:\n{third}"
    );
    let (ok, out, err) = cli(&b, &["verify", &uid]);
    assert!(ok && out.contains("chain intact"), "{out}{err}");
    // node-a is told the session is node-b's now.
    let (ok, _, err) = exec(&a, &uid, "tick");
    assert!(!ok && err.contains("node-b"), "{err}");
    // Suspended on node-b, it forks on node-a: every child restores the snapshot node-b
    // published, which node-a fetches once, and goes on from node-b's count.
    let (ok, out, err) = cli(&b, &["suspend", &uid]);
    assert!(ok && out.contains("compute=COLD"), "{out}{err}");
    let (published, checkpoints) = suspends_and_checkpoints(store.published());
    assert!(
        published.len() == 2 && published.iter().any(|name| name.contains('@')),
        "node-b's snapshot was not published as a layer: {published:?}"
    );
    assert_eq!(checkpoints.len(), 3, "node-b's turn too: {checkpoints:?}");
    let (ok, out, err) = cli(&a, &["--json", "fork", &uid, "--count", "3"]);
    assert!(ok, "{out}{err}");
    let children: Vec<String> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|c| c["metadata"]["uid"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(children.len(), 3, "{out}");
    for child in &children {
        let (ok, out, err) = exec(&a, child, "tick");
        assert!(ok && out.contains("assistant: 4"), "{child}: {out}{err}");
    }

    // Deleted through node-a (the fork took the parent there), the sessions' snapshots go
    // from both nodes and from the fleet's store: node-b's copies by node-b's own sweep.
    for session in children.iter().chain([&uid]) {
        let (ok, out, err) = cli(&a, &["delete", session]);
        assert!(ok, "deleting {session}: {out}{err}");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (suspends, checkpoints) = suspends_and_checkpoints(store.published());
        let left = (
            [suspends, checkpoints].concat(),
            stored(dir_a.path()),
            stored(dir_b.path()),
        );
        if left.0.is_empty() && left.1.is_empty() && left.2.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left after deleting (fleet store, node-a, node-b): {left:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_memory_session_moves_through_a_shared_directory() {
    a_memory_session_moves_through(SharedStore::Dir(tempfile::tempdir().unwrap()), "fleet_dir");
}

#[test]
fn a_memory_session_moves_through_an_s3_bucket() {
    match TestS3::start() {
        Ok(server) => a_memory_session_moves_through(SharedStore::S3(server), "fleet_s3"),
        Err(why) => println!("SKIPPED: no S3-compatible server to test against: {why}"),
    }
}

/// Processes under `dir` (a node's state) serving `session`: its harness, on the process
/// runtime.
fn serving(dir: &std::path::Path, session: &str) -> usize {
    let dir = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|cmdline| String::from_utf8_lossy(&cmdline).replace('\0', " "))
        .filter(|args| args.contains(&dir) && args.contains(session) && args.contains("--listen"))
        .count()
}

fn signal(d: &Daemon, name: &str) {
    let sent = std::process::Command::new("kill")
        .args([format!("-{name}"), d.child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// A node that stops beating (here: stopped with SIGSTOP, as a long pause or a partition
/// would) loses its session to another node after a lease; once it runs again it stops its
/// own compute of that session rather than run it beside the new holder's.
#[test]
fn a_node_that_missed_its_heartbeats_lets_go_of_what_was_taken() {
    let Some(TwoNodes {
        server: _server,
        url: _url,
        dir_a,
        dir_b,
        a,
        b,
        uid,
    }) = two_nodes("paused")
    else {
        return;
    };
    assert_eq!(serving(dir_a.path(), &uid), 1, "node-a runs the harness");

    signal(&a, "STOP");
    let paused = Instant::now();
    loop {
        let (ok, out, err) = exec(&b, &uid, "again");
        if ok {
            assert!(out.contains("echo:again"), "{out}");
            break;
        }
        assert!(
            paused.elapsed() < Duration::from_secs(LEASE_SECS * 4),
            "node-b never took the session over: {err}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    signal(&a, "CONT");
    let resumed = Instant::now();
    while serving(dir_a.path(), &uid) > 0 {
        assert!(
            resumed.elapsed() < Duration::from_secs(LEASE_SECS * 3),
            "node-a still runs the session node-b took"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, _, err) = exec(&a, &uid, "mine?");
    assert!(!ok && err.contains("node-b"), "{err}");
    assert_eq!(serving(dir_b.path(), &uid), 1, "node-b runs it");
}

/// The journal's server crashes and comes back while nodes run: every turn acknowledged
/// before is in the log, and turns go on through the same nodes.
#[test]
fn a_journal_server_crash_loses_no_acknowledged_turn() {
    let Some(server) = postgres() else { return };
    server.create_database("pg_crash").unwrap();
    let url = server.url("pg_crash");
    let dir = tempfile::tempdir().unwrap();
    let a = node(dir.path(), "node-a", &url);
    let uid = create_on(&a, "echo");
    for n in 0..3 {
        let (ok, out, err) = exec(&a, &uid, &format!("before {n}"));
        assert!(
            ok && out.contains(&format!("echo:before {n}")),
            "{out}{err}"
        );
    }
    server.restart_after_crash().unwrap();
    let (ok, out, err) = exec(&a, &uid, "after");
    assert!(ok && out.contains("echo:after"), "{out}{err}");
    let (ok, out, err) = cli(&a, &["replay", &uid]);
    assert!(ok, "{err}");
    for turn in [
        "echo:before 0",
        "echo:before 1",
        "echo:before 2",
        "echo:after",
    ] {
        assert!(out.contains(turn), "{turn} missing from:\n{out}");
    }
    let (ok, out, err) = cli(&a, &["verify", &uid]);
    assert!(ok && out.contains("chain intact"), "{out}{err}");
}

/// Issue 34 (item 2): after kill -9 of the node running a memory session and a takeover by
/// another, the restarted node left the session's VMM running, serving nothing, and the
/// takeover recorded the lost turn as a completed suspend. The new holder records the loss,
/// naming the seq the session goes back to, and the restarted node stops its VMM at start.
#[test]
fn a_node_restarted_after_a_takeover_stops_the_vmm_it_lost() {
    let Some(fleet) = MicrovmFleet::start("takeover") else {
        return;
    };
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let node =
        |dir: &std::path::Path, name: &str, uid_base: &str| fleet.node(dir, name, uid_base, &[]);
    let a = node(dir_a.path(), "node-a", "1879048192");
    let mut b = node(dir_b.path(), "node-b", "1879179264");
    let uid = create_on(&b, "testguest");
    let count = |d: &Daemon| -> String {
        let (ok, out, err) = exec(d, &uid, "tick");
        assert!(ok, "{out}{err}");
        out
    };
    assert!(count(&b).contains("assistant: 1"));
    let (ok, out, err) = cli(&b, &["suspend", &uid]);
    assert!(ok && out.contains("compute=COLD"), "{out}{err}");
    assert!(count(&b).contains("assistant: 2"));
    let pid_file = dir_b.path().join("state/vms").join(&uid).join("vmm.pid");
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let _ = b.child.kill();
    let _ = b.child.wait();
    let died = Instant::now();
    let taken = loop {
        let (ok, out, err) = exec(&a, &uid, "tick");
        if ok {
            break out;
        }
        assert!(
            died.elapsed() < Duration::from_secs(LEASE_SECS * 4),
            "node-a never took the session over: {err}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    // Count 2 lived only in node-b's VM: node-a goes on from the suspended count.
    assert!(taken.contains("assistant: 2"), "{taken}");
    let (ok, out, err) = cli(&a, &["--json", "replay", &uid]);
    assert!(ok, "{err}");
    let records: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let lifecycle: Vec<String> = records
        .iter()
        .filter_map(|r| {
            r["event"]["lifecycle"]["detail"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert!(
        lifecycle.iter().any(|d| d.contains("compute lost")),
        "the lost turn is not recorded as lost: {lifecycle:?}"
    );
    assert!(
        !lifecycle.iter().any(|d| d.contains("suspend completed")),
        "a loss recorded as a suspend: {lifecycle:?}"
    );

    let alive =
        |pid: i32| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty());
    assert!(alive(pid), "node-b's VMM outlives its daemon");
    let b = node(dir_b.path(), "node-b", "1879179264");
    let restarted = Instant::now();
    while alive(pid) {
        assert!(
            restarted.elapsed() < Duration::from_secs(LEASE_SECS * 3),
            "the restarted node-b left the VMM of the session node-a took"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, _, err) = exec(&b, &uid, "tick");
    assert!(!ok && err.contains("node-a"), "{err}");
}

/// Issue 36 item 4: a node publishes its image's template to the fleet's store at its
/// sweep, says so in its heartbeat, and another node whose image has the same key fetches
/// it instead of booting a template VM of its own.
#[test]
fn a_template_made_on_one_node_is_fetched_by_another() {
    let Some(fleet) = MicrovmFleet::start("fleet_templates") else {
        return;
    };
    let store = &fleet.store;
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let node = |dir: &std::path::Path, name: &str, uid_base: &str| {
        fleet.node(dir, name, uid_base, &["--snapshot-sweep-secs", "1"])
    };
    let a = node(dir_a.path(), "node-a", "1879048192");
    let first = create_on(&a, "testguest");
    let (ok, out, err) = exec(&a, &first, "tick");
    assert!(ok && out.contains("assistant: 1"), "{out}{err}");
    // Published at node-a's next sweep; its next heartbeat says where.
    let deadline = Instant::now() + Duration::from_secs(60);
    let published = loop {
        let (ok, out, err) = cli(&a, &["--json", "node", "list"]);
        assert!(ok, "{err}");
        let fleet: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let published = fleet["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| {
                let status = n["statusJson"].as_str().or(n["status_json"].as_str())?;
                serde_json::from_str::<serde_json::Value>(status).ok()
            })
            .flat_map(|status| status["templates"].as_array().cloned().unwrap_or_default())
            .find_map(|t| {
                t["published"]
                    .as_str()
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned)
            });
        if let Some(published) = published {
            break published;
        }
        assert!(
            Instant::now() < deadline,
            "node-a never published its template: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(published.contains("#sha256="), "pinned: {published}");
    assert_eq!(
        store.published().iter().filter(|k| is_template(k)).count(),
        1
    );

    // node-b starts its first session from node-a's template: fetched, not made.
    let b = node(dir_b.path(), "node-b", "1879179264");
    let second = create_on(&b, "testguest");
    let (ok, out, err) = exec(&b, &second, "tick");
    assert!(ok && out.contains("assistant: 1"), "{out}{err}");
    let log = std::fs::read_to_string(dir_b.path().join("agentvmd.log")).unwrap();
    assert!(log.contains("template fetched from the fleet"), "{log}");
    assert!(
        !log.contains("template made"),
        "node-b booted a template VM:\n{log}"
    );
    let (ok, out, err) = cli(&b, &["--json", "node", "status"]);
    assert!(ok, "{err}");
    let status: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let starts = &status["vmStarts"];
    let starts = if starts.is_null() {
        &status["vm_starts"]
    } else {
        starts
    };
    assert_eq!(starts[&second], "template", "{status}");
    for (d, s) in [(&a, &first), (&b, &second)] {
        let (ok, out, err) = cli(d, &["delete", s]);
        assert!(ok, "{out}{err}");
    }
}
