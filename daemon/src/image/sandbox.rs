//! A root image build handles no byte of the container image as root.
//!
//! Why: an image is hostile input (its layers plant links and whiteouts, its archives are
//! bombs), and the code that makes files from it is the part most likely to hold the next
//! bug. [`super::tree::Tree`] keeps every write inside the tree being built; this keeps a
//! bug there from having root's rights at all. What reads the image's bytes and writes
//! files from them (an archive's extraction, each layer, `mkfs.erofs` over the tree) runs as
//! `agentvm image unpack` or `mkfs.erofs` in a child that is root only of a user namespace
//! of its own, the way rootless container builders run: ids `0..BUILD_UIDS` there are the
//! host's `BUILD_UID_BASE..`, so the image's owners are kept (the child chowns, mkfs.erofs
//! reads them back as the image means them) while on the host the child is an unprivileged
//! uid that may write nothing it did not make. In its own mount namespace the host's
//! world-writable places (`/tmp`, `/var/tmp`, `/dev/shm`, `/run/lock`) are empty tmpfs, so
//! there is nowhere it could leave anything for another user; it has no network and no new
//! privileges. The child gets what it reads as an open descriptor (the archive, each layer
//! blob) and works in the build's scratch directory, its current directory, given to its
//! uid; this process keeps the reading of the image's metadata and digests, and copies
//! the finished erofs out into a file of its own.

use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::sys::{IdMap, Step, cpath, spawn_in_user_namespace};

use super::{ImageError, invalid, io_error};

/// The host uid (and gid) that is root in a build's user namespace: above the VMM jail's
/// range (`vm_uid_base`, 0x70000000 by default) and below 2^31.
pub const BUILD_UID_BASE: u32 = 0x7f00_0000;
/// How many ids a build's namespace maps: every owner a real image uses (nobody is 65534;
/// a few images use ids in the hundred thousands).
pub const BUILD_UIDS: u32 = 1 << 20;

/// The host's world-writable directories, hidden from the child behind empty tmpfs.
const SHARED_WRITABLE: [&str; 4] = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"];

/// What `agentvm image unpack` is asked to do, its descriptor on standard input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// Extract an image archive (a tar) into a directory.
    Archive,
    /// Apply one layer blob over a tree.
    Layer,
}

impl Job {
    pub fn name(self) -> &'static str {
        match self {
            Job::Archive => "archive",
            Job::Layer => "layer",
        }
    }

    pub fn parse(name: &str) -> Option<Job> {
        [Job::Archive, Job::Layer]
            .into_iter()
            .find(|job| job.name() == name)
    }
}

/// Runs a root build's image-handling steps in user namespaces (see the module doc).
#[derive(Debug, Clone)]
pub struct Sandbox {
    /// The `agentvm` binary, whose hidden `image unpack` does the work.
    helper: PathBuf,
}

impl Sandbox {
    pub fn new(helper: PathBuf) -> Sandbox {
        Sandbox { helper }
    }

