//! virtio-net on a real tap, in a network namespace of the test's own: a VMM (seccomp
//! filters on) attaches at boot and at restore, `vm.egress-allow` changes the policy in
//! force, and a restore takes a new tap, MAC and policy. The test guest has no network
//! driver, so frames themselves are the device tests' business.
//!
//! Skips, saying why, without KVM, without root, or without /dev/net/tun, `unshare`,
//! `nsenter` or `ip`.

mod support;

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use agentvm_vmm_api::client::ClientError;
use agentvm_vmm_api::config::{EgressPolicy, EgressRule, NetConfig};
use agentvm_vmm_api::types::{NetOverride, RestoreConfig};
use support::Vmm;

/// A network namespace held open by a sleeping process; gone (with its taps) on drop.
struct Netns {
    holder: Child,
    path: String,
}

impl Netns {
    fn new() -> Result<Self, String> {
        let holder = Command::new("unshare")
            .args(["--net", "--", "sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("unshare: {e}"))?;
        let path = format!("/proc/{}/ns/net", holder.id());
        let netns = Self { holder, path };
        // unshare has switched namespaces once its namespace link differs from ours.
        let ours = std::fs::read_link("/proc/self/ns/net").map_err(|e| e.to_string())?;
        for _ in 0..1000 {
            match std::fs::read_link(&netns.path) {
                Ok(theirs) if theirs != ours => return Ok(netns),
                _ => std::thread::sleep(std::time::Duration::from_millis(2)),
            }
        }
        Err("the namespace never appeared".into())
    }

    fn enter_arg(&self) -> String {
        format!("--net={}", self.path)
    }

    /// Runs `ip ARGS` inside the namespace.
    fn ip(&self, args: &[&str]) -> Result<(), String> {
        let output = Command::new("nsenter")
            .arg(self.enter_arg())
            .arg("ip")
            .args(args)
            .output()
            .map_err(|e| format!("nsenter ip: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        Ok(())
    }

    fn add_tap(&self, name: &str) -> Result<(), String> {
        self.ip(&["tuntap", "add", "dev", name, "mode", "tap"])?;
        self.ip(&["link", "set", name, "up"])
    }

    async fn vmm(&self) -> Vmm {
        let nsenter = OsStr::new("nsenter");
        let arg = self.enter_arg();
        Vmm::spawn_wrapped(&[nsenter, OsStr::new(&arg)]).await
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// Why this machine cannot run the test, if it cannot.
fn unavailable() -> Option<String> {
    if let Some(reason) = support::kvm_unavailable() {
        return Some(reason);
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (a network namespace and taps need it)".into());
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing".into());
    }
    for tool in ["unshare", "nsenter", "ip"] {
        let found = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("`{tool}` is not installed"));
        }
    }
    None
}

fn policy(guest: [u8; 4], allow: Vec<EgressRule>) -> EgressPolicy {
    EgressPolicy {
        guest_ip: Ipv4Addr::from(guest),
        gateway_ip: Ipv4Addr::new(10, 0, 0, 1),
        allow,
        reserved: Vec::new(),
    }
}

fn status(result: Result<(), ClientError>) -> u16 {
    match result {
        Err(e) => e
            .status()
            .unwrap_or_else(|| panic!("not an API error: {e}")),
        Ok(()) => panic!("expected an error"),
    }
}

#[tokio::test]
async fn a_vm_attaches_its_tap_takes_new_rules_and_restores_onto_another_tap() {
    if let Some(reason) = unavailable() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let netns = match Netns::new() {
        Ok(netns) => netns,
        Err(reason) => {
            eprintln!("SKIPPED: no network namespace here ({reason})");
            return;
        }
    };
    for tap in ["agvm0", "agvm1"] {
        netns.add_tap(tap).expect("creating a tap in the namespace");
    }

    let vmm = netns.vmm().await;
    let mut config = vmm.config(1, 64, "");
    let mut net = NetConfig::on_tap("agvm0");
    net.mac = Some("52:54:00:00:00:01".into());
    net.egress = Some(policy(
        [10, 0, 0, 2],
        vec![EgressRule::host(Ipv4Addr::new(1, 1, 1, 1))],
    ));
    config.net = vec![net];
    vmm.boot(&config).await;

    let info = vmm.client.info().await.unwrap();
    let node = &info.device_tree.unwrap()["_net0"];
    // Window 9 (after vsock and eight disk windows), its interrupt line 5 + 9.
    assert_eq!(
        node.resources[0]["MmioAddressRange"]["base"],
        0xd000_9000u64
    );
    assert_eq!(node.resources[1]["LegacyIrq"], 14);
    let counters = vmm.client.counters().await.unwrap();
    assert!(
        counters["_net0"].contains_key("tx_dropped_policy"),
        "{counters:?}"
    );

    // A second VMM cannot take the tap the first one holds: the boot fails, naming it.
    let busy = netns.vmm().await;
    let mut other = busy.config(1, 64, "");
    other.net = vec![NetConfig::on_tap("agvm0")];
    busy.client.create(&other).await.unwrap();
    let err = busy.client.boot().await.unwrap_err().to_string();
    assert!(err.contains("net[0].tap \"agvm0\": TUNSETIFF"), "{err}");
    busy.shutdown().await;

    // Rules added at run time, repeats ignored, the total bounded.
    let added = EgressRule {
        cidr: "140.82.112.0/20".into(),
        ports: Some("443".into()),
        protocol: Some("tcp".into()),
    };
    for _ in 0..2 {
        vmm.client
            .egress_allow(None, std::slice::from_ref(&added))
            .await
            .unwrap();
    }
    let allow = |info: agentvm_vmm_api::VmInfo| info.config.net[0].egress.clone().unwrap().allow;
    assert_eq!(allow(vmm.client.info().await.unwrap()).len(), 2);
    assert_eq!(
        status(
            vmm.client
                .egress_allow(Some("eth9"), std::slice::from_ref(&added))
                .await
        ),
        404
    );
    // Revoked, a rule leaves the policy in force (and a rule not held is ignored).
    vmm.client
        .egress_revoke(None, std::slice::from_ref(&added))
        .await
        .unwrap();
    assert_eq!(allow(vmm.client.info().await.unwrap()).len(), 1);
    vmm.client
        .egress_revoke(None, std::slice::from_ref(&added))
        .await
        .unwrap();
    assert_eq!(
        status(
            vmm.client
                .egress_revoke(Some("eth9"), std::slice::from_ref(&added))
                .await
        ),
        404
    );
    vmm.client
        .egress_allow(None, std::slice::from_ref(&added))
        .await
        .unwrap();
    let many: Vec<EgressRule> = (0..4095u32)
        .map(|i| EgressRule::host(Ipv4Addr::from(0x0b00_0000 + i)))
        .collect();
    assert_eq!(status(vmm.client.egress_allow(None, &many).await), 400);
    vmm.client.egress_allow(None, &many[..4094]).await.unwrap();
    assert_eq!(allow(vmm.client.info().await.unwrap()).len(), 4096);

    // A snapshot carries the policy in force and the transport.
    vmm.client.pause().await.unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let snapshot = scratch.path().join("snap");
    std::fs::create_dir(&snapshot).unwrap();
    vmm.client.snapshot(&snapshot).await.unwrap();
    vmm.shutdown().await;
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snapshot.join("state.json")).unwrap()).unwrap();
    assert_eq!(
        state["nets"].as_array().map(Vec::len),
        Some(1),
        "state.json holds the network device's transport"
    );

    // A restore naming a device the snapshot lacks is the caller's error.
    let child = netns.vmm().await;
    let mut request = RestoreConfig {
        source_url: format!("file://{}", snapshot.display()),
        resume: true,
        vsock_socket: Some(child.vsock_socket()),
        serial_file: Some(child.serial_log()),
        net_overrides: vec![NetOverride {
            id: "_net1".into(),
            tap: None,
            mac: None,
            egress: None,
        }],
        ..Default::default()
    };
    let err = child.client.restore(&request).await.unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("net_overrides[0].id"), "{err}");

    // A fork child: its own tap, MAC, address and policy.
    let new_policy = policy([10, 0, 0, 3], vec![]);
    request.net_overrides = vec![NetOverride {
        id: "_net0".into(),
        tap: Some("agvm1".into()),
        mac: Some("52:54:00:00:00:02".into()),
        egress: Some(new_policy.clone()),
    }];
    child.client.restore(&request).await.expect("vm.restore");
    let restored = child.client.info().await.unwrap().config.net[0].clone();
    assert_eq!(restored.tap, "agvm1");
    assert_eq!(restored.mac.as_deref(), Some("52:54:00:00:00:02"));
    assert_eq!(restored.egress, Some(new_policy));
    assert!(child.client.counters().await.unwrap().contains_key("_net0"));
    child.shutdown().await;

    // Without overrides the snapshot's config (agvm0, the rules added) is kept.
    let again = netns.vmm().await;
    request.vsock_socket = Some(again.vsock_socket());
    request.serial_file = Some(again.serial_log());
    request.net_overrides.clear();
    again.client.restore(&request).await.expect("vm.restore");
    let kept = again.client.info().await.unwrap().config.net[0].clone();
    assert_eq!(kept.tap, "agvm0");
    assert_eq!(kept.egress.unwrap().allow.len(), 4096);
    again.shutdown().await;
}
