use serde_json::json;

use super::*;
use crate::config::VmConfig;

fn decode(net: serde_json::Value) -> Result<VmConfig, ConfigError> {
    VmConfig::from_json(
        json!({"payload": {"kernel": "/k"}, "net": net})
            .to_string()
            .as_bytes(),
    )
}

/// `net` is refused at `path`; returns the error.
#[track_caller]
fn rejected(net: serde_json::Value, path: &str) -> ConfigError {
    let err = match decode(net.clone()) {
        Ok(c) => panic!("{net} was accepted: {c:?}"),
        Err(e) => e,
    };
    assert_eq!(err.path, path, "{net}: {err}");
    assert!(err.to_string().starts_with(&format!("{path}: ")), "{err}");
    err
}

fn policy(allow: serde_json::Value) -> serde_json::Value {
    json!([{"tap": "tap0", "egress": {"guest_ip": "10.0.0.2", "gateway_ip": "10.0.0.1", "allow": allow}}])
}

#[test]
fn a_full_device_decodes_round_trips_and_parses() {
    let config = decode(json!([{
        "tap": "agvm-tap0",
        "mac": "52:54:00:AB:cd:01",
        "id": "eth",
        "mtu": 1400,
        "rate_limiter_config": {
            "bandwidth": {"size": 1000000, "one_time_burst": 5000000, "refill_time": 100},
            "ops": {"size": 1000, "refill_time": 1000}
        },
        "egress": {
            "guest_ip": "10.0.0.2",
            "gateway_ip": "10.0.0.1",
            "allow": [
                {"cidr": "140.82.112.0/20", "ports": "443", "protocol": "tcp"},
                {"cidr": "1.1.1.1"},
                {"cidr": "0.0.0.0/0", "ports": "8000-8099", "protocol": "udp"}
            ]
        }
    }]))
    .expect("valid net");
    let net = &config.net[0];
    assert_eq!(net.device_id(0), "eth");
    assert_eq!(
        net.mac_bytes().unwrap(),
        [0x52, 0x54, 0x00, 0xab, 0xcd, 0x01]
    );
    assert_eq!(net.mtu(), 1400);
    let limiter = net.rate_limiter_config.as_ref().unwrap();
    assert_eq!(
        limiter.bandwidth.as_ref().unwrap().one_time_burst,
        Some(5000000)
    );
    assert_eq!(limiter.ops.as_ref().unwrap().one_time_burst, None);
    let parsed = net.egress.as_ref().unwrap().parse().unwrap();
    assert_eq!(
        parsed.rules,
        vec![
            ParsedRule {
                net: u32::from(Ipv4Addr::new(140, 82, 112, 0)),
                prefix: 20,
                ports: (443, 443),
                tcp: true,
                udp: false
            },
            ParsedRule {
                net: u32::from(Ipv4Addr::new(1, 1, 1, 1)),
                prefix: 32,
                ports: (0, 65535),
                tcp: true,
                udp: true
            },
            ParsedRule {
                net: 0,
                prefix: 0,
                ports: (8000, 8099),
                tcp: false,
                udp: true
            },
        ]
    );
    let again: VmConfig = serde_json::from_value(serde_json::to_value(&config).unwrap()).unwrap();
    assert_eq!(again, config);
}

#[test]
fn defaults_and_a_vm_without_net_say_nothing_of_it() {
    let config = decode(json!([{"tap": "tap0"}])).expect("tap only");
    let net = &config.net[0];
    assert_eq!(net, &NetConfig::on_tap("tap0"));
    assert_eq!(net.device_id(0), "_net0");
    assert_eq!(net.mac_bytes().unwrap(), DEFAULT_MAC);
    assert_eq!(format_mac(DEFAULT_MAC), "52:54:00:12:34:56");
    assert_eq!(net.mtu(), 1500);
    let encoded = serde_json::to_string(&config).unwrap();
    assert!(
        !encoded.contains("mac") && !encoded.contains("egress"),
        "{encoded}"
    );
    let none = decode(json!([])).unwrap();
    assert!(!serde_json::to_string(&none).unwrap().contains("net"));
}

