//! The system calls agentvmd makes that no safe wrapper covers, each with why it is sound.
//! Everything else goes through `nix` and the standard library; the crate root denies
//! `unsafe` outside this module.
//!
//! - [`clone_and_exec`] starts a (jailed) child with clone(CLONE_VM) and runs its [`Step`]s between
//!   clone and exec: code there may not allocate, so it makes raw calls on memory prepared
//!   before the clone.
//! - [`spawn_in_user_namespace`] starts a program as root of a user namespace of its own,
//!   which takes a hook between fork and exec and a thread to write the id maps.
//! - [`pidfd_open`], [`pidfd_send_signal`], [`dup_above`] and [`die_with_parent`] have no wrapper in `nix`, and
//!   tokio registers a descriptor with its reactor only on the caller's word
//!   ([`watch_fd`]).

#![allow(unsafe_code)]

mod step;
mod userns;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;

use nix::sched::CloneFlags;
use nix::sys::signal::{SigSet, SigmaskHow, pthread_sigmask};
use nix::unistd::Pid;

use self::step::last_errno;
pub use self::step::{Step, cpath, cstring};
pub use self::userns::{IdMap, spawn_in_user_namespace};

/// A descriptor on process `pid` (pidfd_open(2)), which polls readable once it exits.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is shared.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Sends `signal` (0: only checks it may be sent) to the process `pidfd` holds
/// (pidfd_send_signal(2)): it reaches that process or, once it is gone, none, however soon
/// its pid is reused.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: i32) -> io::Result<()> {
    // SAFETY: the call reads only its integer arguments (no siginfo is passed); the fd is
    // borrowed for its duration.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `fd` registered with tokio's reactor for `interest`.
pub fn watch_fd(
    fd: OwnedFd,
    interest: tokio::io::Interest,
) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is an open descriptor that only it closes, and its `as_raw_fd`
    // never changes: it stays the same open file until the AsyncFd is dropped.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, interest) }.map_err(|e| e.into())
}

/// A close-on-exec duplicate of `fd` numbered `min` or above.
pub fn dup_above(fd: BorrowedFd, min: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor and touches nothing else.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fcntl just created `dup` and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// Makes the process `command` starts die with the thread that starts it.
pub fn die_with_parent(command: &mut std::process::Command) {
    // SAFETY: the hook runs in the forked child before exec and makes one prctl call,
    // which neither allocates nor takes a lock.
    unsafe {
        command.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(io::Error::from)
        });
    }
}

/// Clones a child (into new `namespaces`) that runs `steps`, then execs the program behind
/// `binary` with `args` (the first is its argv\[0\]) and `env`. Returns its pid at once;
/// a failure before exec is written to `report` (step index as le u32, then errno as
/// le i32; index `steps.len()` for the exec) and the child exits 127. `report` must be
/// close-on-exec: it reads end-of-file once the program runs.
pub fn clone_and_exec(
    steps: &[Step],
    namespaces: CloneFlags,
    binary: BorrowedFd,
    args: &[CString],
    env: &[CString],
    report: BorrowedFd,
) -> io::Result<Pid> {
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());
    clone_child(
        &ChildArgs {
            steps,
            exec: Some(Exec {
                binary: binary.as_raw_fd(),
                argv: &argv,
                envp: &envp,
            }),
            report: report.as_raw_fd(),
        },
        namespaces,
    )
}

/// Runs `steps` in a child cloned for them alone (as root, in this process's namespaces
/// until a step enters others), and waits for it. A step that fails is named by its index,
/// with its errno.
pub fn run_in_child(steps: &[Step]) -> Result<(), (usize, i32)> {
    use nix::fcntl::OFlag;
    let (read, write) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| (steps.len(), e as i32))?;
    let pid = clone_child(
        &ChildArgs {
            steps,
            exec: None,
            report: write.as_raw_fd(),
        },
        CloneFlags::empty(),
    )
    .map_err(|e| (steps.len(), e.raw_os_error().unwrap_or(libc::EIO)))?;
    drop(write);
    let mut report = [0u8; 8];
    let got = loop {
        match nix::unistd::read(&read, &mut report) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other.unwrap_or(0),
        }
    };
    let status = loop {
        match nix::sys::wait::waitpid(pid, None) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other,
        }
    };
    if got == report.len() {
        let index = u32::from_le_bytes(report[..4].try_into().unwrap_or_default()) as usize;
        let errno = i32::from_le_bytes(report[4..].try_into().unwrap_or_default());
        return Err((index, errno));
    }
    match status {
        Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
        _ => Err((steps.len(), libc::ECHILD)),
    }
}

