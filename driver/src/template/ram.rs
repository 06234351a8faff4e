//! A template's files as bytes: sparse copies with their digest, and the guest's RAM as a memfd.
//!
//! - **Sparse.** A guest's RAM and an image root's writable layer are mostly holes; only the data
//!   ranges (`SEEK_DATA`/`SEEK_HOLE`) are read, copied and hashed, each with its offset, and the length
//!   last. A hole reads as zeros, so two files with one digest read the same.
//! - **Sealed.** A clone's RAM is a memfd filled from the template's `ram` while its digest is checked, then
//!   sealed against writes and size changes ([`vm_contract::guest_ram::SEALS`]): no VMM can change the
//!   pages the other clones map.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;

use rustix::fs::{MemfdFlags, SeekFrom as RawSeek};
use sha2::{Digest as _, Sha256};

/// The most bytes read at a time.
const CHUNK: usize = 1 << 20;

/// A file's sparse digest, as lowercase hex.
pub type Digest = String;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The data ranges of `file` (of `len` bytes), as (start, end).
fn data_ranges(file: &File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let mut ranges = Vec::new();
    let mut at = 0;
    while at < len {
        let start = match rustix::fs::seek(file, RawSeek::Data(at)) {
            Ok(start) => start,
            // ENXIO: no data past `at`.
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = rustix::fs::seek(file, RawSeek::Hole(start))?.min(len);
        ranges.push((start, end));
        at = end;
    }
    Ok(ranges)
}

/// The sparse digest of `from` (`len` bytes), copying each range of data that is not all zeros into `to`
/// (already `len` bytes long, holes elsewhere) when there is one: a copy of a filled memfd stays sparse.
fn sparse_digest(from: &File, len: u64, to: Option<&File>) -> std::io::Result<Digest> {
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    for (start, end) in data_ranges(from, len)? {
        let mut at = start;
        while at < end {
            let n = usize::try_from(end - at).unwrap_or(CHUNK).min(CHUNK);
            from.read_exact_at(&mut buf[..n], at)?;
            let chunk = &buf[..n];
            if chunk.iter().any(|b| *b != 0) {
                hash.update(at.to_le_bytes());
                hash.update((n as u64).to_le_bytes());
                hash.update(chunk);
                if let Some(to) = to {
                    to.write_all_at(chunk, at)?;
                }
            }
            at += n as u64;
        }
    }
    hash.update(len.to_le_bytes());
    Ok(hex(&hash.finalize()))
}

/// The sparse digest of `path`.
///
/// # Errors
/// The file cannot be read.
pub fn digest(path: &std::path::Path) -> std::io::Result<Digest> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    sparse_digest(&file, len, None)
}

/// An empty memfd of `bytes` for a VM being saved to write its RAM into (`share=on`).
///
/// # Errors
/// The memfd cannot be made.
pub fn for_saving(bytes: u64) -> std::io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create("vm-template-save", MemfdFlags::CLOEXEC)?;
    rustix::fs::ftruncate(&fd, bytes)?;
    Ok(fd)
}

/// Writes a saved VM's RAM (`memfd`) into a new 0400 file at `path`, sparse, and returns its digest.
///
/// # Errors
/// The file cannot be written.
pub fn keep(memfd: OwnedFd, path: &std::path::Path) -> std::io::Result<Digest> {
    use std::os::unix::fs::OpenOptionsExt;
    let from = File::from(memfd);
    let len = from.metadata()?.len();
    let to = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o400).open(path)?;
    to.set_len(len)?;
    let digest = sparse_digest(&from, len, Some(&to))?;
    to.sync_all()?;
    Ok(digest)
}

/// Why a template's RAM was not loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file or the memfd failed.
    #[error("cannot load the template's RAM")]
    Io(#[from] std::io::Error),
    /// Its bytes are not the ones saved.
    #[error("the template's RAM does not match its digest")]
    Tampered,
    /// Not the guest's size.
    #[error("the template's RAM is not the guest's size")]
    Size,
}

/// The template's `ram` (`bytes` long, with digest `expected`) in a sealed memfd, checked as it is copied.
///
/// # Errors
/// [`LoadError`].
pub fn load_sealed(path: &std::path::Path, bytes: u64, expected: &str) -> Result<OwnedFd, LoadError> {
    let from = File::open(path)?;
    if from.metadata()?.len() != bytes {
        return Err(LoadError::Size);
    }
    let fd = rustix::fs::memfd_create("vm-template", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(std::io::Error::from)?;
    rustix::fs::ftruncate(&fd, bytes).map_err(std::io::Error::from)?;
    let to = File::from(fd);
    if sparse_digest(&from, bytes, Some(&to))? != expected {
        return Err(LoadError::Tampered);
    }
    rustix::fs::fcntl_add_seals(&to, vm_contract::guest_ram::SEALS).map_err(std::io::Error::from)?;
    Ok(to.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_copy_reads_the_same_refuses_writes_and_a_changed_byte_changes_the_digest() {
        let dir = std::env::temp_dir().join(format!("vm-template-ram-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let bytes = 8 << 20;
        let saving = for_saving(bytes).unwrap();
        let file = File::from(saving.try_clone().unwrap());
        file.write_all_at(b"guest page", 3 << 20).unwrap();
        let path = dir.join("ram");
        let digest = keep(saving, &path).unwrap();
        assert_eq!(super::digest(&path).unwrap(), digest);
        assert!(data_ranges(&File::open(&path).unwrap(), bytes).unwrap().len() <= 1, "kept sparse");
        let sealed = File::from(load_sealed(&path, bytes, &digest).unwrap());
        let mut page = [0u8; 10];
        sealed.read_exact_at(&mut page, 3 << 20).unwrap();
        assert_eq!(&page, b"guest page");
        // The seal: not even its maker writes.
        assert!(sealed.write_all_at(b"x", 0).is_err());
        assert!(sealed.set_len(bytes * 2).is_err());
        // Control: the same bytes changed on disk are refused.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().write_all_at(b"G", 3 << 20).unwrap();
        assert!(matches!(load_sealed(&path, bytes, &digest), Err(LoadError::Tampered)));
        assert!(matches!(load_sealed(&path, bytes * 2, &digest), Err(LoadError::Size)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
