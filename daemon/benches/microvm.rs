//! Sessions on microVMs, measured through the Sessions API with the test guest's counter:
//! first turn (create → VM booted → answered), warm turn latency, suspend, resume → first
//! event, fork fan-out 1/16/64/128 → every child answered, memory per idle session and
//! sessions per GiB, and density: host memory (MemAvailable) and page cache per idle
//! session for 200 booted, resumed and forked sessions, and (where PostgreSQL is installed)
//! a counter suspended on one node of a fleet resuming on another. Prints a table and
//! writes the figures as JSON (`AGENTVM_BENCH_JSON`, default `target/bench-microvm.json`).
//!
//! `cargo build --release -p agentvm-vmm && cargo bench -p agentvmd --bench microvm`
//! (the VMM is taken from beside this benchmark; `AGENTVM_VMM_BIN` overrides it).

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use agentvm_proto::v1::sessions_client::SessionsClient;
use agentvm_proto::v1::{DeleteSessionRequest, ForkRequest, SuspendRequest};
use serde_json::json;
use tonic::transport::Channel;

fn stats(
    name: &str,
    unit: &str,
    mut xs: Vec<f64>,
    out: &mut serde_json::Map<String, serde_json::Value>,
) {
    xs.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
    println!(
        "{name:<44} min {:>8.2}  p50 {:>8.2}  p99 {:>8.2}  max {:>8.2}  {unit}  (n={})",
        xs[0],
        pick(0.5),
        pick(0.99),
        xs[xs.len() - 1],
        xs.len()
    );
    out.insert(
        name.to_owned(),
        json!({"unit": unit, "n": xs.len(), "min": xs[0], "p50": pick(0.5), "p99": pick(0.99), "max": xs[xs.len() - 1]}),
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

async fn create(c: &mut SessionsClient<Channel>) -> String {
    support::create_for(c, "testguest").await
}

/// One turn; returns (time to the first record, time to the end of the stream).
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

/// One test-guest session (memory tier) run to `turns` turns, its turn latency at marks
/// along the way (the 11 turns ending at each mark): a turn must cost the same at turn 2,000
/// as at turn 10.
async fn long_session(
    c: &mut SessionsClient<Channel>,
    turns: usize,
    out: &mut serde_json::Map<String, serde_json::Value>,
) {
    let s = create(c).await;
    let mut latency = Vec::with_capacity(turns);
    for _ in 0..turns {
        latency.push(ms(turn(c, &s).await.1));
    }
    let mut medians = Vec::new();
    for mark in [10, 100, 500, 1000, 2000, turns] {
        if mark > turns || medians.iter().any(|(m, _)| *m == mark) {
            continue;
        }
        let mut window = latency[mark.saturating_sub(11)..mark].to_vec();
        window.sort_by(|a, b| a.total_cmp(b));
        medians.push((mark, window[window.len() / 2]));
        stats(
            &format!("long session (testguest), turn {mark}"),
            "ms",
            window,
            out,
        );
    }
    if let (Some((_, first)), Some((last, at_last))) = (medians.first(), medians.last()) {
        let ratio = at_last / first;
        println!(
            "{:<44} {ratio:>8.2}  (median turn {last} / median turn 10)",
            "long session (testguest), growth"
        );
        out.insert("long_session_growth".into(), json!(ratio));
    }
    c.delete_session(DeleteSessionRequest { uid: s })
        .await
        .unwrap();
}

/// Bytes on disk under `dir` (regular files, not following links).
fn bytes_under(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            // What the file takes on disk (memory files are sparse).
            Ok(t) if t.is_file() => e
                .metadata()
                .map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512),
            _ => 0,
        })
        .sum()
}

