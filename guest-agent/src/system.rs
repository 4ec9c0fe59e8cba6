//! What a restore notice and a shutdown do to the guest's kernel, behind a trait so the
//! protocol is tested with a recording fake and the syscalls on their own.

use std::sync::Mutex;

use nix::errno::Errno;
use nix::sys::reboot::{RebootMode, reboot};
use nix::sys::time::TimeSpec;
use nix::time::{ClockId, clock_settime};

use agentvm_proto::guest::v1::Network;

use crate::sys;

#[derive(Debug, thiserror::Error)]
pub enum SystemError {
    #[error("{what}: {source}")]
    Syscall {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

fn syscall_failed(what: &'static str, errno: Errno) -> SystemError {
    SystemError::Syscall {
        what,
        source: errno.into(),
    }
}

pub trait System: Send + Sync {
    /// Mixes `entropy` into the kernel's pool, credited, and reseeds the CRNG so that two
    /// clones of one snapshot draw different numbers from here on.
    fn add_entropy(&self, entropy: &[u8]) -> Result<(), SystemError>;
    /// Steps CLOCK_REALTIME to the host's time.
    fn set_wall_clock(&self, unix_nanos: i64) -> Result<(), SystemError>;
    fn set_hostname(&self, name: &str) -> Result<(), SystemError>;
    /// Gives the network interface the identity `network` describes (MAC, address, route,
    /// name server), dropping whatever it had.
    fn configure_network(&self, network: &Network) -> Result<(), SystemError>;
    /// Flushes and powers the VM off. Returns only on failure.
    fn power_off(&self) -> SystemError;
}

/// The real kernel.
pub struct LinuxSystem;

/// Longest entropy blob accepted from the host (the kernel mixes any length; this bounds us).
pub const MAX_ENTROPY: usize = 512;

impl System for LinuxSystem {
    fn add_entropy(&self, entropy: &[u8]) -> Result<(), SystemError> {
        if entropy.len() > MAX_ENTROPY {
            return Err(SystemError::Invalid(format!(
                "entropy: {} bytes, at most {MAX_ENTROPY}",
                entropy.len()
            )));
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/urandom")
            .map_err(|source| SystemError::Syscall {
                what: "opening /dev/urandom",
                source,
            })?;
        sys::add_credited_entropy(&file, entropy)
            .map_err(|e| syscall_failed("RNDADDENTROPY", e))?;
        sys::reseed_crng(&file).map_err(|e| syscall_failed("RNDRESEEDCRNG", e))
    }

    fn set_wall_clock(&self, unix_nanos: i64) -> Result<(), SystemError> {
        if unix_nanos <= 0 {
            return Err(SystemError::Invalid(format!(
                "wall clock {unix_nanos} ns is not a time after 1970"
            )));
        }
        let time = TimeSpec::new(unix_nanos / 1_000_000_000, unix_nanos % 1_000_000_000);
        clock_settime(ClockId::CLOCK_REALTIME, time).map_err(|e| syscall_failed("clock_settime", e))
    }

    fn set_hostname(&self, name: &str) -> Result<(), SystemError> {
        if name.is_empty() || name.len() > 64 || name.bytes().any(|b| b == 0) {
            return Err(SystemError::Invalid(format!(
                "hostname {name:?}: 1 to 64 bytes, no NUL"
            )));
        }
        nix::unistd::sethostname(name).map_err(|e| syscall_failed("sethostname", e))
    }

    fn configure_network(&self, network: &Network) -> Result<(), SystemError> {
        crate::net::configure(&crate::net::Interface::parse(network)?)
    }

    fn power_off(&self) -> SystemError {
        nix::unistd::sync();
        let Err(errno) = reboot(RebootMode::RB_POWER_OFF);
        syscall_failed("reboot(RB_POWER_OFF)", errno)
    }
}

/// What a [`RecordingSystem`] was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SystemCall {
    Entropy(Vec<u8>),
    WallClock(i64),
    Hostname(String),
    Network(Network),
    PowerOff,
}

/// A fake kernel for tests: records every call in order.
#[derive(Default)]
pub struct RecordingSystem {
    pub calls: Mutex<Vec<SystemCall>>,
}

impl RecordingSystem {
    pub fn calls(&self) -> Vec<SystemCall> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn record(&self, call: SystemCall) {
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(call);
    }
}

impl System for RecordingSystem {
    fn add_entropy(&self, entropy: &[u8]) -> Result<(), SystemError> {
        self.record(SystemCall::Entropy(entropy.to_vec()));
        Ok(())
    }
    fn set_wall_clock(&self, unix_nanos: i64) -> Result<(), SystemError> {
        self.record(SystemCall::WallClock(unix_nanos));
        Ok(())
    }
    fn set_hostname(&self, name: &str) -> Result<(), SystemError> {
        self.record(SystemCall::Hostname(name.to_owned()));
        Ok(())
    }
    fn configure_network(&self, network: &Network) -> Result<(), SystemError> {
        crate::net::Interface::parse(network)?;
        self.record(SystemCall::Network(network.clone()));
        Ok(())
    }
    fn power_off(&self) -> SystemError {
        self.record(SystemCall::PowerOff);
        SystemError::Invalid("a recording system does not power off".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_arguments_are_refused_before_any_syscall() {
        let s = LinuxSystem;
        assert!(matches!(
            s.add_entropy(&[0; MAX_ENTROPY + 1]),
            Err(SystemError::Invalid(_))
        ));
        assert!(matches!(s.set_wall_clock(-5), Err(SystemError::Invalid(_))));
        assert!(matches!(s.set_hostname(""), Err(SystemError::Invalid(_))));
        assert!(matches!(
            s.set_hostname(&"h".repeat(65)),
            Err(SystemError::Invalid(_))
        ));
    }

    /// The real syscalls, where this process may make them: the hostname in a UTS namespace
    /// of this thread's own (the machine's is untouched), entropy and the clock as root (the
    /// clock is stepped to what it already reads).
    #[test]
    fn the_syscalls_really_work_where_permitted() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!(
                "skipped: needs root for unshare(CLONE_NEWUTS), RNDADDENTROPY and clock_settime"
            );
            return;
        }
        std::thread::spawn(|| {
            // On this thread only: it gets a UTS namespace of its own.
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUTS).unwrap();
            LinuxSystem.set_hostname("agentvm-guest-test").unwrap();
            assert_eq!(nix::unistd::gethostname().unwrap(), "agentvm-guest-test");
        })
        .join()
        .unwrap();
        LinuxSystem.add_entropy(&[0x5a; 64]).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64;
        LinuxSystem.set_wall_clock(now).unwrap();
    }
}
