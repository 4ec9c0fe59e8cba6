//! Starting a VMM inside its jail (what Firecracker's jailer does, done by agentvmd itself):
//! a process cloned straight into new mount, PID, network, IPC and UTS namespaces, whose
//! root is a small private tmpfs holding only the VM's own files at their usual paths (so
//! the paths agentvmd sends through the API need no translation), a few device nodes and its
//! own /proc; it drops to a uid/gid of its own with no supplementary groups, inherits no descriptor but stdin/stdout/stderr, and is exec'd from a descriptor
//! opened before the jail existed (the VMM binary itself need not be inside).
//!
//! Everything the child does between clone and exec is a list of [`Step`]s built before the
//! clone: the child may not allocate (another thread of the daemon may hold the allocator's
//! lock at the moment of the clone) and uses raw system calls only. A step that fails reports
//! its index and errno through a close-on-exec pipe, which the parent turns into a message.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

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
}

/// One program to start.
pub struct Command<'a> {
    pub binary: &'a Path,
    pub args: &'a [OsString],
    pub env: &'a [(&'a str, &'a str)],
    /// Its stdout and stderr.
    pub output: &'a File,
    /// Confined when set; otherwise only detached into its own process group.
    pub jail: Option<&'a Jail>,
}

/// Device nodes every jail has: (name, mode). /dev/kvm is the VM user's alone.
const DEVICES: [(&str, u32); 5] = [
    ("null", 0o666),
    ("zero", 0o666),
    ("urandom", 0o666),
    ("random", 0o666),
    ("kvm", 0o600),
];
const ROOT_TMPFS_OPTIONS: &str = "mode=0755,size=1m,nr_inodes=4096";
const NOFILE_LIMIT: u64 = 8192;

