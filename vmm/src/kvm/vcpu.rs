//! vCPU threads: one per vCPU, each looping on KVM_RUN and answering port/MMIO exits from the
//! device buses, parked on a condition variable while the VM is paused.
//!
//! A thread inside KVM_RUN is interrupted by setting `immediate_exit` in its `kvm_run` page
//! and sending it a signal: the flag covers the window where the thread is about to enter
//! KVM_RUN and would miss the signal, the signal covers a thread already inside it.

use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{SIGRTMIN, register_signal_handler};

use crate::devices::bus::Bus;
use crate::exit::{ExitReason, ExitSignal};

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("installing the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    #[error("starting vCPU thread {index}: {source}")]
    Spawn { index: u8, source: std::io::Error },
    #[error("{parked} of {total} vCPUs stopped within {waited:?}")]
    PauseTimeout {
        parked: usize,
        total: usize,
        waited: Duration,
    },
}

/// What every vCPU thread needs besides its own fd.
#[derive(Clone)]
pub struct VcpuContext {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub exit: Arc<ExitSignal>,
    pub stats: Arc<VcpuStats>,
}

#[derive(Debug, Default)]
pub struct VcpuStats {
    pub io_exits: AtomicU64,
    pub mmio_exits: AtomicU64,
    pub unclaimed_accesses: AtomicU64,
}

