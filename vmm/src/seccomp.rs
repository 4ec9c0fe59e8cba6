//! Seccomp filters per thread role. The process installs the API filter first thing, so
//! every thread inherits it; vCPU and device threads then add their own, narrower one
//! (stacked filters: a call must pass both). A call outside a thread's filter kills the whole
//! VMM with SIGSYS (SECCOMP_RET_KILL_PROCESS), which the kernel logs and the daemon records as
//! the session's lost compute.
//!
//! The lists are what each role was seen to call (strace over the VMM's tests and the
//! daemon's microVM tests) plus the few calls the Rust runtime makes on rare paths. The
//! calls that can do very different things depending on an argument are narrowed by it
//! ([`rules`]): sockets are unix sockets only, `clone` makes threads only (never a process),
//! no memory becomes executable, `ioctl` is KVM's (plus the few descriptor-flag requests
//! the runtime makes, and TUNSETIFF where a network device is built), `fcntl`, `prctl` and
//! `tgkill` only what the VMM uses them for.

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
    // The kernel makes this call itself when a stopped thread (SIGSTOP/SIGCONT, a debugger, a
    // cgroup freeze) resumes an interrupted sleep or futex wait: refusing it killed the VMM.
    libc::SYS_restart_syscall,
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
    // virtio-blk: a FLUSH request.
    libc::SYS_fdatasync,
    libc::SYS_getsockopt,
    libc::SYS_ioctl,
    libc::SYS_poll,
    libc::SYS_ppoll,
    // virtio-blk: reads and writes of the disk files.
    libc::SYS_pread64,
    libc::SYS_pwrite64,
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
    // Checking that an inherited API descriptor is a unix socket.
    libc::SYS_getsockname,
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

/// One argument condition: the call passes when, for one of `alternatives`, the low 32 bits
/// of argument `index` masked with `.0` equal `.1` (ints, flags and ioctl numbers all fit in
/// them, and the kernel ignores or refuses the high ones). Otherwise the process is killed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub nr: libc::c_long,
    pub index: u8,
    pub alternatives: Vec<(u32, u32)>,
}

const EXACT: u32 = u32::MAX;
/// The ioctl "type" byte of KVM's requests (KVMIO).
const IOCTL_TYPE_MASK: u32 = 0xff00;
const KVMIO: u32 = 0xae00;

fn exact(values: &[u64]) -> Vec<(u32, u32)> {
    values.iter().map(|v| (EXACT, *v as u32)).collect()
}

fn kill_unless(nr: libc::c_long, index: u8, alternatives: Vec<(u32, u32)>) -> Rule {
    Rule {
        nr,
        index,
        alternatives,
    }
}

/// Descriptor-flag ioctls the Rust runtime issues on sockets and files.
const FD_IOCTLS: [u64; 3] = [libc::FIONBIO, libc::FIOCLEX, libc::FIONCLEX];

/// The argument conditions of `role`, for the process whose pid is `pid`.
pub fn rules(role: Role, pid: u32) -> Vec<Rule> {
    let no_exec = || vec![(libc::PROT_EXEC as u32, 0)];
    let unix_only = || exact(&[libc::AF_UNIX as u64]);
    let fcntl = || {
        exact(&[
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
            libc::F_GETFL as u64,
            libc::F_SETFL as u64,
            libc::F_DUPFD_CLOEXEC as u64,
        ])
    };
    let ioctl = |extra: &[u64]| {
        let mut alternatives = vec![(IOCTL_TYPE_MASK, KVMIO)];
        alternatives.extend(exact(extra));
        alternatives
    };
    let mut rules = vec![
        kill_unless(libc::SYS_mmap, 2, no_exec()),
        kill_unless(libc::SYS_mprotect, 2, no_exec()),
        kill_unless(
            libc::SYS_prctl,
            0,
            exact(&[
                libc::PR_SET_NAME as u64,
                libc::PR_GET_NAME as u64,
                libc::PR_SET_NO_NEW_PRIVS as u64,
            ]),
        ),
        // Signals to its own threads only (vCPU kicks).
        kill_unless(libc::SYS_tgkill, 0, exact(&[u64::from(pid)])),
    ];
    match role {
        Role::Api => {
            let tty = [libc::TCGETS, libc::TIOCGWINSZ];
            // Attaching a network device's tap while the VM is built (open of /dev/net/tun
            // is an `openat`, already allowed). Its frames move with read and write.
            let tap = [libc::TUNSETIFF];
            // Disk copies into and out of snapshots are reflinks where the filesystem has
            // them (FICLONE shares the source's blocks with the new file).
            let reflink = [libc::FICLONE];
            let api_ioctls: Vec<u64> = FD_IOCTLS
                .iter()
                .chain(&tty)
                .chain(&tap)
                .chain(&reflink)
                .copied()
                .collect();
            rules.extend([
                kill_unless(libc::SYS_socket, 0, unix_only()),
                kill_unless(libc::SYS_socketpair, 0, unix_only()),
                kill_unless(libc::SYS_fcntl, 1, fcntl()),
                kill_unless(libc::SYS_ioctl, 1, ioctl(&api_ioctls)),
                // Threads, never processes.
                kill_unless(
                    libc::SYS_clone,
                    0,
                    vec![(libc::CLONE_THREAD as u32, libc::CLONE_THREAD as u32)],
                ),
            ]);
        }
        Role::Vcpu => rules.push(kill_unless(libc::SYS_ioctl, 1, ioctl(&[]))),
        Role::Devices => rules.extend([
            kill_unless(libc::SYS_socket, 0, unix_only()),
            kill_unless(libc::SYS_fcntl, 1, fcntl()),
            kill_unless(libc::SYS_ioctl, 1, ioctl(&FD_IOCTLS)),
        ]),
    }
    rules
}

