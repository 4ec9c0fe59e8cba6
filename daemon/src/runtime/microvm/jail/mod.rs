//! Starting a VMM inside its jail (what Firecracker's jailer does, done by agentvmd itself):
//! a process cloned straight into new mount, PID, network, IPC and UTS namespaces, whose
//! root is a small private tmpfs holding only the VM's own files at their usual paths (so
//! the paths agentvmd sends through the API need no translation), a few device nodes and its
//! own /proc; it drops to a uid/gid of its own with no supplementary groups, inherits no
//! descriptor but stdin/stdout/stderr, and is exec'd from a descriptor opened before the
//! jail existed (the VMM binary itself need not be inside).
//!
//! Everything the child does between clone and exec is a list of [`Step`]s built before the
//! clone: the child may not allocate (another thread of the daemon may hold the allocator's
//! lock at the moment of the clone) and uses raw system calls only. A step that fails reports
//! its index and errno through a close-on-exec pipe, which the parent turns into a message.

mod spawn;

use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

pub use self::spawn::{ANCHOR_FD, Command, INHERITED_FD, spawn};
use nix::mount::MsFlags;
use nix::sys::resource::Resource;

use crate::sys::{Step, cpath, cstring};

/// What a jailed VMM may see and who it runs as.
#[derive(Debug, Clone, Default)]
pub struct Jail {
    /// An empty host directory the jail's root is mounted on, inside the child's own mount
    /// namespace only (every VMM may use the same one).
    pub staging: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// Visible read-write, at their own paths.
    pub writable: Vec<PathBuf>,
    /// Visible read-only, at their own paths (files or directories).
    pub readable: Vec<PathBuf>,
    /// Read-only and executable: shared libraries of a dynamically linked VMM.
    pub libraries: Vec<PathBuf>,
    /// Given the host's /dev/userfaultfd, owned by `uid` (a lazy restore opens it).
    pub userfaultfd: bool,
}

/// Device nodes every jail has: (name, mode). /dev/kvm is the VM user's alone, and so is
/// /dev/net/tun: with it the VMM attaches to the tap agentvmd made its own, and creates none
/// (that needs CAP_NET_ADMIN, which it does not have).
const DEVICES: [(&str, u32); 6] = [
    ("null", 0o666),
    ("zero", 0o666),
    ("urandom", 0o666),
    ("random", 0o666),
    ("kvm", 0o600),
    ("net/tun", 0o600),
];
/// The VM user's alone as well, in a jail that is given it.
const USERFAULTFD: (&str, u32) = ("userfaultfd", 0o600);
const ROOT_TMPFS_OPTIONS: &str = "mode=0755,size=1m,nr_inodes=4096";
const NOFILE_LIMIT: u64 = 8192;

/// The directories steps have made so far, so each is made once.
#[derive(Default)]
struct MountPoints(std::collections::BTreeSet<PathBuf>);

impl MountPoints {
    /// Steps making `path` (absolute) and its parents under `root`, those not made yet.
    fn mkdir_p(&mut self, steps: &mut Vec<Step>, root: &Path, path: &Path) -> Result<(), String> {
        let mut at = PathBuf::from("/");
        for part in path.strip_prefix("/").unwrap_or(path).components() {
            at.push(part);
            if self.0.insert(at.clone()) {
                steps.push(Step::Mkdir(cpath(&staged(root, &at))?));
            }
        }
        Ok(())
    }
}

/// `path` (absolute) as it sits under the staging directory.
fn staged(staging: &Path, path: &Path) -> PathBuf {
    staging.join(path.strip_prefix("/").unwrap_or(path))
}