#[test]
fn tap_mac_id_and_mtu_are_checked() {
    for tap in [
        "",
        "a-name-too-long!",
        "a/b",
        "a b",
        "a:b",
        ".",
        "..",
        "x\u{0}",
    ] {
        rejected(json!([{"tap": tap}]), "net[0].tap");
    }
    assert!(decode(json!([{"tap": "fifteen-bytes-x"}])).is_ok());
    for mac in [
        "52:54:00:12:34",
        "52:54:00:12:34:56:78",
        "52-54-00-12-34-56",
        "5:54:00:12:34:56",
        "52:54:00:12:34:zz",
        "53:54:00:12:34:56",
        "ff:ff:ff:ff:ff:ff",
        "00:00:00:00:00:00",
        "+5:54:00:12:34:56",
    ] {
        rejected(json!([{"tap": "t", "mac": mac}]), "net[0].mac");
    }
    rejected(json!([{"tap": "t", "id": ""}]), "net[0].id");
    for mtu in [0, 575, 1501, 9000] {
        rejected(json!([{"tap": "t", "mtu": mtu}]), "net[0].mtu");
    }
    assert!(decode(json!([{"tap": "t", "mtu": 576}])).is_ok());
    rejected(json!([{"tap": "t", "mtu": 70000}]), "net[0].mtu");
    rejected(json!([{"tap": "a"}, {"tap": "b"}]), "net");
}

#[test]
fn ids_collide_with_no_other_device() {
    let with = |extra: serde_json::Value, net: serde_json::Value| {
        let mut body = json!({"payload": {"kernel": "/k"}, "net": net});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        VmConfig::from_json(body.to_string().as_bytes())
    };
    let err = with(
        json!({"disks": [{"path": "/d"}]}),
        json!([{"tap": "t", "id": "_disk0"}]),
    )
    .unwrap_err();
    assert_eq!(err.path, "net[0].id");
    let err = with(
        json!({"vsock": {"cid": 3, "socket": "/s"}}),
        json!([{"tap": "t", "id": "_vsock0"}]),
    )
    .unwrap_err();
    assert_eq!(err.path, "net[0].id");
    let err = with(
        json!({"disks": [{"path": "/d", "id": "_net0"}]}),
        json!([{"tap": "t"}]),
    )
    .unwrap_err();
    assert_eq!(err.path, "net[0].id");
    for reserved in ["vcpus", "_serial"] {
        rejected(json!([{"tap": "t", "id": reserved}]), "net[0].id");
    }
    assert!(
        with(
            json!({"disks": [{"path": "/d", "id": "root"}]}),
            json!([{"tap": "t"}])
        )
        .is_ok()
    );
}

#[test]
fn rate_limiter_values_are_checked() {
    for (limiter, path) in [
        (
            json!({"bandwidth": {"size": 1, "refill_time": 0}}),
            "net[0].rate_limiter_config.bandwidth.refill_time",
        ),
        (
            json!({"ops": {"size": 1, "refill_time": MAX_REFILL_TIME_MS + 1}}),
            "net[0].rate_limiter_config.ops.refill_time",
        ),
        (
            json!({"ops": {"size": -1, "refill_time": 1}}),
            "net[0].rate_limiter_config.ops.size",
        ),
    ] {
        rejected(json!([{"tap": "t", "rate_limiter_config": limiter}]), path);
    }
    let ok = decode(json!([{"tap": "t", "rate_limiter_config": {}}])).unwrap();
    assert_eq!(
        ok.net[0].rate_limiter_config,
        Some(RateLimiterConfig::default())
    );
    assert!(
        decode(
            json!([{"tap": "t", "rate_limiter_config": {"ops": {"size": 0, "refill_time": 1}}}])
        )
        .is_ok(),
        "size 0 is no limit, as in Cloud Hypervisor"
    );
}

#[test]
fn policy_addresses_are_checked() {
    for (guest, gateway, path) in [
        ("0.0.0.0", "10.0.0.1", "guest_ip"),
        ("255.255.255.255", "10.0.0.1", "guest_ip"),
        ("224.0.0.1", "10.0.0.1", "guest_ip"),
        ("127.0.0.1", "10.0.0.1", "guest_ip"),
        ("10.0.0.2", "0.0.0.0", "gateway_ip"),
        ("10.0.0.2", "10.0.0.2", "gateway_ip"),
        ("10.0.0.256", "10.0.0.1", "guest_ip"),
        ("fe80::1", "10.0.0.1", "guest_ip"),
    ] {
        rejected(
            json!([{"tap": "t", "egress": {"guest_ip": guest, "gateway_ip": gateway}}]),
            &format!("net[0].egress.{path}"),
        );
    }
    let ok =
        decode(json!([{"tap": "t", "egress": {"guest_ip": "10.0.0.2", "gateway_ip": "10.0.0.1"}}]))
            .unwrap();
    assert!(ok.net[0].egress.as_ref().unwrap().allow.is_empty());
}

