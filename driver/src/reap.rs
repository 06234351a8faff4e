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
use vm_protocol::status::{SandboxPids, AUTH_BUNDLE_FILE, PIDS_FILE};

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
    /// What was still running and had to be killed.
    pub left: Leftovers,
}

impl Reaped {
    /// Whether anything was still running.
    pub fn killed(&self) -> bool {
        self.left.vm || self.left.cgroup
    }
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
    let mut vm = false;
    for record in [pids.watchdog, pids.vmm].into_iter().flatten() {
        vm |= procs::kill(&record);
    }
    let cgroup = cgroup::recorded(dir).is_some_and(|cg| cgroup::sweep(&cg));
    let left = Leftovers { vm, cgroup };
    let reason = if vm || cgroup { "orphan reaped: supervisor gone, VM killed" } else { "supervisor gone" };
    mark_terminated(dir, reason);
    Some(Reaped { sandbox: dir.file_name()?.to_string_lossy().into_owned(), left })
}

/// What [`end_generation`] found still running and killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leftovers {
    /// A VMM or watchdog outlived the supervisor.
    pub vm: bool,
    /// Other processes were still in the cgroup.
    pub cgroup: bool,
}

/// After a supervisor ended, or failed to start: kills what it left (VMM, watchdog, anything in `cgroup`),
/// removes the auth bundle if it never read it (it holds collector credentials), and writes the tombstone.
/// Blocking: it waits on pidfds and the cgroup.
pub fn end_generation(dir: &Path, cgroup: Option<&Path>, reason: &str) -> Leftovers {
    // `reap_one` sweeps the recorded cgroup itself when it reaps.
    let left =
        reap_one(dir).map_or_else(|| Leftovers { vm: false, cgroup: cgroup.is_some_and(cgroup::sweep) }, |r| r.left);
    if !keep_credentials() {
        let _ = fs::remove_file(dir.join(AUTH_BUNDLE_FILE));
    }
    mark_terminated(dir, reason);
    left
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
fn keep_credentials() -> bool {
    vm_contract::test_control::TestControl::KeepCredentials.is_on()
}

#[cfg(not(feature = "test-controls"))]
fn keep_credentials() -> bool {
    false
}

#[cfg(feature = "test-controls")]
fn disabled() -> bool {
    vm_contract::test_control::TestControl::NoReaper.is_on()
}

#[cfg(not(feature = "test-controls"))]
fn disabled() -> bool {
    false
}