    /// Gives `scratch` (this process's, empty) to the namespace's root, which works there.
    pub fn prepare(&self, scratch: &Path) -> Result<(), ImageError> {
        use std::os::unix::fs::PermissionsExt;
        std::os::unix::fs::chown(scratch, Some(BUILD_UID_BASE), Some(BUILD_UID_BASE))
            .and_then(|()| {
                std::fs::set_permissions(scratch, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(io_error(scratch))
    }

    /// Extracts the archive at `source` into `scratch/dir`.
    pub fn extract_archive(
        &self,
        source: &Path,
        scratch: &Path,
        dir: &str,
    ) -> Result<(), ImageError> {
        let archive = File::open(source).map_err(io_error(source))?;
        let label = source.display().to_string();
        self.unpack(scratch, Job::Archive, dir, &label, archive, None)
            .map(drop)
    }

    /// Applies `layers` (each blob's path in the layout, for messages, and the open blob)
    /// in order over `root`, a directory in `scratch`.
    pub fn apply_layers(
        &self,
        scratch: &Path,
        root: &Path,
        layers: &[(PathBuf, File)],
    ) -> Result<(), ImageError> {
        let inside = root
            .strip_prefix(scratch)
            .ok()
            .and_then(|rel| rel.to_str())
            .filter(|rel| !rel.is_empty() && !rel.contains('/'))
            .ok_or_else(|| {
                invalid(
                    "oci",
                    format!(
                        "{} is not a directory of the build's scratch {}",
                        root.display(),
                        scratch.display()
                    ),
                )
            })?;
        let mut budget = super::oci::MAX_UNPACKED;
        for (path, file) in layers {
            let blob = file.try_clone().map_err(io_error(path))?;
            let label = path.display().to_string();
            let left = self.unpack(scratch, Job::Layer, inside, &label, blob, Some(budget))?;
            // Never more than it had: what the child says is only believed downwards.
            budget = left.filter(|&left| left <= budget).ok_or_else(|| {
                invalid(
                    "oci",
                    format!("layer {label}: the unpacker did not say what is left"),
                )
            })?;
        }
        Ok(())
    }

    /// Runs `agentvm image unpack JOB DIR LABEL [BUDGET]` on `input`; returns what it
    /// printed as the budget left.
    fn unpack(
        &self,
        scratch: &Path,
        job: Job,
        dir: &str,
        label: &str,
        input: File,
        budget: Option<u64>,
    ) -> Result<Option<u64>, ImageError> {
        // Run through a descriptor: the helper may lie where the child cannot look (under
        // the /tmp its namespace hides, or a directory only root may pass).
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let helper = File::open(&self.helper).map_err(io_error(&self.helper))?;
        let mut command = Command::new(format!("/proc/self/fd/{}", helper.as_raw_fd()));
        command
            .arg0("agentvm")
            .args(["image", "unpack", job.name(), dir, label])
            .args(budget.map(|b| b.to_string()));
        let out = self.run(scratch, command, Stdio::from(input))?;
        drop(helper);
        Ok(out.trim().parse().ok())
    }

    /// Runs mkfs.erofs's `args` in `scratch` (where it reads the tree and writes the image).
    pub fn mkfs_erofs(&self, scratch: &Path, args: &[&OsStr]) -> Result<(), ImageError> {
        let mut command = Command::new("mkfs.erofs");
        command.args(args);
        self.run(scratch, command, Stdio::null()).map(drop)
    }

    /// Runs `command` in the namespace with `scratch` as its current directory; its standard
    /// output on success, else its standard error as the error of the build.
    fn run(
        &self,
        scratch: &Path,
        mut command: Command,
        stdin: Stdio,
    ) -> Result<String, ImageError> {
        let program = command.get_program().to_string_lossy().into_owned();
        command
            .current_dir(scratch)
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Nothing of the caller's environment but what finds and runs programs.
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LC_ALL", "C");
        let child = spawn_in_user_namespace(
            &mut command,
            IdMap {
                base: BUILD_UID_BASE,
                count: BUILD_UIDS,
            },
            mount_steps(scratch)?,
        )
        .map_err(|e| {
            invalid(
                "oci",
                format!(
                    "cannot start {program} as an unprivileged uid in a user namespace of its \
                     own: {e} (pass --no-sandbox to build as root anyway)"
                ),
            )
        })?;
        let output = child
            .wait_with_output()
            .map_err(io_error(Path::new(&program)))?;
        if output.status.success() {
            return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
        }
        let said = String::from_utf8_lossy(&output.stderr);
        let said = said.trim();
        let said = said.strip_prefix("oci: ").unwrap_or(said);
        Err(invalid(
            "oci",
            match said.is_empty() {
                true => format!("{program} failed ({})", output.status),
                false => said.to_owned(),
            },
        ))
    }
}

/// The child's mount namespace: nothing propagates out of it, and the host's
/// world-writable directories are empty tmpfs but for `scratch` (its current directory),
/// bound back at its own path where it lay in one of them: tools find their inputs by
/// absolute path (mkfs.erofs resolves its source directory).
fn mount_steps(scratch: &Path) -> Result<Vec<Step>, ImageError> {
    let c = |path: &str| cpath(Path::new(path)).map_err(|why| invalid("oci", why));
    let mut steps = vec![Step::Mount {
        source: None,
        target: c("/")?,
        fstype: None,
        flags: nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
        data: None,
    }];
    for dir in SHARED_WRITABLE {
        if Path::new(dir).is_dir() {
            steps.push(Step::Mount {
                source: Some(c("tmpfs")?),
                target: c(dir)?,
                fstype: Some(c("tmpfs")?),
                flags: nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
                data: Some(c("size=16m,mode=1777")?),
            });
            if let Ok(inside) = scratch.strip_prefix(dir) {
                let mut at = PathBuf::from(dir);
                for part in inside.components() {
                    at.push(part);
                    steps.push(Step::Mkdir(cpath(&at).map_err(|why| invalid("oci", why))?));
                }
                steps.push(Step::Mount {
                    source: Some(c(".")?),
                    target: cpath(scratch).map_err(|why| invalid("oci", why))?,
                    fstype: None,
                    flags: nix::mount::MsFlags::MS_BIND,
                    data: None,
                });
            }
        }
    }
    Ok(steps)
}

/// The child's side of [`Job`]: runs in `agentvm image unpack`, on standard input, in the
/// current directory. Returns what to print: the budget left after a layer.
pub fn serve(job: Job, dir: &Path, label: &str, budget: Option<u64>) -> Result<String, ImageError> {
    use std::os::fd::AsFd;
    let input = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map(File::from)
        .map_err(io_error(Path::new("standard input")))?;
    match job {
        Job::Archive => {
            std::fs::create_dir(dir).map_err(io_error(dir))?;
            super::oci::extract_archive(input, label, dir)?;
            Ok(String::new())
        }
        Job::Layer => {
            let tree = super::tree::Tree::open(dir).map_err(io_error(dir))?;
            let mut budget = budget.unwrap_or(super::oci::MAX_UNPACKED);
            let path = Path::new(label);
            let mut open = || super::oci::layer_reader(&input, path);
            super::oci::apply_layer(&mut open, path, &tree, &mut budget)?;
            Ok(format!("{budget}\n"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory given to a sandbox's namespace root; `None` (said) but as root.
    fn prepared() -> Option<(tempfile::TempDir, Sandbox)> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: only root maps a user namespace onto other uids");
            return None;
        }
        let scratch = tempfile::tempdir().unwrap();
        let sandbox = Sandbox::new(PathBuf::from("/nonexistent"));
        sandbox.prepare(scratch.path()).unwrap();
        Some((scratch, sandbox))
    }

    /// What the child of a root build is: root of its own namespace only, with no
    /// supplementary groups, no new privileges, no network, and none of the host's
    /// world-writable directories; what it chowns is an unprivileged host uid's.
    #[test]
    fn the_child_is_root_only_of_its_own_namespace() {
        let Some((scratch, sandbox)) = prepared() else {
            return;
        };
        let marker = tempfile::NamedTempFile::new_in("/tmp").unwrap();
        // Root's, and open to everyone to pass and read: the child may look, not write.
        let host = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            host.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let script = format!(
            "id -u; id -G; cat /proc/self/uid_map; grep NoNewPrivs /proc/self/status\n\
             grep -c : /proc/net/dev\n\
             test -e {marker} && echo marker-seen || echo marker-hidden\n\
             touch {host}/planted 2>/dev/null && echo host-written || echo host-refused\n\
             echo made > here && chown 1000:1001 here && echo scratch-written\n\
             pwd\n",
            marker = marker.path().display(),
            host = host.path().display(),
        );
        let mut command = Command::new("sh");
        command.args(["-c", &script]);
        let out = sandbox.run(scratch.path(), command, Stdio::null()).unwrap();
        let lines: Vec<&str> = out.lines().map(str::trim).collect();
        let map = format!("0 {BUILD_UID_BASE} {BUILD_UIDS}");
        assert_eq!(lines[0], "0", "{out}");
        assert_eq!(lines[1], "0", "no supplementary group of root's: {out}");
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>().join(" "),
            map,
            "{out}"
        );
        assert_eq!(lines[3].split_whitespace().last(), Some("1"), "{out}");
        assert_eq!(lines[4], "1", "only the loopback device: {out}");
        assert_eq!(lines[5], "marker-hidden", "{out}");
        assert_eq!(lines[6], "host-refused", "{out}");
        assert_eq!(lines[7], "scratch-written", "{out}");
        assert_eq!(Path::new(lines[8]), scratch.path(), "{out}");
        assert!(!host.path().join("planted").exists());
        let made = std::fs::metadata(scratch.path().join("here")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            (made.uid(), made.gid()),
            (BUILD_UID_BASE + 1000, BUILD_UID_BASE + 1001)
        );
    }

    /// A helper that fails says why, as the build's error.
    #[test]
    fn what_the_child_says_on_failure_is_the_error() {
        let Some((scratch, sandbox)) = prepared() else {
            return;
        };
        let mut command = Command::new("sh");
        command.args(["-c", "echo 'oci: layer x: broken' >&2; exit 2"]);
        let err = sandbox
            .run(scratch.path(), command, Stdio::null())
            .unwrap_err();
        assert_eq!(err.to_string(), "oci: layer x: broken");
    }
}
