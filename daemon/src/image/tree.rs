//! An untrusted directory tree (a container image's root filesystem while its layers are
//! applied, an archive's contents while they are read), edited and read only through
//! directory file descriptors, never through path strings.
//!
//! Why: image builds run as root, and a hostile layer plants symlinks for later entries and
//! whiteouts to go through (`evil -> /victim`, then `evil/.wh..wh..opq`). A check of a path
//! followed by an operation on the same path can be redirected between the two, and any
//! operation on a path string follows the symlinks in it. Here every lookup is an
//! `openat2(2)` relative to the tree's root directory: parents resolve with `RESOLVE_IN_ROOT`
//! (a symlink in the tree is followed as the image means it, `/` and `..` clamped to the
//! tree's root, as containerd applies layers), and the last component of what is created,
//! changed or removed is never followed (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`, `unlinkat`).
//! Nothing done through a [`Tree`] can touch a file outside it.

use std::ffi::{CString, OsStr};
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps};

/// How deep a tree may nest: deeper is no real image, and removal recurses that far.
pub const MAX_DEPTH: usize = 256;

/// Parents: symlinks followed inside the tree only.
fn in_root() -> ResolveFlags {
    ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS
}

/// A directory found while removing: never through a symlink, never out of its parent.
fn beneath_no_links() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
}

/// A directory itself, not a link to one.
fn dir_flags() -> OFlags {
    OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW
}

/// A directory on the way to an entry: a link to one is followed (inside the tree).
fn parent_flags() -> OFlags {
    OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC
}

/// A path inside a tree: its normal components only, at most [`MAX_DEPTH`] of them.
fn components(rel: &Path) -> io::Result<Vec<&OsStr>> {
    let mut parts = Vec::new();
    for part in rel.components() {
        match part {
            Component::Normal(p) => parts.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} climbs out of the tree", rel.display()),
                ));
            }
        }
    }
    if parts.len() > MAX_DEPTH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is nested deeper than {MAX_DEPTH}", rel.display()),
        ));
    }
    Ok(parts)
}

fn errno(e: rustix::io::Errno) -> io::Error {
    io::Error::from(e)
}

/// The kinds of entry a tree holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
    Symlink,
    Other,
}

impl Kind {
    fn of(mode: u32) -> Kind {
        match FileType::from_raw_mode(mode) {
            FileType::Directory => Kind::Dir,
            FileType::RegularFile => Kind::File,
            FileType::Symlink => Kind::Symlink,
            _ => Kind::Other,
        }
    }
}

/// Owner, mode and modification time to give an entry.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meta {
    /// Permission bits (`& 0o7777`); `None` leaves them (a symlink has none).
    pub mode: Option<u32>,
    /// (uid, gid), set only when given.
    pub owner: Option<(u32, u32)>,
    /// Seconds since the epoch.
    pub mtime: Option<u64>,
}

pub struct Tree {
    root: OwnedFd,
}

impl Tree {
    /// The tree rooted at `root`, a directory this process made (the one path resolved the
    /// ordinary way).
    pub fn open(root: &Path) -> io::Result<Tree> {
        let root = rustix::fs::open(root, dir_flags(), Mode::empty()).map_err(errno)?;
        Ok(Tree { root })
    }

    /// The directory at `rel` (the root for an empty path); symlinks on the way, and one
    /// there, resolve inside the tree.
    fn dir(&self, parts: &[&OsStr]) -> io::Result<OwnedFd> {
        let rel: PathBuf = parts.iter().collect();
        let rel = if parts.is_empty() {
            Path::new(".")
        } else {
            rel.as_path()
        };
        rustix::fs::openat2(&self.root, rel, parent_flags(), Mode::empty(), in_root())
            .map_err(errno)
    }

