//! The directories agentvmd keeps its state and sockets in must be its own.
//!
//! A daemon that falls back to a shared directory (`/tmp` when a non-root daemon has no
//! `HOME` or `XDG_RUNTIME_DIR`) would otherwise use whatever another local user created
//! there first: that user's directory would then hold the journal, the snapshots and the
//! API socket, and that user could swap any of them. So a directory the daemon relies on is
//! created private (0700) when absent, and refused at start when it is there but belongs to
//! someone else or lets others write in it.

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a directory (a link or a file is not used)")]
    NotADirectory { path: String },
    #[error(
        "{path} belongs to uid {owner}, not to this daemon (uid {me}) or root: another user \
         could replace what agentvmd keeps there; remove it or choose another directory"
    )]
    Foreign { path: String, owner: u32, me: u32 },
    #[error(
        "{path} lets others write in it (mode {mode:o}): another user could replace what \
         agentvmd keeps there; chmod go-w it or choose another directory"
    )]
    Writable { path: String, mode: u32 },
}

/// Which directories qualify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// The daemon's own directory (state): only its uid (or root's, for a root daemon's
    /// parents) owns it, and nobody else writes in it.
    Own,
    /// A directory a socket is placed in: it may also be a shared sticky directory owned by
    /// root (`/tmp`), where nobody can remove or replace another user's entry.
    SocketParent,
}

/// Creates `dir` (and its parents) 0700 when absent, then checks it qualifies for `use_`.
pub fn ensure(dir: &Path, use_: Use) -> Result<(), Error> {
    let path = || dir.display().to_string();
    if std::fs::symlink_metadata(dir).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| Error::Io {
                path: path(),
                source,
            })?;
    }
    check(dir, use_)
}

/// Whether `dir`, as it is now, qualifies for `use_`.
pub fn check(dir: &Path, use_: Use) -> Result<(), Error> {
    let path = || dir.display().to_string();
    let meta = std::fs::symlink_metadata(dir).map_err(|source| Error::Io {
        path: path(),
        source,
    })?;
    if !meta.file_type().is_dir() {
        return Err(Error::NotADirectory { path: path() });
    }
    let me = nix::unistd::geteuid().as_raw();
    let owner = meta.uid();
    if owner != me && owner != 0 {
        return Err(Error::Foreign {
            path: path(),
            owner,
            me,
        });
    }
    let mode = meta.mode() & 0o7777;
    let others_write = mode & 0o022 != 0;
    let shared_sticky = use_ == Use::SocketParent && owner == 0 && mode & 0o1000 != 0;
    if others_write && !shared_sticky {
        return Err(Error::Writable { path: path(), mode });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_missing_directory_is_made_private() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b/agentvm");
        ensure(&dir, Use::Own).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn a_directory_others_may_write_or_a_link_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        chmod(&dir, 0o777);
        let err = ensure(&dir, Use::Own).unwrap_err().to_string();
        assert!(
            err.contains("lets others write") && err.contains("777"),
            "{err}"
        );
        chmod(&dir, 0o755);
        ensure(&dir, Use::Own).unwrap();

        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let err = ensure(&link, Use::Own).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
    }

    #[test]
    fn another_users_directory_is_refused_and_a_sticky_shared_one_only_holds_sockets() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: needs root to give a directory to another user");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        // What another local user pre-created where a daemon without HOME would look.
        let planted = tmp.path().join("agentvm");
        std::fs::create_dir(&planted).unwrap();
        chmod(&planted, 0o700);
        std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).unwrap();
        for use_ in [Use::Own, Use::SocketParent] {
            let err = ensure(&planted, use_).unwrap_err().to_string();
            assert!(err.contains("belongs to uid 65534"), "{err}");
        }

        let shared = tmp.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        chmod(&shared, 0o1777);
        check(&shared, Use::SocketParent).unwrap();
        assert!(check(&shared, Use::Own).is_err());
        chmod(&shared, 0o777);
        assert!(check(&shared, Use::SocketParent).is_err());
    }
}
