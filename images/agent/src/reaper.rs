//! Reaps every child, including orphans re-parented to PID 1, and routes exit statuses to the table.
//!
//! It peeks with `waitid(WNOWAIT)` and reaps only while holding the table lock. `process::spawn` holds that
//! lock across `spawn::spawn` (which itself reaps a child whose `exec` failed), so a status is never taken
//! from under it and never lost for a child not yet registered.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use vm_protocol::ExitStatus;

use crate::link::Shared;

/// How long to sleep when there are no children before looking again (spawns wake it earlier).
const IDLE_RECHECK_MS: u64 = 1000;

pub(crate) fn run(shared: &Arc<Shared>) {
    while !shared.ended.load(Ordering::Acquire) {
        let spawned_before = shared.table().spawned;
        match waitid(Id::All, WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
            Ok(peeked) => {
                let Some(pid) = peeked.pid() else { continue };
                let mut table = shared.table();
                if shared.ended.load(Ordering::Acquire) {
                    return;
                }
                let status = match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(_, code)) => ExitStatus::Code(code),
                    Ok(WaitStatus::Signaled(_, signal, _)) => ExitStatus::Signaled(signal as i32),
                    // Already reaped by `spawn::spawn` (failed exec) or not finished after all.
                    _ => continue,
                };
                let exited = table.reaped(pid, status);
                drop(table);
                shared.finish(exited);
            }
            Err(Errno::ECHILD) => {
                let table = shared.table();
                // Sleep only if no spawn happened since we looked; otherwise its wakeup is already gone.
                if table.spawned == spawned_before {
                    let _unused = shared
                        .children
                        .wait_timeout(table, Duration::from_millis(IDLE_RECHECK_MS))
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            }
            Err(_) => {}
        }
    }
}
