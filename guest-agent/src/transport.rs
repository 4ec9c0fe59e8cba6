//! Where the agent listens: `vsock:PORT` inside a VM, `unix:PATH` anywhere else (tests, a
//! harness developer's laptop). Both yield plain byte streams.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Vsock(u32),
    Unix(PathBuf),
}

impl FromStr for Listen {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(port) = s.strip_prefix("vsock:") {
            return port
                .parse()
                .map(Listen::Vsock)
                .map_err(|_| format!("{s:?}: vsock:PORT with a 32-bit port expected"));
        }
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!("{s:?}: unix:PATH with a path expected"));
            }
            return Ok(Listen::Unix(path.into()));
        }
        Err(format!("{s:?}: vsock:PORT or unix:PATH expected"))
    }
}

pub trait Conn: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Conn for T {}

pub enum Listener {
    Vsock(AsyncFd<OwnedFd>),
    Unix(tokio::net::UnixListener),
}

impl Listener {
    pub fn bind(listen: &Listen) -> io::Result<Self> {
        match listen {
            Listen::Unix(path) => {
                let _ = std::fs::remove_file(path);
                Ok(Listener::Unix(tokio::net::UnixListener::bind(path)?))
            }
            Listen::Vsock(port) => bind_vsock(libc::VMADDR_CID_ANY, *port).map(Listener::Vsock),
        }
    }

    pub async fn accept(&self) -> io::Result<Box<dyn Conn>> {
        match self {
            Listener::Unix(l) => Ok(Box::new(l.accept().await?.0)),
            Listener::Vsock(fd) => loop {
                let mut guard = fd.readable().await?;
                // SAFETY: accept4 on our listening socket; we do not ask for the peer address.
                let conn = unsafe {
                    libc::accept4(
                        fd.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                    )
                };
                if conn >= 0 {
                    // SAFETY: accept4 returned a new descriptor that nothing else owns.
                    let owned = unsafe { OwnedFd::from_raw_fd(conn) };
                    return Ok(Box::new(VsockStream(register(owned)?)));
                }
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::WouldBlock {
                    guard.clear_ready();
                    continue;
                }
                return Err(err);
            },
        }
    }
}

/// A listening AF_VSOCK stream socket on `port`.
pub fn bind_vsock(cid: u32, port: u32) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            libc::AF_VSOCK,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data; zero is a valid starting value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_port = port;
    addr.svm_cid = cid;
    // SAFETY: bind reads `size_of::<sockaddr_vm>()` bytes of `addr`.
    let rc = unsafe {
        libc::bind(
            owned.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen on a bound socket.
    if unsafe { libc::listen(owned.as_raw_fd(), 64) } != 0 {
        return Err(io::Error::last_os_error());
    }
    register(owned)
}

fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open descriptor that stays open, and always the same
    // descriptor, until the AsyncFd that owns it drops it.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

/// An accepted vsock connection.
pub struct VsockStream(AsyncFd<OwnedFd>);

fn io_result(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn raw(s: &VsockStream) -> RawFd {
    s.0.as_raw_fd()
}

impl AsyncRead for VsockStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            // SAFETY: read into the initialized, unfilled part of the caller's buffer.
            let n = unsafe { libc::read(raw(&self), unfilled.as_mut_ptr().cast(), unfilled.len()) };
            match io_result(n) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for VsockStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            // SAFETY: write from the caller's buffer; MSG_NOSIGNAL so a closed peer is an
            // error, not a SIGPIPE.
            let n = unsafe {
                libc::send(
                    raw(&self),
                    data.as_ptr().cast(),
                    data.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            match io_result(n) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // SAFETY: shutdown of our own socket's write side.
        let rc = unsafe { libc::shutdown(raw(&self), libc::SHUT_WR) };
        Poll::Ready(if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse_or_say_why_not() {
        assert_eq!("vsock:1024".parse(), Ok(Listen::Vsock(1024)));
        assert_eq!(
            "unix:/run/a.sock".parse(),
            Ok(Listen::Unix("/run/a.sock".into()))
        );
        for bad in ["vsock:", "vsock:x", "unix:", "tcp:1", "1024"] {
            assert!(bad.parse::<Listen>().is_err(), "{bad}");
        }
    }

    /// AF_VSOCK through the kernel's loopback transport (CID 1), where this host has it.
    #[tokio::test]
    async fn vsock_streams_carry_bytes_both_ways() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const VMADDR_CID_LOCAL: u32 = 1;
        let listener = match bind_vsock(VMADDR_CID_LOCAL, 52_000) {
            Ok(fd) => Listener::Vsock(fd),
            Err(e) => {
                eprintln!("skipped: no AF_VSOCK loopback transport here ({e})");
                return;
            }
        };
        let client = tokio::task::spawn_blocking(|| {
            use std::io::{Read, Write};
            // SAFETY: plain socket creation.
            let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0) };
            assert!(fd >= 0);
            // SAFETY: a new descriptor nothing else owns.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: zeroed sockaddr_vm is valid plain data.
            let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
            addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
            addr.svm_port = 52_000;
            addr.svm_cid = VMADDR_CID_LOCAL;
            // SAFETY: connect reads the address we pass.
            let rc = unsafe {
                libc::connect(
                    owned.as_raw_fd(),
                    (&addr as *const libc::sockaddr_vm).cast(),
                    std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
                )
            };
            assert_eq!(rc, 0, "{}", io::Error::last_os_error());
            let mut s = std::fs::File::from(owned);
            s.write_all(b"ping").unwrap();
            let mut back = [0u8; 4];
            s.read_exact(&mut back).unwrap();
            back
        });
        let mut conn = listener.accept().await.unwrap();
        let mut got = [0u8; 4];
        conn.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        conn.write_all(b"pong").await.unwrap();
        assert_eq!(&client.await.unwrap(), b"pong");
    }
}
