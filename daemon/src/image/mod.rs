//! Guest image bundles (`agentvm image build`): a directory holding the kernel (`vmlinux`),
//! an initramfs (`initramfs.cpio`: the agent as `/init`, the image configuration, the
//! harness under `/opt/harness`), `image.toml` (how the host boots it) and `manifest.json`
//! (sha256 and size of each). The same inputs give byte-identical bundles.

pub mod cpio;
pub mod elf;
pub mod oci;
pub mod oci_layout;
pub mod sandbox;
pub mod tree;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use agentvm_guest::image::{IMAGE_CONFIG_PATH, ImageConfig, ImageConfigError, WorkspaceFs};
use serde::Serialize;
use sha2::{Digest, Sha256};

use cpio::{Entry, Kind};

/// Bumped when the bundle layout changes.
pub const BUNDLE_FORMAT: u32 = 1;
pub const KERNEL_FILE: &str = "vmlinux";
pub const INITRAMFS_FILE: &str = "initramfs.cpio";
pub const CONFIG_FILE: &str = "image.toml";
pub const MANIFEST_FILE: &str = "manifest.json";
/// A container image's root filesystem (erofs, read-only; shared by every VM of the image).
pub const ROOTFS_FILE: &str = "rootfs.erofs";
/// The formatted template each session's workspace disk starts as (an image with an ext4
/// workspace). Sparse; its digest is over its data pages.
pub const WORKSPACE_FILE: &str = "workspace.img";
const HARNESS_ROOT: &str = "opt/harness";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    Config(#[from] ImageConfigError),
    #[error("{field}: {why}")]
    Invalid { field: &'static str, why: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn invalid(field: &'static str, why: impl Into<String>) -> ImageError {
    ImageError::Invalid {
        field,
        why: why.into(),
    }
}

/// Parts given on the command line, used where `[build]` names none.
#[derive(Debug, Clone, Default)]
pub struct BuildInputs {
    pub kernel: Option<PathBuf>,
    pub agent: Option<PathBuf>,
    /// A container image to use as the root filesystem (`--oci`), where `[build]` names none.
    pub oci: Option<PathBuf>,
    /// Where the container image's bytes are handled: `None` in this process (a build as
    /// an ordinary user already is unprivileged).
    pub sandbox: Option<sandbox::Sandbox>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileDigest {
    pub sha256: String,
    pub size: u64,
    /// `pages`: the sha256 is over the file's non-zero 4 KiB pages (a sparse disk image),
    /// not its bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<&'static str>,
}

/// The `digest` of a file hashed by its pages.
pub const PAGES_DIGEST: &str = "pages";

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Manifest {
    pub format: u32,
    pub files: BTreeMap<String, FileDigest>,
}

fn digest(bytes: &[u8]) -> FileDigest {
    FileDigest {
        sha256: hex::encode(Sha256::digest(bytes)),
        size: bytes.len() as u64,
        digest: None,
    }
}

/// A stable UUID for a filesystem the builder makes, from `seed` (so rebuilding the same
/// inputs gives the same bytes).
fn seeded_uuid(seed: &[u8], salt: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(salt.as_bytes());
    hasher.update(seed);
    let h = hex::encode(&hasher.finalize()[..16]);
    format!(
        "{}-{}-4{}-8{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}

/// The container image's tree as an uncompressed erofs image at `path` (erofs-utils'
/// mkfs.erofs), with fixed timestamps and a UUID from `seed`: the same image gives the same
/// bytes. Uncompressed, so a cold read is one read, and the host's page cache holds each
/// block once for every VM of the image.
fn make_erofs(
    tree: &Path,
    path: &Path,
    seed: &[u8],
    sandboxed: Option<(&sandbox::Sandbox, &Path)>,
) -> Result<FileDigest, ImageError> {
    let _ = std::fs::remove_file(path);
    let uuid = format!("-U{}", seeded_uuid(seed, "rootfs"));
    match sandboxed {
        None => {
            let mut mkfs = std::process::Command::new("mkfs.erofs");
            mkfs.arg("-T0").arg(&uuid).arg(path).arg(tree);
            run_tool(mkfs, "build.oci", "erofs-utils", path)?;
        }
        // mkfs.erofs reads the tree as its owners mean it, in the namespace, and writes into
        // the scratch directory; the bundle's file is this process's own copy.
        Some((sandbox, scratch)) => {
            const MADE: &str = "rootfs.erofs";
            let tree_name = tree.strip_prefix(scratch).map_err(|_| {
                invalid(
                    "build.oci",
                    format!("{} is not in {}", tree.display(), scratch.display()),
                )
            })?;
            let args = [
                OsStr::new("-T0"),
                OsStr::new(&uuid),
                OsStr::new(MADE),
                tree_name.as_os_str(),
            ];
            sandbox.mkfs_erofs(scratch, &args)?;
            let made = tree::Tree::open(scratch)
                .and_then(|dir| dir.open_file(Path::new(MADE)))
                .map_err(io_error(&scratch.join(MADE)))?;
            let mut out = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(io_error(path))?;
            std::io::copy(&mut std::io::BufReader::new(made), &mut out)
                .and_then(|_| out.sync_all())
                .map_err(io_error(path))?;
        }
    }
    paged_digest(path)
}

/// Runs a filesystem tool of Debian's (`package`) that writes `path`; its failure is an
/// error of the image.toml `field` that asked for it, with what the tool said.
fn run_tool(
    mut cmd: std::process::Command,
    field: &'static str,
    package: &str,
    path: &Path,
) -> Result<(), ImageError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let output = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            invalid(
                field,
                format!("needs {program} (Debian: apt-get install {package}): {e}"),
            )
        })?;
    if output.status.success() {
        return Ok(());
    }
    Err(invalid(
        field,
        format!(
            "{program} {}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ),
    ))
}

/// A disk image's manifest entry: its size and the digest of its data pages.
fn paged_digest(path: &Path) -> Result<FileDigest, ImageError> {
    let file = std::fs::File::open(path).map_err(io_error(path))?;
    let size = file.metadata().map_err(io_error(path))?.len();
    let (sha256, _pages) = agentvm_snapshot::pages::file_digest(&file).map_err(io_error(path))?;
    Ok(FileDigest {
        sha256,
        size,
        digest: Some(PAGES_DIGEST),
    })
}

/// Fills what the container image says it runs into `config`, where image.toml leaves it
/// unsaid: the command (Entrypoint and Cmd), the environment, the working directory and the
/// user; and marks the image as booting into its root filesystem.
fn runs_image(
    config: &mut ImageConfig,
    run: &oci::RunConfig,
    tree: &tree::Tree,
) -> Result<(), ImageError> {
    config.vm.rootfs = true;
    if config.harness.command.is_empty() {
        config.harness.command = run.entrypoint.iter().chain(&run.cmd).cloned().collect();
        if config.harness.command.is_empty() {
            return Err(invalid(
                "harness.command",
                "the container image has no Entrypoint or Cmd: give harness.command",
            ));
        }
    }
    for pair in &run.env {
        if let Some((key, value)) = pair.split_once('=') {
            config
                .harness
                .env
                .entry(key.to_owned())
                .or_insert_with(|| value.to_owned());
        }
    }
    // A bare program name is looked up on the image's PATH, as a container runtime would.
    let program = config.harness.command[0].clone();
    if !program.starts_with('/') {
        let path = config
            .harness
            .env
            .get("PATH")
            .cloned()
            .unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".to_owned());
        let found = path
            .split(':')
            .filter(|dir| dir.starts_with('/'))
            .map(|dir| format!("{}/{program}", dir.trim_end_matches('/')))
            .find(|candidate| {
                tree.kind(Path::new(candidate.trim_start_matches('/')))
                    .is_ok_and(|kind| kind.is_some())
            })
            .ok_or_else(|| {
                invalid(
                    "harness.command",
                    format!("{program:?} is not on the image's PATH ({path})"),
                )
            })?;
        config.harness.command[0] = found;
    }
    if config.harness.workdir == Path::new("/") && !run.working_dir.is_empty() {
        config.harness.workdir = PathBuf::from(&run.working_dir);
    }
    if !run.user.is_empty() {
        let (uid, gid) = image_user(&run.user, tree)?;
        config.harness.uid = uid;
        config.harness.gid = gid;
    }
    Ok(())
}

/// The most an image's /etc/passwd or /etc/group is read of.
const MAX_ACCOUNTS_FILE: u64 = 4 << 20;

/// A container image's `User` (`name`, `uid`, `name:group` or `uid:gid`) as numbers, names
/// looked up in the image's own /etc/passwd and /etc/group.
fn image_user(user: &str, tree: &tree::Tree) -> Result<(u32, u32), ImageError> {
    let lookup = |file: &str, name: &str| -> Option<(u32, u32)> {
        let bytes = tree.read(Path::new(file), MAX_ACCOUNTS_FILE).ok()?;
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(|line| line.split(':').collect::<Vec<_>>())
            .find(|fields| fields.first() == Some(&name))
            .and_then(|fields| {
                Some((
                    fields.get(2)?.parse().ok()?,
                    fields.get(3)?.parse().unwrap_or(0),
                ))
            })
    };
    let unknown = |what: &str| invalid("oci", format!("the image's User {user:?}: no {what}"));
    let (name, group) = match user.split_once(':') {
        Some((name, group)) => (name, Some(group)),
        None => (user, None),
    };
    let (uid, primary) = match name.parse::<u32>() {
        Ok(uid) => (uid, lookup("etc/passwd", name).map_or(0, |(_, gid)| gid)),
        Err(_) => lookup("etc/passwd", name).ok_or_else(|| unknown("such user in /etc/passwd"))?,
    };
    let gid = match group {
        None => primary,
        Some(group) => match group.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => lookup("etc/group", group)
                .map(|(gid, _)| gid)
                .ok_or_else(|| unknown("such group in /etc/group"))?,
        },
    };
    Ok((uid, gid))
}

/// The harness program must be in the container image's tree and executable (following
/// symlinks inside the tree).
fn check_program_in_tree(config: &ImageConfig, tree: &tree::Tree) -> Result<(), ImageError> {
    let program = &config.harness.command[0];
    let (path, found) = resolve_program(program, |path| {
        let at = Path::new(path);
        match tree.stat(at) {
            Err(_) | Ok(None) => Found::Missing,
            Ok(Some((tree::Kind::Symlink, _))) => tree.read_link(at).map_or(Found::Missing, |t| {
                Found::Link(t.to_string_lossy().into_owned())
            }),
            Ok(Some((tree::Kind::File, mode))) if mode & 0o111 != 0 => Found::Executable,
            Ok(Some(_)) => Found::NotExecutable,
        }
    });
    let why = match found {
        Found::Executable => return Ok(()),
        Found::NotExecutable => format!("/{path} in the container image is not an executable file"),
        Found::Missing => format!("/{path} is not in the container image"),
        Found::Link(_) => format!("{program} is a loop of symlinks"),
    };
    Err(invalid("harness.command", why))
}

/// What a path of an image holds, as far as finding the harness program goes.
enum Found {
    Executable,
    NotExecutable,
    /// A symlink, and its target.
    Link(String),
    Missing,
}

/// Follows `program` (absolute in the image) through the image's symlinks, asking `lookup`
/// what each path (relative to the image's root) is; returns the last path and what it is
/// (still a `Link` after 16 hops: a loop).
fn resolve_program(program: &str, lookup: impl Fn(&str) -> Found) -> (String, Found) {
    let mut path = program.trim_start_matches('/').to_owned();
    for _ in 0..16 {
        match lookup(&path) {
            Found::Link(target) => {
                path = match target.strip_prefix('/') {
                    Some(abs) => abs.to_owned(),
                    None => {
                        let parent = Path::new(&path).parent().unwrap_or(Path::new(""));
                        normalize(&parent.join(&target))
                    }
                };
            }
            other => return (path, other),
        }
    }
    let last = lookup(&path);
    (path, last)
}

/// Formats `path` as the workspace template: an ext4 filesystem of `mib` MiB labelled
/// `workspace`, written by Debian's mke2fs. Its identity (UUID, hash seed) comes from `seed`
/// and its timestamps are fixed, so the same image.toml gives the same bytes.
fn format_workspace(path: &Path, mib: u32, seed: &[u8]) -> Result<FileDigest, ImageError> {
    let uuid = seeded_uuid(seed, "workspace");
    let _ = std::fs::remove_file(path);
    let file = std::fs::File::create(path).map_err(io_error(path))?;
    file.set_len(u64::from(mib) << 20).map_err(io_error(path))?;
    drop(file);
    let mut mke2fs = std::process::Command::new("mke2fs");
    mke2fs
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-L",
            "workspace",
            "-U",
            &uuid,
            "-E",
        ])
        .arg(format!(
            "hash_seed={uuid},lazy_itable_init=1,lazy_journal_init=1,nodiscard"
        ))
        .arg(path)
        // mke2fs stamps the superblock with this time instead of now.
        .env("E2FSPROGS_FAKE_TIME", "1");
    run_tool(mke2fs, "vm.workspace_fs", "e2fsprogs", path)?;
    paged_digest(path)
}

