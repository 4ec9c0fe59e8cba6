//! `agentvm image testguest -o FILE` through the real binary.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
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

// ---------- agentvm image build ----------

struct ImageDir {
    dir: tempfile::TempDir,
}

impl ImageDir {
    /// A kernel and an "agent" (any static ELF: the test guest stands in), a harness
    /// directory with a runtime-like layout, and an image.toml using them.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::write(p.join("vmlinux"), agentvm_testguest::TESTGUEST_ELF).unwrap();
        std::fs::write(p.join("agent"), agentvm_testguest::TESTGUEST_ELF).unwrap();
        std::fs::create_dir_all(p.join("harness/bin")).unwrap();
        std::fs::create_dir_all(p.join("harness/lib/site")).unwrap();
        std::fs::write(p.join("harness/bin/python3.11"), b"\x7fELF pretend runtime").unwrap();
        std::fs::set_permissions(
            p.join("harness/bin/python3.11"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::os::unix::fs::symlink("python3.11", p.join("harness/bin/python3")).unwrap();
        std::fs::write(p.join("harness/lib/site/agent.py"), b"print('hi')\n").unwrap();
        let me = ImageDir { dir };
        me.config(
            r#"command = ["/opt/harness/bin/python3", "/opt/harness/lib/site/agent.py", "--listen", "unix:{socket}"]"#,
            r#"harness_dir = "harness""#,
        );
        me
    }

    fn config(&self, command: &str, harness: &str) {
        std::fs::write(
            self.dir.path().join("image.toml"),
            format!(
                "[harness]\n{command}\nresumability = \"STATELESS_REPLAY\"\n\n\
                 [vm]\nmemory_mib = 128\ncmdline = \"quiet\"\n\n\
                 [build]\nkernel = \"vmlinux\"\nagent = \"agent\"\n{harness}\n"
            ),
        )
        .unwrap();
    }

    fn build(&self, out: &str) -> std::process::Output {
        self.build_with(out, &[])
    }

    fn build_with(&self, out: &str, flags: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_agentvm"))
            .args(flags)
            .args(["image", "build", "--config"])
            .arg(self.dir.path().join("image.toml"))
            .arg("-o")
            .arg(self.dir.path().join(out))
            .output()
            .unwrap()
    }

    /// `image build` of this directory's image.toml over the container image at `source`.
    fn build_oci(&self, out: &str, source: &Path) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_agentvm"))
            .args(["image", "build", "--config"])
            .arg(self.dir.path().join("image.toml"))
            .arg("-o")
            .arg(self.dir.path().join(out))
            .arg("--oci")
            .arg(source)
            .output()
            .unwrap()
    }

    fn read(&self, out: &str, file: &str) -> Vec<u8> {
        std::fs::read(self.dir.path().join(out).join(file)).unwrap()
    }
}

/// The (path, mode) of every entry of a newc archive, and the trailer's presence.
fn cpio_entries(archive: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    let field = |b: &[u8], i: usize| {
        u32::from_str_radix(std::str::from_utf8(&b[6 + i * 8..14 + i * 8]).unwrap(), 16).unwrap()
    };
    loop {
        let h = &archive[at..at + 110];
        assert_eq!(&h[..6], b"070701");
        let (mode, size, namesize) = (field(h, 1), field(h, 6) as usize, field(h, 11) as usize);
        assert_eq!(field(h, 5), 0, "mtime is 0");
        let name = String::from_utf8(archive[at + 110..at + 110 + namesize - 1].to_vec()).unwrap();
        let data_at = (at + 110 + namesize).div_ceil(4) * 4;
        if name == "TRAILER!!!" {
            return out;
        }
        out.push((name, mode, archive[data_at..data_at + size].to_vec()));
        at = (data_at + size).div_ceil(4) * 4;
    }
}

