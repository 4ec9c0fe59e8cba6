//! The network extensions: `vm.egress-allow` and `vm.restore`'s `net_overrides`, as the
//! server checks them before the backend sees them.

use agentvm_vmm_api::config::{EgressPolicy, EgressRule, NetConfig, VmConfig};
use agentvm_vmm_api::types::NetOverride;
use serde_json::json;

use crate::support::{TestServer, put};

fn config_with_policy() -> VmConfig {
    let mut config = TestServer::config();
    let mut net = NetConfig::on_tap("tap0");
    net.egress = Some(EgressPolicy {
        guest_ip: "10.0.0.2".parse().unwrap(),
        gateway_ip: "10.0.0.1".parse().unwrap(),
        allow: vec![],
        reserved: Vec::new(),
    });
    config.net.push(net);
    config
}

#[tokio::test]
async fn egress_allow_is_404_without_a_vm_400_for_bad_rules_and_204_when_added() {
    let server = TestServer::start().await;
    let s = &server.socket;
    let client = server.client();
    let rules = vec![EgressRule::host("93.184.216.34".parse().unwrap())];

    // No VM (created or not, it must be booted).
    let err = client.egress_allow(None, &rules).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    client.create(&config_with_policy()).await.unwrap();
    let err = client.egress_allow(None, &rules).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    client.boot().await.unwrap();

    // Bad bodies never reach the backend.
    let calls = server.backend.call_count();
    for (body, path) in [
        (json!({"rules": [{"cidr": "10.0.0.0/33"}]}), "rules[0].cidr"),
        (
            json!({"rules": [{"cidr": "1.1.1.1"}, {"cidr": "1.1.1.1", "ports": "x"}]}),
            "rules[1].ports",
        ),
        (
            json!({"rules": [{"cidr": "1.1.1.1", "protocol": "sctp"}]}),
            "rules[0].protocol",
        ),
        (json!({"id": "", "rules": []}), "id"),
    ] {
        let m = put(s, "vm.egress-allow", Some(body.to_string().as_bytes()))
            .await
            .error(400);
        assert_eq!(m[0], "vm.egress-allow failed", "{m:?}");
        assert!(
            m.iter().any(|m| m.starts_with(&format!("{path}: "))),
            "{m:?}"
        );
    }
    let m = put(s, "vm.egress-allow", Some(br#"{"rules":[],"extra":1}"#))
        .await
        .error(400);
    assert!(
        m.iter().any(|m| m.contains("unknown field `extra`")),
        "{m:?}"
    );
    put(s, "vm.egress-allow", None).await.error(400);
    let many: Vec<_> = (0..=4096).map(|_| json!({"cidr": "1.1.1.1"})).collect();
    put(
        s,
        "vm.egress-allow",
        Some(json!({"rules": many}).to_string().as_bytes()),
    )
    .await
    .error(400);
    assert_eq!(server.backend.call_count(), calls);

    // Good ones are added; an unknown device is 404.
    let response = put(
        s,
        "vm.egress-allow",
        Some(
            json!({"rules": [{"cidr": "140.82.112.0/20", "ports": "443", "protocol": "tcp"}]})
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(response.status, 204, "{response:?}");
    client.egress_allow(Some("_net0"), &rules).await.unwrap();
    assert_eq!(server.backend.egress_rules.lock().unwrap()["_net0"], 2);
    let err = client.egress_allow(Some("eth1"), &rules).await.unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
}

#[tokio::test]
async fn restore_net_overrides_are_checked_by_field() {
    let server = TestServer::start().await;
    let s = &server.socket;
    for (overrides, path) in [
        (json!([{"id": ""}]), "net_overrides[0].id"),
        (
            json!([{"id": "_net0", "tap": "a/b"}]),
            "net_overrides[0].tap",
        ),
        (
            json!([{"id": "_net0", "mac": "01:00:00:00:00:01"}]),
            "net_overrides[0].mac",
        ),
        (
            json!([{"id": "_net0", "egress": {"guest_ip": "10.0.0.2", "gateway_ip": "10.0.0.1", "allow": [{"cidr": "1.2.3.4/40"}]}}]),
            "net_overrides[0].egress.allow[0].cidr",
        ),
        (
            json!([{"id": "_net0"}, {"id": "_net0"}]),
            "net_overrides[1].id",
        ),
    ] {
        let body = json!({"source_url": "file:///snap", "net_overrides": overrides});
        let m = put(s, "vm.restore", Some(body.to_string().as_bytes()))
            .await
            .error(400);
        assert!(
            m.iter().any(|m| m.starts_with(&format!("{path}: "))),
            "{path}: {m:?}"
        );
    }
    let m = put(
        s,
        "vm.restore",
        Some(br#"{"source_url":"file:///snap","net_fds":[3]}"#),
    )
    .await
    .error(400);
    assert!(m.iter().any(|m| m.contains("net_fds")), "{m:?}");
    assert_eq!(server.backend.call_count(), 0);

    let request = agentvm_vmm_api::types::RestoreConfig {
        source_url: "file:///snap".into(),
        net_overrides: vec![NetOverride {
            id: "_net0".into(),
            tap: Some("tap7".into()),
            mac: Some("52:54:00:00:00:07".into()),
            egress: None,
        }],
        ..Default::default()
    };
    server.client().restore(&request).await.unwrap();
    assert_eq!(
        server.backend.restored.lock().unwrap().as_ref(),
        Some(&request)
    );
}
