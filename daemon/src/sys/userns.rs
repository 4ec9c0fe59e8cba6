//! Starting a program as the root of a user namespace of its own: it may chown, read and
//! write whatever it made itself, and nothing of the host's that an unprivileged uid could
//! not (on the host it runs as `base`).
//!
//! The kernel lets only a process of the parent namespace write the child's id maps, and
//! only after the child has made its namespace, so the two meet halfway: the forked child
//! unshares and says its pid, a thread of ours writes the maps, the child takes up the
//! namespace's root and runs its steps, then execs.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

use super::step::{Step, last_errno};

/// Ids `0..count` of the namespace are the host's `base..base + count`.
#[derive(Debug, Clone, Copy)]
pub struct IdMap {
    pub base: u32,
    pub count: u32,
}

/// Spawns `command` as uid and gid 0 of a new user namespace mapped by `map`, in new mount,
/// network and IPC namespaces of that user namespace, with no supplementary groups, no new
/// privileges and SIGKILL when the spawning thread dies. `steps` run first inside, as that
/// root (mounts of the new mount namespace). The command's `current_dir` is entered before
/// anything is dropped, so it may lie under directories only the host's root can pass.
pub fn spawn_in_user_namespace(
    command: &mut Command,
    map: IdMap,
    steps: Vec<Step>,
) -> io::Result<Child> {
    use nix::fcntl::OFlag;
    let (ready_read, ready_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let (go_read, go_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let (ready_fd, go_fd, go_write_fd) = (
        ready_write.as_raw_fd(),
        go_read.as_raw_fd(),
        go_write.as_raw_fd(),
    );
    let mapper = std::thread::Builder::new()
        .name("userns-map".into())
        .spawn(move || write_maps(ready_read, go_write, map))?;
    // SAFETY: the hook runs in the forked child before exec. It makes raw system calls on
    // descriptors and `steps` prepared before the fork, on stack buffers only: nothing
    // allocates, takes a lock, or touches another thread's state.
    unsafe {
        command.pre_exec(move || {
            let check = |rc: libc::c_long| {
                if rc < 0 {
                    Err(io::Error::from_raw_os_error(last_errno()))
                } else {
                    Ok(())
                }
            };
            // Our copy of the go pipe's write end would keep the read below from ever
            // seeing the end of file that means "no maps".
            libc::close(go_write_fd);
            check(
                libc::unshare(
                    libc::CLONE_NEWUSER
                        | libc::CLONE_NEWNS
                        | libc::CLONE_NEWNET
                        | libc::CLONE_NEWIPC,
                )
                .into(),
            )?;
            let pid = libc::getpid().to_le_bytes();
            if libc::write(ready_fd, pid.as_ptr().cast(), pid.len()) != pid.len() as isize {
                return Err(io::Error::from_raw_os_error(libc::EPIPE));
            }
            let mut go = [0u8; 1];
            if libc::read(go_fd, go.as_mut_ptr().cast(), 1) != 1 {
                // The maps could not be written: the thread says why.
                return Err(io::Error::from_raw_os_error(libc::ECANCELED));
            }
            // The namespace's root, and nothing of the host's: raw calls, as glibc's wrappers
            // would try to reach threads that exist only in the parent.
            check(libc::syscall(
                libc::SYS_setgroups,
                0,
                std::ptr::null::<libc::gid_t>(),
            ))?;
            check(libc::syscall(libc::SYS_setresgid, 0, 0, 0))?;
            check(libc::syscall(libc::SYS_setresuid, 0, 0, 0))?;
            for step in &steps {
                // SAFETY: this is the forked child, which execs or exits next.
                step.run().map_err(io::Error::from_raw_os_error)?;
            }
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0).into())?;
            // Set last: a change of credentials clears it.
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0).into())
        });
    }
    let spawned = command.spawn();
    // The child has exec'd or died: either way the thread's read ends now.
    drop(ready_write);
    drop(go_read);
    let mapped = mapper
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the id-map thread panicked")));
    match (spawned, mapped) {
        (Ok(child), Ok(())) => Ok(child),
        (Ok(mut child), Err(e)) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
        (Err(_), Err(e)) => Err(e),
        (Err(e), Ok(())) => Err(e),
    }
}

/// The parent's half: waits for the child's pid, maps its namespace, lets it go on.
/// `Ok(())` also when the child died before saying its pid (spawn reports that).
fn write_maps(ready: OwnedFd, go: OwnedFd, map: IdMap) -> io::Result<()> {
    let mut pid = [0u8; 4];
    if std::fs::File::from(ready).read_exact(&mut pid).is_err() {
        return Ok(());
    }
    let pid = i32::from_le_bytes(pid);
    let line = format!("0 {} {}\n", map.base, map.count);
    for file in ["uid_map", "gid_map"] {
        std::fs::write(format!("/proc/{pid}/{file}"), &line).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "writing /proc/{pid}/{file} ({line:?}) for a user namespace: {e} \
                     (user.max_user_namespaces may be 0)"
                ),
            )
        })?;
    }
    std::fs::File::from(go).write_all(&[1])
}
