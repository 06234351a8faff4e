//! The pool as `ListPool` shows it (made into the API's message in `service::api`).

use vm_contract::ids::SandboxId;

use super::{Pool, PoolTarget, SlotState};

/// One pooled VM, as `ListPool` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PooledView {
    /// The slot's id.
    pub slot: SandboxId,
    /// Its target's shape and image name.
    pub target: PoolTarget,
    /// `booting`, `ready` or `claiming`.
    pub state: &'static str,
    /// Its supervisor's pid.
    pub supervisor_pid: u32,
    /// Its VMM's pid, once ready.
    pub vmm_pid: u32,
}

/// The pool as `ListPool` shows it: every pooled VM by slot, and the targets configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolListing {
    /// The pooled VMs.
    pub vms: Vec<PooledView>,
    /// The targets.
    pub targets: Vec<PoolTarget>,
}

impl Pool {
    /// The pool as `ListPool` shows it.
    pub fn list(&self) -> PoolListing {
        let state = self.lock();
        let vms = state
            .slots
            .iter()
            .map(|s| {
                let (label, vmm_pid) = match s.state {
                    SlotState::Booting => ("booting", 0),
                    SlotState::Ready { vmm_pid } => ("ready", vmm_pid),
                    SlotState::Claiming => ("claiming", 0),
                };
                let target = state.targets[s.target].config.clone();
                PooledView { slot: s.id.clone(), target, state: label, supervisor_pid: s.supervisor_pid, vmm_pid }
            })
            .collect();
        PoolListing { vms, targets: state.targets.iter().map(|t| t.config.clone()).collect() }
    }
}
