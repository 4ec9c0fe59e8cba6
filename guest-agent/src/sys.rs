//! The few kernel and runtime calls that no safe wrapper covers, each a small function whose
//! callers cannot break it. Every other module of the crate is free of `unsafe`.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::socket::SockFlag;
use nix::{ioctl_none, ioctl_write_ptr_bad, request_code_write};
use tokio::io::unix::AsyncFd;

use crate::reaper::Exit;
use crate::system::MAX_ENTROPY;

/// Hands `fd` to the tokio reactor; needs a tokio runtime.
pub fn register_with_reactor(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open descriptor that stays open, and always the same
    // descriptor, until the AsyncFd that owns it drops it.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

/// Accepts a connection on `listener` as a non-blocking, close-on-exec socket; we do not ask
/// for the peer's address.
pub fn accept_nonblocking(listener: &impl AsFd) -> nix::Result<OwnedFd> {
    let fd = nix::sys::socket::accept4(
        listener.as_fd().as_raw_fd(),
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
    )?;
    // SAFETY: accept4 returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `struct rand_pool_info` with its trailing buffer.
#[repr(C)]
struct RandPoolInfo {
    entropy_count: libc::c_int,
    buf_size: libc::c_int,
    buf: [u8; MAX_ENTROPY],
}

// From <linux/random.h>: RNDADDENTROPY is declared _IOW('R', 0x03, int[2]) though it reads a
// whole rand_pool_info, hence the "bad" form with the request code spelt out.
ioctl_write_ptr_bad!(
    rnd_add_entropy,
    request_code_write!(b'R', 0x03, std::mem::size_of::<[libc::c_int; 2]>()),
    RandPoolInfo
);
ioctl_none!(rnd_reseed_crng, b'R', 0x07);

/// Mixes `entropy` (at most [`MAX_ENTROPY`] bytes) into the kernel's pool through `urandom`,
/// credited with 8 bits a byte.
pub fn add_credited_entropy(urandom: &std::fs::File, entropy: &[u8]) -> nix::Result<()> {
    if entropy.len() > MAX_ENTROPY {
        return Err(Errno::EINVAL);
    }
    let mut info = RandPoolInfo {
        entropy_count: (entropy.len() * 8) as libc::c_int,
        buf_size: entropy.len() as libc::c_int,
        buf: [0; MAX_ENTROPY],
    };
    info.buf[..entropy.len()].copy_from_slice(entropy);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf_size bytes follow the header;
    // `info` is a live, properly laid out struct with buf_size <= its buffer.
    unsafe { rnd_add_entropy(urandom.as_raw_fd(), &info) }.map(drop)
}

/// Reseeds the kernel's CRNG from its pool, through `urandom`.
pub fn reseed_crng(urandom: &std::fs::File) -> nix::Result<()> {
    // SAFETY: RNDRESEEDCRNG takes no argument.
    unsafe { rnd_reseed_crng(urandom.as_raw_fd()) }.map(drop)
}

/// Makes the child `cmd` spawns receive `signal` when this process dies.
pub fn signal_child_on_our_death(cmd: &mut std::process::Command, signal: Signal) {
    // SAFETY: the closure runs in the forked child before exec and only calls prctl, which
    // is async-signal-safe, and builds an io::Error from an errno, which does not allocate.
    unsafe {
        cmd.pre_exec(move || nix::sys::prctl::set_pdeathsig(signal).map_err(io::Error::from));
    }
}

/// Reaps one child that has ended, without blocking: its pid and how it ended, or `None` when
/// no child has ended (or there are none).
///
/// Not nix's `waitpid`: for a child killed by a real-time signal it reaps the child, then fails
/// with EINVAL and the pid is lost, and whoever waits for that child would wait forever.
pub fn reap_any_child() -> Option<(i32, Exit)> {
    let mut status = 0;
    // SAFETY: waitpid writes the status of any reaped child into `status`.
    let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
    if pid <= 0 {
        return None;
    }
    let exit = if libc::WIFSIGNALED(status) {
        Exit::Signal(libc::WTERMSIG(status))
    } else {
        Exit::Code(libc::WEXITSTATUS(status))
    };
    Some((pid, exit))
}

/// A zeroed `ifreq` naming interface `name` (shorter than IFNAMSIZ).
fn ifreq(name: &str) -> Result<libc::ifreq, Errno> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(Errno::EINVAL);
    }
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn sockaddr_in(address: std::net::Ipv4Addr) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(address).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn ifreq_ioctl(sock: &OwnedFd, request: libc::Ioctl, req: &mut libc::ifreq) -> Result<(), Errno> {
    // SAFETY: every request passed here reads or writes one ifreq, which lives for the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), request, std::ptr::from_mut(req)) };
    Errno::result(rc).map(drop)
}

/// Sets or clears IFF_UP on interface `name`.
pub fn set_interface_up(sock: &OwnedFd, name: &str, up: bool) -> Result<(), Errno> {
    let mut req = ifreq(name)?;
    ifreq_ioctl(sock, libc::SIOCGIFFLAGS, &mut req)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    let bit = libc::IFF_UP as libc::c_short;
    req.ifr_ifru.ifru_flags = if up { flags | bit } else { flags & !bit };
    ifreq_ioctl(sock, libc::SIOCSIFFLAGS, &mut req)
}

/// Gives interface `name` the Ethernet address `mac`.
pub fn set_interface_hwaddr(sock: &OwnedFd, name: &str, mac: [u8; 6]) -> Result<(), Errno> {
    let mut req = ifreq(name)?;
    let mut hwaddr = libc::sockaddr {
        sa_family: libc::ARPHRD_ETHER,
        sa_data: [0; 14],
    };
    for (dst, src) in hwaddr.sa_data.iter_mut().zip(mac) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = hwaddr;
    ifreq_ioctl(sock, libc::SIOCSIFHWADDR, &mut req)
}

/// Sets an IPv4 attribute of interface `name`: its address (SIOCSIFADDR) or netmask
/// (SIOCSIFNETMASK).
pub fn set_interface_ipv4(
    sock: &OwnedFd,
    name: &str,
    request: libc::Ioctl,
    address: std::net::Ipv4Addr,
) -> Result<(), Errno> {
    let mut req = ifreq(name)?;
    // SAFETY: a sockaddr_in is no larger than the sockaddr member it is written over; the
    // write makes no alignment assumption.
    unsafe {
        std::ptr::write_unaligned(
            (&raw mut req.ifr_ifru.ifru_addr).cast::<libc::sockaddr_in>(),
            sockaddr_in(address),
        );
    }
    ifreq_ioctl(sock, request, &mut req)
}

/// Adds the IPv4 default route through `gateway`.
pub fn add_default_route(sock: &OwnedFd, gateway: std::net::Ipv4Addr) -> Result<(), Errno> {
    // SAFETY: rtentry is plain data; all zeroes is a valid value.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    let any = sockaddr_in(std::net::Ipv4Addr::UNSPECIFIED);
    // SAFETY: each sockaddr_in is written over a sockaddr of at least its size, unaligned.
    unsafe {
        std::ptr::write_unaligned((&raw mut route.rt_dst).cast::<libc::sockaddr_in>(), any);
        std::ptr::write_unaligned((&raw mut route.rt_genmask).cast::<libc::sockaddr_in>(), any);
        std::ptr::write_unaligned(
            (&raw mut route.rt_gateway).cast::<libc::sockaddr_in>(),
            sockaddr_in(gateway),
        );
    }
    route.rt_flags = (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort;
    // SAFETY: SIOCADDRT reads one rtentry, which lives for the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT, &raw mut route) };
    Errno::result(rc).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ioctl_codes_are_the_kernels() {
        assert_eq!(
            request_code_write!(b'R', 0x03, std::mem::size_of::<[libc::c_int; 2]>()),
            0x4008_5203
        );
        assert_eq!(nix::request_code_none!(b'R', 0x07), 0x5207);
    }

    #[test]
    fn oversized_entropy_is_refused_before_the_ioctl() {
        let file = tempfile::tempfile().unwrap();
        assert_eq!(
            add_credited_entropy(&file, &[0; MAX_ENTROPY + 1]),
            Err(Errno::EINVAL)
        );
    }
}
