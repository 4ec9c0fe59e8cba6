use serde_json::json;

use super::*;

/// vmm-api.md §3.4's minimal sandbox body, minus what agentvm-vmm does not support
/// (memory `zones`).
const MINIMAL_BODY: &str = r#"{"cpus":{"boot_vcpus":2,"max_vcpus":2},
 "memory":{"size":1073741824},
 "payload":{"kernel":"/var/lib/sbx/vmlinux","initramfs":"/var/lib/sbx/initrd",
            "cmdline":"console=ttyS0 clocksource=kvm-clock reboot=k panic=1 quiet"},
 "serial":{"mode":"File","file":"/run/sbx/v1/serial.log"},
 "console":{"mode":"Off"},
 "vsock":{"cid":3,"socket":"/run/sbx/v1/vsock.sock"}}"#;

fn decode(value: serde_json::Value) -> Result<VmConfig, ConfigError> {
    VmConfig::from_json(value.to_string().as_bytes())
}

fn base() -> serde_json::Value {
    json!({"payload": {"kernel": "/k"}})
}

/// Decodes `base()` with `patch` merged in at the top level, expecting an error at `path`.
fn rejected(patch: serde_json::Value, path: &str) -> ConfigError {
    let mut body = base();
    if let (Some(body), Some(patch)) = (body.as_object_mut(), patch.as_object()) {
        for (k, v) in patch {
            body.insert(k.clone(), v.clone());
        }
    }
    let err = match decode(body.clone()) {
        Ok(c) => panic!("{body} was accepted: {c:?}"),
        Err(e) => e,
    };
    assert_eq!(err.path, path, "{body}: {err}");
    assert!(err.to_string().starts_with(&format!("{path}: ")), "{err}");
    err
}

#[test]
fn minimal_body_decodes_validates_and_round_trips() {
    let config = VmConfig::from_json(MINIMAL_BODY.as_bytes()).expect("minimal body");
    assert_eq!(
        config.cpus,
        CpusConfig {
            boot_vcpus: 2,
            max_vcpus: 2
        }
    );
    assert_eq!(config.memory.size, 1 << 30);
    assert!(config.memory.thp, "thp defaults to true");
    assert!(!config.memory.shared);
    assert_eq!(config.serial.mode, ConsoleOutputMode::File);
    assert_eq!(
        config.serial.file.as_deref(),
        Some(Path::new("/run/sbx/v1/serial.log"))
    );
    assert_eq!(config.console.mode, ConsoleOutputMode::Off);
    let vsock = config.vsock.clone().expect("vsock");
    assert_eq!(vsock.cid, 3);
    assert_eq!(vsock.socket, Path::new("/run/sbx/v1/vsock.sock"));

    let encoded = serde_json::to_value(&config).expect("encode");
    assert_eq!(encoded["memory"]["size"], json!(1073741824u64));
    assert_eq!(encoded["serial"]["mode"], json!("File"));
    assert_eq!(encoded["payload"]["kernel"], json!("/var/lib/sbx/vmlinux"));
    assert_eq!(encoded["memory"]["thp"], json!(true));
    let again: VmConfig = serde_json::from_value(encoded).expect("decode again");
    assert_eq!(again, config);
}

#[test]
fn defaults_match_cloud_hypervisor_except_console() {
    let config = decode(base()).expect("payload only");
    assert_eq!(config.cpus, CpusConfig::default());
    assert_eq!((config.cpus.boot_vcpus, config.cpus.max_vcpus), (1, 1));
    assert_eq!(config.memory, MemoryConfig::default());
    assert_eq!(config.memory.size, 512 << 20);
    assert_eq!(config.serial.mode, ConsoleOutputMode::Null);
    assert_eq!(config.console.mode, ConsoleOutputMode::Off);
    assert_eq!(config.vsock, None);
    assert_eq!(config, VmConfig::with_kernel("/k"));
}

#[test]
fn payload_is_required() {
    let err = VmConfig::from_json(b"{}").expect_err("no payload");
    assert!(err.to_string().contains("missing field `payload`"), "{err}");
}