    /// The directory holding `rel`, and `rel`'s last name.
    fn parent<'a>(&self, rel: &'a Path) -> io::Result<(OwnedFd, &'a OsStr)> {
        let parts = components(rel)?;
        let (name, parents) = parts
            .split_last()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the tree's root itself"))?;
        Ok((self.dir(parents)?, name))
    }

    /// What is at `rel` (not following a symlink there); `None` if nothing is.
    pub fn kind(&self, rel: &Path) -> io::Result<Option<Kind>> {
        Ok(self.stat(rel)?.map(|(kind, _)| kind))
    }

    /// What is at `rel` and its permission bits (not following a symlink there); `None` if
    /// nothing is.
    pub fn stat(&self, rel: &Path) -> io::Result<Option<(Kind, u32)>> {
        let (dir, name) = match self.parent(rel) {
            Ok(found) => found,
            Err(e) if missing(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some((Kind::of(st.st_mode), st.st_mode & 0o7777))),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(errno(e)),
        }
    }

    /// The target of the symlink at `rel`, as written (never resolved).
    pub fn read_link(&self, rel: &Path) -> io::Result<PathBuf> {
        let (dir, name) = self.parent(rel)?;
        let target = rustix::fs::readlinkat(&dir, name, Vec::new()).map_err(errno)?;
        Ok(PathBuf::from(OsStr::from_bytes(target.as_bytes())))
    }

    /// Removes whatever is at `rel` (a directory with everything in it); nothing there is
    /// not an error.
    pub fn remove(&self, rel: &Path) -> io::Result<()> {
        let (dir, name) = match self.parent(rel) {
            Ok(found) => found,
            Err(e) if missing(&e) => return Ok(()),
            Err(e) => return Err(e),
        };
        match remove_at(dir.as_fd(), name, 0) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            done => done,
        }
    }

    /// Removes everything in the directory at `rel` (an opaque whiteout); no directory
    /// there is not an error.
    pub fn empty(&self, rel: &Path) -> io::Result<()> {
        match self.dir(&components(rel)?) {
            Ok(dir) => empty_at(dir.as_fd(), 0),
            Err(e) if missing(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Makes `rel`'s parent directories that are missing (mode 0755), and returns the
    /// directory holding `rel` with `rel`'s last name. Something other than a directory in
    /// the way is replaced, as a later layer's directory replaces a lower layer's file.
    fn make_parent<'a>(&self, rel: &'a Path) -> io::Result<(OwnedFd, &'a OsStr)> {
        let parts = components(rel)?;
        let (name, parents) = parts
            .split_last()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the tree's root itself"))?;
        let mut dir = self.dir(&[])?;
        for part in parents {
            dir = match rustix::fs::openat2(&dir, *part, parent_flags(), Mode::empty(), in_root()) {
                Ok(next) => next,
                Err(rustix::io::Errno::NOENT) => {
                    make_dir_at(dir.as_fd(), part)?;
                    rustix::fs::openat2(&dir, *part, parent_flags(), Mode::empty(), in_root())
                        .map_err(errno)?
                }
                Err(rustix::io::Errno::NOTDIR) => {
                    remove_at(dir.as_fd(), part, 0)?;
                    make_dir_at(dir.as_fd(), part)?;
                    rustix::fs::openat2(&dir, *part, parent_flags(), Mode::empty(), in_root())
                        .map_err(errno)?
                }
                Err(e) => return Err(errno(e)),
            };
        }
        Ok((dir, name))
    }

    /// Makes the directory `rel` (replacing a non-directory there) and gives it `meta`.
    pub fn make_dir(&self, rel: &Path, meta: Meta) -> io::Result<()> {
        let (dir, name) = self.make_parent(rel)?;
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if Kind::of(st.st_mode) == Kind::Dir => {}
            Ok(_) => {
                remove_at(dir.as_fd(), name, 0)?;
                make_dir_at(dir.as_fd(), name)?;
            }
            Err(rustix::io::Errno::NOENT) => make_dir_at(dir.as_fd(), name)?,
            Err(e) => return Err(errno(e)),
        }
        let made = rustix::fs::openat2(&dir, name, dir_flags(), Mode::empty(), beneath_no_links())
            .map_err(errno)?;
        set_meta(dir.as_fd(), name, Some(made.as_fd()), meta)
    }

    /// Writes the regular file `rel` from `data` (replacing whatever was there, never
    /// writing through a link), at most `max` bytes of it; returns how many were written.
    pub fn write_file(
        &self,
        rel: &Path,
        data: &mut dyn Read,
        max: u64,
        meta: Meta,
    ) -> io::Result<u64> {
        let (dir, name) = self.make_parent(rel)?;
        clear(dir.as_fd(), name)?;
        let file = rustix::fs::openat(
            &dir,
            name,
            OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::from_raw_mode(0o600),
        )
        .map_err(errno)?;
        let mut file = std::fs::File::from(file);
        let written = io::copy(&mut data.take(max), &mut file)?;
        // One byte more than allowed says the data was longer.
        let mut probe = [0u8; 1];
        if written == max && data.read(&mut probe)? > 0 {
            drop(file);
            let _ = rustix::fs::unlinkat(&dir, name, AtFlags::empty());
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                format!("{} is larger than the {max} bytes left", rel.display()),
            ));
        }
        let fd = OwnedFd::from(file);
        set_meta(dir.as_fd(), name, Some(fd.as_fd()), meta)?;
        Ok(written)
    }

    /// Makes `rel` a symlink to `target` (never followed here).
    pub fn symlink(&self, rel: &Path, target: &Path, meta: Meta) -> io::Result<()> {
        let (dir, name) = self.make_parent(rel)?;
        clear(dir.as_fd(), name)?;
        rustix::fs::symlinkat(target, &dir, name).map_err(errno)?;
        set_meta(dir.as_fd(), name, None, Meta { mode: None, ..meta })
    }

    /// Makes `rel` a hard link to the entry at `target` (itself, if that is a symlink).
    pub fn hard_link(&self, rel: &Path, target: &Path) -> io::Result<()> {
        let (from_dir, from_name) = self.parent(target)?;
        let (dir, name) = self.make_parent(rel)?;
        clear(dir.as_fd(), name)?;
        rustix::fs::linkat(&from_dir, from_name, &dir, name, AtFlags::empty()).map_err(errno)
    }

    /// The regular file at `rel`, opened for reading; symlinks on the way resolve inside the
    /// tree (an absolute one from the tree's root).
    pub fn open_file(&self, rel: &Path) -> io::Result<std::fs::File> {
        let parts = components(rel)?;
        let rel: PathBuf = parts.iter().collect();
        let fd = rustix::fs::openat2(
            &self.root,
            &rel,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
            in_root(),
        )
        .map_err(errno)?;
        let file = std::fs::File::from(fd);
        if !file.metadata()?.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file", rel.display()),
            ));
        }
        Ok(file)
    }

    /// The whole regular file at `rel`, refused if larger than `max` bytes.
    pub fn read(&self, rel: &Path, max: u64) -> io::Result<Vec<u8>> {
        let file = self.open_file(rel)?;
        let len = file.metadata()?.len();
        if len > max {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                format!("{} is {len} bytes, more than {max}", rel.display()),
            ));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        file.take(max).read_to_end(&mut bytes)?;
        Ok(bytes)
    }
}