/// Builds the bundle for `config_path` into `output` (created if needed; the four files are
/// replaced).
pub fn build(
    config_path: &Path,
    output: &Path,
    inputs: &BuildInputs,
) -> Result<Manifest, ImageError> {
    let mut config = ImageConfig::load(config_path)?;
    let base = config_path.parent().unwrap_or(Path::new("."));
    let build = config.build.clone().unwrap_or_default();
    let resolve = |p: &PathBuf| {
        if p.is_absolute() {
            p.clone()
        } else {
            base.join(p)
        }
    };
    let scratch = tempfile::tempdir().map_err(io_error(Path::new("a scratch directory")))?;
    let sandbox = inputs.sandbox.as_ref();
    if let Some(sandbox) = sandbox {
        sandbox.prepare(scratch.path())?;
    }
    let rootfs = match build
        .oci
        .as_ref()
        .map(resolve)
        .or_else(|| inputs.oci.clone())
    {
        Some(source) => {
            let tree = scratch.path().join("rootfs");
            std::fs::create_dir(&tree).map_err(io_error(&tree))?;
            if sandbox.is_some() {
                std::os::unix::fs::chown(
                    &tree,
                    Some(sandbox::BUILD_UID_BASE),
                    Some(sandbox::BUILD_UID_BASE),
                )
                .map_err(io_error(&tree))?;
            }
            let run = oci::unpack_with(&source, &tree, scratch.path(), sandbox)?;
            let unpacked = tree::Tree::open(&tree).map_err(io_error(&tree))?;
            runs_image(&mut config, &run, &unpacked)?;
            Some((tree, unpacked))
        }
        None if config.harness.command.is_empty() => {
            return Err(invalid(
                "harness.command",
                "is empty (it may be left out only with a container image: [build] oci or --oci)",
            ));
        }
        None => None,
    };

    let kernel_path = build
        .kernel
        .as_ref()
        .map(resolve)
        .or_else(|| inputs.kernel.clone())
        .ok_or_else(|| {
            invalid(
                "build.kernel",
                "no kernel given (set it, or pass --kernel; scripts/build-kernel.sh builds one)",
            )
        })?;
    let kernel = std::fs::read(&kernel_path).map_err(io_error(&kernel_path))?;
    elf::check_kernel(&kernel)
        .map_err(|why| invalid("build.kernel", format!("{}: {why}", kernel_path.display())))?;

    let agent_path = build
        .agent
        .as_ref()
        .map(resolve)
        .or_else(|| inputs.agent.clone())
        .ok_or_else(|| {
            invalid(
                "build.agent",
                "no agentvm-guest binary given (set it, or pass --agent)",
            )
        })?;
    let agent = std::fs::read(&agent_path).map_err(io_error(&agent_path))?;
    elf::check_static(&agent).map_err(|why| {
        invalid(
            "build.agent",
            format!(
                "{}: {why}; the agent runs as the guest's /init with no libraries: build it \
                 static with scripts/build-guest.sh and pass --agent \
                 target/x86_64-unknown-linux-gnu/release/agentvm-guest",
                agent_path.display()
            ),
        )
    })?;

    let mut entries = base_entries();
    entries.push(Entry {
        path: "init".into(),
        mode: 0o755,
        kind: Kind::File(agent),
    });
    let mut guest_config = config.clone();
    guest_config.build = None;
    let guest_toml = toml::to_string(&guest_config)
        .map_err(|e| invalid("image.toml", format!("cannot be written back: {e}")))?;
    entries.push(Entry {
        path: IMAGE_CONFIG_PATH.trim_start_matches('/').into(),
        mode: 0o644,
        kind: Kind::File(guest_toml.clone().into_bytes()),
    });
    match (&build.harness_dir, &build.harness_binary) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "build",
                "harness_dir and harness_binary are alternatives; give one",
            ));
        }
        // The container image holds the harness.
        (None, None) if rootfs.is_some() => {}
        (None, None) => {
            return Err(invalid(
                "build",
                "no harness: give harness_dir (a directory) or harness_binary (a static binary)",
            ));
        }
        (Some(dir), None) => {
            let dir = resolve(dir);
            entries.push(Entry {
                path: HARNESS_ROOT.into(),
                mode: 0o755,
                kind: Kind::Dir,
            });
            collect_dir(&dir, HARNESS_ROOT, &mut entries)?;
        }
        (None, Some(bin)) => {
            let bin = resolve(bin);
            let bytes = std::fs::read(&bin).map_err(io_error(&bin))?;
            elf::check_static(&bytes).map_err(|why| {
                invalid(
                    "build.harness_binary",
                    format!(
                        "{}: {why} (use harness_dir to ship a runtime with it)",
                        bin.display()
                    ),
                )
            })?;
            let name = bin
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| invalid("build.harness_binary", "has no file name"))?;
            entries.push(Entry {
                path: HARNESS_ROOT.into(),
                mode: 0o755,
                kind: Kind::Dir,
            });
            entries.push(Entry {
                path: format!("{HARNESS_ROOT}/{name}"),
                mode: 0o755,
                kind: Kind::File(bytes),
            });
        }
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    match &rootfs {
        Some((_, unpacked)) => check_program_in_tree(&config, unpacked)?,
        None => check_program(&config, &entries)?,
    }

    let mut initramfs = Vec::new();
    let mut w = cpio::Writer::new(&mut initramfs);
    for e in &entries {
        w.entry(e).map_err(io_error(Path::new(INITRAMFS_FILE)))?;
    }
    w.finish().map_err(io_error(Path::new(INITRAMFS_FILE)))?;

    std::fs::create_dir_all(output).map_err(io_error(output))?;
    let mut files = BTreeMap::new();
    for (name, bytes) in [
        (KERNEL_FILE, kernel.as_slice()),
        (INITRAMFS_FILE, initramfs.as_slice()),
        (CONFIG_FILE, guest_toml.as_bytes()),
    ] {
        let path = output.join(name);
        std::fs::write(&path, bytes).map_err(io_error(&path))?;
        files.insert(name.to_owned(), digest(bytes));
    }
    let rootfs_image = output.join(ROOTFS_FILE);
    match &rootfs {
        Some((tree, _)) => {
            let sandboxed = sandbox.map(|s| (s, scratch.path()));
            let made = make_erofs(tree, &rootfs_image, guest_toml.as_bytes(), sandboxed)?;
            files.insert(ROOTFS_FILE.to_owned(), made);
        }
        None if rootfs_image.exists() => {
            std::fs::remove_file(&rootfs_image).map_err(io_error(&rootfs_image))?;
        }
        None => {}
    }
    let workspace = output.join(WORKSPACE_FILE);
    if config.vm.workspace_mib > 0 && config.vm.workspace_fs == WorkspaceFs::Ext4 {
        let formatted =
            format_workspace(&workspace, config.vm.workspace_mib, guest_toml.as_bytes())?;
        files.insert(WORKSPACE_FILE.to_owned(), formatted);
    } else if workspace.exists() {
        // A bundle rebuilt without a workspace must not keep the old one's template.
        std::fs::remove_file(&workspace).map_err(io_error(&workspace))?;
    }
    let manifest = Manifest {
        format: BUNDLE_FORMAT,
        files,
    };
    let path = output.join(MANIFEST_FILE);
    let mut text = serde_json::to_string_pretty(&manifest).expect("plain data");
    text.push('\n');
    std::fs::write(&path, text).map_err(io_error(&path))?;
    Ok(manifest)
}

