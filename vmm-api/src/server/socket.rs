//! Binding the API socket: never replace anything but a stale socket, never expose the
//! socket with a mode wider than 0600.

use std::fs::{self, DirBuilder, Permissions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::net::UnixListener;

/// Longest path a `sockaddr_un` holds (108 bytes with the terminating NUL).
const SUN_PATH_MAX: usize = 107;

/// Binds the API socket at `path` with mode 0600. Must be called inside a tokio runtime.
///
/// - Nothing at `path`: bind.
/// - A socket nobody listens on (connect is refused): stale, removed, then bind.
/// - A socket somebody listens on: `AddrInUse`.
/// - Anything else (file, directory, symlink): `AlreadyExists`, left alone.
///
/// The socket is bound inside a fresh 0700 directory next to `path`, set to 0600, and then
/// hard-linked into place, so no other user can connect in between. If that staging path
/// would be too long for a socket address, it binds at `path` directly and sets the mode
/// right after (the directory holding it should be private anyway).
pub fn bind_api_socket(path: impl AsRef<Path>) -> io::Result<UnixListener> {
    let path = path.as_ref();
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(io::Error::other(format!(
            "binding {}: bind_api_socket must be called inside a tokio runtime",
            path.display()
        )));
    }
    let listener = bind_api_listener(path)?;
    listener
        .set_nonblocking(true)
        .and_then(|()| UnixListener::from_std(listener))
        .map_err(|e| with_path(e, "setting up", path))
}

/// [`bind_api_socket`] for a VMM started with its API socket already listening: whoever
/// starts it binds here and hands the listener down, so a client may connect (and have its
/// first request wait in the backlog) before the VMM has even begun to run.
pub fn bind_api_listener(path: impl AsRef<Path>) -> io::Result<StdUnixListener> {
    let path = path.as_ref();
    remove_stale_socket(path)?;
    bind_private(path)
}

/// Serves on a listener handed down by whoever started this process (see
/// [`bind_api_listener`]). Refuses a descriptor that is not a unix socket.
pub fn adopt_api_listener(listener: StdUnixListener) -> io::Result<UnixListener> {
    listener.local_addr().map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the inherited API descriptor is not a unix socket: {e}"),
        )
    })?;
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener)
}

fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(with_path(e, "inspecting", path)),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            ),
        ));
    }
    match StdUnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{} is in use by another process", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            fs::remove_file(path).map_err(|e| with_path(e, "removing stale socket", path))
        }
        Err(e) => Err(with_path(e, "probing existing socket", path)),
    }
}

fn bind_private(path: &Path) -> io::Result<StdUnixListener> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let staging = Staging(dir.join(format!(
        ".s{:x}.{:x}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )));
    let temp = staging.0.join("s");
    if temp.as_os_str().len() > SUN_PATH_MAX {
        return bind_in_place(path);
    }
    DirBuilder::new()
        .mode(0o700)
        .create(&staging.0)
        .map_err(|e| with_path(e, "creating staging directory", &staging.0))?;
    let listener = StdUnixListener::bind(&temp).map_err(|e| with_path(e, "binding", &temp))?;
    fs::set_permissions(&temp, Permissions::from_mode(0o600))
        .map_err(|e| with_path(e, "setting the mode of", &temp))?;
    fs::hard_link(&temp, path).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} appeared while binding it", path.display()),
            )
        } else {
            with_path(e, "linking the socket into place at", path)
        }
    })?;
    Ok(listener)
}

fn bind_in_place(path: &Path) -> io::Result<StdUnixListener> {
    let listener = StdUnixListener::bind(path).map_err(|e| with_path(e, "binding", path))?;
    if let Err(e) = fs::set_permissions(path, Permissions::from_mode(0o600)) {
        let _ = fs::remove_file(path);
        return Err(with_path(e, "setting the mode of", path));
    }
    Ok(listener)
}

/// The staging directory; removed (with the temporary socket name in it) when dropped.
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.0.join("s"));
        let _ = fs::remove_dir(&self.0);
    }
}

fn with_path(e: io::Error, doing: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{doing} {}: {e}", path.display()))
}
