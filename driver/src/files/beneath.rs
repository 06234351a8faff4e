//! Making an extracted tree under one directory descriptor, where the kernel, not the extractor, keeps every
//! path beneath it: each lookup is `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, so no component
//! of any path may be a symlink (the tar's own included) or lead out, and every name is created relative to
//! its parent's descriptor, never by a path string the host resolves again.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use vm_protocol::files::TarRefusal;

/// The staging tree: a directory descriptor everything is made beneath.
#[derive(Debug)]
pub struct Beneath {
    root: OwnedFd,
    /// Off only for the `unchecked-extract` control: lookups follow symlinks wherever they lead, and symlink
    /// targets are not checked.
    pub confined: bool,
}

/// A failure to make an entry: the tar's fault (a refusal) or the host's (I/O).
#[derive(Debug)]
pub enum MakeError {
    /// The entry is refused.
    Refused(TarRefusal),
    /// The host failed.
    Io(io::Error),
}

impl From<Errno> for MakeError {
    fn from(errno: Errno) -> Self {
        match errno {
            // RESOLVE_NO_SYMLINKS met a symlink; O_NOFOLLOW met one as the last component.
            Errno::LOOP => Self::Refused(TarRefusal::ThroughSymlink),
            // RESOLVE_BENEATH saw the walk leave the root.
            Errno::XDEV => Self::Refused(TarRefusal::ParentDir),
            Errno::EXIST | Errno::NOTDIR | Errno::ISDIR => Self::Refused(TarRefusal::Duplicate),
            other => Self::Io(other.into()),
        }
    }
}

fn os(name: &[u8]) -> &OsStr {
    OsStr::from_bytes(name)
}

impl Beneath {
    /// The tree under `root` (a directory descriptor).
    pub fn new(root: OwnedFd, confined: bool) -> Self {
        Self { root, confined }
    }

    /// The staging directory itself.
    pub fn root(&self) -> &OwnedFd {
        &self.root
    }

    fn resolve(&self) -> ResolveFlags {
        if self.confined {
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
        } else {
            ResolveFlags::empty()
        }
    }

    /// Opens the directory `parts` (all of them, from the root), making each missing one (mode 0700 until
    /// the end, so a read-only directory of the tar can still be filled).
    pub fn dir(&self, parts: &[Vec<u8>]) -> Result<OwnedFd, MakeError> {
        let mut dir = rustix::io::fcntl_dupfd_cloexec(&self.root, 0)?;
        for part in parts {
            match rustix::fs::mkdirat(&dir, os(part), Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            dir = self.open(&dir, part, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).map_err(|e| {
                let is_link = rustix::fs::statat(&dir, os(part), rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_symlink());
                if is_link {
                    MakeError::Refused(TarRefusal::ThroughSymlink)
                } else {
                    e.into()
                }
            })?;
        }
        Ok(dir)
    }

    fn open(&self, dir: impl AsFd, name: &[u8], flags: OFlags, mode: Mode) -> Result<OwnedFd, Errno> {
        let flags = flags | OFlags::CLOEXEC | if self.confined { OFlags::NOFOLLOW } else { OFlags::empty() };
        rustix::fs::openat2(dir, os(name), flags, mode, self.resolve())
    }

    /// Creates the regular file `name` in `dir`, which must not exist yet.
    pub fn create(&self, dir: &OwnedFd, name: &[u8]) -> Result<std::fs::File, MakeError> {
        let fd = self.open(dir, name, OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL, Mode::from_raw_mode(0o600))?;
        Ok(std::fs::File::from(fd))
    }

    /// Makes the symlink `name` in `dir` (its target already checked).
    pub fn symlink(&self, dir: &OwnedFd, name: &[u8], target: &[u8]) -> Result<(), MakeError> {
        rustix::fs::symlinkat(os(target), dir, os(name)).map_err(MakeError::from)
    }

    /// Makes `name` in `dir` a hard link to the file at `target` (parts from the root).
    pub fn hard_link(&self, dir: &OwnedFd, name: &[u8], target: &[Vec<u8>]) -> Result<(), MakeError> {
        let Some((file, parents)) = target.split_last() else {
            return Err(MakeError::Refused(TarRefusal::ForeignHardLink));
        };
        let from = self.existing_dir(parents)?;
        rustix::fs::linkat(&from, os(file), dir, os(name), rustix::fs::AtFlags::empty()).map_err(MakeError::from)
    }

    /// Sets the permission bits of the directory `parts`.
    pub fn chmod_dir(&self, parts: &[Vec<u8>], mode: u32) -> Result<(), MakeError> {
        let dir = self.existing_dir(parts)?;
        rustix::fs::fchmod(&dir, Mode::from_raw_mode(mode)).map_err(MakeError::from)
    }

    /// Opens an existing directory, making nothing.
    fn existing_dir(&self, parts: &[Vec<u8>]) -> Result<OwnedFd, MakeError> {
        let mut dir = rustix::io::fcntl_dupfd_cloexec(&self.root, 0)?;
        for part in parts {
            dir = self.open(&dir, part, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty())?;
        }
        Ok(dir)
    }
}
