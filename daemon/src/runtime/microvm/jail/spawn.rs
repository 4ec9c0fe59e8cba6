//! Starting a program as a cloned child that runs its [`Step`]s, then execs it from a
//! descriptor; failures come back through a close-on-exec pipe, naming the step.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::step::{Step, cpath, cstring, last_errno};
use super::{Jail, jail_steps};

/// One program to start.
pub struct Command<'a> {
    pub binary: &'a Path,
    pub args: &'a [OsString],
    pub env: &'a [(&'a str, &'a str)],
    /// Its stdout and stderr.
    pub output: &'a File,
    /// Confined when set; otherwise only detached into its own process group.
    pub jail: Option<&'a Jail>,
    /// Handed down as descriptor [`INHERITED_FD`]: a listening socket the program serves on.
    pub listener: Option<BorrowedFd<'a>>,
}

/// The descriptor number a [`Command`]'s `listener` has in the program.
pub const INHERITED_FD: RawFd = 3;

fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array; the result is checked.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 just created both descriptors and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A close-on-exec duplicate of `fd` numbered `min` or above.
fn above(fd: BorrowedFd, min: RawFd) -> Result<OwnedFd, String> {
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor and touches nothing else.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
    if dup < 0 {
        return Err(format!(
            "duplicating the listening socket: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: fcntl just created `dup` and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// Starts `command`; returns its pid once it has exec'd (or why it could not).
pub fn spawn(command: &Command) -> Result<u32, String> {
    let binary = File::open(command.binary)
        .map_err(|e| format!("opening {}: {e}", command.binary.display()))?;
    // Duplicates numbered 3 or above (try_clone asks for that): if the daemon runs with one
    // of 0-2 closed, a source descriptor could otherwise be one the child overwrites.
    let stdin = File::open("/dev/null")
        .and_then(|f| f.try_clone())
        .map_err(|e| format!("opening /dev/null: {e}"))?;
    let output_dup = command
        .output
        .try_clone()
        .map_err(|e| format!("duplicating the VMM's log descriptor: {e}"))?;
    let output = output_dup.as_raw_fd();
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
    // Numbered above INHERITED_FD, so its dup2 onto that number is never a no-op that would
    // leave it close-on-exec.
    let listener = command
        .listener
        .map(|fd| above(fd, INHERITED_FD + 1))
        .transpose()?;
    if let Some(listener) = &listener {
        steps.push(Step::Dup2 {
            fd: listener.as_raw_fd(),
            onto: INHERITED_FD,
        });
    }
    let mut flags = 0u64;
    if let Some(jail) = command.jail {
        steps.extend(jail_steps(jail)?);
        flags = (libc::CLONE_NEWNS
            | libc::CLONE_NEWPID
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS) as u64;
    }
    steps.push(Step::CloseInherited {
        first: match listener {
            Some(_) => INHERITED_FD as u32 + 1,
            None => INHERITED_FD as u32,
        },
    });

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
    // Every signal blocked in this thread across the clone: the child must not run one of the
    // daemon's handlers before it has reset them.
    // SAFETY: sigfillset fills a zeroed set; pthread_sigmask swaps this thread's mask.
    let saved_mask = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut saved: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        saved
    };
    // SAFETY: clone3 without CLONE_VM and with no stack behaves as fork: the child runs on
    // a copy of this stack. It only runs `child`, which never returns.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &mut args_block as *mut libc::clone_args,
            std::mem::size_of::<libc::clone_args>(),
        )
    };
    if pid != 0 {
        // SAFETY: restores the mask saved above (the child resets its own).
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &saved_mask, std::ptr::null_mut()) };
    }
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
