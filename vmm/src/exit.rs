//! Why a VM stopped on its own, and how the vCPU and device threads say so.
//!
//! Whoever sees the guest reset, triple-fault or break records the first reason here and
//! wakes the thread that tears the VM down. Later reasons are ignored: the first is the cause.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use vmm_sys_util::eventfd::EventFd;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest asked for a reset (i8042 0xFE, or KVM reported a reset event).
    GuestReset,
    /// The guest powered off (KVM system event).
    GuestShutdown,
    /// The guest triple-faulted.
    TripleFault,
    /// KVM could not run the guest; the text says what KVM reported.
    VcpuFailure(String),
    /// Stopped through the API (vm.shutdown, vm.delete, vmm.shutdown).
    Requested,
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::GuestReset => f.write_str("guest reset"),
            Self::GuestShutdown => f.write_str("guest powered off"),
            Self::TripleFault => f.write_str("guest triple fault"),
            Self::VcpuFailure(why) => write!(f, "vCPU failure: {why}"),
            Self::Requested => f.write_str("stopped through the API"),
        }
    }
}

pub struct ExitSignal {
    requested: AtomicBool,
    reason: Mutex<Option<ExitReason>>,
    event: EventFd,
}

impl ExitSignal {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            requested: AtomicBool::new(false),
            reason: Mutex::new(None),
            event: EventFd::new(libc::EFD_CLOEXEC)?,
        })
    }

    pub fn request(&self, reason: ExitReason) {
        let mut slot = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            tracing::info!(%reason, "VM is stopping");
            *slot = Some(reason);
            self.requested.store(true, Ordering::Release);
            if let Err(e) = self.event.write(1) {
                tracing::error!(error = %e, "could not signal the VM exit");
            }
        }
    }

    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }

    pub fn reason(&self) -> Option<ExitReason> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Readable once an exit was requested.
    pub fn event(&self) -> &EventFd {
        &self.event
    }
}