/// Clones the child `args` describes into new `namespaces`; returns once it has exec'd or
/// exited.
fn clone_child(child_args: &ChildArgs, namespaces: CloneFlags) -> io::Result<Pid> {
    // The child runs on a stack of its own in this address space until it execs (CLONE_VM,
    // as posix_spawn does): a fork would first copy the daemon's page tables, about a
    // millisecond of every VM start, only for exec to throw them away.
    let mut stack = vec![0u8; CHILD_STACK];
    let stack_top = stack.as_mut_ptr_range().end as usize & !15;
    let flags = namespaces.bits() | libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD;
    // Every signal blocked in this thread across the clone: the child must not run one of the
    // daemon's handlers before it has reset them.
    let mut saved = SigSet::empty();
    pthread_sigmask(
        SigmaskHow::SIG_SETMASK,
        Some(&SigSet::all()),
        Some(&mut saved),
    )?;
    // SAFETY: the child starts in `child_entry` on `stack`, which nothing else uses and
    // which outlives it: CLONE_VFORK suspends this thread until the child has exec'd or
    // exited, and only then is `stack` (or `child_args`) dropped. The child shares this
    // memory but only reads it (steps, argv, envp) and writes its own stack; it has its own
    // copy of the signal handlers (no CLONE_SIGHAND) and of the descriptor table (no
    // CLONE_FILES), so what it changes there stays its own.
    let pid = unsafe {
        libc::clone(
            child_entry,
            stack_top as *mut libc::c_void,
            flags,
            child_args as *const ChildArgs as *mut libc::c_void,
        )
    };
    drop(stack);
    let cloned = match pid {
        pid if pid < 0 => Err(io::Error::last_os_error()),
        pid => Ok(Pid::from_raw(pid as libc::pid_t)),
    };
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&saved), None)?;
    cloned
}

/// The child's stack: ample for the steps, which use small fixed buffers.
const CHILD_STACK: usize = 256 << 10;

/// What `child_entry` gets: memory of the parent's, read-only to the child.
struct ChildArgs<'a> {
    steps: &'a [Step],
    /// What to exec once the steps are done; without it the child exits 0.
    exec: Option<Exec<'a>>,
    report: RawFd,
}

struct Exec<'a> {
    binary: RawFd,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
}

extern "C" fn child_entry(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` clone_and_exec passed, alive while its thread waits
    // for this child to exec or exit (CLONE_VFORK); this is that freshly cloned child.
    unsafe {
        let args = &*(arg as *const ChildArgs);
        child(args.steps, args.exec.as_ref(), args.report)
    }
}

/// The cloned child: runs `steps`, then execs the binary behind `binary`. Reports the first
/// failure (step index, errno; index `steps.len()` for the exec) on `report`.
///
/// # Safety
/// Call only in a freshly cloned child; every pointer stays valid (the parent's memory,
/// which the parent leaves alone until this child has exec'd or exited).
unsafe fn child(steps: &[Step], exec: Option<&Exec>, report: RawFd) -> ! {
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
    let Some(exec) = exec else {
        // SAFETY: leaves without running any of the parent's atexit handlers or destructors.
        unsafe { libc::_exit(0) }
    };
    // SAFETY: execveat of a descriptor opened before the clone, with NULL-terminated
    // argument and environment arrays whose strings live in the parent's memory.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            exec.binary,
            c"".as_ptr(),
            exec.argv.as_ptr(),
            exec.envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
    }
    fail(steps.len(), last_errno())
}

/// Mount attributes (mount_setattr(2)) a detached tree can be given.
pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x8;

/// struct mount_attr of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A detached, private copy of the mount tree at `path` with `attributes` (the
/// `MOUNT_ATTR_*` above) set on all of it, ready to be attached anywhere — including in
/// another process's mount namespace ([`Step::MoveMount`] after [`Step::Setns`]). Unlike a
/// bind mount remounted afterwards, it is never visible without its attributes.
pub fn detached_tree(path: &std::path::Path, attributes: u64) -> io::Result<OwnedFd> {
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let path = cpath(path).map_err(io::Error::other)?;
    // SAFETY: open_tree takes a NUL-terminated path and flags and returns a new descriptor
    // or -1; no memory is shared.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            path.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_RECURSIVE as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let attr = MountAttr {
        attr_set: attributes,
        attr_clr: 0,
        // A copy of a shared mount would stay its peer: nothing mounted later under the
        // source may appear where this one goes, nor the other way round.
        propagation: libc::MS_PRIVATE,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads `attr` (its size given) and changes only the detached
    // tree behind `tree`, which this process alone holds.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tree)
}