#[test]
fn cloud_hypervisor_fields_we_lack_are_refused_by_name() {
    // A disk field of CH's we lack is refused by name, as a whole unknown section is.
    let disks =
        json!({"disks": [{"path": "/run/sbx/v1/rootfs.img", "id": "root", "vhost_user": true}]});
    let err = VmConfig::from_json(
        MINIMAL_BODY
            .replacen('{', &format!("{{\"disks\":{},", disks["disks"]), 1)
            .as_bytes(),
    )
    .expect_err("vhost_user");
    assert!(
        err.to_string().contains("unknown field `vhost_user`"),
        "{err}"
    );
    assert!(err.path.starts_with("disks[0]"), "{err:?}");

    let zones = r#"{"payload":{"kernel":"/k"},"memory":{"size":0,"zones":[{"id":"mem0","size":1073741824,"file":"/run/sbx/v1/mem","shared":false}]}}"#;
    let err = VmConfig::from_json(zones.as_bytes()).expect_err("zones");
    assert!(err.to_string().contains("unknown field `zones`"), "{err}");
    assert!(err.path.starts_with("memory"), "{err:?}");

    for (body, field) in [
        (
            json!({"net": [{"tap": "tap0", "vhost_user": true}]}),
            "vhost_user",
        ),
        (
            json!({"net": [{"tap": "tap0", "rate_limiter_config": {"bandwidth": {"size": 1, "refill_time": 1, "x": 1}}}]}),
            "x",
        ),
        (json!({"rng": {"src": "/dev/urandom"}}), "rng"),
        (
            json!({"cpus": {"boot_vcpus": 1, "max_vcpus": 1, "topology": {}}}),
            "topology",
        ),
        (
            json!({"vsock": {"cid": 3, "socket": "/s", "iommu": false}}),
            "iommu",
        ),
        (json!({"payload": {"kernel": "/k", "igvm": "/x"}}), "igvm"),
    ] {
        let mut full = base();
        if let (Some(full), Some(body)) = (full.as_object_mut(), body.as_object()) {
            for (k, v) in body {
                full.insert(k.clone(), v.clone());
            }
        }
        let err = decode(full).expect_err(field);
        assert!(
            err.to_string()
                .contains(&format!("unknown field `{field}`")),
            "{err}"
        );
    }
}