/// One action of the child between clone and exec.
#[derive(Debug)]
enum Step {
    ResetSignals,
    NewProcessGroup,
    Dup2 {
        fd: RawFd,
        onto: RawFd,
    },
    Mount {
        source: Option<CString>,
        target: CString,
        fstype: Option<CString>,
        flags: libc::c_ulong,
        data: Option<CString>,
    },
    Mkdir(CString),
    Touch(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    Mknod {
        path: CString,
        mode: u32,
        device: u64,
    },
    Chown {
        path: CString,
        uid: u32,
        gid: u32,
    },
    Chdir(CString),
    /// Makes the current directory the root and detaches the old one.
    PivotHere,
    Rlimit {
        resource: libc::__rlimit_resource_t,
        value: u64,
    },
    DropPrivileges {
        uid: u32,
        gid: u32,
    },
    NoNewPrivileges,
    CloseInherited,
}

fn cstring(bytes: &[u8]) -> Result<CString, String> {
    CString::new(bytes)
        .map_err(|_| format!("{:?} holds a NUL byte", String::from_utf8_lossy(bytes)))
}

fn cpath(path: &Path) -> Result<CString, String> {
    cstring(path.as_os_str().as_bytes())
}

/// `path` (absolute) as it sits under the staging directory.
fn staged(staging: &Path, path: &Path) -> PathBuf {
    staging.join(path.strip_prefix("/").unwrap_or(path))
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

impl Step {
    /// Runs in the cloned child: raw system calls on memory prepared before the clone.
    ///
    /// # Safety
    /// Call only in a freshly cloned child that will exec or `_exit`.
    unsafe fn run(&self) -> Result<(), i32> {
        let check = |rc: libc::c_long| if rc < 0 { Err(last_errno()) } else { Ok(()) };
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY (every arm): arguments are NUL-terminated strings and plain values built
        // before the clone; each call only affects this child.
        unsafe {
            match self {
                Step::ResetSignals => {
                    let empty: libc::sigset_t = std::mem::zeroed();
                    check(libc::syscall(
                        libc::SYS_rt_sigprocmask,
                        libc::SIG_SETMASK,
                        &empty as *const libc::sigset_t,
                        std::ptr::null::<libc::sigset_t>(),
                        8usize,
                    ))?;
                    // Ignored signals stay ignored across exec: the Rust runtime ignores SIGPIPE.
                    if libc::signal(libc::SIGPIPE, libc::SIG_DFL) == libc::SIG_ERR {
                        return Err(last_errno());
                    }
                    Ok(())
                }
                Step::NewProcessGroup => check(libc::setpgid(0, 0).into()),
                Step::Dup2 { fd, onto } => check(libc::dup2(*fd, *onto).into()),
                Step::Mount {
                    source,
                    target,
                    fstype,
                    flags,
                    data,
                } => check(
                    libc::mount(
                        source.as_ref().map_or(null, |s| s.as_ptr()),
                        target.as_ptr(),
                        fstype.as_ref().map_or(null, |s| s.as_ptr()),
                        *flags,
                        data.as_ref().map_or(null, |s| s.as_ptr()).cast(),
                    )
                    .into(),
                ),
                Step::Mkdir(path) => {
                    if libc::mkdir(path.as_ptr(), 0o755) == 0 {
                        return Ok(());
                    }
                    match last_errno() {
                        libc::EEXIST => Ok(()),
                        e => Err(e),
                    }
                }
                Step::Touch(path) => {
                    let fd = libc::open(
                        path.as_ptr(),
                        libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC,
                        0o444,
                    );
                    check(fd.into())?;
                    libc::close(fd);
                    Ok(())
                }
                Step::Symlink { target, link } => {
                    check(libc::symlink(target.as_ptr(), link.as_ptr()).into())
                }
                Step::Mknod { path, mode, device } => {
                    check(libc::mknod(path.as_ptr(), libc::S_IFCHR | mode, *device).into())?;
                    // mknod is subject to the umask.
                    check(libc::chmod(path.as_ptr(), *mode).into())
                }
                Step::Chown { path, uid, gid } => {
                    check(libc::lchown(path.as_ptr(), *uid, *gid).into())
                }
                Step::Chdir(path) => check(libc::chdir(path.as_ptr()).into()),
                Step::PivotHere => {
                    let here = c".".as_ptr();
                    check(libc::syscall(libc::SYS_pivot_root, here, here))?;
                    // The old root now sits on top of the new one at "/": detach it.
                    check(libc::umount2(here, libc::MNT_DETACH).into())?;
                    check(libc::chdir(c"/".as_ptr()).into())
                }
                Step::Rlimit { resource, value } => {
                    let limit = libc::rlimit {
                        rlim_cur: *value,
                        rlim_max: *value,
                    };
                    check(libc::setrlimit(*resource, &limit).into())
                }
                Step::DropPrivileges { uid, gid } => {
                    // Raw calls: glibc's wrappers would try to reach threads that exist only
                    // in the parent.
                    check(libc::syscall(libc::SYS_setgroups, 0, null))?;
                    check(libc::syscall(libc::SYS_setresgid, *gid, *gid, *gid))?;
                    check(libc::syscall(libc::SYS_setresuid, *uid, *uid, *uid))
                }
                Step::NoNewPrivileges => {
                    check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0).into())
                }
                Step::CloseInherited => check(libc::syscall(
                    libc::SYS_close_range,
                    3u32,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                )),
            }
        }
    }
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
        flags: libc::MS_REC | libc::MS_PRIVATE,
        data: None,
    });
    steps.push(Step::Mount {
        source: Some(cstring(b"tmpfs")?),
        target: cpath(staging)?,
        fstype: Some(cstring(b"tmpfs")?),
        flags: libc::MS_NOSUID,
        data: Some(cstring(ROOT_TMPFS_OPTIONS.as_bytes())?),
    });
    let mut made = std::collections::BTreeSet::new();
    let mut mkdir_p = |steps: &mut Vec<Step>, path: &Path| -> Result<(), String> {
        let mut at = PathBuf::from("/");
        for part in path.strip_prefix("/").unwrap_or(path).components() {
            at.push(part);
            if made.insert(at.clone()) {
                steps.push(Step::Mkdir(cpath(&staged(staging, &at))?));
            }
        }
        Ok(())
    };
    let mut binds: Vec<(&PathBuf, libc::c_ulong)> = Vec::new();
    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    binds.extend(
        jail.writable
            .iter()
            .map(|p| (p, nosuid_nodev | libc::MS_NOEXEC)),
    );
    binds.extend(
        jail.readable
            .iter()
            .map(|p| (p, nosuid_nodev | libc::MS_NOEXEC | libc::MS_RDONLY)),
    );
    binds.extend(
        jail.libraries
            .iter()
            .map(|p| (p, nosuid_nodev | libc::MS_RDONLY)),
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
            flags: libc::MS_BIND | libc::MS_REC,
            data: None,
        });
        // Bind mounts take their flags only on a remount.
        steps.push(Step::Mount {
            source: None,
            target,
            fstype: None,
            flags: libc::MS_REMOUNT | libc::MS_BIND | flags,
            data: None,
        });
    }
    mkdir_p(&mut steps, Path::new("/dev"))?;
    for (name, mode) in DEVICES {
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
        if name == "kvm" {
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
        flags: nosuid_nodev | libc::MS_NOEXEC,
        data: None,
    });
    steps.push(Step::Chdir(cpath(staging)?));
    steps.push(Step::PivotHere);
    steps.push(Step::Mount {
        source: None,
        target: cstring(b"/")?,
        fstype: None,
        flags: libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID,
        data: None,
    });
    for (resource, value) in [(libc::RLIMIT_CORE, 0), (libc::RLIMIT_NOFILE, NOFILE_LIMIT)] {
        steps.push(Step::Rlimit { resource, value });
    }
    steps.push(Step::DropPrivileges {
        uid: jail.uid,
        gid: jail.gid,
    });
    steps.push(Step::NoNewPrivileges);
    Ok(steps)
}

fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array; the result is checked.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 just created both descriptors and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Starts `command`; returns its pid once it has exec'd (or why it could not).
pub fn spawn(command: &Command) -> Result<u32, String> {
    let binary = File::open(command.binary)
        .map_err(|e| format!("opening {}: {e}", command.binary.display()))?;
    let stdin = File::open("/dev/null").map_err(|e| format!("opening /dev/null: {e}"))?;
    let output = command.output.as_raw_fd();
    let mut steps = vec![
        Step::ResetSignals,
        Step::NewProcessGroup,
        Step::Dup2 {
            fd: stdin.as_raw_fd(),
            onto: 0,
        },
        Step::Dup2 {
            fd: output,
            onto: 1,
        },
        Step::Dup2 {
            fd: output,
            onto: 2,
        },
    ];
    let mut flags = 0u64;
    if let Some(jail) = command.jail {
        steps.extend(jail_steps(jail)?);
        flags = (libc::CLONE_NEWNS
            | libc::CLONE_NEWPID
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS) as u64;
    }
    steps.push(Step::CloseInherited);

    let argv0 = cpath(command.binary)?;
    let args: Vec<CString> = std::iter::once(Ok(argv0))
        .chain(command.args.iter().map(|a| cstring(a.as_bytes())))
        .collect::<Result<_, _>>()?;
    let env: Vec<CString> = command
        .env
        .iter()
        .map(|(k, v)| cstring(format!("{k}={v}").as_bytes()))
        .collect::<Result<_, _>>()?;
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());

    let (report_read, report_write) = pipe()?;
    // SAFETY: zeroed clone_args are valid; the fields set below are the only ones used.
    let mut args_block: libc::clone_args = unsafe { std::mem::zeroed() };
    args_block.flags = flags;
    args_block.exit_signal = libc::SIGCHLD as u64;
    // SAFETY: clone3 without CLONE_VM and with no stack behaves as fork: the child runs on
    // a copy of this stack. It only runs `child`, which never returns.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &mut args_block as *mut libc::clone_args,
            std::mem::size_of::<libc::clone_args>(),
        )
    };
    if pid < 0 {
        return Err(format!(
            "clone3 (namespaces {flags:#x}): {}",
            std::io::Error::last_os_error()
        ));
    }
    if pid == 0 {
        // SAFETY: this is the freshly cloned child.
        unsafe {
            child(
                &steps,
                binary.as_raw_fd(),
                &argv,
                &envp,
                report_write.as_raw_fd(),
            )
        }
    }
    drop(report_write);
    let mut report = [0u8; 8];
    let mut got = 0;
    while got < report.len() {
        // SAFETY: reads into the unfilled tail of a stack buffer.
        let n = unsafe {
            libc::read(
                report_read.as_raw_fd(),
                report[got..].as_mut_ptr().cast(),
                report.len() - got,
            )
        };
        match n {
            0 => break,
            n if n > 0 => got += n as usize,
            _ if last_errno() == libc::EINTR => continue,
            _ => break,
        }
    }
    if got == 0 {
        return Ok(pid as u32);
    }
    // The child failed before exec: reap it and say which step failed.
    let mut status = 0;
    // SAFETY: waits for the child this call created.
    unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
    let index = u32::from_le_bytes(report[..4].try_into().unwrap_or_default()) as usize;
    let errno = i32::from_le_bytes(report[4..].try_into().unwrap_or_default());
    let what = steps
        .get(index)
        .map_or_else(|| "exec".to_owned(), |s| format!("{s:?}"));
    Err(format!(
        "starting {} failed at {what}: {}",
        command.binary.display(),
        std::io::Error::from_raw_os_error(errno)
    ))
}

