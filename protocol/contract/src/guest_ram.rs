//! A guest's RAM handed down as a memfd (templates, `docs/templates.md`): the driver holds it, and each
//! process below reopens it through its parent's `/proc/PID/fd/N` (no descriptor is ever inherited, so no
//! other child of the driver or the supervisor holds it); the jailer hands it to QEMU, which maps it as
//! `mem-path=/proc/self/fd/N`.
//!
//! - **Shared** (a template being saved): QEMU writes the guest's RAM through into the memfd, which the driver
//!   then keeps as the template's `ram`.
//! - **Private** (a clone): the memfd holds the template's RAM and is sealed against every write and size
//!   change ([`SEALS`]); QEMU maps it private, so the clone's writes are its own pages, and every clone of one
//!   memfd shares its clean ones.

use std::fs::File;

use rustix::fs::SealFlags;

/// The seals a template's memfd carries: no write, no size change, no change of seals.
pub const SEALS: SealFlags = SealFlags::WRITE.union(SealFlags::SHRINK).union(SealFlags::GROW).union(SealFlags::SEAL);

/// How a VM maps its RAM memfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RamUse {
    /// Written through (`share=on`): a template being saved.
    Shared,
    /// Mapped copy-on-write (`share=off`) from a sealed memfd: a clone.
    Private,
}

impl RamUse {
    /// QEMU's `share=` value.
    pub const fn share(self) -> &'static str {
        match self {
            Self::Shared => "on",
            Self::Private => "off",
        }
    }
}

/// Why a RAM memfd was refused. Fixed text.
#[derive(Debug, thiserror::Error)]
pub enum RamError {
    /// The parent's descriptor could not be reopened.
    #[error("cannot reopen the guest RAM memfd from the parent")]
    Open(#[source] std::io::Error),
    /// Not a memfd, or not of the guest's size.
    #[error("the guest RAM descriptor is not a memfd of the guest's size")]
    NotRam,
    /// A clone's memfd that is not sealed against writes, or a saver's that is.
    #[error("the guest RAM memfd's seals do not fit its use")]
    Seals,
}

/// Reopens (read-only, close-on-exec) the memfd this process's parent holds at `fd`, and checks it is one of
/// `bytes` bytes, sealed as `usage` needs. The parent is alive while its child waits on it (the driver's
/// liveness pipe, the supervisor's wait for its jailer); a parent gone meanwhile leaves a descriptor that is
/// not a memfd of this size, or no descriptor.
///
/// # Errors
/// [`RamError`].
pub fn reopen_from_parent(fd: u32, bytes: u64, usage: RamUse) -> Result<File, RamError> {
    let parent = rustix::process::getppid().ok_or(RamError::NotRam)?;
    let link = format!("/proc/{}/fd/{fd}", parent.as_raw_nonzero());
    let target = std::fs::read_link(&link).map_err(RamError::Open)?;
    if !target.as_os_str().as_encoded_bytes().starts_with(b"/memfd:") {
        return Err(RamError::NotRam);
    }
    let file = File::open(&link).map_err(RamError::Open)?;
    check(&file, bytes, usage)?;
    Ok(file)
}

/// Whether `file` is a guest RAM memfd of `bytes` bytes, sealed as `usage` needs: a clone's against every
/// write and size change, a saver's open to writes.
///
/// # Errors
/// [`RamError::NotRam`], [`RamError::Seals`].
pub fn check(file: &File, bytes: u64, usage: RamUse) -> Result<(), RamError> {
    let meta = file.metadata().map_err(RamError::Open)?;
    if !meta.file_type().is_file() || meta.len() != bytes {
        return Err(RamError::NotRam);
    }
    let seals = rustix::fs::fcntl_get_seals(file).map_err(|_| RamError::NotRam)?;
    let fits = match usage {
        RamUse::Private => seals.contains(SEALS),
        RamUse::Shared => !seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE),
    };
    if fits {
        Ok(())
    } else {
        Err(RamError::Seals)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::MemfdFlags;

    fn memfd(bytes: u64, seals: SealFlags) -> File {
        let fd = rustix::fs::memfd_create("t", MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, bytes).unwrap();
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        File::from(fd)
    }

    #[test]
    fn a_clone_takes_only_a_sealed_memfd_of_its_size_and_a_saver_only_a_writable_one() {
        let sealed = memfd(1 << 20, SEALS);
        assert!(check(&sealed, 1 << 20, RamUse::Private).is_ok());
        assert!(matches!(check(&sealed, 2 << 20, RamUse::Private), Err(RamError::NotRam)));
        assert!(matches!(check(&sealed, 1 << 20, RamUse::Shared), Err(RamError::Seals)));
        // Control: a memfd whose writes any holder could make (no seal, or only some) is no clone's RAM.
        let open = memfd(1 << 20, SealFlags::empty());
        assert!(matches!(check(&open, 1 << 20, RamUse::Private), Err(RamError::Seals)));
        assert!(check(&open, 1 << 20, RamUse::Shared).is_ok());
        let resizable = memfd(1 << 20, SealFlags::WRITE);
        assert!(matches!(check(&resizable, 1 << 20, RamUse::Private), Err(RamError::Seals)));
        let file = File::open("/proc/self/exe").unwrap();
        assert!(check(&file, 1 << 20, RamUse::Private).is_err(), "a file that is not a memfd");
    }
}