#[test]
fn type_errors_name_the_path() {
    let err =
        decode(json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": "x", "max_vcpus": 1}}))
            .expect_err("string vcpus");
    assert_eq!(err.path, "cpus.boot_vcpus");
    assert!(
        err.to_string()
            .starts_with("cpus.boot_vcpus: invalid type: string \"x\", expected u8"),
        "{err}"
    );
    let err =
        decode(json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": 300, "max_vcpus": 1}}))
            .expect_err("u8 overflow");
    assert_eq!(err.path, "cpus.boot_vcpus");
    let err = decode(json!({"payload": {"kernel": "/k"}, "serial": {"mode": "Fancy"}}))
        .expect_err("bad mode");
    assert_eq!(err.path, "serial.mode");
    let err = decode(json!({"payload": {"kernel": "/k"}, "memory": {"size": -1}}))
        .expect_err("negative size");
    assert_eq!(err.path, "memory.size");
    let err = decode(json!({"payload": {"kernel": "/k"}, "memory": {"shared": true}}))
        .expect_err("size is required inside memory");
    assert!(err.to_string().contains("missing field `size`"), "{err}");
    let err = VmConfig::from_json(br#"{"payload":{"kernel":"/k"}} trailing"#)
        .expect_err("trailing bytes");
    assert!(err.to_string().contains("trailing"), "{err}");
}

#[test]
fn cpu_values_are_checked() {
    rejected(
        json!({"cpus": {"boot_vcpus": 0, "max_vcpus": 0}}),
        "cpus.boot_vcpus",
    );
    rejected(
        json!({"cpus": {"boot_vcpus": 33, "max_vcpus": 33}}),
        "cpus.boot_vcpus",
    );
    let err = rejected(
        json!({"cpus": {"boot_vcpus": 2, "max_vcpus": 4}}),
        "cpus.max_vcpus",
    );
    assert!(err.reason.contains("no CPU hotplug"), "{err}");
    assert!(
        decode(json!({"payload": {"kernel": "/k"}, "cpus": {"boot_vcpus": 32, "max_vcpus": 32}}))
            .is_ok()
    );
}

#[test]
fn memory_values_are_checked() {
    rejected(json!({"memory": {"size": 0}}), "memory.size");
    rejected(
        json!({"memory": {"size": (2u64 << 20) - 4096}}),
        "memory.size",
    );
    rejected(json!({"memory": {"size": (4u64 << 20) + 1}}), "memory.size");
    rejected(
        json!({"memory": {"size": (64u64 << 30) + 4096}}),
        "memory.size",
    );
    let err = rejected(
        json!({"memory": {"size": 1u64 << 30, "hugepages": true}}),
        "memory.hugepages",
    );
    assert!(err.reason.contains("not supported"), "{err}");
    let ok = decode(json!({"payload": {"kernel": "/k"}, "memory": {"size": 2u64 << 20, "shared": true, "prefault": true, "mergeable": true, "thp": false}}))
        .expect("valid memory");
    assert!(ok.memory.shared && ok.memory.prefault && ok.memory.mergeable && !ok.memory.thp);
    assert!(decode(json!({"payload": {"kernel": "/k"}, "memory": {"size": 64u64 << 30}})).is_ok());
}

#[test]
fn payload_values_are_checked() {
    rejected(json!({"payload": {"initramfs": "/i"}}), "payload.kernel");
    rejected(json!({"payload": {"kernel": ""}}), "payload.kernel");
    let err = rejected(json!({"payload": {"firmware": "/fw"}}), "payload.firmware");
    assert!(err.reason.contains("not supported"), "{err}");
    rejected(
        json!({"payload": {"kernel": "/k", "firmware": "/fw"}}),
        "payload.firmware",
    );
    rejected(
        json!({"payload": {"kernel": "/k", "initramfs": ""}}),
        "payload.initramfs",
    );
    rejected(
        json!({"payload": {"kernel": "/k", "cmdline": "a\u{0}b"}}),
        "payload.cmdline",
    );
    rejected(
        json!({"payload": {"kernel": "/k", "cmdline": "x".repeat(2048)}}),
        "payload.cmdline",
    );
    assert!(decode(json!({"payload": {"kernel": "/k", "cmdline": "x".repeat(2047)}})).is_ok());
    rejected(json!({"payload": {"kernel": "/k\u{0}"}}), "payload.kernel");
}

#[test]
fn serial_and_console_modes_are_checked() {
    rejected(json!({"serial": {"mode": "File"}}), "serial.file");
    rejected(
        json!({"serial": {"mode": "File", "file": ""}}),
        "serial.file",
    );
    rejected(
        json!({"serial": {"mode": "Null", "file": "/f"}}),
        "serial.file",
    );
    rejected(json!({"serial": {"mode": "Pty"}}), "serial.mode");
    rejected(
        json!({"serial": {"mode": "Socket", "socket": "/s"}}),
        "serial.mode",
    );
    rejected(
        json!({"serial": {"mode": "Tty", "socket": "/s"}}),
        "serial.socket",
    );
    for mode in ["Off", "Null", "Tty"] {
        assert!(
            decode(json!({"payload": {"kernel": "/k"}, "serial": {"mode": mode}})).is_ok(),
            "{mode}"
        );
    }
    let err = rejected(json!({"console": {"mode": "Tty"}}), "console.mode");
    assert!(err.reason.contains("no virtio-console"), "{err}");
    for mode in ["Pty", "File", "Socket"] {
        rejected(json!({"console": {"mode": mode}}), "console.mode");
    }
    rejected(
        json!({"console": {"mode": "Off", "file": "/f"}}),
        "console.file",
    );
    rejected(
        json!({"console": {"mode": "Null", "socket": "/s"}}),
        "console.socket",
    );
    assert!(decode(json!({"payload": {"kernel": "/k"}, "console": {"mode": "Null"}})).is_ok());
}

#[test]
fn vsock_values_are_checked() {
    for cid in [0u32, 1, 2, u32::MAX] {
        rejected(json!({"vsock": {"cid": cid, "socket": "/s"}}), "vsock.cid");
    }
    rejected(json!({"vsock": {"cid": 3, "socket": ""}}), "vsock.socket");
    rejected(
        json!({"vsock": {"cid": 3, "socket": "/s", "id": ""}}),
        "vsock.id",
    );
    let ok = decode(json!({"payload": {"kernel": "/k"}, "vsock": {"cid": u32::MAX - 1, "socket": "/s", "id": "_vsock0"}}))
        .expect("valid vsock");
    assert_eq!(ok.vsock.and_then(|v| v.id).as_deref(), Some("_vsock0"));
}

#[test]
fn disks_decode_in_order_and_their_values_are_checked() {
    let ok = decode(json!({
        "payload": {"kernel": "/k"},
        "vsock": {"cid": 3, "socket": "/s", "id": "_vsock0"},
        "disks": [
            {"path": "/images/root.erofs", "readonly": true, "id": "root"},
            {"path": "/run/w.img", "serial": "workspace"}
        ]
    }))
    .expect("valid disks");
    assert_eq!(ok.disks.len(), 2);
    assert!(ok.disks[0].readonly && !ok.disks[1].readonly);
    assert_eq!(ok.disks[1].serial.as_deref(), Some("workspace"));
    // It round-trips, and a VM without disks says nothing of them.
    let again: VmConfig = serde_json::from_value(serde_json::to_value(&ok).unwrap()).unwrap();
    assert_eq!(again, ok);
    assert!(
        !serde_json::to_string(&decode(base()).unwrap())
            .unwrap()
            .contains("disks")
    );

    rejected(json!({"disks": [{"path": ""}]}), "disks[0].path");
    rejected(
        json!({"disks": [{"path": "/a"}, {"path": "/b", "id": ""}]}),
        "disks[1].id",
    );
    rejected(
        json!({"disks": [{"path": "/a", "serial": "a serial that is much too long"}]}),
        "disks[0].serial",
    );
    rejected(
        json!({"disks": [{"path": "/a", "serial": "with space"}]}),
        "disks[0].serial",
    );
    rejected(
        json!({"disks": [{"path": "/a", "id": "x"}, {"path": "/b", "id": "x"}]}),
        "disks[1].id",
    );
    rejected(
        json!({"vsock": {"cid": 3, "socket": "/s", "id": "v"}, "disks": [{"path": "/a", "id": "v"}]}),
        "disks[0].id",
    );
    let many: Vec<serde_json::Value> = (0..=MAX_DISKS)
        .map(|i| json!({"path": format!("/d{i}")}))
        .collect();
    rejected(json!({"disks": many}), "disks");
    rejected(
        json!({"disks": [{"path": "/a", "readonly": "yes"}]}),
        "disks[0].readonly",
    );
}
