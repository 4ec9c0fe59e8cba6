//! Starting a program as a cloned child that runs its [`Step`]s, then execs it from a
//! descriptor; failures come back through a close-on-exec pipe, naming the step.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sched::CloneFlags;

use super::{Jail, jail_steps};
use crate::sys::{self, Step, cpath, cstring};

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
    /// Handed down as descriptor [`ANCHOR_FD`]: a pipe's read end the program watches.
    pub anchor: Option<BorrowedFd<'a>>,
}

/// The descriptor number a [`Command`]'s `listener` has in the program.
pub const INHERITED_FD: RawFd = 3;
/// The descriptor number a [`Command`]'s `anchor` has in the program.
pub const ANCHOR_FD: RawFd = 4;

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
    // Numbered above both targets, so no dup2 onto one is a no-op that would leave it
    // close-on-exec, nor overwrites the other's source.
    if command.anchor.is_some() && command.listener.is_none() {
        // Descriptor 3 would be whatever the daemon has there.
        return Err("an anchor is handed down only beside a listener".to_owned());
    }
    let handed = [
        (command.listener, INHERITED_FD),
        (command.anchor, ANCHOR_FD),
    ];
    let mut sources = Vec::new();
    let mut last = None;
    for (fd, onto) in handed {
        let Some(fd) = fd else { continue };
        let dup = sys::dup_above(fd, ANCHOR_FD + 1)
            .map_err(|e| format!("duplicating descriptor {onto} for the VMM: {e}"))?;
        steps.push(Step::Dup2 {
            fd: dup.as_raw_fd(),
            onto,
        });
        sources.push(dup);
        last = Some(onto);
    }
    let mut namespaces = CloneFlags::empty();
    if let Some(jail) = command.jail {
        steps.extend(jail_steps(jail)?);
        namespaces = CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWPID
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS;
    }
    // Everything above the last one handed down.
    steps.push(Step::CloseInherited {
        first: last.map_or(INHERITED_FD, |fd| fd + 1) as u32,
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

    let (report_read, report_write) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let pid = sys::clone_and_exec(
        &steps,
        namespaces,
        binary.as_fd(),
        &args,
        &env,
        report_write.as_fd(),
    )
    .map_err(|e| format!("clone (namespaces {:#x}): {e}", namespaces.bits()))?;
    drop(report_write);
    let mut report = [0u8; 8];
    let mut got = 0;
    while got < report.len() {
        match nix::unistd::read(&report_read, &mut report[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    if got == 0 {
        return Ok(pid.as_raw() as u32);
    }
    // The child failed before exec: reap it and say which step failed.
    let _ = nix::sys::wait::waitpid(pid, None);
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
