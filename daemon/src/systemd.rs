//! systemd's notify protocol (sd_notify(3)) without libsystemd: `READY=1`, `STOPPING=1`,
//! `WATCHDOG=1` and `STATUS=…` as datagrams to `$NOTIFY_SOCKET` (a path, or an abstract
//! name when it starts with `@`). Without the variable every call is a no-op.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

#[derive(Debug)]
pub struct Notifier {
    addr: Option<SocketAddr>,
}

impl Notifier {
    pub fn from_env() -> io::Result<Self> {
        let Some(value) = std::env::var_os("NOTIFY_SOCKET") else {
            return Ok(Self { addr: None });
        };
        let value = value.to_string_lossy().into_owned();
        let addr = if let Some(name) = value.strip_prefix('@') {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name.as_bytes())?
        } else {
            SocketAddr::from_pathname(&value)?
        };
        Ok(Self { addr: Some(addr) })
    }

    pub fn enabled(&self) -> bool {
        self.addr.is_some()
    }

    /// Sends `state` (newline-separated `KEY=VALUE` pairs); Ok(false) without a socket.
    pub fn notify(&self, state: &str) -> io::Result<bool> {
        let Some(addr) = &self.addr else {
            return Ok(false);
        };
        let socket = UnixDatagram::unbound()?;
        socket.send_to_addr(state.as_bytes(), addr)?;
        Ok(true)
    }
}

/// How often systemd expects `WATCHDOG=1` from this process (`$WATCHDOG_USEC`, when
/// `$WATCHDOG_PID` is unset or ours); pings should come at half of it.
pub fn watchdog_interval() -> Option<Duration> {
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.trim() != std::process::id().to_string()
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_reach_a_fake_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        let n = Notifier {
            addr: Some(SocketAddr::from_pathname(&path).unwrap()),
        };
        assert!(n.notify("READY=1\nSTATUS=serving").unwrap());
        let mut buf = [0u8; 64];
        let len = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=serving");
        let none = Notifier { addr: None };
        assert!(!none.notify("READY=1").unwrap());
    }
}