/// Nothing at a path, or a path through something that is not a directory.
fn missing(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP)
    )
}

fn make_dir_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o755)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
        Err(e) => Err(errno(e)),
    }
}

/// Removes whatever is at `name` in `dir`, so something new can be made there.
fn clear(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match remove_at(dir, name, 0) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        done => done,
    }
}

fn remove_at(dir: BorrowedFd<'_>, name: &OsStr, depth: usize) -> io::Result<()> {
    let st = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(errno)?;
    if Kind::of(st.st_mode) != Kind::Dir {
        return rustix::fs::unlinkat(dir, name, AtFlags::empty()).map_err(errno);
    }
    let sub = rustix::fs::openat2(dir, name, dir_flags(), Mode::empty(), beneath_no_links())
        .map_err(errno)?;
    empty_at(sub.as_fd(), depth + 1)?;
    rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(errno)
}

fn empty_at(dir: BorrowedFd<'_>, depth: usize) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a directory nested deeper than {MAX_DEPTH}"),
        ));
    }
    let mut names: Vec<CString> = Vec::new();
    for entry in Dir::read_from(dir).map_err(errno)? {
        let entry = entry.map_err(errno)?;
        let name = entry.file_name();
        if name.to_bytes() != b"." && name.to_bytes() != b".." {
            names.push(name.to_owned());
        }
    }
    for name in names {
        remove_at(dir, OsStr::from_bytes(name.to_bytes()), depth)?;
    }
    Ok(())
}

