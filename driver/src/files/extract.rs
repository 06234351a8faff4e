//! The hardened extractor: a tar the guest sent, unpacked into a staging directory on the host.
//!
//! The archive is read raw (the `tar` crate's own handling of GNU long names and PAX headers reads them
//! whole, whatever size their header claims): this module reads each extension entry itself, within
//! [`Limits::max_path_bytes`]. Every header counts towards [`Limits::max_entries`], and each file's size is
//! judged against [`Limits::max_bytes`] from its header, before its data. Names are checked on bytes
//! ([`super::names`]) and made beneath the staging directory's descriptor ([`super::beneath`]). Modes keep
//! their permission bits (`0o777`); set-id and sticky bits are dropped; ownership is the host user's.

use std::collections::HashSet;
use std::io::{self, Read};

use tar::EntryType;
use vm_protocol::files::{TarRefusal, MAX_PATH_BYTES};

use super::beneath::{Beneath, MakeError};
use super::names::{self, EntryName};

/// What a tar may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Headers, extension headers included.
    pub max_entries: u64,
    /// File bytes, from the headers.
    pub max_bytes: u64,
    /// Bytes of one name or link target.
    pub max_path_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_entries: 100_000, max_bytes: 8 << 30, max_path_bytes: MAX_PATH_BYTES }
    }
}

/// Bytes of a PAX extension header it reads: a path and a link path, with room for the keys' overhead.
const MAX_PAX_BYTES: u64 = 3 * MAX_PATH_BYTES as u64;
/// Bytes after the end-of-archive blocks that are still padding (a record is 10 KiB); more is refused.
const MAX_TRAILER_BYTES: u64 = 1 << 20;

/// What was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unpacked {
    /// Entries made (files, directories, links).
    pub entries: u64,
    /// File bytes written.
    pub bytes: u64,
    /// Whether the top-level entry is a directory.
    pub top_is_dir: bool,
}

/// An extraction that did not complete.
#[derive(Debug)]
pub enum UnpackError {
    /// The tar broke a rule: the guest's doing.
    Refused(TarRefusal),
    /// The host failed to write (a full disk, a permission).
    Io(io::Error),
}

impl From<MakeError> for UnpackError {
    fn from(e: MakeError) -> Self {
        match e {
            MakeError::Refused(r) => Self::Refused(r),
            MakeError::Io(e) => Self::Io(e),
        }
    }
}

impl From<rustix::io::Errno> for UnpackError {
    fn from(e: rustix::io::Errno) -> Self {
        MakeError::from(e).into()
    }
}

/// Extension headers waiting for the entry they describe.
#[derive(Debug, Default)]
struct Pending {
    name: Option<Vec<u8>>,
    link: Option<Vec<u8>>,
}

