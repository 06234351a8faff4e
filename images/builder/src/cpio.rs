//! A deterministic writer for the `newc` cpio format the kernel unpacks as an initramfs.
//!
//! Every header field comes from the caller, nothing from the build machine: inode numbers count up
//! from 1, device numbers are 0, owners are root, and the caller passes one fixed mtime. Entries are
//! written in the order given; the caller sorts them.

use std::io::{self, Write};

const MAGIC: &[u8] = b"070701";
const TRAILER: &str = "TRAILER!!!";

/// File type bits of `st_mode`.
pub const S_IFDIR: u32 = 0o040_000;
/// Regular file.
pub const S_IFREG: u32 = 0o100_000;
/// Symbolic link.
pub const S_IFLNK: u32 = 0o120_000;
/// Character device.
pub const S_IFCHR: u32 = 0o020_000;

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A directory.
    Dir,
    /// A regular file with these contents.
    File(Vec<u8>),
    /// A symbolic link to this target.
    Symlink(String),
    /// A character device with this major and minor number.
    CharDevice(u32, u32),
}

/// One archive member. `path` has no leading slash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Path inside the archive, e.g. `bin/busybox`.
    pub path: String,
    /// Permission bits (the type bits come from `kind`).
    pub perm: u32,
    /// Contents.
    pub kind: Kind,
}

/// Writes `entries` and the trailer as one `newc` archive with every mtime set to `mtime`.
///
/// # Errors
/// An entry too large for the format's 32-bit sizes, or a write error.
pub fn write(out: &mut impl Write, entries: &[Entry], mtime: u32) -> io::Result<()> {
    let mut ino = 0u32;
    for entry in entries {
        ino += 1;
        let (mode, nlink, data, rdev): (u32, u32, &[u8], (u32, u32)) = match &entry.kind {
            Kind::Dir => (S_IFDIR, 2, &[], (0, 0)),
            Kind::File(bytes) => (S_IFREG, 1, bytes, (0, 0)),
            Kind::Symlink(target) => (S_IFLNK, 1, target.as_bytes(), (0, 0)),
            Kind::CharDevice(major, minor) => (S_IFCHR, 1, &[], (*major, *minor)),
        };
        member(out, &entry.path, mode | (entry.perm & 0o7777), nlink, data, rdev, ino, mtime)?;
    }
    member(out, TRAILER, 0, 1, &[], (0, 0), 0, 0)
}

#[expect(clippy::too_many_arguments, reason = "one argument per header field that varies")]
fn member(
    out: &mut impl Write,
    name: &str,
    mode: u32,
    nlink: u32,
    data: &[u8],
    rdev: (u32, u32),
    ino: u32,
    mtime: u32,
) -> io::Result<()> {
    let too_big = || io::Error::new(io::ErrorKind::InvalidInput, "cpio member exceeds 4 GiB");
    let size = u32::try_from(data.len()).map_err(|_| too_big())?;
    let namesize = u32::try_from(name.len() + 1).map_err(|_| too_big())?;
    let mut header = Vec::with_capacity(110 + name.len() + 4);
    header.extend_from_slice(MAGIC);
    // ino mode uid gid nlink mtime filesize devmajor devminor rdevmajor rdevminor namesize check
    for field in [ino, mode, 0, 0, nlink, mtime, size, 0, 0, rdev.0, rdev.1, namesize, 0] {
        header.extend_from_slice(format!("{field:08x}").as_bytes());
    }
    header.extend_from_slice(name.as_bytes());
    header.push(0);
    pad4(&mut header);
    out.write_all(&header)?;
    out.write_all(data)?;
    out.write_all(&[0; 3][..padding(data.len())])
}

fn padding(len: usize) -> usize {
    (4 - len % 4) % 4
}

fn pad4(buf: &mut Vec<u8>) {
    buf.resize(buf.len() + padding(buf.len()), 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(entries: &[Entry]) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out, entries, 1234).unwrap();
        out
    }

    #[test]
    fn headers_and_data_are_four_byte_aligned() {
        let out = archive(&[Entry { path: "a".into(), perm: 0o644, kind: Kind::File(b"xyz".to_vec()) }]);
        // 110-byte header + "a\0" = 112 (aligned), 3 data bytes + 1 pad, then the trailer member.
        assert_eq!(&out[..6], MAGIC);
        assert_eq!(&out[110..112], b"a\0");
        assert_eq!(&out[112..115], b"xyz");
        assert_eq!(out[115], 0);
        assert_eq!(&out[116..122], MAGIC);
        assert_eq!(out.len() % 4, 0);
    }

    #[test]
    fn header_fields_are_fixed_hex() {
        let out = archive(&[Entry { path: "dev/console".into(), perm: 0o600, kind: Kind::CharDevice(5, 1) }]);
        let field =
            |i: usize| u32::from_str_radix(std::str::from_utf8(&out[6 + i * 8..14 + i * 8]).unwrap(), 16).unwrap();
        assert_eq!(field(0), 1, "inode numbers count from 1");
        assert_eq!(field(1), S_IFCHR | 0o600);
        assert_eq!((field(2), field(3)), (0, 0), "owned by root");
        assert_eq!(field(5), 1234, "the given mtime");
        assert_eq!((field(9), field(10)), (5, 1));
    }

    #[test]
    fn same_entries_give_same_bytes() {
        let entries = [
            Entry { path: "bin".into(), perm: 0o755, kind: Kind::Dir },
            Entry { path: "bin/sh".into(), perm: 0o777, kind: Kind::Symlink("busybox".into()) },
        ];
        assert_eq!(archive(&entries), archive(&entries));
    }
}