/// The steps that build `jail` under its staging directory and enter it.
fn jail_steps(jail: &Jail) -> Result<Vec<Step>, String> {
    let staging = &jail.staging;
    let mut steps = Vec::new();
    // Nothing mounted from here on may reach the host's namespace.
    steps.push(Step::Mount {
        source: None,
        target: cstring(b"/")?,
        fstype: None,
        flags: MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        data: None,
    });
    steps.push(Step::Mount {
        source: Some(cstring(b"tmpfs")?),
        target: cpath(staging)?,
        fstype: Some(cstring(b"tmpfs")?),
        flags: MsFlags::MS_NOSUID,
        data: Some(cstring(ROOT_TMPFS_OPTIONS.as_bytes())?),
    });
    let mut made = MountPoints::default();
    let mut mkdir_p = |steps: &mut Vec<Step>, path: &Path| made.mkdir_p(steps, staging, path);
    let mut binds: Vec<(&PathBuf, MsFlags)> = Vec::new();
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    binds.extend(
        jail.writable
            .iter()
            .map(|p| (p, nosuid_nodev | MsFlags::MS_NOEXEC)),
    );
    binds.extend(
        jail.readable
            .iter()
            .map(|p| (p, nosuid_nodev | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY)),
    );
    binds.extend(
        jail.libraries
            .iter()
            .map(|p| (p, nosuid_nodev | MsFlags::MS_RDONLY)),
    );
    // Parents before what is inside them.
    binds.sort();
    for (path, flags) in binds {
        if !path.is_absolute() {
            return Err(format!("{} is not an absolute path", path.display()));
        }
        let meta =
            std::fs::symlink_metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let target = staged(staging, path);
        if meta.file_type().is_symlink() {
            // Such as /lib -> usr/lib on a merged-/usr system: recreated, not followed.
            if let Some(parent) = path.parent() {
                mkdir_p(&mut steps, parent)?;
            }
            let points_to =
                std::fs::read_link(path).map_err(|e| format!("{}: {e}", path.display()))?;
            steps.push(Step::Symlink {
                target: cpath(&points_to)?,
                link: cpath(&target)?,
            });
            continue;
        }
        if meta.is_dir() {
            mkdir_p(&mut steps, path)?;
        } else {
            if let Some(parent) = path.parent() {
                mkdir_p(&mut steps, parent)?;
            }
            steps.push(Step::Touch(cpath(&target)?));
        }
        let target = cpath(&target)?;
        steps.push(Step::Mount {
            source: Some(cpath(path)?),
            target: target.clone(),
            fstype: None,
            flags: MsFlags::MS_BIND | MsFlags::MS_REC,
            data: None,
        });
        // Bind mounts take their flags only on a remount.
        steps.push(Step::Mount {
            source: None,
            target,
            fstype: None,
            flags: MsFlags::MS_REMOUNT | MsFlags::MS_BIND | flags,
            data: None,
        });
    }
    mkdir_p(&mut steps, Path::new("/dev/net"))?;
    let userfaultfd = jail.userfaultfd.then_some(USERFAULTFD);
    for (name, mode) in DEVICES.into_iter().chain(userfaultfd) {
        let host = Path::new("/dev").join(name);
        let Ok(meta) = std::fs::metadata(&host) else {
            continue;
        };
        if !meta.file_type().is_char_device() {
            continue;
        }
        let path = cpath(&staged(staging, &host))?;
        steps.push(Step::Mknod {
            path: path.clone(),
            mode,
            device: meta.rdev(),
        });
        if mode == 0o600 {
            steps.push(Step::Chown {
                path,
                uid: jail.uid,
                gid: jail.gid,
            });
        }
    }
    mkdir_p(&mut steps, Path::new("/proc"))?;
    // Mounted by the child, in its new PID namespace: it shows the VMM and nothing else.
    steps.push(Step::Mount {
        source: Some(cstring(b"proc")?),
        target: cpath(&staging.join("proc"))?,
        fstype: Some(cstring(b"proc")?),
        flags: nosuid_nodev | MsFlags::MS_NOEXEC,
        data: None,
    });
    steps.push(Step::Chdir(cpath(staging)?));
    steps.push(Step::PivotHere);
    steps.push(Step::Mount {
        source: None,
        target: cstring(b"/")?,
        fstype: None,
        flags: MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
        data: None,
    });
    for (resource, value) in [
        (Resource::RLIMIT_CORE, 0),
        (Resource::RLIMIT_NOFILE, NOFILE_LIMIT),
    ] {
        steps.push(Step::Rlimit { resource, value });
    }
    steps.push(Step::DropPrivileges {
        uid: jail.uid,
        gid: jail.gid,
    });
    steps.push(Step::NoNewPrivileges);
    Ok(steps)
}