#[test]
fn image_build_writes_a_reproducible_bundle() {
    let img = ImageDir::new();
    let out = img.build("a");
    assert!(out.status.success(), "{out:?}");
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(listing.contains("initramfs.cpio"), "{listing}");
    let again = img.build("b");
    assert!(again.status.success(), "{again:?}");
    for file in ["vmlinux", "initramfs.cpio", "image.toml", "manifest.json"] {
        assert_eq!(
            img.read("a", file),
            img.read("b", file),
            "{file} differs between builds"
        );
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&img.read("a", "manifest.json")).unwrap();
    assert_eq!(manifest["format"], 1);
    // Under --json the build prints the manifest it wrote.
    let json = img.build_with("c", &["--json"]);
    assert!(json.status.success(), "{json:?}");
    let printed: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(printed, manifest);
    let initramfs = img.read("a", "initramfs.cpio");
    assert_eq!(
        manifest["files"]["initramfs.cpio"]["size"],
        initramfs.len() as u64
    );
    use sha2::Digest;
    assert_eq!(
        manifest["files"]["initramfs.cpio"]["sha256"],
        hex::encode(sha2::Sha256::digest(&initramfs))
    );
    let entries = cpio_entries(&initramfs);
    let find = |p: &str| {
        entries
            .iter()
            .find(|e| e.0 == p)
            .unwrap_or_else(|| panic!("{p} missing"))
    };
    assert_eq!(find("init").1, 0o100755);
    assert_eq!(find("init").2, agentvm_testguest::TESTGUEST_ELF);
    assert_eq!(
        find("dev/console").1 & 0o170000,
        0o020000,
        "a character device"
    );
    assert_eq!(
        find("opt/harness/bin/python3").1 & 0o170000,
        0o120000,
        "a symlink"
    );
    assert_eq!(find("opt/harness/bin/python3").2, b"python3.11");
    assert_eq!(find("opt/harness/lib/site/agent.py").2, b"print('hi')\n");
    // The guest's copy of the configuration has no [build] section; the bundle's neither.
    let guest_config = String::from_utf8(find("etc/agentvm/image.toml").2.clone()).unwrap();
    assert!(!guest_config.contains("[build]"), "{guest_config}");
    assert_eq!(guest_config.as_bytes(), img.read("a", "image.toml"));
    let paths: Vec<&String> = entries.iter().map(|e| &e.0).collect();
    let mut sorted = paths.clone();
    sorted.sort();
    assert_eq!(paths, sorted, "entries in path order");
}

