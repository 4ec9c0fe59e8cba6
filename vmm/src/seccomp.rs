//! Seccomp filters per thread role. The process installs the API filter first thing, so
//! every thread inherits it; vCPU and device threads then add their own, narrower one
//! (stacked filters: a call must pass both). A call outside a thread's filter kills the whole
//! VMM with SIGSYS (SECCOMP_RET_KILL_PROCESS), which the kernel logs and the daemon records as
//! the session's lost compute.
//!
//! The lists are what each role was seen to call (strace over the VMM's tests and the
//! daemon's microVM tests) plus the few calls the Rust runtime makes on rare paths. There is
//! no argument filtering yet; the narrowing is by role.

use std::io;

/// Which filter a thread runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The main thread and everything it starts: API server, VM setup and teardown,
    /// snapshots, restores. The superset.
    Api,
    /// A vCPU: KVM_RUN and port/MMIO exits.
    Vcpu,
    /// The device event loop: virtio queues, vsock streams, serial output.
    Devices,
}

/// What every thread needs: memory, futexes, signals, its own end.
const COMMON: &[libc::c_long] = &[
    libc::SYS_brk,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_close,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_futex,
    libc::SYS_getpid,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_madvise,
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_munmap,
    libc::SYS_nanosleep,
    libc::SYS_prctl,
    libc::SYS_read,
    libc::SYS_rseq,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_yield,
    // A thread narrowing its own filter (stacking only ever removes calls).
    libc::SYS_seccomp,
    libc::SYS_set_robust_list,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    libc::SYS_write,
    libc::SYS_writev,
];

const VCPU: &[libc::c_long] = &[libc::SYS_ioctl];

const DEVICES: &[libc::c_long] = &[
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_wait,
    libc::SYS_fcntl,
    libc::SYS_getsockopt,
    libc::SYS_ioctl,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_shutdown,
    libc::SYS_socket,
];

const API: &[libc::c_long] = &[
    libc::SYS_accept4,
    libc::SYS_access,
    libc::SYS_arch_prctl,
    libc::SYS_bind,
    libc::SYS_chmod,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_connect,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_wait,
    libc::SYS_eventfd2,
    libc::SYS_fallocate,
    libc::SYS_fchmod,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_fstat,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_getdents64,
    libc::SYS_getsockopt,
    libc::SYS_ioctl,
    libc::SYS_linkat,
    libc::SYS_listen,
    libc::SYS_lseek,
    libc::SYS_memfd_create,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_newfstatat,
    libc::SYS_openat,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_pread64,
    libc::SYS_prlimit64,
    libc::SYS_pwrite64,
    libc::SYS_readlink,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_rmdir,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_set_tid_address,
    libc::SYS_setsockopt,
    libc::SYS_shutdown,
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_statfs,
    libc::SYS_statx,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
];

/// The syscalls `role` may make (sorted, without repeats).
pub fn allowed(role: Role) -> Vec<libc::c_long> {
    let own: &[libc::c_long] = match role {
        Role::Api => API,
        Role::Vcpu => VCPU,
        Role::Devices => DEVICES,
    };
    let mut all: Vec<libc::c_long> = COMMON.iter().chain(own).copied().collect();
    all.sort_unstable();
    all.dedup();
    all
}

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
// offsetof(struct seccomp_data, nr / arch)
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jeq(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

/// The BPF program: x86-64 only, then one comparison per allowed number.
pub fn program(role: Role) -> Vec<libc::sock_filter> {
    let load = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let ret = (libc::BPF_RET | libc::BPF_K) as u16;
    let nrs = allowed(role);
    let n = nrs.len();
    assert!(n < 255, "jump offsets are one byte");
    let mut p = vec![
        stmt(load, DATA_ARCH),
        jeq(AUDIT_ARCH_X86_64, 1, 0),
        stmt(ret, SECCOMP_RET_KILL_PROCESS),
        stmt(load, DATA_NR),
    ];
    for (i, nr) in nrs.iter().enumerate() {
        // Taken: skip the rest of the list and the kill, to the allow.
        p.push(jeq(*nr as u32, (n - i) as u8, 0));
    }
    p.push(stmt(ret, SECCOMP_RET_KILL_PROCESS));
    p.push(stmt(ret, SECCOMP_RET_ALLOW));
    p
}

static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Installs the API filter on the calling thread (call it before starting any other) and
/// makes [`enter`] install each role's filter from now on.
pub fn enable() -> io::Result<()> {
    // glibc gives a thread that allocates under contention a new malloc arena, and to size
    // the arena pool it reads /sys/devices/system/cpu/online — an openat a vCPU or device
    // thread may not make. With the pool size fixed it never asks.
    // SAFETY: mallopt with an integer option, before any other thread exists.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 2) };
    install(Role::Api)?;
    ENABLED.store(true, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

/// Called first thing by a vCPU or device thread: narrows its filter to `role` when the
/// process runs filtered. A thread that cannot be filtered ends the process rather than run
/// unconfined.
pub fn enter(role: Role) {
    if ENABLED.load(std::sync::atomic::Ordering::SeqCst)
        && let Err(e) = install(role)
    {
        eprintln!("agentvm-vmm: installing the {role:?} seccomp filter: {e}");
        std::process::exit(70);
    }
}

/// Installs `role`'s filter on the calling thread (and the threads it starts from now on).
pub fn install(role: Role) -> io::Result<()> {
    let filter = program(role);
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments; it is required to install a filter
    // without CAP_SYS_ADMIN and harmless with it.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `prog` points at `filter`, alive for the call; the kernel copies the program.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &prog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_narrow_the_api_set() {
        let api = allowed(Role::Api);
        for role in [Role::Vcpu, Role::Devices] {
            for nr in allowed(role) {
                assert!(
                    api.contains(&nr),
                    "{role:?} allows {nr}, which the API filter does not"
                );
            }
        }
        assert!(!allowed(Role::Vcpu).contains(&libc::SYS_socket));
        assert!(!allowed(Role::Api).contains(&libc::SYS_execve));
    }

    #[test]
    fn jumps_land_on_allow() {
        let p = program(Role::Api);
        let allow = p.len() - 1;
        for (i, ins) in p.iter().enumerate().skip(4).take(p.len() - 6) {
            assert_eq!(i + 1 + ins.jt as usize, allow, "instruction {i}");
        }
    }
}
