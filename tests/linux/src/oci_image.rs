//! `agentvm-lane-oci --out DIR --harness BIN`: writes the lane's container image as an OCI
//! image layout (no registry is reachable from the lane): the static reference harness as
//! `/usr/bin/agentvm-harness`, run by Entrypoint/Cmd as user `harness` (uid 1000), in two
//! layers, the second removing a file of the first (a whiteout) and adding one.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use agentvmd::image::oci_layout::{self, LayerEntry};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (out, harness) = match args.as_slice() {
        [o, out, h, harness] if o == "--out" && h == "--harness" => {
            (PathBuf::from(out), PathBuf::from(harness))
        }
        _ => {
            eprintln!("usage: agentvm-lane-oci --out DIR --harness BIN");
            return ExitCode::from(2);
        }
    };
    match write(&out, &harness) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentvm-lane-oci: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write(out: &std::path::Path, harness: &std::path::Path) -> std::io::Result<()> {
    let binary = std::fs::read(harness)?;
    let bottom = oci_layout::layer(&[
        LayerEntry::Dir("etc", 0o755),
        LayerEntry::File(
            "etc/passwd",
            0o644,
            b"root:x:0:0:root:/root:/bin/false\nharness:x:1000:1000::/tmp:/bin/false\n",
        ),
        LayerEntry::File("etc/group", 0o644, b"root:x:0:\nharness:x:1000:\n"),
        LayerEntry::File("etc/leftover", 0o644, b"the top layer removes this"),
        LayerEntry::Dir("usr", 0o755),
        LayerEntry::Dir("usr/bin", 0o755),
        LayerEntry::File("usr/bin/agentvm-harness", 0o755, &binary),
    ])?;
    let top = oci_layout::layer(&[
        LayerEntry::File("etc/.wh.leftover", 0o644, b""),
        LayerEntry::File("etc/motd", 0o644, b"agentvm lane container image\n"),
    ])?;
    oci_layout::write(
        out,
        &[oci_layout::gzip(&bottom)?, top],
        serde_json::json!({
            "Entrypoint": ["agentvm-harness"],
            "Cmd": ["serve", "echo", "--listen", "unix:{socket}"],
            "Env": ["PATH=/usr/bin:/bin"],
            "User": "harness",
        }),
    )
}