/// Shows the jailed process `pid` more host paths, at their own paths and with the flags its
/// jail gives them (a VMM started ahead of its VM learns them only once it is claimed):
/// `writable` read-write, `readable` read-only, neither executable nor honouring set-uid
/// bits or devices. Each is a detached copy of the host's mount made here, with its flags
/// set before it is visible anywhere, attached inside the jail's mount namespace by a child
/// that enters it; the jail's root is writable only while that child makes mount points.
pub fn inject(pid: u32, writable: &[PathBuf], readable: &[PathBuf]) -> Result<(), String> {
    use crate::sys::{
        MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY, detached_tree,
    };
    use std::os::fd::AsRawFd;
    let namespace = File::open(format!("/proc/{pid}/ns/mnt"))
        .map_err(|e| format!("the jail of process {pid}: {e}"))?;
    let confined = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
    let mut shown: Vec<(&PathBuf, u64)> = writable.iter().map(|p| (p, confined)).collect();
    shown.extend(readable.iter().map(|p| (p, confined | MOUNT_ATTR_RDONLY)));
    // Parents before what is inside them.
    shown.sort();
    let mut steps = vec![
        Step::Setns {
            fd: namespace.as_raw_fd(),
            nstype: libc::CLONE_NEWNS,
        },
        Step::Mount {
            source: None,
            target: cstring(b"/")?,
            fstype: None,
            flags: MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID,
            data: None,
        },
    ];
    // Held open until the child has attached them.
    let mut trees = Vec::new();
    let mut made = MountPoints::default();
    for (path, attributes) in shown {
        if !path.is_absolute() {
            return Err(format!("{} is not an absolute path", path.display()));
        }
        let meta =
            std::fs::symlink_metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let dir = if meta.is_dir() {
            Some(path.as_path())
        } else {
            path.parent()
        };
        if let Some(dir) = dir {
            // Inside the jail's mount namespace, its root is "/".
            made.mkdir_p(&mut steps, Path::new("/"), dir)?;
        }
        if meta.file_type().is_symlink() {
            // Recreated, not followed, as at the jail's start.
            let points_to =
                std::fs::read_link(path).map_err(|e| format!("{}: {e}", path.display()))?;
            steps.push(Step::Symlink {
                target: cpath(&points_to)?,
                link: cpath(path)?,
            });
            continue;
        }
        if !meta.is_dir() {
            steps.push(Step::Touch(cpath(path)?));
        }
        let tree = detached_tree(path, attributes)
            .map_err(|e| format!("a detached copy of {}: {e}", path.display()))?;
        steps.push(Step::MoveMount {
            fd: tree.as_raw_fd(),
            target: cpath(path)?,
        });
        trees.push(tree);
    }
    steps.push(Step::Mount {
        source: None,
        target: cstring(b"/")?,
        fstype: None,
        flags: MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
        data: None,
    });
    crate::sys::run_in_child(&steps).map_err(|(index, errno)| {
        let what = steps
            .get(index)
            .map_or_else(|| "its end".to_owned(), |s| format!("{s:?}"));
        format!(
            "showing the jail of process {pid} its files failed at {what}: {}",
            std::io::Error::from_raw_os_error(errno)
        )
    })
}