#[test]
fn image_build_refuses_what_cannot_run() {
    let img = ImageDir::new();
    let refused = |img: &ImageDir, want: &str| {
        let out = img.build("x");
        assert_eq!(out.status.code(), Some(2), "{want}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{want}: {stderr}");
    };
    // The harness program is not in the image.
    img.config(
        r#"command = ["/opt/harness/bin/node"]"#,
        r#"harness_dir = "harness""#,
    );
    refused(&img, "/opt/harness/bin/node is not in the image");
    // It is there but not executable.
    img.config(
        r#"command = ["/opt/harness/lib/site/agent.py"]"#,
        r#"harness_dir = "harness""#,
    );
    refused(&img, "not executable");
    // No harness at all, or a missing directory.
    img.config(r#"command = ["/opt/harness/h"]"#, "");
    refused(&img, "no harness");
    img.config(
        r#"command = ["/opt/harness/h"]"#,
        r#"harness_dir = "nowhere""#,
    );
    refused(&img, "nowhere");
    // A dynamically linked harness binary.
    img.config(
        r#"command = ["/opt/harness/agentvm"]"#,
        &format!("harness_binary = {:?}", env!("CARGO_BIN_EXE_agentvm")),
    );
    refused(&img, "dynamically linked");
    // A dynamically linked agent (as `cargo build` makes it): the error says how to get the
    // static one.
    std::fs::copy(env!("CARGO_BIN_EXE_agentvm"), img.dir.path().join("agent")).unwrap();
    img.config(
        r#"command = ["/opt/harness/bin/python3"]"#,
        r#"harness_dir = "harness""#,
    );
    refused(&img, "scripts/build-guest.sh");
    std::fs::write(
        img.dir.path().join("agent"),
        agentvm_testguest::TESTGUEST_ELF,
    )
    .unwrap();
    // An invalid image.toml names the field.
    std::fs::write(
        img.dir.path().join("image.toml"),
        "[harness]\ncommand = [\"/x\"]\nresumability = \"OFTEN\"\n",
    )
    .unwrap();
    refused(&img, "harness.resumability");
    // A kernel that is not one.
    img.config(
        r#"command = ["/opt/harness/bin/python3"]"#,
        r#"harness_dir = "harness""#,
    );
    std::fs::write(img.dir.path().join("vmlinux"), b"#!/bin/sh\n").unwrap();
    refused(&img, "neither a vmlinux ELF nor a bzImage");
}

/// An image with an ext4 workspace ships its formatted template: sparse, described by a page
/// digest, byte-identical from build to build; a workspace on a stateless image is refused.
#[test]
fn an_ext4_workspace_is_formatted_once_at_build_and_reproducibly() {
    let img = ImageDir::new();
    let write = |resumability: &str, vm: &str| {
        std::fs::write(
            img.dir.path().join("image.toml"),
            format!(
                "[harness]\ncommand = [\"/opt/harness/bin/python3\"]\nresumability = \
                 \"{resumability}\"\n\n[vm]\nmemory_mib = 128\n{vm}\n\n[build]\n\
                 kernel = \"vmlinux\"\nagent = \"agent\"\nharness_dir = \"harness\"\n"
            ),
        )
        .unwrap();
    };
    write("REQUIRES_MEMORY_SNAPSHOT", "workspace_mib = 64");
    for out in ["a", "b"] {
        let built = img.build(out);
        assert!(built.status.success(), "{built:?}");
    }
    let template = img.dir.path().join("a/workspace.img");
    let meta = std::fs::metadata(&template).unwrap();
    assert_eq!(meta.len(), 64 << 20);
    use std::os::unix::fs::MetadataExt;
    assert!(
        meta.blocks() * 512 < 8 << 20,
        "sparse: {} blocks",
        meta.blocks()
    );
    let bytes = img.read("a", "workspace.img");
    assert_eq!(
        &bytes[1080..1082],
        &[0x53, 0xef],
        "the ext4 superblock magic"
    );
    assert_eq!(&bytes[1144..1153], b"workspace", "the volume label");
    assert_eq!(bytes, img.read("b", "workspace.img"), "reproducible");
    let manifest: serde_json::Value =
        serde_json::from_slice(&img.read("a", "manifest.json")).unwrap();
    assert_eq!(manifest["files"]["workspace.img"]["digest"], "pages");
    assert_eq!(manifest["files"]["workspace.img"]["size"], 64u64 << 20);
    // Rebuilt raw, or without a workspace, the template goes.
    write(
        "REQUIRES_MEMORY_SNAPSHOT",
        "workspace_mib = 64\nworkspace_fs = \"raw\"",
    );
    assert!(img.build("a").status.success());
    assert!(!template.exists());
    write("STATELESS_REPLAY", "workspace_mib = 64");
    let out = img.build("c");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("vm.workspace_mib"),
        "{out:?}"
    );
}

