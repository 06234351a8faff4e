//! File descriptors: QEMU keeps stdin, stdout and stderr, and of the rest only the snapshot and the guest RAM
//! memfd the jailer opened for it.

use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use crate::JailError;

/// Marks every inherited fd above 2 close-on-exec, so the exec of QEMU closes it whatever the supervisor (or
/// anything before it) leaked, and returns them: each stays open (and its number taken) until [`close`].
/// Marking rather than closing leaves the directory listing's own fd alone.
pub fn close_on_exec_beyond_stdio() -> Result<Vec<RawFd>, JailError> {
    let listed: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
        .map_err(JailError::step("list the open files"))?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    let inherited = listed.into_iter().filter(|&raw| {
        // SAFETY: the process is single-threaded here, so an fd listed a moment ago is still open, or was the
        // listing's own, now closed: then the call fails with EBADF and the number is left out. No safe API
        // marks an fd this process did not open itself; std and rustix only take fds they can prove are owned.
        #[allow(unsafe_code)]
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC).is_ok()
    });
    Ok(inherited.collect())
}

/// Closes `inherited` (from [`close_on_exec_beyond_stdio`]) in the jailer that stays QEMU's parent and never
/// execs: close-on-exec alone would leave them open there.
pub fn close(inherited: &[RawFd]) {
    for &raw in inherited {
        // SAFETY: single-threaded; each number was open when listed and nothing closed it since, so no fd the
        // jailer opened itself can have the same number, and no object of the jailer's owns it. Taking
        // ownership here is the only way to close it (see above on safe APIs).
        #[allow(unsafe_code)]
        drop(unsafe { OwnedFd::from_raw_fd(raw) });
    }
}

/// Opens `path` read-only for QEMU to inherit (not close-on-exec). The jailer that stays QEMU's parent
/// drops it ([`crate::pidns::split`]): only QEMU holds the snapshot.
pub fn open_for_exec(path: &Path) -> Result<OwnedFd, JailError> {
    let file = std::fs::File::open(path).map_err(JailError::step("open the snapshot"))?;
    rustix::io::fcntl_setfd(&file, rustix::io::FdFlags::empty())
        .map_err(|e| JailError::step("pass the snapshot to QEMU")(e.into()))?;
    Ok(file.into())
}

/// The guest's RAM memfd, reopened for QEMU to inherit, and the memory backend that names it.
pub struct GuestRam {
    /// Open across QEMU's exec.
    pub fd: OwnedFd,
    /// QEMU's `-object` (the machine names it as `memory-backend=mem`).
    pub backend: String,
}

/// Reopens the supervisor's guest RAM memfd (`--guest-ram-fd`), checked for its size and seals
/// ([`vm_contract::guest_ram::reopen_from_parent`]), for QEMU to inherit: a sealed one is mapped private.
pub fn guest_ram(args: &vm_contract::jail::JailerArgs) -> Result<Option<GuestRam>, JailError> {
    use vm_contract::guest_ram::{reopen_from_parent, RamUse};
    let (Some(fd), Some(mib)) = (args.guest_ram_fd, args.guest_ram_mib) else { return Ok(None) };
    let usage = if args.guest_ram_private { RamUse::Private } else { RamUse::Shared };
    let file = reopen_from_parent(fd, u64::from(mib) << 20, usage)?;
    rustix::io::fcntl_setfd(&file, rustix::io::FdFlags::empty())
        .map_err(|e| JailError::step("pass the guest's RAM to QEMU")(e.into()))?;
    let fd = OwnedFd::from(file);
    let backend = format!(
        "memory-backend-file,id=mem,size={mib}M,mem-path=/proc/self/fd/{},share={}",
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        usage.share()
    );
    Ok(Some(GuestRam { fd, backend }))
}
