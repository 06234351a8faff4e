//! Inherited file descriptors: QEMU keeps stdin, stdout and stderr, and nothing else.

use std::os::fd::{BorrowedFd, RawFd};

use crate::JailError;

/// Marks every open fd above 2 close-on-exec, so the exec of QEMU closes it whatever the supervisor (or
/// anything before it) leaked. Marking rather than closing leaves the directory listing's own fd alone.
pub fn close_on_exec_beyond_stdio() -> Result<(), JailError> {
    let listed: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")
        .map_err(JailError::step("list the open files"))?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    for raw in listed {
        // SAFETY: the process is single-threaded here, so an fd listed a moment ago is still open (or was the
        // listing's own, now closed: then the call fails with EBADF, which is ignored). No safe API marks an
        // fd this process did not open itself; std and rustix only take fds they can prove are owned.
        #[allow(unsafe_code)]
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        let _ = rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC);
    }
    Ok(())
}
