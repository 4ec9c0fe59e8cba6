//! Builds the test guest from `c/` with the system's `gcc` and `ld` (32-bit, freestanding, no
//! libc, no libgcc) and converts the result to an ELF64 container, which is what
//! linux-loader's ELF loader accepts (as with vmlinux, the code inside stays 32-bit).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiled and linked, in this order (start.S first: it holds the entry point).
const SOURCES: &[&str] = &[
    "start.S",
    "main.c",
    "pic.c",
    "serial.c",
    "clock.c",
    "mp.c",
    "virtio.c",
    "disk.c",
    "vsock.c",
    "frame.c",
    "handlers.c",
    "proto.c",
    "cmdline.c",
    "fmt.c",
    "libc.c",
];

const CFLAGS: &[&str] = &[
    "-m32",
    "-march=i686",
    "-std=gnu11",
    "-ffreestanding",
    "-fno-builtin",
    "-mgeneral-regs-only",
    "-fno-pic",
    "-fno-pie",
    "-O2",
    "-fno-stack-protector",
    "-nostdlib",
    "-fno-asynchronous-unwind-tables",
    "-fno-unwind-tables",
    // No endbr32: nothing here needs CET, and the PVM emulator need not know the opcode.
    "-fcf-protection=none",
    // Otherwise gcc may turn a loop into a call to memset/memcpy, even inside those.
    "-fno-tree-loop-distribute-patterns",
    "-Wall",
    "-Wextra",
    "-g",
];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    let c = manifest.join("c");

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", c.display());
    let mut entries: Vec<_> = std::fs::read_dir(&c)
        .unwrap_or_else(|e| panic!("reading {}: {e}", c.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in &entries {
        println!("cargo:rerun-if-changed={}", path.display());
    }

    for tool in ["gcc", "ld", "objcopy"] {
        if Command::new(tool).arg("--version").output().is_err() {
            panic!(
                "agentvm-testguest needs `{tool}` on PATH to build the test guest \
                 (Debian: apt-get install gcc binutils)"
            );
        }
    }

    let obj_dir = out.join("obj");
    std::fs::create_dir_all(&obj_dir).expect("creating OUT_DIR/obj");
    let mut objects = Vec::new();
    for src in SOURCES {
        let obj = obj_dir.join(format!("{src}.o"));
        let mut cmd = Command::new("gcc");
        cmd.args(CFLAGS)
            .arg("-c")
            .arg(c.join(src))
            .arg("-o")
            .arg(&obj);
        run(&mut cmd, &format!("compiling {src}"));
        objects.push(obj);
    }

    let elf32 = out.join("testguest.elf32");
    let mut ld = Command::new("ld");
    ld.args(["-m", "elf_i386", "-nostdlib", "-static", "-T"])
        .arg(c.join("link.ld"))
        .arg("-o")
        .arg(&elf32)
        .args(&objects);
    run(&mut ld, "linking the test guest");

    let elf = out.join("testguest.elf");
    let mut objcopy = Command::new("objcopy");
    objcopy
        .args(["-O", "elf64-x86-64", "--strip-all"])
        .arg(&elf32)
        .arg(&elf);
    run(&mut objcopy, "converting the test guest to ELF64");
    check_pvh_note(&elf);
}

/// Runs a build step: its warnings become cargo warnings, a failure ends the build with them.
fn run(cmd: &mut Command, what: &str) {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {:?}: {e}", cmd.get_program()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        panic!(
            "{what} failed ({}):\n{stderr}\ncommand: {cmd:?}",
            output.status
        );
    }
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning={what}: {line}");
    }
}

/// A last check that the note survived linking and conversion: without it a VMM would try
/// to boot the image as a Linux kernel.
fn check_pvh_note(elf: &Path) {
    let bytes = std::fs::read(elf).expect("reading the linked test guest");
    let needle = [4u8, 0, 0, 0, 4, 0, 0, 0, 18, 0, 0, 0, b'X', b'e', b'n', 0];
    assert!(
        bytes.windows(needle.len()).any(|w| w == needle),
        "the linked test guest has no XEN_ELFNOTE_PHYS32_ENTRY note"
    );
}
