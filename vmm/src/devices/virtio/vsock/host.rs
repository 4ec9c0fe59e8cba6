//! Host-side unix socket operations the muxer needs and std does not offer: a connect that
//! never blocks the device thread, and reading the `CONNECT <port>\n` line without consuming
//! the bytes that follow it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// Connects to a listening unix socket without blocking: a listener whose backlog is full
/// counts as refused rather than stalling every other connection of the VM.
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid (unnamed) address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    let len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_un and `len` does not exceed its size.
    let rc = unsafe {
        libc::connect(
            stream.as_raw_fd(),
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stream)
}

/// Outcome of looking for the connect line.
#[derive(Debug, PartialEq, Eq)]
pub enum ConnectLine {
    /// Not all of it has arrived yet.
    Incomplete,
    /// The peer closed before sending a line.
    Closed,
    /// A well-formed `CONNECT <port>\n`; the line has been consumed.
    Port(u32),
    /// Anything else: the connection must be dropped.
    Invalid,
}

/// Longest acceptable line: "CONNECT 4294967295\n" is 19 bytes.
const LINE_MAX: usize = 32;

/// Peeks for `CONNECT <port>\n` and consumes exactly that line once it is complete.
pub fn read_connect_line(stream: &UnixStream) -> io::Result<ConnectLine> {
    let mut buf = [0u8; LINE_MAX];
    // SAFETY: `buf` is valid for `LINE_MAX` bytes; recv with MSG_PEEK leaves the data queued.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let err = io::Error::last_os_error();
        return match err.kind() {
            io::ErrorKind::WouldBlock => Ok(ConnectLine::Incomplete),
            _ => Err(err),
        };
    }
    let peeked = &buf[..n as usize];
    if peeked.is_empty() {
        return Ok(ConnectLine::Closed);
    }
    let Some(end) = peeked.iter().position(|b| *b == b'\n') else {
        return Ok(if peeked.len() >= LINE_MAX {
            ConnectLine::Invalid
        } else {
            ConnectLine::Incomplete
        });
    };
    let port = parse_connect(&peeked[..end]);
    // Consume the line (and only it); what follows is the start of the data stream.
    let mut line = vec![0u8; end + 1];
    // SAFETY: `line` is valid for `end + 1` bytes, which are already queued (peeked above).
    let taken = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            line.as_mut_ptr().cast(),
            line.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if taken != (end + 1) as isize {
        return Ok(ConnectLine::Invalid);
    }
    Ok(port.map_or(ConnectLine::Invalid, ConnectLine::Port))
}

fn parse_connect(line: &[u8]) -> Option<u32> {
    let rest = line.strip_prefix(b"CONNECT ")?;
    let text = std::str::from_utf8(rest).ok()?.trim_end_matches('\r');
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn connect_line_is_consumed_exactly() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"CONN").unwrap();
        assert_eq!(read_connect_line(&b).unwrap(), ConnectLine::Incomplete);
        a.write_all(b"ECT 1024\nhello").unwrap();
        assert_eq!(read_connect_line(&b).unwrap(), ConnectLine::Port(1024));
        let mut rest = [0u8; 5];
        (&b).read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"hello");
    }

    #[test]
    fn malformed_lines_are_invalid() {
        for line in [
            &b"CONNECT\n"[..],
            b"CONNECT -1\n",
            b"CONNECT 99999999999\n",
            b"connect 5\n",
            b"CONNECT 5 6\n",
            b"CONNECT 0x10\n",
        ] {
            let (mut a, b) = UnixStream::pair().unwrap();
            a.write_all(line).unwrap();
            assert_eq!(read_connect_line(&b).unwrap(), ConnectLine::Invalid, "{line:?}");
        }
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[b'A'; 40]).unwrap();
        assert_eq!(read_connect_line(&b).unwrap(), ConnectLine::Invalid);
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        assert_eq!(read_connect_line(&b).unwrap(), ConnectLine::Closed);
    }

    #[test]
    fn nonblocking_connect_refuses_missing_listener() {
        let dir = tempfile::tempdir().unwrap();
        assert!(connect_nonblocking(&dir.path().join("nobody")).is_err());
        let path = dir.path().join("l");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let stream = connect_nonblocking(&path).unwrap();
        drop(stream);
        drop(listener);
        assert!(connect_nonblocking(Path::new(&"x".repeat(200))).is_err());
    }
}
