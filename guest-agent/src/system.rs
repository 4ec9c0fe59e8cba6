//! What a restore notice and a shutdown do to the guest's kernel, behind a trait so the
//! protocol is tested with a recording fake and the syscalls on their own.

use std::sync::Mutex;

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

fn last_os_error(what: &'static str) -> SystemError {
    SystemError::Syscall {
        what,
        source: std::io::Error::last_os_error(),
    }
}

pub trait System: Send + Sync {
    /// Mixes `entropy` into the kernel's pool, credited, and reseeds the CRNG so that two
    /// clones of one snapshot draw different numbers from here on.
    fn add_entropy(&self, entropy: &[u8]) -> Result<(), SystemError>;
    /// Steps CLOCK_REALTIME to the host's time.
    fn set_wall_clock(&self, unix_nanos: i64) -> Result<(), SystemError>;
    fn set_hostname(&self, name: &str) -> Result<(), SystemError>;
    /// Flushes and powers the VM off. Returns only on failure.
    fn power_off(&self) -> SystemError;
}

/// The real kernel.
pub struct LinuxSystem;

/// `struct rand_pool_info` with its trailing buffer.
#[repr(C)]
struct RandPoolInfo {
    entropy_count: libc::c_int,
    buf_size: libc::c_int,
    buf: [u8; MAX_ENTROPY],
}

/// Longest entropy blob accepted from the host (the kernel mixes any length; this bounds us).
pub const MAX_ENTROPY: usize = 512;
// _IOW('R', 0x03, int[2]) and _IO('R', 0x07) from <linux/random.h>.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

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
        let mut info = RandPoolInfo {
            entropy_count: (entropy.len() * 8) as libc::c_int,
            buf_size: entropy.len() as libc::c_int,
            buf: [0; MAX_ENTROPY],
        };
        info.buf[..entropy.len()].copy_from_slice(entropy);
        use std::os::fd::AsRawFd;
        // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf_size bytes follow the header;
        // `info` is a live, properly laid out struct with buf_size <= its buffer.
        if unsafe { libc::ioctl(file.as_raw_fd(), RNDADDENTROPY as _, &info) } != 0 {
            return Err(last_os_error("RNDADDENTROPY"));
        }
        // SAFETY: RNDRESEEDCRNG takes no argument.
        if unsafe { libc::ioctl(file.as_raw_fd(), RNDRESEEDCRNG as _) } != 0 {
            return Err(last_os_error("RNDRESEEDCRNG"));
        }
        Ok(())
    }

    fn set_wall_clock(&self, unix_nanos: i64) -> Result<(), SystemError> {
        if unix_nanos <= 0 {
            return Err(SystemError::Invalid(format!(
                "wall clock {unix_nanos} ns is not a time after 1970"
            )));
        }
        let ts = libc::timespec {
            tv_sec: unix_nanos / 1_000_000_000,
            tv_nsec: unix_nanos % 1_000_000_000,
        };
        // SAFETY: clock_settime reads the timespec we pass.
        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
            return Err(last_os_error("clock_settime"));
        }
        Ok(())
    }

    fn set_hostname(&self, name: &str) -> Result<(), SystemError> {
        if name.is_empty() || name.len() > 64 || name.bytes().any(|b| b == 0) {
            return Err(SystemError::Invalid(format!(
                "hostname {name:?}: 1 to 64 bytes, no NUL"
            )));
        }
        // SAFETY: sethostname reads `len` bytes from the pointer.
        if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
            return Err(last_os_error("sethostname"));
        }
        Ok(())
    }

    fn power_off(&self) -> SystemError {
        // SAFETY: sync takes no arguments.
        unsafe { libc::sync() };
        // SAFETY: reboot with RB_POWER_OFF; it returns only on failure.
        unsafe { libc::reboot(libc::RB_POWER_OFF) };
        last_os_error("reboot(RB_POWER_OFF)")
    }
}

/// What a [`RecordingSystem`] was asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SystemCall {
    Entropy(Vec<u8>),
    WallClock(i64),
    Hostname(String),
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
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!(
                "skipped: needs root for unshare(CLONE_NEWUTS), RNDADDENTROPY and clock_settime"
            );
            return;
        }
        std::thread::spawn(|| {
            // SAFETY: unshare on this thread only; it gets a UTS namespace of its own.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWUTS) }, 0);
            LinuxSystem.set_hostname("agentvm-guest-test").unwrap();
            let mut buf = [0u8; 65];
            // SAFETY: gethostname writes at most buf.len() bytes.
            assert_eq!(
                unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) },
                0
            );
            let end = buf.iter().position(|b| *b == 0).unwrap();
            assert_eq!(&buf[..end], b"agentvm-guest-test");
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