/// Gives `name` in `dir` its owner, mode and time. `opened` is the entry itself, for what
/// must not go through its name (mode: `fchmodat` cannot refuse to follow a link).
fn set_meta(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    opened: Option<BorrowedFd<'_>>,
    meta: Meta,
) -> io::Result<()> {
    // -1 would mean "leave it" to chown(2): never an owner to give.
    if let Some((uid, gid)) = meta.owner.filter(|&(u, g)| u != u32::MAX && g != u32::MAX) {
        let (uid, gid) = (
            rustix::fs::Uid::from_raw(uid),
            rustix::fs::Gid::from_raw(gid),
        );
        rustix::fs::chownat(dir, name, Some(uid), Some(gid), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(errno)?;
    }
    if let (Some(mode), Some(fd)) = (meta.mode, opened) {
        rustix::fs::fchmod(fd, Mode::from_raw_mode(mode & 0o7777)).map_err(errno)?;
    }
    if let Some(mtime) = meta.mtime {
        let at = Timespec {
            tv_sec: i64::try_from(mtime).unwrap_or(i64::MAX),
            tv_nsec: 0,
        };
        let times = Timestamps {
            last_access: at,
            last_modification: at,
        };
        rustix::fs::utimensat(dir, name, &times, AtFlags::SYMLINK_NOFOLLOW).map_err(errno)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree beside a "host" directory, with symlinks from inside the tree to the host.
    fn planted() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let (root, host) = (tmp.path().join("root"), tmp.path().join("host"));
        std::fs::create_dir_all(host.join("dir")).unwrap();
        std::fs::write(host.join("precious"), b"host").unwrap();
        std::fs::write(host.join("dir/inner"), b"host").unwrap();
        std::fs::create_dir(&root).unwrap();
        std::os::unix::fs::symlink(&host, root.join("evil")).unwrap();
        std::os::unix::fs::symlink(host.join("precious"), root.join("evil-file")).unwrap();
        std::os::unix::fs::symlink("../host", root.join("climb")).unwrap();
        (tmp, root, host)
    }

    fn host_untouched(host: &Path) {
        assert_eq!(std::fs::read(host.join("precious")).unwrap(), b"host");
        assert_eq!(std::fs::read(host.join("dir/inner")).unwrap(), b"host");
        assert_eq!(std::fs::read_dir(host).unwrap().count(), 2);
    }

    #[test]
    fn nothing_through_a_planted_symlink_reaches_outside_the_tree() {
        let (_tmp, root, host) = planted();
        // What `climb` (`../host`) means inside the tree: `host` under the tree's root.
        std::fs::create_dir_all(root.join("host/dir")).unwrap();
        let tree = Tree::open(&root).unwrap();
        let meta = Meta::default();
        for link in ["evil", "climb", "evil-file"] {
            let l = Path::new(link);
            // Each may fail (a link to nowhere in the tree) or act inside the tree: either
            // way the host is untouched.
            let _ = tree.empty(l);
            let _ = tree.empty(&l.join("dir"));
            let _ = tree.remove(&l.join("precious"));
            let _ = tree.remove(&l.join("dir"));
            let _ = tree.write_file(&l.join("precious"), &mut &b"evil"[..], 100, meta);
            let _ = tree.make_dir(&l.join("dir/inner"), meta);
            let _ = tree.symlink(&l.join("planted"), Path::new("/etc/passwd"), meta);
            let _ = tree.hard_link(&l.join("hard"), Path::new("evil-file"));
            host_untouched(&host);
        }
        assert_eq!(std::fs::read(root.join("host/precious")).unwrap(), b"evil");
        assert_eq!(
            tree.read(Path::new("climb/precious"), 100).unwrap(),
            b"evil"
        );
        // A link as the last component is replaced, never written through.
        tree.write_file(Path::new("evil-file"), &mut &b"x"[..], 100, meta)
            .unwrap();
        assert!(
            !std::fs::symlink_metadata(root.join("evil-file"))
                .unwrap()
                .is_symlink()
        );
        tree.remove(Path::new("evil")).unwrap();
        assert!(std::fs::symlink_metadata(root.join("evil")).is_err());
        host_untouched(&host);
        // Reading resolves links inside the tree only.
        std::os::unix::fs::symlink("/etc/passwd", root.join("abs")).unwrap();
        assert!(tree.read(Path::new("abs"), 1 << 20).is_err());
        assert!(tree.read(Path::new("../host/precious"), 100).is_err());
    }

    #[test]
    fn entries_are_made_replaced_and_capped() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = Tree::open(tmp.path()).unwrap();
        let meta = Meta {
            mode: Some(0o751),
            owner: None,
            mtime: Some(1_000_000),
        };
        tree.write_file(Path::new("a/b/file"), &mut &b"hello"[..], 5, meta)
            .unwrap();
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::metadata(tmp.path().join("a/b/file")).unwrap();
        assert_eq!(
            (m.permissions().mode() & 0o7777, m.mtime()),
            (0o751, 1_000_000)
        );
        // A file replacing a directory, and the other way round.
        tree.write_file(Path::new("a/b"), &mut &b"now a file"[..], 100, meta)
            .unwrap();
        assert_eq!(tree.kind(Path::new("a/b")).unwrap(), Some(Kind::File));
        tree.make_dir(Path::new("a/b"), meta).unwrap();
        assert_eq!(tree.kind(Path::new("a/b")).unwrap(), Some(Kind::Dir));
        tree.hard_link(Path::new("a/link"), Path::new("a/b"))
            .unwrap_err();
        tree.write_file(Path::new("a/f"), &mut &b"x"[..], 1, meta)
            .unwrap();
        tree.hard_link(Path::new("a/g"), Path::new("a/f")).unwrap();
        assert_eq!(
            std::fs::metadata(tmp.path().join("a/g")).unwrap().nlink(),
            2
        );
        // Longer than allowed: refused, and nothing is left of it.
        let err = tree
            .write_file(Path::new("big"), &mut &[0u8; 10][..], 9, meta)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::FileTooLarge);
        assert_eq!(tree.kind(Path::new("big")).unwrap(), None);
        // Too deep, or climbing out, is refused.
        let deep: PathBuf = std::iter::repeat_n("d", MAX_DEPTH + 1).collect();
        assert!(tree.make_dir(&deep, meta).is_err());
        assert!(tree.remove(Path::new("../x")).is_err());
    }
}