/// One test-guest session suspended and resumed `cycles` times (a turn between): what its
/// snapshots take in the store after the first suspend and after the last, and its resume
/// time early and late. Neither may grow with the number of suspends.
async fn suspend_cycles(
    c: &mut SessionsClient<Channel>,
    state: &std::path::Path,
    cycles: usize,
    out: &mut serde_json::Map<String, serde_json::Value>,
) {
    let s = create(c).await;
    let store = state.join("snapshots");
    let stored = || -> u64 {
        std::fs::read_dir(&store)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(s.as_str()))
            .map(|e| bytes_under(&e.path()))
            .sum()
    };
    turn(c, &s).await;
    let mut resumes = Vec::with_capacity(cycles);
    let mut most = 0;
    let mut first = 0;
    for i in 0..cycles {
        c.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
        let now = stored();
        if i == 0 {
            first = now;
        }
        most = most.max(now);
        resumes.push(ms(turn(c, &s).await.0));
    }
    let last = stored();
    // Median resume by tenth of the run: flat, or it grows with the suspends.
    let tenths: Vec<String> = resumes
        .chunks(cycles.div_ceil(10).max(1))
        .map(|chunk| {
            let mut c = chunk.to_vec();
            c.sort_by(|a, b| a.total_cmp(b));
            format!("{:.1}", c[c.len() / 2])
        })
        .collect();
    println!(
        "{:<44} {} ms (median of each tenth of the run)",
        "suspend cycles, resume -> first event",
        tenths.join(" ")
    );
    let window = cycles.min(11);
    stats(
        "suspend cycles, resume -> first event, first",
        "ms",
        resumes[..window].to_vec(),
        out,
    );
    stats(
        &format!("suspend cycles, resume -> first event, last {window}"),
        "ms",
        resumes[cycles - window..].to_vec(),
        out,
    );
    let kib = |b: u64| b as f64 / 1024.0;
    println!(
        "{:<44} first suspend {:>8.0} KiB, most {:>8.0} KiB ({:.2}x), after {cycles}: {:>8.0} KiB",
        "suspend cycles, stored",
        kib(first),
        kib(most),
        most as f64 / first.max(1) as f64,
        kib(last),
    );
    out.insert(
        "suspend_cycles_stored".into(),
        json!({"cycles": cycles, "first_kib": kib(first), "most_kib": kib(most), "last_kib": kib(last)}),
    );
    c.delete_session(DeleteSessionRequest { uid: s })
        .await
        .unwrap();
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// PSS (MiB) of the VMM processes serving `sessions`.
fn pss_mib(state: &std::path::Path, sessions: &[String]) -> Vec<f64> {
    sessions
        .iter()
        .filter_map(|s| {
            let pid = std::fs::read_to_string(state.join("vms").join(s).join("vmm.pid")).ok()?;
            let rollup =
                std::fs::read_to_string(format!("/proc/{}/smaps_rollup", pid.trim())).ok()?;
            rollup
                .lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
                .map(|kib| kib / 1024.0)
        })
        .collect()
}

/// (MemAvailable, Cached) of the host, in MiB.
fn meminfo_mib() -> (f64, f64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kib| kib.parse::<f64>().ok())
            .map_or(0.0, |kib| kib / 1024.0)
    };
    (field("MemAvailable:"), field("Cached:"))
}

/// Runs `each` over `items`, eight at a time.
async fn eight_at_a_time<T, F, Fut>(items: Vec<T>, each: F)
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use futures_util::StreamExt;
    futures_util::stream::iter(items)
        .for_each_concurrent(8, each)
        .await;
}

/// One turn in each of `sessions`, eight at a time.
async fn turn_each(c: &SessionsClient<Channel>, sessions: Vec<String>) {
    eight_at_a_time(sessions, |s| {
        let mut c = c.clone();
        async move {
            turn(&mut c, &s).await;
        }
    })
    .await;
}

/// Per session, the host memory (MemAvailable) and page cache `n` sessions took between two
/// `meminfo_mib` readings.
fn per_session(n: usize, before: (f64, f64), after: (f64, f64)) -> (f64, f64) {
    (
        (before.0 - after.0) / n as f64,
        (after.1 - before.1) / n as f64,
    )
}