/// A filter could not be built (a rule the library refuses: a bug, caught by the tests).
#[derive(Debug, thiserror::Error)]
#[error("building the {role:?} seccomp filter: {source}")]
pub struct BuildError {
    role: Role,
    source: seccompiler::BackendError,
}

/// `role`'s filter for the process `pid`, compiled by rust-vmm's `seccompiler`: x86-64
/// only; every call of [`allowed`] passes, those with a [`rules`] entry only with the
/// arguments it names; anything else kills the process.
pub fn program(role: Role, pid: u32) -> Result<seccompiler::BpfProgram, BuildError> {
    use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};
    let err = |source| BuildError { role, source };
    let mut map: std::collections::BTreeMap<i64, Vec<SeccompRule>> = allowed(role)
        .into_iter()
        .map(|nr| (nr, Vec::new()))
        .collect();
    for rule in rules(role, pid) {
        let mut alternatives = Vec::new();
        for (mask, value) in &rule.alternatives {
            let op = match *mask {
                EXACT => SeccompCmpOp::Eq,
                mask => SeccompCmpOp::MaskedEq(u64::from(mask)),
            };
            let condition =
                SeccompCondition::new(rule.index, SeccompCmpArgLen::Dword, op, u64::from(*value))
                    .map_err(err)?;
            alternatives.push(SeccompRule::new(vec![condition]).map_err(err)?);
        }
        map.insert(rule.nr, alternatives);
    }
    let filter = seccompiler::SeccompFilter::new(
        map,
        seccompiler::SeccompAction::KillProcess,
        seccompiler::SeccompAction::Allow,
        seccompiler::TargetArch::x86_64,
    )
    .map_err(err)?;
    filter.try_into().map_err(err)
}

/// A second filter, stacked over the API one: `clone3` answers ENOSYS. Its flags sit in
/// memory a filter cannot read, so it is refused, and the C library falls back to `clone`,
/// whose flags the API filter checks. (Of stacked filters the strictest verdict wins: this
/// one's errno over the other's allow; every other call it allows.)
pub fn clone3_refusal() -> Result<seccompiler::BpfProgram, BuildError> {
    let err = |source| BuildError {
        role: Role::Api,
        source,
    };
    seccompiler::SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
        seccompiler::SeccompAction::Allow,
        seccompiler::SeccompAction::Errno(libc::ENOSYS as u32),
        seccompiler::TargetArch::x86_64,
    )
    .map_err(err)?
    .try_into()
    .map_err(err)
}

