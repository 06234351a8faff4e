//! The orphan reaper: no VM may outlive its supervisor.
//!
//! When a driver starts it looks at every sandbox in its state directory. A sandbox whose recorded
//! supervisor is gone (pid and start time no longer match a live process) while its VMM or watchdog still
//! runs is an orphan: the VMM and the watchdog are killed through pidfds, the cgroup is swept, and the
//! sandbox is marked terminated. This covers the double failure the lease cannot: supervisor and watchdog
//! killed together. A guest cannot be trusted to power itself off.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};
use vm_protocol::status::{SandboxPids, PIDS_FILE};

use crate::{cgroup, procs};

/// Written into a sandbox directory once its main process is known to have ended.
pub const TOMBSTONE_FILE: &str = "terminated.json";

/// Why a sandbox ended, as its tombstone records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    /// What happened.
    pub reason: String,
    /// Seconds since the epoch.
    pub at_unix: u64,
}

/// What the reaper did to one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reaped {
    /// The sandbox directory's name (its id).
    pub sandbox: String,
    /// Whether a VMM or watchdog was still running and had to be killed.
    pub killed: bool,
}

/// Reaps every orphaned sandbox under `sandboxes_dir`.
pub fn reap_all(sandboxes_dir: &Path) -> Vec<Reaped> {
    if disabled() {
        return Vec::new();
    }
    let Ok(entries) = fs::read_dir(sandboxes_dir) else {
        return Vec::new();
    };
    entries.flatten().filter_map(|e| reap_one(&e.path())).collect()
}

/// Reaps one sandbox if its supervisor is gone. `None` when it is alive, finished, or not a sandbox.
pub fn reap_one(dir: &Path) -> Option<Reaped> {
    if disabled() || dir.join(TOMBSTONE_FILE).exists() {
        return None;
    }
    let pids: SandboxPids = serde_json::from_slice(&fs::read(dir.join(PIDS_FILE)).ok()?).ok()?;
    if procs::is_alive(&pids.supervisor) {
        return None;
    }
    // Watchdog first, so it cannot race us; then the VMM.
    let mut killed = false;
    for record in [pids.watchdog, pids.vmm].into_iter().flatten() {
        killed |= procs::kill(&record);
    }
    if let Some(cg) = cgroup::recorded(dir) {
        killed |= cgroup::sweep(&cg);
    }
    let reason = if killed { "orphan reaped: supervisor gone, VM killed" } else { "supervisor gone" };
    mark_terminated(dir, reason);
    Some(Reaped { sandbox: dir.file_name()?.to_string_lossy().into_owned(), killed })
}

/// Writes the tombstone.
pub fn mark_terminated(dir: &Path, reason: &str) {
    let at_unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let stone = Tombstone { reason: reason.into(), at_unix };
    if let Ok(json) = serde_json::to_vec(&stone) {
        let _ = fs::write(dir.join(TOMBSTONE_FILE), json);
    }
}

#[cfg(feature = "test-controls")]
fn disabled() -> bool {
    crate::test_controls::enabled("no-reaper")
}

#[cfg(not(feature = "test-controls"))]
fn disabled() -> bool {
    false
}
