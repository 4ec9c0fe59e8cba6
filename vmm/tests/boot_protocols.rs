//! The 64-bit Linux boot protocol, for kernels without a PVH note: an ELF64 and a bzImage,
//! each carrying a few instructions of 64-bit code that check they run in long mode with RSI
//! pointing at a zero page ("HdrS" at +0x202), print `BOOT64 OK` and reset the machine.
//! (The PVH path is what the test guest boots through.)

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

/// Position-independent x86-64: `cmpl $0x53726448, 0x202(%rsi)`, print "BOOT64 OK\n" or
/// "BOOT64 BAD\n" on COM1, `outb $0xfe, $0x64`, `hlt`. In 32-bit mode the REX prefixes decode
/// as other instructions, so only a long-mode entry prints OK.
const CODE64: &[u8] = &[
    0x81, 0xbe, 0x02, 0x02, 0x00, 0x00, 0x48, 0x64, 0x72, 0x53, 0x75, 0x09, 0x48, 0x8d, 0x1d, 0x20,
    0x00, 0x00, 0x00, 0xeb, 0x07, 0x48, 0x8d, 0x1d, 0x22, 0x00, 0x00, 0x00, 0x66, 0xba, 0xf8, 0x03,
    0x8a, 0x03, 0x84, 0xc0, 0x74, 0x06, 0xee, 0x48, 0xff, 0xc3, 0xeb, 0xf4, 0xb0, 0xfe, 0xe6, 0x64,
    0xf4, 0xeb, 0xfd, 0x42, 0x4f, 0x4f, 0x54, 0x36, 0x34, 0x20, 0x4f, 0x4b, 0x0a, 0x00, 0x42, 0x4f,
    0x4f, 0x54, 0x36, 0x34, 0x20, 0x42, 0x41, 0x44, 0x0a, 0x00,
];

fn boot_one_shot(image: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("kernel");
    let log = dir.path().join("serial.log");
    std::fs::write(&kernel, image).unwrap();
    let mut child = Command::new(support::vmm_bin())
        .arg("--kernel")
        .arg(&kernel)
        .arg("--serial")
        .arg(&log)
        .arg("--memory-mib")
        .arg("64")
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "the VM did not reset; serial: {:?}",
                std::fs::read_to_string(&log)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "{status}");
    std::fs::read_to_string(&log).unwrap()
}

#[test]
fn elf_without_pvh_note_enters_in_long_mode_with_a_zero_page() {
    require_kvm!();
    assert_eq!(
        boot_one_shot(&agentvm_testguest::synthetic::elf64(CODE64)),
        "BOOT64 OK\n"
    );
}

#[test]
fn bzimage_enters_at_its_64bit_entry_with_a_zero_page() {
    require_kvm!();
    assert_eq!(
        boot_one_shot(&agentvm_testguest::synthetic::bzimage(CODE64)),
        "BOOT64 OK\n"
    );
}

#[test]
fn garbage_kernels_are_refused_before_anything_runs() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("kernel");
    std::fs::write(&kernel, vec![0x90u8; 8192]).unwrap();
    let output = Command::new(support::vmm_bin())
        .arg("--kernel")
        .arg(&kernel)
        .arg("--serial")
        .arg("null")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("neither an ELF"), "{stderr}");
}
