//! Where agentvmd keeps its state and where it listens, with the embedded defaults of
//! ARCHITECTURE.md's fixed contracts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// A listener address: `unix:PATH` or `HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddrError {
    #[error("address {0:?}: `unix:` needs an absolute or relative path")]
    EmptyUnixPath(String),
    #[error("address {0:?} is neither unix:PATH nor HOST:PORT")]
    Unparseable(String),
    #[error(
        "listen address {0}: TCP is served on loopback only until TLS is configured \
         (plaintext would expose the Sessions API to the network)"
    )]
    NonLoopbackTcp(SocketAddr),
}

impl std::str::FromStr for ListenAddr {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            // Accept the URI spellings clients use too (unix:///abs, unix://rel).
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(AddrError::EmptyUnixPath(s.to_owned()));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        let addr: SocketAddr = s
            .parse()
            .or_else(|_| {
                // "localhost:PORT" is common enough to accept without DNS.
                s.strip_prefix("localhost:")
                    .and_then(|p| p.parse::<u16>().ok())
                    .map(|port| SocketAddr::from(([127, 0, 0, 1], port)))
                    .ok_or(())
            })
            .map_err(|()| AddrError::Unparseable(s.to_owned()))?;
        Ok(ListenAddr::Tcp(addr))
    }
}

impl ListenAddr {
    /// A listener without TLS: a unix socket (its permissions are its access control) or
    /// loopback TCP, never the network.
    pub fn check_plaintext(&self) -> Result<(), AddrError> {
        match self {
            ListenAddr::Tcp(addr) if !addr.ip().is_loopback() => {
                Err(AddrError::NonLoopbackTcp(*addr))
            }
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `/var/lib/agentvm` as root, else `$XDG_STATE_HOME/agentvm` (or `~/.local/state/agentvm`,
/// or `/tmp/agentvm-UID`).
pub fn default_state_dir() -> PathBuf {
    if is_root() {
        return PathBuf::from("/var/lib/agentvm");
    }
    std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/state")))
        .map(|base| base.join("agentvm"))
        .unwrap_or_else(per_user_temp_dir)
}

/// `/tmp/agentvm-UID`: the last resort of a non-root daemon with no home or runtime
/// directory. Named for its user so another user's directory is never taken for ours
/// ([`crate::private_dir`] refuses one anyway).
fn per_user_temp_dir() -> PathBuf {
    std::env::temp_dir().join(format!("agentvm-{}", nix::unistd::geteuid()))
}

/// `unix:/run/agentvm/agentvmd.sock` as root, else under `$XDG_RUNTIME_DIR`.
pub fn default_listen() -> ListenAddr {
    if is_root() {
        return ListenAddr::Unix(PathBuf::from("/run/agentvm/agentvmd.sock"));
    }
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(|base| PathBuf::from(base).join("agentvm"))
        .unwrap_or_else(per_user_temp_dir);
    ListenAddr::Unix(dir.join("agentvmd.sock"))
}

/// The admin (HarnessRegistry) listener: `admin.sock` beside a unix API socket, else in the
/// node's state directory, so two nodes on one host that each have their own state
/// directory and API address never share one (a shared runtime directory made the second
/// fail with "admin.sock is in use").
pub fn default_admin_listen(api: &ListenAddr, state_dir: &Path) -> ListenAddr {
    let dir = match api {
        ListenAddr::Unix(p) => p.parent().map(Path::to_path_buf),
        ListenAddr::Tcp(_) => None,
    };
    ListenAddr::Unix(
        dir.unwrap_or_else(|| state_dir.to_owned())
            .join("admin.sock"),
    )
}

/// The journal database inside a state directory.
pub fn journal_path(state_dir: &Path) -> PathBuf {
    state_dir.join("journal.db")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_unix_and_loopback_tcp() {
        assert_eq!(
            "unix:/run/a.sock".parse(),
            Ok(ListenAddr::Unix("/run/a.sock".into()))
        );
        assert_eq!(
            "unix:///run/a.sock".parse(),
            Ok(ListenAddr::Unix("/run/a.sock".into()))
        );
        assert_eq!(
            "127.0.0.1:7000".parse(),
            Ok(ListenAddr::Tcp("127.0.0.1:7000".parse().unwrap()))
        );
        assert_eq!(
            "localhost:7000".parse(),
            Ok(ListenAddr::Tcp("127.0.0.1:7000".parse().unwrap()))
        );
        assert_eq!(
            "[::1]:7000".parse(),
            Ok(ListenAddr::Tcp("[::1]:7000".parse().unwrap()))
        );
    }

    #[test]
    fn refuses_bad_and_exposed_addresses() {
        assert!(matches!(
            "unix:".parse::<ListenAddr>(),
            Err(AddrError::EmptyUnixPath(_))
        ));
        assert!(matches!(
            "nonsense".parse::<ListenAddr>(),
            Err(AddrError::Unparseable(_))
        ));
        let exposed: ListenAddr = "0.0.0.0:7000".parse().unwrap();
        assert!(matches!(
            exposed.check_plaintext(),
            Err(AddrError::NonLoopbackTcp(_))
        ));
        let local: ListenAddr = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(local.check_plaintext(), Ok(()));
    }
}
