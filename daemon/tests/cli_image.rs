//! `agentvm image testguest -o FILE` through the real binary.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

#[test]
fn writes_the_test_guest_elf() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("testguest.elf");
    // An existing file with another mode is replaced and gets 0644.
    std::fs::write(&path, b"old contents that are longer than nothing").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .args(["image", "testguest", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty() && out.stderr.is_empty(), "{out:?}");

    let elf = std::fs::read(&path).unwrap();
    assert_eq!(elf, agentvm_testguest::TESTGUEST_ELF);
    assert_eq!(&elf[..4], b"\x7fELF");
    // XEN_ELFNOTE_PHYS32_ENTRY: namesz 4, descsz 4, type 18, "Xen\0", then the entry point,
    // which is also e_entry.
    let note = [4, 0, 0, 0, 4, 0, 0, 0, 18, 0, 0, 0, b'X', b'e', b'n', 0];
    let at = elf
        .windows(note.len())
        .position(|w| w == note)
        .expect("PVH note");
    let entry = u32::from_le_bytes(elf[at + 16..at + 20].try_into().unwrap());
    assert_eq!(
        u64::from(entry),
        u64::from_le_bytes(elf[24..32].try_into().unwrap())
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644);
}

#[test]
fn reports_an_unwritable_destination() {
    let out = Command::new(env!("CARGO_BIN_EXE_agentvm"))
        .args(["image", "testguest", "-o", "/nonexistent-dir/testguest.elf"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent-dir/testguest.elf"),
        "{stderr}"
    );
}