/// The directories a Linux userland expects, and the device nodes the kernel needs before
/// devtmpfs is mounted (the console `/init` writes to, /dev/null).
fn base_entries() -> Vec<Entry> {
    let dir = |p: &str, mode| Entry {
        path: p.into(),
        mode,
        kind: Kind::Dir,
    };
    vec![
        dir("dev", 0o755),
        Entry {
            path: "dev/console".into(),
            mode: 0o600,
            kind: Kind::CharDevice(5, 1),
        },
        Entry {
            path: "dev/null".into(),
            mode: 0o666,
            kind: Kind::CharDevice(1, 3),
        },
        dir("etc", 0o755),
        dir("etc/agentvm", 0o755),
        dir("opt", 0o755),
        dir("proc", 0o555),
        dir("run", 0o755),
        dir("sys", 0o555),
        dir("tmp", 0o1777),
    ]
}

/// Adds `dir`'s tree under `at`: directories, regular files and symlinks, sorted, with their
/// permission bits. Anything else (devices, sockets, fifos) is refused.
fn collect_dir(dir: &Path, at: &str, entries: &mut Vec<Entry>) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt;
    let mut children: Vec<_> = std::fs::read_dir(dir)
        .map_err(io_error(dir))?
        .collect::<Result<_, _>>()
        .map_err(io_error(dir))?;
    children.sort_by_key(|e| e.file_name());
    for child in children {
        let path = child.path();
        let name = child.file_name();
        let name = name.to_str().ok_or_else(|| {
            invalid(
                "build.harness_dir",
                format!("{}: not a UTF-8 name", path.display()),
            )
        })?;
        let inside = format!("{at}/{name}");
        let meta = std::fs::symlink_metadata(&path).map_err(io_error(&path))?;
        let mode = meta.permissions().mode();
        let kind = if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&path).map_err(io_error(&path))?;
            Kind::Symlink(target.to_string_lossy().into_owned())
        } else if meta.is_dir() {
            entries.push(Entry {
                path: inside.clone(),
                mode,
                kind: Kind::Dir,
            });
            collect_dir(&path, &inside, entries)?;
            continue;
        } else if meta.is_file() {
            Kind::File(std::fs::read(&path).map_err(io_error(&path))?)
        } else {
            return Err(invalid(
                "build.harness_dir",
                format!(
                    "{}: only files, directories and symlinks can go in an image",
                    path.display()
                ),
            ));
        };
        entries.push(Entry {
            path: inside,
            mode,
            kind,
        });
    }
    Ok(())
}

