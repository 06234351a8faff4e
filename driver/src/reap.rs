//! The orphan reaper: no VM may outlive its supervisor.
//!
//! When a driver starts it looks at every sandbox in its state directory. A sandbox whose recorded
//! supervisor is gone (pid and start time no longer match a live process) while its VMM or watchdog still
//! runs is an orphan: the VMM and the watchdog are killed through pidfds, the cgroup is swept, and the
//! sandbox is marked terminated. This covers the double failure the lease cannot: supervisor and watchdog
//! killed together. A guest cannot be trusted to power itself off.

use std::fs;
use std::path::Path;

use vm_contract::auth::AuthBundle;
use vm_contract::layout::SandboxLayout;
use vm_contract::pids::SandboxPids;
use vm_contract::tombstone::{EndReason, Tombstone};

use crate::controls::Reaper;
use crate::{cgroup, procs};

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
pub fn reap_all(sandboxes_dir: &Path, controls: Reaper) -> Vec<Reaped> {
    if controls.no_reaper {
        return Vec::new();
    }
    let Ok(entries) = fs::read_dir(sandboxes_dir) else {
        return Vec::new();
    };
    entries.flatten().filter_map(|e| reap_one(&SandboxLayout::new(e.path()), controls)).collect()
}

/// Reaps one sandbox if its supervisor is gone. `None` when it is alive, finished, or not a sandbox.
pub fn reap_one(layout: &SandboxLayout, controls: Reaper) -> Option<Reaped> {
    if controls.no_reaper || Tombstone::exists(layout.dir()) {
        return None;
    }
    let pids = SandboxPids::read(layout.dir())?;
    if pids.supervisor.is_alive() {
        return None;
    }
    // Watchdog first, so it cannot race us; then the VMM.
    let mut vm = false;
    for record in [pids.watchdog, pids.vmm].into_iter().flatten() {
        vm |= procs::kill(&record);
    }
    let cgroup = cgroup::recorded(layout.dir()).is_some_and(|cg| cgroup::sweep(&cg, controls));
    let cgroup = end_jail(layout) || cgroup;
    let left = Leftovers { vm, cgroup };
    Tombstone::write(layout.dir(), if vm || cgroup { EndReason::OrphanReaped } else { EndReason::SupervisorGone });
    Some(Reaped { sandbox: layout.id(), left })
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
pub fn end_generation(layout: &SandboxLayout, cgroup: Option<&Path>, reason: EndReason, controls: Reaper) -> Leftovers {
    // `reap_one` sweeps the recorded cgroups itself when it reaps.
    let swept = || Leftovers { vm: false, cgroup: cgroup.is_some_and(|cg| cgroup::sweep(cg, controls)) };
    let mut left = reap_one(layout, controls).map_or_else(swept, |r| r.left);
    left.cgroup |= end_jail(layout);
    if !controls.keep_credentials {
        AuthBundle::remove(layout.dir());
    }
    Tombstone::write(layout.dir(), reason);
    left
}

/// Sweeps and removes the VMM's own cgroups and releases its uid. Returns whether anything still ran there.
fn end_jail(layout: &SandboxLayout) -> bool {
    let recorded = cgroup::limits::recorded(layout.dir());
    let found = cgroup::limits::remove(&recorded);
    crate::jail::release(layout);
    // A cgroup that would not go stays recorded, for the next reaper.
    let record = layout.path(vm_contract::layout::SandboxFile::VmmCgroups);
    let left: Vec<String> = recorded.iter().filter(|c| c.exists()).map(|c| c.display().to_string()).collect();
    let _ = if left.is_empty() { fs::remove_file(record) } else { fs::write(record, left.join("\n")) };
    found
}
