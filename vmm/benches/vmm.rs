//! agentvm-vmm benchmarks on real /dev/kvm with the test guest. Prints min/median/max.
//!
//! `AGENTVM_VMM_BIN=$(scripts/build-vmm.sh) cargo bench -p agentvm-vmm --bench vmm`
//! (without AGENTVM_VMM_BIN it measures cargo's dynamically linked build).
//!
//! - spawn → API ready: process start until `vmm.ping` answers;
//! - spawn → first guest output / TESTGUEST READY: process start, `vm.create` + `vm.boot`
//!   through the API, until the guest's first serial line (`TESTGUEST BOOT`) and until its
//!   ready marker, after vsock is up (and READY in one-shot mode, no API calls);
//! - vsock connect → first frame: `CONNECT 1024` / `OK`, Hello → Ready;
//! - frame round trip on an open stream (HealthCheck → HealthReport) and a counter turn;
//! - idle RSS of the VMM process with a booted 256 MiB guest.

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentvm_proto::guest::v1::envelope::Body;
use agentvm_proto::guest::v1::{HarnessFrame, HealthCheck, harness_frame};
use agentvm_proto::v1::{ControllerFrame, Start, controller_frame};
use support::{GuestLink, Vmm, ms, rss_kib, summary, wait_for_serial};

async fn spawn_to_api_ready(runs: usize) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    for i in 0..runs {
        let api = dir.path().join(format!("api-{i}.sock"));
        let start = Instant::now();
        let mut child = Command::new(support::vmm_bin())
            .arg("--api-socket")
            .arg(&api)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let client = agentvm_vmm_api::VmmClient::new(&api);
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
        out.push(ms(start.elapsed()));
        let _ = child.kill();
        let _ = child.wait();
    }
    out
}

/// (spawn → first guest line, spawn → READY) per run.
async fn spawn_to_guest_ready(runs: usize) -> (Vec<f64>, Vec<f64>) {
    let mut first = Vec::new();
    let mut out = Vec::new();
    for _ in 0..runs {
        // The image and config are prepared before the clock starts, as a daemon would have
        // them ready.
        let dir = tempfile::tempdir().unwrap();
        let api = dir.path().join("api.sock");
        let start = Instant::now();
        let child = Command::new(support::vmm_bin())
            .arg("--api-socket")
            .arg(&api)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let client = agentvm_vmm_api::VmmClient::new(&api);
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
        let vmm = Vmm {
            child,
            dir,
            api,
            client,
        };
        let config = vmm.config(1, 256, "");
        let setup = start.elapsed();
        let start = Instant::now();
        vmm.client.create(&config).await.unwrap();
        vmm.client.boot().await.unwrap();
        wait_for_serial(&vmm.serial_log(), "TESTGUEST BOOT", Duration::from_secs(20));
        first.push(ms(setup + start.elapsed()));
        wait_for_serial(
            &vmm.serial_log(),
            "TESTGUEST READY",
            Duration::from_secs(20),
        );
        out.push(ms(setup + start.elapsed()));
        vmm.shutdown().await;
    }
    (first, out)
}

fn one_shot_to_guest_ready(runs: usize) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("testguest.elf");
    std::fs::write(&kernel, agentvm_testguest::TESTGUEST_ELF).unwrap();
    let mut out = Vec::new();
    for i in 0..runs {
        let log = dir.path().join(format!("serial-{i}.log"));
        let start = Instant::now();
        let mut child = Command::new(support::vmm_bin())
            .arg("--kernel")
            .arg(&kernel)
            .arg("--serial")
            .arg(&log)
            .arg("--memory-mib")
            .arg("256")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        wait_for_serial(&log, "TESTGUEST READY", Duration::from_secs(20));
        out.push(ms(start.elapsed()));
        let _ = child.kill();
        let _ = child.wait();
    }
    out
}

fn turn(link: &mut GuestLink, stream: u64) {
    link.send(Body::Harness(HarnessFrame {
        stream,
        frame: Some(harness_frame::Frame::Controller(ControllerFrame {
            session: "bench".into(),
            execution_id: format!("e{stream}"),
            frame: Some(controller_frame::Frame::Start(Start::default())),
        })),
    }));
    for _ in 0..3 {
        link.recv().unwrap();
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` runs this once, quickly.
    let quick = !std::env::args().any(|a| a == "--bench");
    if let Some(reason) = support::kvm_unavailable() {
        println!("SKIPPED: {reason}; the VMM benchmarks need KVM");
        return;
    }
    let runs = if quick { 2 } else { 20 };
    println!("VMM binary: {}", support::vmm_bin().display());

    summary(
        "spawn -> API ready (vmm.ping)",
        "ms",
        spawn_to_api_ready(runs).await,
    );
    let (first_output, ready) = spawn_to_guest_ready(runs).await;
    summary(
        "spawn -> first guest output (API create+boot)",
        "ms",
        first_output,
    );
    summary("spawn -> TESTGUEST READY (API create+boot)", "ms", ready);
    summary(
        "spawn -> TESTGUEST READY (one-shot)",
        "ms",
        one_shot_to_guest_ready(runs),
    );

    let vmm = Vmm::spawn().await;
    vmm.boot(&vmm.config(1, 256, "")).await;
    let mut connects = Vec::new();
    for _ in 0..runs {
        let start = Instant::now();
        let mut link = GuestLink::connect(&vmm.vsock_socket(), 1024).unwrap();
        link.hello();
        connects.push(ms(start.elapsed()));
    }
    summary("vsock connect -> first frame (Hello/Ready)", "ms", connects);

    let mut link = GuestLink::connect(&vmm.vsock_socket(), 1024).unwrap();
    link.hello();
    let mut round_trips = Vec::new();
    for _ in 0..runs * 5 {
        let start = Instant::now();
        link.send(Body::HealthCheck(HealthCheck {}));
        link.recv().unwrap();
        round_trips.push(ms(start.elapsed()));
    }
    summary("frame round trip (HealthCheck)", "ms", round_trips);
    let mut turns = Vec::new();
    for stream in 1..=(runs as u64 * 5) {
        let start = Instant::now();
        turn(&mut link, stream);
        turns.push(ms(start.elapsed()));
    }
    summary("counter turn (Start -> OUTPUT, END, close)", "ms", turns);
    drop(link);
    vmm.shutdown().await;

    let mut rss = Vec::new();
    for _ in 0..runs.min(5) {
        let vmm = Vmm::spawn().await;
        vmm.boot(&vmm.config(1, 256, "")).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        rss.push(rss_kib(vmm.pid()) as f64 / 1024.0);
        vmm.shutdown().await;
    }
    summary("idle VMM RSS, 256 MiB guest", "MiB", rss);
}