/// A container image becomes the bundle's root filesystem: its layers (whiteouts applied) in
/// an erofs image, its Entrypoint, Cmd, Env, WorkingDir and User in the guest's image.toml;
/// byte-identical from build to build.
#[test]
fn a_container_image_becomes_an_erofs_root_and_says_what_runs() {
    use agentvmd::image::oci_layout::{self, LayerEntry};
    let img = ImageDir::new();
    let layout = img.dir.path().join("layout");
    let bottom = oci_layout::layer(&[
        LayerEntry::Dir("usr", 0o755),
        LayerEntry::Dir("usr/bin", 0o755),
        LayerEntry::File("usr/bin/harness", 0o755, b"\x7fELF pretend harness"),
        LayerEntry::Dir("etc", 0o755),
        LayerEntry::File(
            "etc/passwd",
            0o644,
            b"root:x:0:0::/root:/bin/sh\nagent:x:1000:1000::/:/bin/sh\n",
        ),
        LayerEntry::File("etc/secret", 0o600, b"removed above"),
    ])
    .unwrap();
    let top = oci_layout::layer(&[LayerEntry::File("etc/.wh.secret", 0o644, b"")]).unwrap();
    oci_layout::write(
        &layout,
        &[oci_layout::gzip(&bottom).unwrap(), top],
        serde_json::json!({
            "Entrypoint": ["harness"],
            "Cmd": ["serve", "--listen", "unix:{socket}"],
            "Env": ["PATH=/usr/bin", "MODE=oci"],
            "WorkingDir": "/srv",
            "User": "agent",
        }),
    )
    .unwrap();
    std::fs::write(
        img.dir.path().join("image.toml"),
        "[harness]\nresumability = \"STATELESS_REPLAY\"\nenv = { MODE = \"toml wins\" }\n\n\
         [build]\nkernel = \"vmlinux\"\nagent = \"agent\"\n",
    )
    .unwrap();
    let build = |out: &str| {
        let built = img.build_oci(out, &layout);
        assert!(built.status.success(), "{built:?}");
    };
    build("a");
    build("b");
    assert_eq!(img.read("a", "rootfs.erofs"), img.read("b", "rootfs.erofs"));
    let manifest: serde_json::Value =
        serde_json::from_slice(&img.read("a", "manifest.json")).unwrap();
    assert_eq!(manifest["files"]["rootfs.erofs"]["digest"], "pages");
    let guest: toml::Value =
        toml::from_str(&String::from_utf8(img.read("a", "image.toml")).unwrap()).unwrap();
    assert_eq!(guest["vm"]["rootfs"].as_bool(), Some(true));
    let command: Vec<&str> = guest["harness"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        command,
        ["/usr/bin/harness", "serve", "--listen", "unix:{socket}"]
    );
    assert_eq!(guest["harness"]["env"]["MODE"].as_str(), Some("toml wins"));
    assert_eq!(guest["harness"]["env"]["PATH"].as_str(), Some("/usr/bin"));
    assert_eq!(guest["harness"]["workdir"].as_str(), Some("/srv"));
    assert_eq!(guest["harness"]["uid"].as_integer(), Some(1000));
    // What the guest mounts as its root.
    let tree = img.dir.path().join("tree");
    let fsck = Command::new("fsck.erofs")
        .arg(format!("--extract={}", tree.display()))
        .arg(img.dir.path().join("a/rootfs.erofs"))
        .output()
        .unwrap();
    assert!(fsck.status.success(), "{fsck:?}");
    assert_eq!(
        std::fs::read(tree.join("usr/bin/harness")).unwrap(),
        b"\x7fELF pretend harness"
    );
    assert!(tree.join("etc/passwd").exists());
    assert!(!tree.join("etc/secret").exists() && !tree.join("etc/.wh.secret").exists());
    // An entrypoint that is not in the image is refused by name.
    oci_layout::write(
        &layout,
        &[bottom],
        serde_json::json!({"Entrypoint": ["/bin/missing"]}),
    )
    .unwrap();
    let refused = img.build_oci("c", &layout);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr)
            .contains("/bin/missing is not in the container image"),
        "{refused:?}"
    );
}

