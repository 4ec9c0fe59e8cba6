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
/// them, and the kernel ignores or refuses the high ones). Otherwise it gets `mismatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub nr: libc::c_long,
    pub index: u8,
    pub alternatives: Vec<(u32, u32)>,
    pub mismatch: u32,
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
        mismatch: SECCOMP_RET_KILL_PROCESS,
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
                // Its flags sit in memory a filter cannot read: refused, so the C library
                // falls back to `clone`, whose flags it can.
                Rule {
                    nr: libc::SYS_clone3,
                    index: 0,
                    alternatives: Vec::new(),
                    mismatch: SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
                },
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

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
// offsetof(struct seccomp_data, nr / arch / args[0])
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARGS: u32 = 16;

fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jeq(k: u32, jt: usize) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt: u8::try_from(jt).expect("a seccomp jump fits in a byte"),
        jf: 0,
        k,
    }
}

const LOAD: u32 = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
const RET: u32 = libc::BPF_RET | libc::BPF_K;
const AND: u32 = libc::BPF_ALU | libc::BPF_AND | libc::BPF_K;

/// One rule's block: each alternative loads and tests the argument and jumps to the block's
/// final allow; falling through every one returns the mismatch verdict.
fn block(rule: &Rule) -> Vec<libc::sock_filter> {
    let mut alternatives: Vec<[libc::sock_filter; 3]> = Vec::new();
    let n = rule.alternatives.len();
    for (i, (mask, value)) in rule.alternatives.iter().enumerate() {
        // Instructions after this jump up to the allow: the later alternatives and the
        // mismatch return.
        let to_allow = (n - 1 - i) * 3 + 1;
        alternatives.push([
            stmt(LOAD, DATA_ARGS + 8 * u32::from(rule.index)),
            stmt(AND, *mask),
            jeq(*value, to_allow),
        ]);
    }
    let mut b: Vec<libc::sock_filter> = alternatives.into_iter().flatten().collect();
    b.push(stmt(RET, rule.mismatch));
    b.push(stmt(RET, SECCOMP_RET_ALLOW));
    b
}

/// The BPF program of `role` for the process `pid`: x86-64 only; then one comparison per
/// allowed number, straight to the allow or to the block that checks its argument.
pub fn program(role: Role, pid: u32) -> Vec<libc::sock_filter> {
    let rules = rules(role, pid);
    let plain: Vec<libc::c_long> = allowed(role)
        .into_iter()
        .filter(|nr| !rules.iter().any(|r| r.nr == *nr))
        .collect();
    let mut p = vec![
        stmt(LOAD, DATA_ARCH),
        jeq(AUDIT_ARCH_X86_64, 1),
        stmt(RET, SECCOMP_RET_KILL_PROCESS),
        stmt(LOAD, DATA_NR),
    ];
    let dispatch = plain.len() + rules.len();
    // Index of the kill and allow after the dispatch, then the blocks.
    let kill = p.len() + dispatch;
    let allow = kill + 1;
    for nr in &plain {
        let at = p.len();
        p.push(jeq(*nr as u32, allow - at - 1));
    }
    let blocks: Vec<Vec<libc::sock_filter>> = rules.iter().map(block).collect();
    let mut block_at = allow + 1;
    for (rule, b) in rules.iter().zip(&blocks) {
        let at = p.len();
        p.push(jeq(rule.nr as u32, block_at - at - 1));
        block_at += b.len();
    }
    p.push(stmt(RET, SECCOMP_RET_KILL_PROCESS));
    p.push(stmt(RET, SECCOMP_RET_ALLOW));
    p.extend(blocks.into_iter().flatten());
    p
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
    let filter = program(role, std::process::id());
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
        // A rule narrows a call its role allows; it never adds one.
        for role in [Role::Api, Role::Vcpu, Role::Devices] {
            for rule in rules(role, 1) {
                assert!(allowed(role).contains(&rule.nr), "{role:?}: {rule:?}");
            }
        }
        assert!(!allowed(Role::Api).contains(&libc::SYS_execve));
    }

    /// A tiny interpreter for the instructions `program` emits, to check verdicts without
    /// installing anything.
    fn run(p: &[libc::sock_filter], nr: libc::c_long, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[..4].copy_from_slice(&(nr as u32).to_le_bytes());
        data[4..8].copy_from_slice(&AUDIT_ARCH_X86_64.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let ins = p[pc];
            match u32::from(ins.code) {
                LOAD => {
                    let k = ins.k as usize;
                    a = u32::from_le_bytes(data[k..k + 4].try_into().unwrap());
                }
                AND => a &= ins.k,
                RET => return ins.k,
                c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => {
                    pc += if a == ins.k { ins.jt } else { ins.jf } as usize;
                }
                other => panic!("unexpected instruction {other:#x}"),
            }
            pc += 1;
        }
    }

    #[test]
    fn arguments_decide_where_a_rule_applies() {
        let api = program(Role::Api, 42);
        let vcpu = program(Role::Vcpu, 42);
        let allow = SECCOMP_RET_ALLOW;
        let kill = SECCOMP_RET_KILL_PROCESS;
        let call = |p: &[libc::sock_filter], nr, a0: u64, a1: u64, a2: u64| {
            run(p, nr, [a0, a1, a2, 0, 0, 0])
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
        let devices = program(Role::Devices, 42);
        assert_eq!(call(&devices, libc::SYS_ioctl, 5, libc::TUNSETIFF, 0), kill);
        assert_eq!(call(&vcpu, libc::SYS_ioctl, 5, libc::TUNSETIFF, 0), kill);
        assert_eq!(call(&devices, libc::SYS_read, 5, 0, 0), allow);
        assert_eq!(call(&devices, libc::SYS_write, 5, 0, 0), allow);
        // Plain calls still pass or die by number alone.
        assert_eq!(call(&vcpu, libc::SYS_futex, 0, 0, 0), allow);
        assert_eq!(call(&vcpu, libc::SYS_socket, unix, 0, 0), kill);
        assert_eq!(call(&api, libc::SYS_execve, 0, 0, 0), kill);
    }
}
