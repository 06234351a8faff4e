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

/// A process watched for its exit. A small thread waits on its pidfd (readable once it has exited) rather than
/// the async reactor: registering a descriptor with tokio is `unsafe` (`AsyncFd::register`), a blocking wait
/// is not. The thread ends when the process does.
#[derive(Debug)]
pub enum ExitWatch {
    /// Still running when the watch began; the flag turns true when it exits.
    Running(tokio::sync::watch::Receiver<bool>),
    /// Already gone when the watch began (or its record was unreadable, which means the same).
    Gone,
    /// No thread could be started: nothing can be told.
    Unwatched,
}

impl ExitWatch {
    /// Watches `record`'s process; `None` is a process whose record could not be read, which is gone.
    pub fn new(record: Option<&ProcessRecord>) -> Self {
        let Some(record) = record else { return Self::Gone };
        let Some(pid) = Pid::from_raw(record.pid) else { return Self::Gone };
        let fd = match pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) if record.is_alive() => fd,
            Ok(_) | Err(rustix::io::Errno::SRCH) => return Self::Gone,
            // Out of descriptors, say: that says nothing about the process.
            Err(_) => return Self::unwatched(),
        };
        let (tx, rx) = tokio::sync::watch::channel(false);
        let spawned =
            std::thread::Builder::new().name("vm-driver-exit-watch".into()).stack_size(64 * 1024).spawn(move || {
                let mut fds = [PollFd::new(&fd, PollFlags::IN)];
                loop {
                    match poll(&mut fds, None) {
                        Ok(_) => {
                            let _ = tx.send(true);
                            return;
                        }
                        Err(rustix::io::Errno::INTR) => {}
                        Err(rustix::io::Errno::NOMEM) => std::thread::sleep(Duration::from_millis(10)),
                        // Nothing can be told: end without saying the process exited.
                        Err(_) => return,
                    }
                }
            });
        match spawned {
            Ok(_) => Self::Running(rx),
            Err(_) => Self::unwatched(),
        }
    }

    /// Not watched (the `no-vmm-watch` control, or a watch that could not be set up).
    pub fn unwatched() -> Self {
        tracing::warn!("the VMM is not watched; a hung supervisor will go unnoticed");
        Self::Unwatched
    }

    /// Resolves when the process has exited.
    pub async fn exited(&self) {
        match self {
            Self::Running(rx) => {
                // A sender gone without saying so is a watch that failed: nothing can be told.
                if rx.clone().wait_for(|gone| *gone).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            Self::Gone => {}
            Self::Unwatched => std::future::pending().await,
        }
    }
}
