//! Host-side unix socket operations the muxer needs and std does not offer: a connect that
//! never blocks the device thread, and reading the `CONNECT <port>\n` line without consuming
//! the bytes that follow it.

use std::io::{self, Read};
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

/// Reads the `CONNECT <port>\n` line a byte at a time, so nothing after it is consumed, into
/// `line` (kept by the caller between readiness events). The bytes read are gone from the
/// socket, so a client that stops half-way does not keep the socket readable forever.
pub fn read_connect_line(stream: &UnixStream, line: &mut Vec<u8>) -> io::Result<ConnectLine> {
    let mut byte = [0u8; 1];
    loop {
        match (&*stream).read(&mut byte) {
            Ok(0) => return Ok(ConnectLine::Closed),
            Ok(_) if byte[0] == b'\n' => {
                return Ok(parse_connect(line).map_or(ConnectLine::Invalid, ConnectLine::Port));
            }
            Ok(_) => {
                line.push(byte[0]);
                if line.len() >= LINE_MAX {
                    return Ok(ConnectLine::Invalid);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(ConnectLine::Incomplete),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
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
        b.set_nonblocking(true).unwrap();
        let mut line = Vec::new();
        a.write_all(b"CONN").unwrap();
        assert_eq!(
            read_connect_line(&b, &mut line).unwrap(),
            ConnectLine::Incomplete
        );
        a.write_all(b"ECT 1024\nhello").unwrap();
        assert_eq!(
            read_connect_line(&b, &mut line).unwrap(),
            ConnectLine::Port(1024)
        );
        b.set_nonblocking(false).unwrap();
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
            let got = read_connect_line(&b, &mut Vec::new()).unwrap();
            assert_eq!(got, ConnectLine::Invalid, "{line:?}");
        }
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[b'A'; 40]).unwrap();
        let got = read_connect_line(&b, &mut Vec::new()).unwrap();
        assert_eq!(got, ConnectLine::Invalid);
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let got = read_connect_line(&b, &mut Vec::new()).unwrap();
        assert_eq!(got, ConnectLine::Closed);
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