fn report_density(
    out: &mut serde_json::Map<String, serde_json::Value>,
    phase: &str,
    n: usize,
    (memory, cache): (f64, f64),
) {
    println!(
        "{:<44} {:>8.2} MiB host memory each, {:>8.2} MiB page cache each  (n={n})",
        format!("density: {phase}"),
        memory,
        cache
    );
    out.insert(
        format!("density_{phase}"),
        json!({"n": n, "host_mib_each": memory, "page_cache_mib_each": cache}),
    );
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// `n` new sessions, each having answered a turn, and what they took per session.
async fn fresh_sessions(c: &SessionsClient<Channel>, n: usize) -> (Vec<String>, (f64, f64)) {
    settle().await;
    let start = meminfo_mib();
    let mut sessions = Vec::with_capacity(n);
    for _ in 0..n {
        sessions.push(create(&mut c.clone()).await);
    }
    turn_each(c, sessions.clone()).await;
    settle().await;
    (sessions, per_session(n, start, meminfo_mib()))
}

async fn delete_all(c: &SessionsClient<Channel>, sessions: Vec<String>) {
    eight_at_a_time(sessions, |s| {
        let mut c = c.clone();
        async move {
            c.delete_session(DeleteSessionRequest { uid: s })
                .await
                .unwrap();
        }
    })
    .await;
}

/// Host memory per idle session for `n` fresh sessions (from the image's template), the
/// same resumed, and `n` fork children.
async fn density(
    c: &SessionsClient<Channel>,
    n: usize,
    out: &mut serde_json::Map<String, serde_json::Value>,
) {
    let (sessions, fresh) = fresh_sessions(c, n).await;
    report_density(out, "fresh_template", n, fresh);
    eight_at_a_time(sessions.clone(), |s| {
        let mut c = c.clone();
        async move {
            c.suspend(SuspendRequest { session: s }).await.unwrap();
        }
    })
    .await;
    settle().await;
    let suspended = meminfo_mib();
    turn_each(c, sessions.clone()).await;
    settle().await;
    report_density(out, "resumed", n, per_session(n, suspended, meminfo_mib()));

    let parent = sessions[0].clone();
    let mut children = Vec::with_capacity(n);
    let before_fork = meminfo_mib();
    while children.len() < n {
        let count = (n - children.len()).min(128) as i32;
        let forked = c
            .clone()
            .fork(ForkRequest {
                session: parent.clone(),
                count,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .children;
        children.extend(forked.into_iter().map(|s| s.metadata.unwrap().uid));
    }
    turn_each(c, children.clone()).await;
    settle().await;
    report_density(out, "forked", n, per_session(n, before_fork, meminfo_mib()));
    delete_all(c, sessions.into_iter().chain(children).collect()).await;
}

/// The same image on a node without templates: every session boots it. Reports create →
/// first turn answered, and the host memory of `n` fresh idle sessions, beside the template
/// node's figures.
async fn booting(
    binary: &std::path::Path,
    runs: usize,
    n: usize,
    out: &mut serde_json::Map<String, serde_json::Value>,
) {
    let node = support::start_with(|cfg| {
        cfg.vmm_binary = Some(binary.to_owned());
        cfg.ram_dir = "/dev/shm".into();
        cfg.templates = false;
    })
    .await;
    let c = node.c();
    let mut first_turn = Vec::new();
    for _ in 0..runs {
        let s = create(&mut c.clone()).await;
        first_turn.push(ms(turn(&mut c.clone(), &s).await.1));
        delete_all(&c, vec![s]).await;
    }
    stats(
        "create -> first turn answered (boot)",
        "ms",
        first_turn,
        out,
    );
    let (sessions, fresh) = fresh_sessions(&c, n).await;
    report_density(out, "fresh_boot", n, fresh);
    delete_all(&c, sessions).await;
}

/// A counter suspended on node-a resumes on node-b: two nodes sharing a PostgreSQL journal
/// (a server of the bench's own) and a snapshot directory. Reports suspend (snapshot
/// published) → first event on node-b (archive fetched into node-b's store, restored, the
/// turn's first record), and the archive's size.
async fn cross_node(
    binary: &std::path::Path,
    runs: usize,
    out: &mut serde_json::Map<String, serde_json::Value>,
) {
    let server = match agentvmd::testing::TestPostgres::start() {
        Ok(server) => server,
        Err(why) => {
            println!("SKIPPED: cross-node resume: {why}");
            return;
        }
    };
    server.create_database("bench_fleet").unwrap();
    let shared = tempfile::tempdir().unwrap();
    let remote = agentvmd::runtime::microvm::remote::SnapshotRemote::Dir(shared.path().into());
    let node = |name: &'static str, uid_base: u32| {
        let (url, remote, binary) = (server.url("bench_fleet"), remote.clone(), binary.to_owned());
        support::start_with(move |cfg| {
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
    // Sizes of the archives in the shared directory (one directory per session): the
    // flattened ones and the layers.
    let archive_mib = |layers: bool| -> f64 {
        let bytes: u64 = std::fs::read_dir(shared.path())
            .unwrap()
            .flatten()
            .flat_map(|session| std::fs::read_dir(session.path()).unwrap().flatten())
            .filter(|a| a.file_name().to_string_lossy().contains('@') == layers)
            .filter_map(|a| a.metadata().ok())
            .map(|m| m.len())
            .sum();
        bytes as f64 / f64::from(1 << 20)
    };
    let (mut suspend, mut moved, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
    let (mut back, mut layers) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let s = create(&mut ca).await;
        turn(&mut ca, &s).await;
        let start = Instant::now();
        ca.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
        suspend.push(ms(start.elapsed()));
        moved.push(ms(turn(&mut cb, &s).await.0));
        sizes.push(archive_mib(false));
        // Suspended on node-b it goes as a layer on node-a's archive, and node-a fetches
        // only that layer to go on.
        cb.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
        layers.push(archive_mib(true));
        back.push(ms(turn(&mut ca, &s).await.0));
        ca.delete_session(DeleteSessionRequest { uid: s })
            .await
            .unwrap();
        for session in std::fs::read_dir(shared.path()).unwrap().flatten() {
            let _ = std::fs::remove_dir_all(session.path());
        }
    }
    stats("fleet: suspend, snapshot published", "ms", suspend, out);
    stats(
        "fleet: resume on another node -> first event",
        "ms",
        moved,
        out,
    );
    stats(
        "fleet: published archive (256 MiB guest)",
        "MiB",
        sizes,
        out,
    );
    stats(
        "fleet: resume back on the first node (layer fetched) -> first event",
        "ms",
        back,
        out,
    );
    stats(
        "fleet: layer published by the second node's suspend",
        "MiB",
        layers,
        out,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    // RUST_LOG=agentvmd=info shows where a fork's time goes ("session forked" lines).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        println!("SKIPPED: /dev/kvm is not usable here ({e}); the microVM benchmarks need KVM");
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
    let runs = if quick { 2 } else { 20 };
    // AGENTVM_BENCH_VMM_POOL=0 measures without the pool of VMMs started ahead.
    let pool = std::env::var("AGENTVM_BENCH_VMM_POOL")
        .ok()
        .and_then(|v| v.parse().ok());
    let node = support::start_with(|cfg| {
        cfg.vmm_binary = Some(binary.clone());
        cfg.ram_dir = "/dev/shm".into();
        if let Some(pool) = pool {
            cfg.vmm_pool = pool;
        }
    })
    .await;
    let state = node.dir.join("state");
    let mut c = node.c();
    let mut out = serde_json::Map::new();
    out.insert("vmm_binary".into(), json!(binary.display().to_string()));

    // The image's template is made before anything is timed (as `warm_templates` would).
    agentvm_proto::node::v1::node_client::NodeClient::new(node.channel().await)
        .warm_image(agentvm_proto::node::v1::WarmImageRequest {
            harness: "testguest".into(),
        })
        .await
        .unwrap();
    let mut first_turn = Vec::new();
    let mut warm = Vec::new();
    let mut suspend = Vec::new();
    let mut resume_first = Vec::new();
    let mut sessions = Vec::new();
    for _ in 0..runs {
        let s = create(&mut c).await;
        first_turn.push(ms(turn(&mut c, &s).await.1));
        for _ in 0..5 {
            warm.push(ms(turn(&mut c, &s).await.1));
        }
        let start = Instant::now();
        c.suspend(SuspendRequest { session: s.clone() })
            .await
            .unwrap();
        suspend.push(ms(start.elapsed()));
        resume_first.push(ms(turn(&mut c, &s).await.0));
        sessions.push(s);
    }
    stats(
        "create -> first turn answered (template)",
        "ms",
        first_turn,
        &mut out,
    );
    stats("exec turn, warm", "ms", warm, &mut out);
    stats(
        "suspend (snapshot to disk, VMM stopped)",
        "ms",
        suspend,
        &mut out,
    );
    stats(
        "resume -> first event (restore + turn)",
        "ms",
        resume_first,
        &mut out,
    );

    tokio::time::sleep(Duration::from_millis(300)).await;
    let pss = pss_mib(&state, &sessions);
    let per_session = pss.iter().sum::<f64>() / pss.len().max(1) as f64;
    stats("idle session, VMM PSS", "MiB", pss, &mut out);
    println!(
        "{:<44} {:>8.0}  (1 GiB / mean PSS of an idle session)",
        "sessions per GiB",
        1024.0 / per_session
    );
    out.insert("sessions_per_gib".into(), json!(1024.0 / per_session));
    for s in sessions {
        c.delete_session(DeleteSessionRequest { uid: s })
            .await
            .unwrap();
    }

    let parent = create(&mut c).await;
    turn(&mut c, &parent).await;
    let widths: &[i32] = if quick { &[1, 4] } else { &[1, 16, 64, 128] };
    for &k in widths {
        let start = Instant::now();
        let children = c
            .fork(ForkRequest {
                session: parent.clone(),
                count: k,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .children;
        let forked = start.elapsed();
        // Every child's guest already answered (Ready and its Restored notice) before Fork
        // returned; one turn each proves the harness too.
        let mut set = tokio::task::JoinSet::new();
        for child in &children {
            let mut c = c.clone();
            let uid = child.metadata.as_ref().unwrap().uid.clone();
            set.spawn(async move { turn(&mut c, &uid).await });
        }
        while set.join_next().await.is_some() {}
        let answered = start.elapsed();
        println!(
            "{:<44} fork {:>8.1} ms, every child answered a turn {:>8.1} ms",
            format!("fork fan-out {k}"),
            ms(forked),
            ms(answered)
        );
        out.insert(
            format!("fork_{k}"),
            json!({"fork_ms": ms(forked), "all_answered_ms": ms(answered)}),
        );
        for child in children {
            c.delete_session(DeleteSessionRequest {
                uid: child.metadata.unwrap().uid,
            })
            .await
            .unwrap();
        }
    }
    let long_turns = std::env::var("AGENTVM_BENCH_LONG_TURNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 20 } else { 2000 });
    long_session(&mut c, long_turns, &mut out).await;
    let cycles = std::env::var("AGENTVM_BENCH_SUSPEND_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 10 } else { 1000 });
    suspend_cycles(&mut c, &state, cycles, &mut out).await;
    density(&c, if quick { 4 } else { 200 }, &mut out).await;
    booting(&binary, runs, if quick { 4 } else { 200 }, &mut out).await;
    cross_node(&binary, runs, &mut out).await;

    let path = std::env::var_os("AGENTVM_BENCH_JSON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-microvm.json")
        });
    std::fs::write(&path, serde_json::to_vec_pretty(&out).unwrap()).unwrap();
    println!("figures written to {}", path.display());
}