/// Whether the VMM binary needs a dynamic loader, and so the host's library directories.
pub fn library_dirs_for(binary: &Path) -> Vec<PathBuf> {
    use std::io::Read;
    let mut head = vec![0u8; 64 << 10];
    let read = File::open(binary)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    head.truncate(read);
    if crate::image::elf::check_static(&head).is_ok() {
        return Vec::new();
    }
    ["/lib", "/lib64", "/usr/lib", "/usr/lib64"]
        .iter()
        .map(PathBuf::from)
        .filter(|p| std::fs::symlink_metadata(p).is_ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `script` under /bin/sh in a jail showing it `writable` and `readable`; returns
    /// its exit status and output.
    fn run_jailed(jail: &mut Jail, script: &str) -> (i32, String) {
        run_jailed_with(jail, script, None)
    }

    fn run_jailed_with(
        jail: &mut Jail,
        script: &str,
        listener: Option<std::os::fd::BorrowedFd>,
    ) -> (i32, String) {
        let dir = tempfile::tempdir().unwrap();
        let out_path = dir.path().join("out");
        let output = File::create(&out_path).unwrap();
        jail.staging = dir.path().join("staging");
        std::fs::create_dir(&jail.staging).unwrap();
        jail.libraries = library_dirs_for(Path::new("/bin/sh"));
        // The shell and the tools it runs, executable.
        jail.libraries
            .extend(["/bin", "/usr/bin"].map(PathBuf::from));
        let pid = spawn(&Command {
            binary: Path::new("/bin/sh"),
            args: &["-c".into(), script.into()],
            env: &[("PATH", "/usr/bin:/bin")],
            output: &output,
            jail: Some(jail),
            listener,
            anchor: None,
        })
        .unwrap();
        let status = match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None) {
            Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => code,
            other => panic!("the jailed shell ended as {other:?}"),
        };
        (status, std::fs::read_to_string(&out_path).unwrap())
    }

    fn root() -> bool {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: building a jail needs root");
            return false;
        }
        true
    }

    #[test]
    fn a_jail_given_userfaultfd_has_the_device_for_its_vm_user_alone() {
        if !root() {
            return;
        }
        if !Path::new("/dev/userfaultfd").exists() {
            println!("SKIPPED: this host has no /dev/userfaultfd");
            return;
        }
        let uid = 0x7000_fff1;
        let script = "ls -ln /dev/userfaultfd || echo no-userfaultfd";
        for given in [false, true] {
            let mut jail = Jail {
                uid,
                gid: uid,
                userfaultfd: given,
                ..Default::default()
            };
            let (status, out) = run_jailed(&mut jail, script);
            assert_eq!(status, 0, "{out}");
            match given {
                true => assert!(
                    out.starts_with("crw-------") && out.contains(&format!(" {uid} {uid} ")),
                    "{out}"
                ),
                false => assert!(out.contains("no-userfaultfd"), "{out}"),
            }
        }
    }

    #[test]
    fn a_jailed_process_sees_and_writes_only_what_it_was_given() {
        if !root() {
            return;
        }
        let host = tempfile::tempdir().unwrap();
        let uid = 0x7000_fff0;
        let rw = host.path().join("rw");
        std::fs::create_dir(&rw).unwrap();
        std::os::unix::fs::chown(&rw, Some(uid), Some(uid)).unwrap();
        let ro = host.path().join("ro.txt");
        std::fs::write(&ro, "visible\n").unwrap();
        // Beside what it may read, world-readable, yet outside its namespace.
        let secret = host.path().join("secret.txt");
        std::fs::write(&secret, "hidden\n").unwrap();
        let mut jail = Jail {
            uid,
            gid: uid,
            writable: vec![rw.clone()],
            readable: vec![ro.clone()],
            ..Default::default()
        };
        let script = format!(
            "cat {ro}; cat {secret} || echo no-secret; cat /etc/passwd || echo no-passwd; \
             echo written > {rw}/file; echo changed > {ro} || echo ro-refused; \
             id -u; id -G; echo pid $$; ls /; ls /proc | grep -c '^[0-9]'; ls -l /dev/kvm; \
             grep -E '^Sig(Blk|Ign)' /proc/self/status",
            ro = ro.display(),
            rw = rw.display(),
            secret = secret.display()
        );
        let (status, out) = run_jailed(&mut jail, &script);
        assert_eq!(status, 0, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        for expected in [
            "visible",
            "no-secret",
            "no-passwd",
            "ro-refused",
            "pid 1",
            &uid.to_string(),
        ] {
            assert!(lines.contains(&expected), "{expected:?} missing:\n{out}");
        }
        assert!(!out.contains("hidden"), "{out}");
        // Its only group is its own.
        assert!(lines.contains(&uid.to_string().as_str()), "{out}");
        // The root holds only what it was given, and one process in its /proc: itself (and
        // the `ls` it ran, gone by then or counted).
        for absent in ["etc", "home", "root", "var", "run"] {
            assert!(!lines.contains(&absent), "/{absent} is visible:\n{out}");
        }
        let kvm = lines.iter().find(|l| l.contains("/dev/kvm"));
        if std::path::Path::new("/dev/kvm").exists() {
            let kvm = kvm.unwrap_or_else(|| panic!("no /dev/kvm:\n{out}"));
            assert!(kvm.starts_with("crw-------"), "{kvm}");
        }
        // Nothing blocked or ignored: the daemon's signal mask and SIGPIPE disposition stay
        // behind.
        for name in ["SigBlk:", "SigIgn:"] {
            let line = lines.iter().find(|l| l.starts_with(name));
            assert_eq!(
                line.map(|l| l.trim_start_matches(name).trim()),
                Some("0000000000000000"),
                "{out}"
            );
        }
        assert_eq!(
            std::fs::read_to_string(rw.join("file")).unwrap(),
            "written\n"
        );
        let meta = std::fs::metadata(rw.join("file")).unwrap();
        assert_eq!(meta.uid(), uid);
        assert_eq!(std::fs::read_to_string(&ro).unwrap(), "visible\n");
    }

    #[test]
    fn a_running_jail_is_shown_more_paths_with_its_flags() {
        if !root() {
            return;
        }
        let host = tempfile::tempdir().unwrap();
        let uid = 0x7000_fff3;
        let rw = host.path().join("later/rw");
        std::fs::create_dir_all(&rw).unwrap();
        std::os::unix::fs::chown(&rw, Some(uid), Some(uid)).unwrap();
        let ro = host.path().join("later/ro.txt");
        std::fs::write(&ro, "shown\n").unwrap();
        // Its own, so only the mount's flag can refuse it a write.
        std::os::unix::fs::chown(&ro, Some(uid), Some(uid)).unwrap();
        let beside = host.path().join("later/beside.txt");
        std::fs::write(&beside, "hidden\n").unwrap();
        let out_path = host.path().join("out");
        let output = File::create(&out_path).unwrap();
        let mut jail = Jail {
            uid,
            gid: uid,
            staging: host.path().join("staging"),
            ..Default::default()
        };
        std::fs::create_dir(&jail.staging).unwrap();
        jail.libraries = library_dirs_for(Path::new("/bin/sh"));
        jail.libraries
            .extend(["/bin", "/usr/bin"].map(PathBuf::from));
        // Waits (bounded) until the injected directory shows the host's flag file.
        let script = format!(
            "test -e {rw} && echo rw-visible-early; \
             i=0; while [ ! -e {rw}/go ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; \
             cat {ro}; cat {beside} || echo no-beside; echo changed > {ro} || echo ro-refused; \
             echo written > {rw}/file; printf '#!/bin/sh\\necho ran\\n' > {rw}/x.sh; \
             chmod +x {rw}/x.sh; {rw}/x.sh || echo noexec; touch /new || echo root-ro",
            rw = rw.display(),
            ro = ro.display(),
            beside = beside.display(),
        );
        let pid = spawn(&Command {
            binary: Path::new("/bin/sh"),
            args: &["-c".into(), script.into()],
            env: &[("PATH", "/usr/bin:/bin")],
            output: &output,
            jail: Some(&jail),
            listener: None,
            anchor: None,
        })
        .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        inject(pid, std::slice::from_ref(&rw), std::slice::from_ref(&ro)).unwrap();
        std::fs::write(rw.join("go"), "").unwrap();
        let status = match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None) {
            Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => code,
            other => panic!("the jailed shell ended as {other:?}"),
        };
        let out = std::fs::read_to_string(&out_path).unwrap();
        assert_eq!(status, 0, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        for expected in ["shown", "no-beside", "ro-refused", "noexec", "root-ro"] {
            assert!(lines.contains(&expected), "{expected:?} missing:\n{out}");
        }
        assert!(
            !out.contains("rw-visible-early") && !out.contains("ran\n"),
            "{out}"
        );
        assert_eq!(
            std::fs::read_to_string(rw.join("file")).unwrap(),
            "written\n"
        );
        assert_eq!(std::fs::read_to_string(&ro).unwrap(), "shown\n");
        // Nothing was mounted on the host's side.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(host.path().to_str().unwrap()), "{mounts}");
    }

    #[test]
    fn a_failing_step_is_named_and_nothing_runs() {
        if !root() {
            return;
        }
        let mut jail = Jail {
            uid: 0x7000_fff1,
            gid: 0x7000_fff1,
            readable: vec![PathBuf::from("/nonexistent/agentvm-file")],
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        jail.staging = dir.path().to_owned();
        let output = File::create(dir.path().join("out")).unwrap();
        let err = spawn(&Command {
            binary: Path::new("/bin/true"),
            args: &[],
            env: &[],
            output: &output,
            jail: Some(&jail),
            listener: None,
            anchor: None,
        })
        .unwrap_err();
        assert!(err.contains("/nonexistent/agentvm-file"), "{err}");
        // A file that is not a program fails at the exec, reported as such.
        jail.readable.clear();
        let err = spawn(&Command {
            binary: &dir.path().join("out"),
            args: &[],
            env: &[],
            output: &output,
            jail: Some(&jail),
            listener: None,
            anchor: None,
        })
        .unwrap_err();
        assert!(err.contains("failed at exec"), "{err}");
    }

    #[test]
    fn a_listener_handed_down_is_descriptor_3_and_nothing_else_is() {
        if !root() {
            return;
        }
        let host = tempfile::tempdir().unwrap();
        let socket = host.path().join("api.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mut jail = Jail {
            uid: 0x7000_fff2,
            gid: 0x7000_fff2,
            ..Default::default()
        };
        let script = "readlink /proc/self/fd/3; readlink /proc/self/fd/4 || echo no-fd-4;                       readlink /proc/self/fd/5 || echo no-fd-5";
        use std::os::fd::AsFd;
        let (status, out) = run_jailed_with(&mut jail, script, Some(listener.as_fd()));
        assert_eq!(status, 0, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("socket:["), "{out}");
        // The listener's inode: the same socket, not a copy of some other descriptor.
        let ours = std::fs::read_link(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&listener)
        ))
        .unwrap();
        assert_eq!(lines[0], ours.to_str().unwrap(), "{out}");
        assert!(
            lines.contains(&"no-fd-4") && lines.contains(&"no-fd-5"),
            "{out}"
        );
    }
}
