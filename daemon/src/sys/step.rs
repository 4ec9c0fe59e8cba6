//! One action of a jailed child between clone and exec, run with raw system calls on memory
//! prepared before the clone: the child of a multithreaded parent may not allocate or take
//! a lock another thread held at the clone, so nothing here goes through a wrapper that
//! might (nix builds C strings of long paths on the heap).

use std::ffi::CString;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::mount::MsFlags;
use nix::sys::resource::Resource;

/// The kernel's `struct sigaction` for rt_sigaction (not libc's): all zero is SIG_DFL.
#[repr(C)]
#[derive(Default)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// One action of the child between clone and exec.
#[derive(Debug)]
pub enum Step {
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
        flags: MsFlags,
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
        resource: Resource,
        value: u64,
    },
    DropPrivileges {
        uid: u32,
        gid: u32,
    },
    NoNewPrivileges,
    /// Marks close-on-exec every descriptor from `first` up.
    CloseInherited {
        first: u32,
    },
    /// Enters the namespace behind `fd` (a /proc/PID/ns/* descriptor) of type `nstype`.
    Setns {
        fd: RawFd,
        nstype: libc::c_int,
    },
    /// Attaches the detached mount tree `fd` (see `sys::detached_tree`) at `target`.
    MoveMount {
        fd: RawFd,
        target: CString,
    },
}

/// move_mount(2): the source is the descriptor itself.
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

pub fn cstring(bytes: &[u8]) -> Result<CString, String> {
    CString::new(bytes)
        .map_err(|_| format!("{:?} holds a NUL byte", String::from_utf8_lossy(bytes)))
}

pub fn cpath(path: &Path) -> Result<CString, String> {
    cstring(path.as_os_str().as_bytes())
}

pub(super) fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

impl Step {
    /// Runs in the cloned child: raw system calls on memory prepared before the clone.
    ///
    /// # Safety
    /// Call only in a freshly cloned child that will exec or `_exit`.
    pub(super) unsafe fn run(&self) -> Result<(), i32> {
        let check = |rc: libc::c_long| if rc < 0 { Err(last_errno()) } else { Ok(()) };
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY: in every arm, arguments are NUL-terminated strings and plain values built
        // before the clone; each call only affects this child.
        unsafe {
            match self {
                Step::ResetSignals => {
                    // The parent blocked every signal around the clone, so none of its
                    // handlers can have run here. Back to the defaults (an ignored signal
                    // would stay ignored across exec: the Rust runtime ignores SIGPIPE), then
                    // nothing blocked.
                    let default = KernelSigaction::default();
                    for signal in 1..=64 {
                        if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                            // Signals the kernel reserves refuse it; nothing to undo there.
                            libc::syscall(
                                libc::SYS_rt_sigaction,
                                signal,
                                &default as *const KernelSigaction,
                                std::ptr::null::<KernelSigaction>(),
                                8usize,
                            );
                        }
                    }
                    let empty: libc::sigset_t = std::mem::zeroed();
                    check(libc::syscall(
                        libc::SYS_rt_sigprocmask,
                        libc::SIG_SETMASK,
                        &empty as *const libc::sigset_t,
                        std::ptr::null::<libc::sigset_t>(),
                        8usize,
                    ))
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
                        flags.bits(),
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
                    check(libc::setrlimit(*resource as libc::__rlimit_resource_t, &limit).into())
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
                Step::CloseInherited { first } => check(libc::syscall(
                    libc::SYS_close_range,
                    *first,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                )),
                Step::Setns { fd, nstype } => check(libc::setns(*fd, *nstype).into()),
                Step::MoveMount { fd, target } => check(libc::syscall(
                    libc::SYS_move_mount,
                    *fd,
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    target.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                )),
            }
        }
    }
}
