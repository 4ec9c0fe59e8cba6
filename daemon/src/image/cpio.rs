//! The `newc` cpio format the kernel unpacks as an initramfs, written reproducibly: entries
//! in the order given, inode numbers counted from 1, every timestamp 0, owner root.

use std::io::{self, Write};

use nix::sys::stat::SFlag;

const MAGIC: &str = "070701";
const TRAILER: &str = "TRAILER!!!";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    /// A character device (major, minor): `/dev/console` must exist before devtmpfs does.
    CharDevice(u32, u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Relative to the root, without a leading `/`.
    pub path: String,
    /// Permission bits (the type bits come from `kind`).
    pub mode: u32,
    pub kind: Kind,
}

pub struct Writer<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            next_ino: 1,
            written: 0,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let pad = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..pad])
    }

    fn header(
        &mut self,
        path: &str,
        mode: u32,
        size: usize,
        nlink: u32,
        rdev: (u32, u32),
    ) -> io::Result<()> {
        let ino = self.next_ino;
        self.next_ino += 1;
        let namesize = path.len() + 1;
        let fields = [
            ino,
            mode,
            0,
            0,
            nlink,
            0,
            size as u32,
            0,
            0,
            rdev.0,
            rdev.1,
            namesize as u32,
            0,
        ];
        let mut header = String::from(MAGIC);
        for f in fields {
            header.push_str(&format!("{f:08x}"));
        }
        self.put(header.as_bytes())?;
        self.put(path.as_bytes())?;
        self.put(&[0])?;
        self.pad()
    }

    pub fn entry(&mut self, e: &Entry) -> io::Result<()> {
        let perm = e.mode & 0o7777;
        match &e.kind {
            Kind::Dir => self.header(&e.path, SFlag::S_IFDIR.bits() | perm, 0, 2, (0, 0)),
            Kind::File(data) => {
                if data.len() > u32::MAX as usize {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{}: larger than cpio's 4 GiB limit", e.path),
                    ));
                }
                self.header(&e.path, SFlag::S_IFREG.bits() | perm, data.len(), 1, (0, 0))?;
                self.put(data)?;
                self.pad()
            }
            Kind::Symlink(target) => {
                self.header(
                    &e.path,
                    SFlag::S_IFLNK.bits() | 0o777,
                    target.len(),
                    1,
                    (0, 0),
                )?;
                self.put(target.as_bytes())?;
                self.pad()
            }
            Kind::CharDevice(major, minor) => self.header(
                &e.path,
                SFlag::S_IFCHR.bits() | perm,
                0,
                1,
                (*major, *minor),
            ),
        }
    }

    /// Writes the trailer; returns the archive's size.
    pub fn finish(mut self) -> io::Result<u64> {
        self.header(TRAILER, 0, 0, 1, (0, 0))?;
        self.out.flush()?;
        Ok(self.written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_end_with_the_trailer() {
        let mut out = Vec::new();
        let mut w = Writer::new(&mut out);
        w.entry(&Entry {
            path: "etc".into(),
            mode: 0o755,
            kind: Kind::Dir,
        })
        .unwrap();
        w.entry(&Entry {
            path: "etc/a".into(),
            mode: 0o644,
            kind: Kind::File(b"hello".to_vec()),
        })
        .unwrap();
        let size = w.finish().unwrap();
        assert_eq!(size as usize, out.len());
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("070701"));
        // The file's header: ino 2, mode 0100644, size 5, name "etc/a".
        assert!(text.contains("07070100000002000081a4"), "{text}");
        assert!(text.contains("etc/a\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!"));
    }
}