impl VcpuStats {
    pub fn counters(&self) -> [(&'static str, u64); 3] {
        [
            ("io_exits", self.io_exits.load(Ordering::Relaxed)),
            ("mmio_exits", self.mmio_exits.load(Ordering::Relaxed)),
            (
                "unclaimed_accesses",
                self.unclaimed_accesses.load(Ordering::Relaxed),
            ),
        ]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Run,
    Pause,
    Stop,
}

struct Control {
    mode: Mode,
    /// Threads currently waiting (paused, halted after an exit request, or finished).
    parked: usize,
}

struct RunControl {
    state: Mutex<Control>,
    changed: Condvar,
}

impl RunControl {
    fn lock(&self) -> MutexGuard<'_, Control> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks while the thread must not run; false when it must end.
    fn runnable(&self, exit: &ExitSignal) -> bool {
        let mut control = self.lock();
        loop {
            match control.mode {
                Mode::Stop => return false,
                Mode::Run if !exit.requested() => return true,
                _ => {
                    control.parked += 1;
                    self.changed.notify_all();
                    control = self
                        .changed
                        .wait(control)
                        .unwrap_or_else(|p| p.into_inner());
                    control.parked -= 1;
                }
            }
        }
    }
}

/// A vCPU fd, locked by its thread while the vCPU runs and free while it is parked, so a
/// paused VM's register state can be read and written from elsewhere.
pub type SharedVcpu = Arc<Mutex<VcpuFd>>;

struct VcpuThread {
    handle: JoinHandle<()>,
    vcpu: SharedVcpu,
    /// The vCPU's `kvm_run` page; valid while `vcpu` (which owns the mapping) is alive.
    run_page: *mut kvm_run,
}

// SAFETY: `run_page` points into a shared mmap owned by the VcpuFd in `vcpu`, which this
// struct keeps alive; it is only written (one byte, volatile) while that holds.
unsafe impl Send for VcpuThread {}
// SAFETY: as above; concurrent writers only ever store 1 into `immediate_exit`.
unsafe impl Sync for VcpuThread {}

impl VcpuThread {
    fn kick(&self) {
        // SAFETY: the page stays mapped while `self.vcpu` (which owns the VcpuFd) exists,
        // and `immediate_exit` is a plain byte KVM reads on entry to KVM_RUN.
        unsafe { std::ptr::addr_of_mut!((*self.run_page).immediate_exit).write_volatile(1) };
        // SAFETY: the pthread_t belongs to a thread that has not been joined yet, so it is
        // valid (it may have finished, in which case pthread_kill reports ESRCH harmlessly).
        unsafe { libc::pthread_kill(self.handle.as_pthread_t(), kick_signal()) };
    }
}

fn kick_signal() -> i32 {
    SIGRTMIN()
}

extern "C" fn ignore_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn install_kick_handler() -> Result<(), VcpuError> {
    static INSTALL: Once = Once::new();
    let mut result = Ok(());
    INSTALL.call_once(|| {
        result = register_signal_handler(kick_signal(), ignore_kick).map_err(VcpuError::Signal);
    });
    result
}

/// The running vCPUs of one VM.
pub struct VcpuSet {
    control: Arc<RunControl>,
    threads: Vec<VcpuThread>,
}

impl VcpuSet {
    /// Starts one thread per vCPU, running at once or parked until `resume`.
    pub fn start(
        vcpus: Vec<VcpuFd>,
        context: VcpuContext,
        paused: bool,
    ) -> Result<Self, VcpuError> {
        install_kick_handler()?;
        let control = Arc::new(RunControl {
            state: Mutex::new(Control {
                mode: if paused { Mode::Pause } else { Mode::Run },
                parked: 0,
            }),
            changed: Condvar::new(),
        });
        let mut set = Self {
            control: control.clone(),
            threads: Vec::with_capacity(vcpus.len()),
        };
        for (index, mut vcpu) in vcpus.into_iter().enumerate() {
            let index = index as u8;
            let run_page: *mut kvm_run = vcpu.get_kvm_run();
            let vcpu: SharedVcpu = Arc::new(Mutex::new(vcpu));
            let control = control.clone();
            let context = context.clone();
            let thread_vcpu = vcpu.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("vcpu{index}"))
                .spawn(move || run(&thread_vcpu, index, &control, &context));
            match spawned {
                Ok(handle) => set.threads.push(VcpuThread {
                    handle,
                    vcpu,
                    run_page,
                }),
                Err(source) => {
                    set.stop();
                    return Err(VcpuError::Spawn { index, source });
                }
            }
        }
        Ok(set)
    }

    pub fn len(&self) -> usize {
        self.threads.len()
    }

    /// The vCPU fds, in vCPU order. Lock one only while the VM is paused: a running vCPU's
    /// thread holds its lock.
    pub fn vcpus(&self) -> Vec<SharedVcpu> {
        self.threads.iter().map(|t| t.vcpu.clone()).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// Stops every vCPU at its next instruction boundary and waits until all are parked.
    pub fn pause(&self, timeout: Duration) -> Result<(), VcpuError> {
        self.control.lock().mode = Mode::Pause;
        for thread in &self.threads {
            thread.kick();
        }
        let deadline = Instant::now() + timeout;
        let mut control = self.control.lock();
        while control.parked < self.threads.len() {
            let now = Instant::now();
            if now >= deadline {
                return Err(VcpuError::PauseTimeout {
                    parked: control.parked,
                    total: self.threads.len(),
                    waited: timeout,
                });
            }
            control = self
                .control
                .changed
                .wait_timeout(control, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    pub fn resume(&self) {
        self.control.lock().mode = Mode::Run;
        self.control.changed.notify_all();
    }

    /// Whether the set was told to run (not paused or stopping).
    pub fn running(&self) -> bool {
        self.control.lock().mode == Mode::Run
    }

    /// Ends every vCPU thread; the vCPU fds close with the set.
    pub fn stop(&mut self) {
        self.control.lock().mode = Mode::Stop;
        self.control.changed.notify_all();
        for thread in &self.threads {
            thread.kick();
        }
        for thread in self.threads.drain(..) {
            if thread.handle.join().is_err() {
                tracing::error!("a vCPU thread panicked");
            }
        }
    }
}

impl Drop for VcpuSet {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop();
        }
    }
}

fn lock_vcpu(vcpu: &SharedVcpu) -> MutexGuard<'_, VcpuFd> {
    vcpu.lock().unwrap_or_else(|p| p.into_inner())
}

fn run(shared: &SharedVcpu, index: u8, control: &RunControl, context: &VcpuContext) {
    crate::seccomp::enter(crate::seccomp::Role::Vcpu);
    while control.runnable(&context.exit) {
        // Held for one KVM_RUN and its exit; released whenever the thread parks.
        let mut vcpu = lock_vcpu(shared);
        let outcome = match vcpu.run() {
            Ok(exit) => handle_exit(exit, context),
            Err(e) if e.errno() == libc::EINTR => {
                vcpu.set_kvm_immediate_exit(0);
                Outcome::Continue
            }
            Err(e) if e.errno() == libc::EAGAIN => Outcome::Continue,
            Err(e) => Outcome::Exit(ExitReason::VcpuFailure(format!(
                "KVM_RUN on vCPU {index}: {e}"
            ))),
        };
        match outcome {
            Outcome::Continue => {}
            Outcome::Exit(reason) => context.exit.request(reason),
            Outcome::InternalError => {
                let reason = internal_error(&mut vcpu, index);
                context.exit.request(ExitReason::VcpuFailure(reason));
            }
        }
    }
    // Counted as parked so a pause racing with the end of the VM does not wait for us.
    control.lock().parked += 1;
    control.changed.notify_all();
}

enum Outcome {
    Continue,
    Exit(ExitReason),
    InternalError,
}

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;

fn handle_exit(exit: VcpuExit<'_>, context: &VcpuContext) -> Outcome {
    let stats = &context.stats;
    match exit {
        VcpuExit::IoIn(port, data) => {
            stats.io_exits.fetch_add(1, Ordering::Relaxed);
            if !context.pio.read(u64::from(port), data) {
                stats.unclaimed_accesses.fetch_add(1, Ordering::Relaxed);
                // An unpopulated ISA port floats high.
                data.fill(0xff);
            }
        }
        VcpuExit::IoOut(port, data) => {
            stats.io_exits.fetch_add(1, Ordering::Relaxed);
            if !context.pio.write(u64::from(port), data) {
                stats.unclaimed_accesses.fetch_add(1, Ordering::Relaxed);
            }
        }
        VcpuExit::MmioRead(addr, data) => {
            stats.mmio_exits.fetch_add(1, Ordering::Relaxed);
            if !context.mmio.read(addr, data) {
                stats.unclaimed_accesses.fetch_add(1, Ordering::Relaxed);
                data.fill(0);
            }
        }
        VcpuExit::MmioWrite(addr, data) => {
            stats.mmio_exits.fetch_add(1, Ordering::Relaxed);
            if !context.mmio.write(addr, data) {
                stats.unclaimed_accesses.fetch_add(1, Ordering::Relaxed);
            }
        }
        VcpuExit::Shutdown => return Outcome::Exit(ExitReason::TripleFault),
        VcpuExit::SystemEvent(KVM_SYSTEM_EVENT_RESET, _) => {
            return Outcome::Exit(ExitReason::GuestReset);
        }
        VcpuExit::SystemEvent(KVM_SYSTEM_EVENT_SHUTDOWN, _) => {
            return Outcome::Exit(ExitReason::GuestShutdown);
        }
        VcpuExit::SystemEvent(kind, _) => {
            return Outcome::Exit(ExitReason::VcpuFailure(format!("KVM system event {kind}")));
        }
        VcpuExit::InternalError => return Outcome::InternalError,
        VcpuExit::FailEntry(reason, cpu) => {
            return Outcome::Exit(ExitReason::VcpuFailure(format!(
                "VM entry failed on CPU {cpu}: hardware reason {reason:#x}"
            )));
        }
        VcpuExit::Hlt | VcpuExit::IrqWindowOpen | VcpuExit::Intr => {}
        other => {
            tracing::warn!(exit = ?other, "unexpected vCPU exit; stopping the VM");
            return Outcome::Exit(ExitReason::VcpuFailure(format!(
                "unexpected exit {other:?}"
            )));
        }
    }
    Outcome::Continue
}

/// KVM's description of an emulation failure: suberror and the data words (for suberror 1,
/// the instruction bytes), so an unsupported instruction can be identified from the log.
fn internal_error(vcpu: &mut VcpuFd, index: u8) -> String {
    let run = vcpu.get_kvm_run();
    // SAFETY: KVM reported KVM_EXIT_INTERNAL_ERROR, so `internal` is the active union member.
    let internal = unsafe { run.__bindgen_anon_1.internal };
    let count = (internal.ndata as usize).min(internal.data.len());
    let data: Vec<String> = internal.data[..count]
        .iter()
        .map(|d| format!("{d:#x}"))
        .collect();
    let rip = vcpu.get_regs().map(|r| r.rip).unwrap_or_default();
    format!(
        "KVM internal error on vCPU {index}: suberror {} at rip {rip:#x}, data [{}]",
        internal.suberror,
        data.join(", ")
    )
}
