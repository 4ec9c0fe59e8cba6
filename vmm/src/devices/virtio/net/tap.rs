//! Attaching to a tap interface: `/dev/net/tun` opened nonblocking and bound to the named
//! interface with TUNSETIFF, without packet information (one read is one Ethernet frame,
//! one write sends one) and without a virtio header (the device strips and adds its own).
//!
//! The tap is made by whoever runs the VMM (owned by the VMM's uid, so no capability is
//! needed here); this only attaches to it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use agentvm_vmm_api::config::MAX_TAP_NAME_LEN;

const TUN_DEVICE: &str = "/dev/net/tun";

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("opening {TUN_DEVICE}: {0}")]
    Open(std::io::Error),
    #[error("TUNSETIFF: {0}")]
    Attach(std::io::Error),
    #[error("not an interface name (1..=15 bytes, no NUL)")]
    Name,
}

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags at the start of the union
/// (40 bytes in all on 64-bit Linux).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _union_rest: [u8; 22],
}

const _: () = assert!(std::mem::size_of::<IfReq>() == 40);

/// The tap `name`, attached: a nonblocking, close-on-exec descriptor.
pub fn open(name: &str) -> Result<File, TapError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_TAP_NAME_LEN || bytes.contains(&0) {
        return Err(TapError::Name);
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        // std opens close-on-exec already; the device thread must never block on it.
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(TUN_DEVICE)
        .map_err(TapError::Open)?;
    let mut request = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short,
        _union_rest: [0; 22],
    };
    // The name is at most 15 bytes, so the 16th stays the terminating NUL.
    request.name[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: TUNSETIFF reads (and may write back) a `struct ifreq`; `request` is one, laid
    // out as the kernel's, alive and exclusively borrowed for the call, on a descriptor we
    // own.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            libc::TUNSETIFF,
            &mut request as *mut IfReq,
        )
    };
    if rc < 0 {
        return Err(TapError::Attach(std::io::Error::last_os_error()));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_names_are_refused_before_any_system_call() {
        for name in ["", "sixteen-bytes-xx", "a\0b"] {
            assert!(matches!(open(name), Err(TapError::Name)), "{name:?}");
        }
    }
}