/// A build as root handles the container image as an unprivileged uid in a user namespace
/// of its own (docs/security.md, row O1): the image's owners still reach the erofs as the
/// image says them, a hostile layer's links and whiteouts reach nothing of the host's, and
/// an archive is extracted the same way.
#[test]
fn a_root_build_unpacks_as_an_unprivileged_uid_and_keeps_the_image_s_owners() {
    use agentvmd::image::oci_layout::{self, LayerEntry};
    use std::os::unix::fs::MetadataExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: a build unpacks in a user namespace only as root");
        return;
    }
    let img = ImageDir::new();
    let victim = img.dir.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("precious"), b"host file").unwrap();
    let victim_path = victim.to_str().unwrap();
    let bottom = oci_layout::layer(&[
        LayerEntry::Dir("usr", 0o755),
        LayerEntry::Dir("usr/bin", 0o755),
        LayerEntry::File("usr/bin/harness", 0o755, b"\x7fELF pretend harness"),
        LayerEntry::Dir("home", 0o755),
        LayerEntry::Owned("home/agent-notes", 1000, 1001, 0o600, b"the agent's"),
        LayerEntry::Owned("home/far-owner", 200_000, 200_000, 0o644, b"a high id"),
        LayerEntry::Symlink("evil", victim_path),
    ])
    .unwrap();
    // Empties what the link points at, as the image sees it (nothing: the link resolves
    // inside the tree).
    let top = oci_layout::layer(&[LayerEntry::File("evil/.wh..wh..opq", 0o644, b"")]).unwrap();
    let layout = img.dir.path().join("layout");
    oci_layout::write(
        &layout,
        &[bottom.clone(), top],
        serde_json::json!({"Entrypoint": ["/usr/bin/harness"]}),
    )
    .unwrap();
    // The same layout as an archive, extracted by the unpacker too.
    let archive = img.dir.path().join("layout.tar");
    let mut tar = tar::Builder::new(std::fs::File::create(&archive).unwrap());
    tar.append_dir_all(".", &layout).unwrap();
    tar.finish().unwrap();
    drop(tar);
    std::fs::write(
        img.dir.path().join("image.toml"),
        "[harness]\nresumability = \"STATELESS_REPLAY\"\n\n\
         [build]\nkernel = \"vmlinux\"\nagent = \"agent\"\n",
    )
    .unwrap();
    for (out, source) in [("from-dir", &layout), ("from-tar", &archive)] {
        let built = img.build_oci(out, source);
        assert!(built.status.success(), "{out}: {built:?}");
        let tree = img.dir.path().join(format!("{out}-tree"));
        let fsck = Command::new("fsck.erofs")
            .arg(format!("--extract={}", tree.display()))
            .arg("--preserve")
            .arg(img.dir.path().join(out).join("rootfs.erofs"))
            .output()
            .unwrap();
        assert!(fsck.status.success(), "{fsck:?}");
        let owner = |rel: &str| {
            let meta = std::fs::symlink_metadata(tree.join(rel)).unwrap();
            (meta.uid(), meta.gid(), meta.mode() & 0o7777)
        };
        assert_eq!(owner("home/agent-notes"), (1000, 1001, 0o600), "{out}");
        assert_eq!(owner("home/far-owner"), (200_000, 200_000, 0o644), "{out}");
        assert_eq!(owner("usr/bin/harness"), (0, 0, 0o755), "{out}");
        // The link stays a link in the image; the layer's entries under it went inside.
        assert_eq!(
            std::fs::read_link(tree.join("evil")).unwrap(),
            Path::new(victim_path)
        );
        // The bundle's files are root's own, not the unpacker's.
        let rootfs = std::fs::metadata(img.dir.path().join(out).join("rootfs.erofs")).unwrap();
        assert_eq!((rootfs.uid(), rootfs.gid()), (0, 0), "{out}");
    }
    // A layer writing through the link is refused, and writes nothing of the host's.
    let hostile = img.dir.path().join("hostile");
    let through = oci_layout::layer(&[LayerEntry::File("evil/planted", 0o644, b"image's")]);
    oci_layout::write(
        &hostile,
        &[bottom, through.unwrap()],
        serde_json::json!({"Entrypoint": ["/usr/bin/harness"]}),
    )
    .unwrap();
    let refused = img.build_oci("refused", &hostile);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("evil/planted: No such file"),
        "{refused:?}"
    );
    assert_eq!(
        std::fs::read(victim.join("precious")).unwrap(),
        b"host file"
    );
    assert!(!victim.join("planted").exists());
    // Nothing of the unpacker's is left behind. (Another test's build running beside this
    // one has its scratch directory under /tmp for a moment: a leak stays, that goes.)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let leftovers = loop {
        let leftovers: Vec<_> =
            walk_owned_by(Path::new("/tmp"), agentvmd::image::sandbox::BUILD_UID_BASE);
        if leftovers.is_empty() || std::time::Instant::now() > deadline {
            break leftovers;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Files under `dir` (not following links, two levels deep) of host uid `uid` and up.
fn walk_owned_by(dir: &Path, uid: u32) -> Vec<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut found = Vec::new();
    let mut stack = vec![(dir.to_owned(), 0)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.uid() >= uid && meta.uid() < uid + agentvmd::image::sandbox::BUILD_UIDS {
                found.push(entry.path());
            }
            if meta.is_dir() && depth < 1 {
                stack.push((entry.path(), depth + 1));
            }
        }
    }
    found
}