/// The harness program must be in the image and executable.
fn check_program(config: &ImageConfig, entries: &[Entry]) -> Result<(), ImageError> {
    // Following symlinks inside the image (a runtime's `bin/python3 -> python3.11`).
    let (path, found) = resolve_program(&config.harness.command[0], |path| {
        match entries.iter().find(|e| e.path == path) {
            Some(Entry {
                kind: Kind::File(_),
                mode,
                ..
            }) if mode & 0o111 != 0 => Found::Executable,
            Some(Entry {
                kind: Kind::File(_),
                ..
            }) => Found::NotExecutable,
            Some(Entry {
                kind: Kind::Symlink(target),
                ..
            }) => Found::Link(target.clone()),
            _ => Found::Missing,
        }
    });
    match found {
        Found::Executable => return Ok(()),
        Found::NotExecutable => {
            return Err(invalid(
                "harness.command",
                format!("/{path} is in the image but not executable"),
            ));
        }
        Found::Missing | Found::Link(_) => {}
    }
    let shipped: Vec<String> = entries
        .iter()
        .filter(|e| e.path.starts_with(HARNESS_ROOT) && matches!(e.kind, Kind::File(_)))
        .map(|e| format!("/{}", e.path))
        .take(10)
        .collect();
    Err(invalid(
        "harness.command",
        format!(
            "{} is not in the image (files under /{HARNESS_ROOT}: {})",
            config.harness.command[0],
            if shipped.is_empty() {
                "none".to_owned()
            } else {
                shipped.join(", ")
            }
        ),
    ))
}

/// `a/b/../c` → `a/c`, without touching the file system.
fn normalize(p: &Path) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(s) => parts.push(s.to_str().unwrap_or("")),
            _ => {}
        }
    }
    parts.join("/")
}