/// The cloned child: runs `steps`, then execs the binary behind `binary`. Reports the first
/// failure (step index, errno; index `steps.len()` for the exec) on `report`.
///
/// # Safety
/// Call only in a freshly cloned child; every pointer stays valid (the memory is the
/// parent's copy).
unsafe fn child(
    steps: &[Step],
    binary: RawFd,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    report: RawFd,
) -> ! {
    let fail = |index: usize, errno: i32| -> ! {
        let mut message = [0u8; 8];
        message[..4].copy_from_slice(&(index as u32).to_le_bytes());
        message[4..].copy_from_slice(&errno.to_le_bytes());
        // SAFETY: writes a stack buffer to the report pipe, then exits without running any
        // of the parent's atexit handlers or destructors.
        unsafe {
            libc::write(report, message.as_ptr().cast(), message.len());
            libc::_exit(127)
        }
    };
    for (index, step) in steps.iter().enumerate() {
        // SAFETY: this is the cloned child (the caller's contract).
        if let Err(errno) = unsafe { step.run() } {
            fail(index, errno);
        }
    }
    // SAFETY: execveat of a descriptor opened before the clone, with NULL-terminated
    // argument and environment arrays whose strings live in this copy of the parent.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            binary,
            c"".as_ptr(),
            argv.as_ptr(),
            envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
    }
    fail(steps.len(), last_errno())
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
        })
        .unwrap();
        let mut status = 0;
        // SAFETY: waits for the child spawn just created.
        assert_eq!(
            unsafe { libc::waitpid(pid as i32, &mut status, 0) },
            pid as i32
        );
        (status, std::fs::read_to_string(&out_path).unwrap())
    }

    fn root() -> bool {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: building a jail needs root");
            return false;
        }
        true
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
             id -u; id -G; echo pid $$; ls /; ls /proc | grep -c '^[0-9]'; ls -l /dev/kvm",
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
        assert_eq!(
            std::fs::read_to_string(rw.join("file")).unwrap(),
            "written\n"
        );
        let meta = std::fs::metadata(rw.join("file")).unwrap();
        assert_eq!(meta.uid(), uid);
        assert_eq!(std::fs::read_to_string(&ro).unwrap(), "visible\n");
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
        })
        .unwrap_err();
        assert!(err.contains("failed at exec"), "{err}");
    }
}
