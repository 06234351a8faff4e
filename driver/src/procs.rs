//! Recorded processes, by pidfd: killed safely (only after checking the start time, confirmed by the pidfd),
//! and watched for their exit.

use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};
use vm_contract::pids::ProcessRecord;

/// How long to wait for a killed process to be gone.
const KILL_CONFIRM_MS: i64 = 2_000;

/// A pidfd for `record`, if that very process still exists. The start time is checked after opening, so
/// the pidfd cannot refer to a process that merely reused the pid.
fn open(record: &ProcessRecord) -> Option<OwnedFd> {
    let fd = pidfd_open(Pid::from_raw(record.pid)?, PidfdFlags::empty()).ok()?;
    record.is_alive().then_some(fd)
}

/// SIGKILLs the process `record` names, if it still exists, and waits until it is gone. Returns whether
/// it had to be killed.
pub fn kill(record: &ProcessRecord) -> bool {
    let Some(fd) = open(record) else { return false };
    let _ = pidfd_send_signal(&fd, Signal::KILL);
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let limit = Duration::from_millis(u64::try_from(KILL_CONFIRM_MS).unwrap_or(0));
    let timeout = Timespec::try_from(limit).unwrap_or(Timespec { tv_sec: 2, tv_nsec: 0 });
    let _ = poll(&mut fds, Some(&timeout));
    true
}

/// A process watched for its exit: a small thread waits on its pidfd (readable once it has exited). A thread
/// rather than the async reactor, because registering a raw descriptor with tokio is `unsafe` and a blocking
/// wait is not; the thread ends when the process does.
#[derive(Debug)]
pub struct ExitWatch(tokio::sync::watch::Receiver<bool>);

impl ExitWatch {
    /// Watches `record`, if that very process still exists.
    pub fn new(record: &ProcessRecord) -> Option<Self> {
        let fd = open(record)?;
        let (tx, rx) = tokio::sync::watch::channel(false);
        std::thread::Builder::new()
            .name("vm-driver-exit-watch".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                let mut fds = [PollFd::new(&fd, PollFlags::IN)];
                while let Err(rustix::io::Errno::INTR) = poll(&mut fds, None) {}
                let _ = tx.send(true);
            })
            .ok()?;
        Some(Self(rx))
    }

    /// Resolves when the process has exited.
    pub async fn exited(&self) {
        // The sender goes away only after saying so (or if its thread died): either way, stop waiting.
        let _ = self.0.clone().wait_for(|gone| *gone).await;
    }
}