/// Every call `role` may make (sorted, without repeats), argument-checked ones included.
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
    let mut filters = vec![program(role, std::process::id()).map_err(io::Error::other)?];
    if role == Role::Api {
        filters.push(clone3_refusal().map_err(io::Error::other)?);
    }
    for filter in &filters {
        // Sets no-new-privs (required without CAP_SYS_ADMIN, harmless with it), then the
        // filter, on this thread.
        seccompiler::apply_filter(filter).map_err(io::Error::other)?;
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
        // A rule narrows a call its role allows; it never adds one.
        for role in [Role::Api, Role::Vcpu, Role::Devices] {
            for rule in rules(role, 1) {
                assert!(allowed(role).contains(&rule.nr), "{role:?}: {rule:?}");
            }
        }
        assert!(!allowed(Role::Api).contains(&libc::SYS_execve));
    }

    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;

    fn run(p: &[seccompiler::sock_filter], nr: libc::c_long, args: [u64; 6]) -> u32 {
        run_on(p, nr, AUDIT_ARCH_X86_64, args)
    }

    /// A tiny classic-BPF interpreter for the instructions seccompiler emits, to check
    /// verdicts without installing anything: call `nr` with `args` made on `arch`.
    fn run_on(p: &[seccompiler::sock_filter], nr: libc::c_long, arch: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[..4].copy_from_slice(&(nr as u32).to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let ins = &p[pc];
            let jump = |taken: bool| if taken { ins.jt } else { ins.jf } as usize;
            pc += match u32::from(ins.code) {
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => {
                    let k = ins.k as usize;
                    a = u32::from_le_bytes(data[k..k + 4].try_into().unwrap());
                    0
                }
                c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => {
                    a &= ins.k;
                    0
                }
                c if c == libc::BPF_RET | libc::BPF_K => return ins.k,
                c if c == libc::BPF_JMP | libc::BPF_JA => ins.k as usize,
                c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => jump(a == ins.k),
                c if c == libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K => jump(a > ins.k),
                c if c == libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K => jump(a >= ins.k),
                c if c == libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K => jump(a & ins.k != 0),
                other => panic!("unexpected instruction {other:#x}"),
            };
            pc += 1;
        }
    }

    #[test]
    fn arguments_decide_where_a_rule_applies() {
        // The API thread runs under both of its filters: the first verdict other than
        // allow is what the kernel does (the two never disagree otherwise).
        let clone3 = clone3_refusal().unwrap();
        let api = program(Role::Api, 42).unwrap();
        let vcpu = program(Role::Vcpu, 42).unwrap();
        let devices = program(Role::Devices, 42).unwrap();
        let allow = SECCOMP_RET_ALLOW;
        let kill = SECCOMP_RET_KILL_PROCESS;
        let call = |p: &[seccompiler::sock_filter], nr, a0: u64, a1: u64, a2: u64| {
            let args = [a0, a1, a2, 0, 0, 0];
            match (run(p, nr, args), run(&clone3, nr, args)) {
                (SECCOMP_RET_ALLOW, second) => second,
                (first, _) => first,
            }
        };
        let (unix, inet) = (libc::AF_UNIX as u64, libc::AF_INET as u64);
        assert_eq!(call(&api, libc::SYS_socket, unix, 1, 0), allow);
        assert_eq!(call(&api, libc::SYS_socket, inet, 1, 0), kill);
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        assert_eq!(call(&api, libc::SYS_mmap, 0, 4096, rw), allow);
        assert_eq!(
            call(&api, libc::SYS_mmap, 0, 4096, rw | libc::PROT_EXEC as u64),
            kill
        );
        assert_eq!(
            call(&api, libc::SYS_mprotect, 0, 4096, libc::PROT_EXEC as u64),
            kill
        );
        let thread = (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64;
        assert_eq!(call(&api, libc::SYS_clone, thread, 0, 0), allow);
        assert_eq!(
            call(&api, libc::SYS_clone, libc::SIGCHLD as u64, 0, 0),
            kill
        );
        assert_eq!(
            call(&api, libc::SYS_clone3, 0, 0, 0),
            SECCOMP_RET_ERRNO | libc::ENOSYS as u32
        );
        assert_eq!(call(&api, libc::SYS_tgkill, 42, 7, 0), allow);
        assert_eq!(call(&api, libc::SYS_tgkill, 43, 7, 0), kill);
        assert_eq!(
            call(&api, libc::SYS_prctl, libc::PR_SET_NAME as u64, 0, 0),
            allow
        );
        assert_eq!(
            call(&api, libc::SYS_prctl, libc::PR_SET_DUMPABLE as u64, 0, 0),
            kill
        );
        assert_eq!(
            call(&api, libc::SYS_fcntl, 3, libc::F_SETFL as u64, 0),
            allow
        );
        assert_eq!(
            call(&api, libc::SYS_fcntl, 3, libc::F_SETOWN as u64, 0),
            kill
        );
        const KVM_RUN: u64 = 0xae80;
        assert_eq!(call(&vcpu, libc::SYS_ioctl, 5, KVM_RUN, 0), allow);
        assert_eq!(call(&vcpu, libc::SYS_ioctl, 5, libc::FIONBIO, 0), kill);
        assert_eq!(call(&api, libc::SYS_ioctl, 5, libc::FIONBIO, 0), allow);
        assert_eq!(call(&api, libc::SYS_ioctl, 5, libc::TIOCSTI, 0), kill);
        // Taps are attached while building, never from a device or vCPU thread.
        assert_eq!(call(&api, libc::SYS_ioctl, 5, libc::TUNSETIFF, 0), allow);
        assert_eq!(call(&api, libc::SYS_ioctl, 5, libc::FICLONE, 0), allow);
        assert_eq!(call(&devices, libc::SYS_ioctl, 5, libc::TUNSETIFF, 0), kill);
        assert_eq!(call(&vcpu, libc::SYS_ioctl, 5, libc::TUNSETIFF, 0), kill);
        assert_eq!(call(&devices, libc::SYS_read, 5, 0, 0), allow);
        assert_eq!(call(&devices, libc::SYS_write, 5, 0, 0), allow);
        // Plain calls still pass or die by number alone.
        assert_eq!(call(&vcpu, libc::SYS_futex, 0, 0, 0), allow);
        assert_eq!(call(&vcpu, libc::SYS_socket, unix, 0, 0), kill);
        assert_eq!(call(&api, libc::SYS_execve, 0, 0, 0), kill);
        // Another architecture's calls are refused whatever their number (an i386 read).
        assert_eq!(run_on(&api, libc::SYS_read, 0x4000_0003, [0; 6]), kill);
    }
}