#[test]
fn rules_are_checked_and_errors_name_the_rule() {
    let good = json!({"cidr": "10.0.0.0/8"});
    for (bad, field) in [
        (json!({"cidr": "10.0.0.0/33"}), "cidr"),
        (json!({"cidr": "10.0.0.0/"}), "cidr"),
        (json!({"cidr": "10.0.0.0/+8"}), "cidr"),
        (json!({"cidr": "10.1.0.0/8"}), "cidr"),
        (json!({"cidr": "example.com"}), "cidr"),
        (json!({"cidr": ""}), "cidr"),
        (json!({"cidr": "::/0"}), "cidr"),
        (json!({"cidr": "1.2.3.4", "ports": ""}), "ports"),
        (json!({"cidr": "1.2.3.4", "ports": "80-"}), "ports"),
        (json!({"cidr": "1.2.3.4", "ports": "90-80"}), "ports"),
        (json!({"cidr": "1.2.3.4", "ports": "65536"}), "ports"),
        (json!({"cidr": "1.2.3.4", "ports": "1-2-3"}), "ports"),
        (json!({"cidr": "1.2.3.4", "ports": "http"}), "ports"),
        (json!({"cidr": "1.2.3.4", "protocol": "icmp"}), "protocol"),
        (json!({"cidr": "1.2.3.4", "protocol": "TCP"}), "protocol"),
    ] {
        let err = rejected(
            policy(json!([good, good, bad])),
            &format!("net[0].egress.allow[2].{field}"),
        );
        assert!(!err.reason.is_empty());
    }
    let err = decode(policy(json!([{"cidr": "1.2.3.4", "port": "80"}]))).unwrap_err();
    assert!(err.to_string().contains("unknown field `port`"), "{err}");
    let many: Vec<_> = (0..=MAX_EGRESS_RULES).map(|_| good.clone()).collect();
    rejected(policy(json!(many)), "net[0].egress.allow");
    let most: Vec<_> = (0..MAX_EGRESS_RULES).map(|_| good.clone()).collect();
    assert!(decode(policy(json!(most))).is_ok());
}

#[test]
fn parsed_rules_match_what_they_name() {
    let rule = |cidr: &str, ports: Option<&str>, protocol: Option<&str>| {
        EgressRule {
            cidr: cidr.into(),
            ports: ports.map(Into::into),
            protocol: protocol.map(Into::into),
        }
        .parse()
        .unwrap()
    };
    let ip = |a, b, c, d| u32::from(Ipv4Addr::new(a, b, c, d));
    let https = rule("140.82.112.0/20", Some("443"), Some("tcp"));
    assert!(https.allows(ip(140, 82, 127, 255), true, 443));
    assert!(!https.allows(ip(140, 82, 128, 0), true, 443));
    assert!(!https.allows(ip(140, 82, 112, 1), false, 443), "udp");
    assert!(!https.allows(ip(140, 82, 112, 1), true, 444));
    assert!(!https.all_ports());
    assert!(!https.allows_any_port(ip(140, 82, 112, 1), IpProtocol::Tcp));

    let host = rule("1.1.1.1", None, None);
    assert!(host.allows(ip(1, 1, 1, 1), false, 53) && host.allows(ip(1, 1, 1, 1), true, 1));
    assert!(!host.covers(ip(1, 1, 1, 2)));
    assert!(host.allows_any_port(ip(1, 1, 1, 1), IpProtocol::Other));
    assert_eq!(
        EgressRule::host(Ipv4Addr::new(1, 1, 1, 1)).parse().unwrap(),
        host
    );

    let all_tcp = rule("0.0.0.0/0", None, Some("tcp"));
    assert!(all_tcp.covers(0) && all_tcp.covers(u32::MAX));
    assert!(all_tcp.allows_any_port(ip(8, 8, 8, 8), IpProtocol::Tcp));
    assert!(!all_tcp.allows_any_port(ip(8, 8, 8, 8), IpProtocol::Udp));
    assert!(
        !all_tcp.allows_any_port(ip(8, 8, 8, 8), IpProtocol::Other),
        "ICMP needs a rule without a protocol"
    );
    let range = rule("10.0.0.0/8", Some("8000-8099"), None);
    assert!(
        range.allows(ip(10, 9, 9, 9), false, 8000) && range.allows(ip(10, 0, 0, 0), true, 8099)
    );
    assert!(!range.allows(ip(10, 0, 0, 0), true, 8100));
}

#[test]
fn within_puts_paths_under_their_field() {
    let e = ConfigError::new("ports", "bad");
    assert_eq!(
        e.clone().within_index(2).within("allow").path,
        "allow[2].ports"
    );
    assert_eq!(e.within("net[0]").path, "net[0].ports");
    assert_eq!(ConfigError::new(".", "x").within("rules").path, "rules");
}
