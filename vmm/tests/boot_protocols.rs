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

fn put16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A minimal ELF64 executable: one PT_LOAD at 2 MiB, no notes.
fn elf64(code: &[u8]) -> Vec<u8> {
    const LOAD: u64 = 0x20_0000;
    const CODE_OFFSET: usize = 0x1000;
    let mut image = vec![0u8; CODE_OFFSET + code.len()];
    image[..4].copy_from_slice(b"\x7fELF");
    image[4] = 2; // ELFCLASS64
    image[5] = 1; // little endian
    image[6] = 1; // version
    put16(&mut image, 16, 2); // ET_EXEC
    put16(&mut image, 18, 62); // EM_X86_64
    put32(&mut image, 20, 1);
    put64(&mut image, 24, LOAD); // e_entry
    put64(&mut image, 32, 64); // e_phoff
    put16(&mut image, 52, 64); // e_ehsize
    put16(&mut image, 54, 56); // e_phentsize
    put16(&mut image, 56, 1); // e_phnum
    let ph = 64;
    put32(&mut image, ph, 1); // PT_LOAD
    put32(&mut image, ph + 4, 5); // R+X
    put64(&mut image, ph + 8, CODE_OFFSET as u64);
    put64(&mut image, ph + 16, LOAD);
    put64(&mut image, ph + 24, LOAD);
    put64(&mut image, ph + 32, code.len() as u64);
    put64(&mut image, ph + 40, code.len() as u64);
    put64(&mut image, ph + 48, 0x1000);
    image[CODE_OFFSET..].copy_from_slice(code);
    image
}

/// A minimal bzImage: one setup sector after the boot sector, then the protected-mode kernel
/// whose 64-bit entry is 0x200 bytes in.
fn bzimage(code: &[u8]) -> Vec<u8> {
    let setup = 2 * 512;
    let mut image = vec![0u8; setup + 0x200 + code.len()];
    image[0x1f1] = 1; // setup_sects
    put16(&mut image, 0x1fe, 0xaa55);
    image[0x202..0x206].copy_from_slice(b"HdrS");
    put16(&mut image, 0x206, 0x020f); // boot protocol 2.15
    image[0x211] = 1; // LOADED_HIGH
    put32(&mut image, 0x214, 0x10_0000); // code32_start
    image[setup + 0x200..].copy_from_slice(code);
    image
}

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
    assert_eq!(boot_one_shot(&elf64(CODE64)), "BOOT64 OK\n");
}

#[test]
fn bzimage_enters_at_its_64bit_entry_with_a_zero_page() {
    require_kvm!();
    assert_eq!(boot_one_shot(&bzimage(CODE64)), "BOOT64 OK\n");
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