/// Unpacks `tar` beneath `tree`, within `limits`; `max_bytes` is already the smaller of the cap and the
/// destination's free space.
///
/// # Errors
/// The first refusal, or the host's failure. Whatever was made stays in the staging tree for the caller to
/// remove.
pub fn unpack(tar: impl Read, tree: &Beneath, limits: Limits) -> Result<Unpacked, UnpackError> {
    let malformed = |_| UnpackError::Refused(TarRefusal::Malformed);
    let mut archive = tar::Archive::new(tar);
    let mut top = None;
    let mut pending = Pending::default();
    let mut files: HashSet<EntryName> = HashSet::new();
    let mut dirs: Vec<(EntryName, u32)> = Vec::new();
    let mut done = Unpacked::default();
    let mut headers = 0u64;
    for entry in archive.entries().map_err(malformed)?.raw(true) {
        let mut entry = entry.map_err(malformed)?;
        headers += 1;
        if headers > limits.max_entries {
            return Err(UnpackError::Refused(TarRefusal::TooManyEntries));
        }
        let header = entry.header();
        let kind = header.entry_type();
        let size = header.entry_size().map_err(malformed)?;
        let mode = header.mode().map_err(malformed)? & 0o777;
        match kind {
            EntryType::GNULongName => pending.name = Some(read_small(&mut entry, size, limits.max_path_bytes)?),
            EntryType::GNULongLink => pending.link = Some(read_small(&mut entry, size, limits.max_path_bytes)?),
            EntryType::XHeader => pax(&mut entry, size, &mut pending)?,
            EntryType::XGlobalHeader => {
                read_small(&mut entry, size, usize::try_from(MAX_PAX_BYTES).unwrap_or(usize::MAX))?;
            }
            EntryType::Regular | EntryType::Directory | EntryType::Symlink | EntryType::Link => {
                let raw = pending.name.take().unwrap_or_else(|| entry.path_bytes().into_owned());
                let name = names::entry_name(&raw, &mut top, limits.max_path_bytes).map_err(UnpackError::Refused)?;
                let link = pending.link.take().or_else(|| entry.link_name_bytes().map(|l| l.into_owned()));
                done.top_is_dir = kind == EntryType::Directory || !name.below_top.is_empty() || done.top_is_dir;
                match kind {
                    EntryType::Directory => {
                        tree.dir(&path_to(&name))?;
                        dirs.push((name, mode));
                    }
                    EntryType::Regular => {
                        done.bytes = done.bytes.saturating_add(size);
                        if done.bytes > limits.max_bytes {
                            return Err(UnpackError::Refused(TarRefusal::TooManyBytes));
                        }
                        let (parent, file) = split(&name);
                        let dir = tree.dir(&parent)?;
                        let mut out = tree.create(&dir, file)?;
                        let copied = io::copy(&mut entry, &mut out).map_err(UnpackError::Io)?;
                        if copied != size {
                            return Err(UnpackError::Refused(TarRefusal::Malformed));
                        }
                        rustix::fs::fchmod(&out, rustix::fs::Mode::from_raw_mode(mode))?;
                        files.insert(name);
                    }
                    EntryType::Symlink => {
                        let target = link.ok_or(UnpackError::Refused(TarRefusal::Malformed))?;
                        if tree.confined {
                            names::symlink_target(&target, &name, limits.max_path_bytes)
                                .map_err(UnpackError::Refused)?;
                        }
                        let (parent, file) = split(&name);
                        tree.symlink(&tree.dir(&parent)?, file, &target)?;
                    }
                    _ => {
                        let raw = link.ok_or(UnpackError::Refused(TarRefusal::Malformed))?;
                        let target = names::entry_name(&raw, &mut top, limits.max_path_bytes)
                            .map_err(|_| UnpackError::Refused(TarRefusal::ForeignHardLink))?;
                        if !files.contains(&target) {
                            return Err(UnpackError::Refused(TarRefusal::ForeignHardLink));
                        }
                        let (parent, file) = split(&name);
                        tree.hard_link(&tree.dir(&parent)?, file, &path_to(&target))?;
                    }
                }
                done.entries += 1;
            }
            _ => return Err(UnpackError::Refused(TarRefusal::SpecialFile)),
        }
    }
    if top.is_none() || pending.name.is_some() || pending.link.is_some() {
        return Err(UnpackError::Refused(TarRefusal::Malformed));
    }
    // Past the end-of-archive blocks: padding, within reason.
    let mut rest = archive.into_inner().take(MAX_TRAILER_BYTES + 1);
    if io::copy(&mut rest, &mut io::sink()).map_err(malformed)? > MAX_TRAILER_BYTES {
        return Err(UnpackError::Refused(TarRefusal::Malformed));
    }
    // Deepest first, so a read-only directory is closed only once everything under it is in.
    dirs.sort_by_key(|(name, _)| std::cmp::Reverse(name.below_top.len()));
    for (name, mode) in dirs {
        tree.chmod_dir(&path_to(&name), mode)?;
    }
    Ok(done)
}

/// The staging path of an entry: the top-level name is always `top` there.
fn path_to(name: &EntryName) -> Vec<Vec<u8>> {
    std::iter::once(super::STAGED_TOP.to_vec()).chain(name.below_top.iter().cloned()).collect()
}

/// The staging path of an entry's directory, and its own name.
fn split(name: &EntryName) -> (Vec<Vec<u8>>, &[u8]) {
    match name.below_top.split_last() {
        Some((file, parents)) => {
            (std::iter::once(super::STAGED_TOP.to_vec()).chain(parents.iter().cloned()).collect(), file)
        }
        None => (Vec::new(), super::STAGED_TOP),
    }
}

/// Reads an extension entry's data whole, refusing one over `max` bytes before reading any.
fn read_small(entry: &mut impl Read, size: u64, max: usize) -> Result<Vec<u8>, UnpackError> {
    if size > max as u64 {
        return Err(UnpackError::Refused(TarRefusal::PathTooLong));
    }
    let mut data = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    entry.read_to_end(&mut data).map_err(|_| UnpackError::Refused(TarRefusal::Malformed))?;
    // A GNU long name ends in NUL.
    while data.last() == Some(&0) {
        data.pop();
    }
    Ok(data)
}

/// A PAX extension header: its `path` and `linkpath` apply to the next entry; a `size` (which a raw reader
/// would not honour) is refused; the rest (times, ids, xattrs) is ignored.
fn pax(entry: &mut impl Read, size: u64, pending: &mut Pending) -> Result<(), UnpackError> {
    let data = read_small(entry, size, usize::try_from(MAX_PAX_BYTES).unwrap_or(usize::MAX))?;
    for record in tar::PaxExtensions::new(&data) {
        let record = record.map_err(|_| UnpackError::Refused(TarRefusal::Malformed))?;
        match record.key_bytes() {
            b"path" => pending.name = Some(record.value_bytes().to_vec()),
            b"linkpath" => pending.link = Some(record.value_bytes().to_vec()),
            b"size" | b"GNU.sparse.size" | b"GNU.sparse.map" => {
                return Err(UnpackError::Refused(TarRefusal::SpecialFile))
            }
            _ => {}
        }
    }
    Ok(())
}
