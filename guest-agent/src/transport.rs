//! Where the agent listens: `vsock:PORT` inside a VM, `unix:PATH` anywhere else (tests, a
//! harness developer's laptop). Both yield plain byte streams.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll, ready};

use nix::sys::socket::{
    AddressFamily, Backlog, MsgFlags, Shutdown, SockFlag, SockType, VsockAddr, bind, listen, send,
    shutdown, socket,
};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::sys;

/// Any CID (VMADDR_CID_ANY in <linux/vm_sockets.h>): the host reaches the listener whatever
/// CID this VM was given.
const VMADDR_CID_ANY: u32 = u32::MAX;

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
            Listen::Vsock(port) => bind_vsock(VMADDR_CID_ANY, *port).map(Listener::Vsock),
        }
    }

    pub async fn accept(&self) -> io::Result<Box<dyn Conn>> {
        match self {
            Listener::Unix(l) => Ok(Box::new(l.accept().await?.0)),
            Listener::Vsock(fd) => loop {
                let mut guard = fd.readable().await?;
                match guard.try_io(|fd| Ok(sys::accept_nonblocking(fd.get_ref())?)) {
                    Ok(conn) => {
                        return Ok(Box::new(VsockStream(sys::register_with_reactor(conn?)?)));
                    }
                    Err(_would_block) => continue,
                }
            },
        }
    }
}

/// A listening AF_VSOCK stream socket on `port`.
pub fn bind_vsock(cid: u32, port: u32) -> io::Result<AsyncFd<OwnedFd>> {
    let fd = socket(
        AddressFamily::Vsock,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(fd.as_raw_fd(), &VsockAddr::new(cid, port))?;
    listen(&fd, Backlog::new(64)?)?;
    sys::register_with_reactor(fd)
}

/// An accepted vsock connection.
pub struct VsockStream(AsyncFd<OwnedFd>);

impl AsyncRead for VsockStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| Ok(nix::unistd::read(fd.get_ref(), unfilled)?)) {
                Ok(read) => {
                    buf.advance(read?);
                    return Poll::Ready(Ok(()));
                }
                Err(_would_block) => continue,
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
            // MSG_NOSIGNAL so a closed peer is an error, not a SIGPIPE.
            match guard.try_io(|fd| Ok(send(fd.as_raw_fd(), data, MsgFlags::MSG_NOSIGNAL)?)) {
                Ok(written) => return Poll::Ready(written),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(shutdown(self.0.as_raw_fd(), Shutdown::Write)?))
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

    /// What the vsock listener and streams do with a socket (accept4, read, send, SHUT_WR
    /// through the reactor) is not vsock's own: a unix socket exercises it on hosts without an
    /// AF_VSOCK loopback transport.
    #[tokio::test]
    async fn the_vsock_socket_calls_carry_bytes_and_the_end_of_writes() {
        use std::os::unix::net::{UnixListener, UnixStream};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let unix = UnixListener::bind(&path).unwrap();
        unix.set_nonblocking(true).unwrap();
        let listener = Listener::Vsock(sys::register_with_reactor(OwnedFd::from(unix)).unwrap());
        let client = tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut s = UnixStream::connect(&path).unwrap();
            s.write_all(b"ping").unwrap();
            let mut back = Vec::new();
            s.read_to_end(&mut back).unwrap();
            back
        });
        let mut conn = listener.accept().await.unwrap();
        let mut got = [0u8; 4];
        conn.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        conn.write_all(b"pong").await.unwrap();
        conn.shutdown().await.unwrap();
        assert_eq!(client.await.unwrap(), b"pong");
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
            let owned = socket(
                AddressFamily::Vsock,
                SockType::Stream,
                SockFlag::empty(),
                None,
            )
            .unwrap();
            nix::sys::socket::connect(owned.as_raw_fd(), &VsockAddr::new(VMADDR_CID_LOCAL, 52_000))
                .unwrap();
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
