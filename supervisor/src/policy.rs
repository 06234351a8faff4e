//! The policy gate: the one place a client's boundary operation is admitted or denied.
//!
//! The gate lives inside the multiplexer, which the event loop drives one message at a time, so a live update
//! and the operations around it are serialized: every operation admitted before the update has already been
//! dispatched to the guest when the update is applied (and so when it is acknowledged), and every operation
//! handled after it, including those that were queued while it arrived, is judged by the new state.
//!
//! Rules (`docs/policy.md`): an update may allow only operations of the approved policy; its revision must be
//! above the last applied one; its `run_as`, if any, must select the fixed workload identity; a stale,
//! widening or conflicting update is refused and closes admission (every operation denied) until a newer
//! valid update arrives. The approved caps (`max_processes`) hold at every revision.

use std::collections::BTreeSet;

use vm_protocol::identity::WorkloadIdentity;
use vm_protocol::policy::network::{NetRule, DEFAULT_MAX_CONNECTIONS};
use vm_protocol::policy::{Operation, PolicyUpdate, SandboxPolicy, UpdateOutcome};
use vm_protocol::Spawn;

/// Why an operation was denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// The current revision does not allow it.
    NotAllowed,
    /// `exec` of a program outside the approved allow-list.
    ProgramNotAllowed,
    /// Admission is closed by a stale or invalid update.
    Closed,
    /// Under an exec allow-list, a spawn that sets `PATH` or an `LD_*` variable (either would choose the code
    /// that runs, whatever `argv[0]` says).
    LookupOverride,
    /// `exec` with `caps.max_processes` processes running.
    ProcessCap,
}

impl Denial {
    /// Fixed text for findings.
    pub fn describe(self) -> &'static str {
        match self {
            Self::NotAllowed => "not allowed by the current policy revision",
            Self::ProgramNotAllowed => "the program is not in the policy's exec allow-list",
            Self::Closed => "admission is closed by a stale or invalid policy update",
            Self::LookupOverride => "under an exec allow-list a spawn may not set PATH or LD_* variables",
            Self::ProcessCap => "the policy's max_processes are running",
        }
    }
}

/// The approved policy and the state of its live restrictions.
#[derive(Debug, Clone)]
pub struct Gate {
    approved: SandboxPolicy,
    identity: WorkloadIdentity,
    allowed: BTreeSet<Operation>,
    /// The network rules allowed now: a subset of the approved ones.
    net_allowed: Vec<NetRule>,
    revision: u64,
    open: bool,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new(SandboxPolicy::default(), vm_protocol::identity::WORKLOAD)
    }
}

impl Gate {
    /// Starts at revision 0 with everything approved allowed; `identity` is the fixed workload identity that
    /// every update's `run_as` must select.
    pub fn new(approved: SandboxPolicy, identity: WorkloadIdentity) -> Self {
        let net_allowed = approved.network.as_ref().map(|n| n.allow.clone()).unwrap_or_default();
        Self { allowed: approved.allow.clone(), net_allowed, approved, identity, revision: 0, open: true }
    }

    /// The last applied revision.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Admits `op` (for `exec`, of `program`, the `argv[0]` asked for), or says why not.
    ///
    /// # Errors
    /// The [`Denial`].
    pub fn admit(&self, op: Operation, program: Option<&str>) -> Result<(), Denial> {
        if !self.open {
            return Err(Denial::Closed);
        }
        if !self.allowed.contains(&op) {
            return Err(Denial::NotAllowed);
        }
        match (&self.approved.exec_programs, program) {
            (Some(list), Some(p)) if op == Operation::Exec && !list.iter().any(|l| l == p) => {
                Err(Denial::ProgramNotAllowed)
            }
            _ => Ok(()),
        }
    }

    /// Admits a spawn: `exec`, of an allowed program, under an allow-list without environment that would
    /// change which code runs, and with fewer than `max_processes` of the sandbox's processes `running`.
    ///
    /// # Errors
    /// The [`Denial`].
    pub fn admit_spawn(&self, spawn: &Spawn, running: usize) -> Result<(), Denial> {
        self.admit(Operation::Exec, spawn.argv.first().map(String::as_str))?;
        let overrides = spawn.env.iter().any(|e| e.key == "PATH" || e.key.starts_with("LD_"));
        if self.approved.exec_programs.is_some() && overrides {
            return Err(Denial::LookupOverride);
        }
        self.within_process_cap(running)
    }

    /// Admits `op`, a file operation, which runs as a process of the sandbox: within `max_processes`.
    ///
    /// # Errors
    /// The [`Denial`].
    pub fn admit_counted(&self, op: Operation, running: usize) -> Result<(), Denial> {
        self.admit(op, None)?;
        self.within_process_cap(running)
    }

    fn within_process_cap(&self, running: usize) -> Result<(), Denial> {
        if self.approved.caps.max_processes.is_some_and(|cap| running >= cap as usize) {
            return Err(Denial::ProcessCap);
        }
        Ok(())
    }

    /// Applies `update`, or refuses it and closes admission.
    pub fn update(&mut self, update: &PolicyUpdate) -> UpdateOutcome {
        let outcome = if update.revision <= self.revision {
            UpdateOutcome::Stale
        } else if update.allow.iter().any(|op| !self.approved.allow.contains(op))
            || update.network.as_ref().is_some_and(|rules| rules.iter().any(|r| !self.approved_rule(r)))
        {
            UpdateOutcome::NotApproved
        } else if update.run_as.as_ref().is_some_and(|r| r.conflict(&self.identity).is_some()) {
            UpdateOutcome::IdentityConflict
        } else {
            self.net_allowed = match &update.network {
                Some(rules) => rules.clone(),
                None => self.approved.network.as_ref().map(|n| n.allow.clone()).unwrap_or_default(),
            };
            self.allowed = update.allow.iter().copied().collect();
            self.revision = update.revision;
            UpdateOutcome::Applied
        };
        self.open = outcome == UpdateOutcome::Applied;
        outcome
    }

    fn approved_rule(&self, rule: &NetRule) -> bool {
        self.approved.network.as_ref().is_some_and(|n| n.allow.contains(rule))
    }

    /// What connections may reach now: nothing while admission is closed.
    pub fn network(&self) -> NetView {
        NetView {
            rules: if self.open { self.net_allowed.clone() } else { Vec::new() },
            revision: self.revision,
            max_connections: self.approved.network.as_ref().map_or(DEFAULT_MAX_CONNECTIONS, |n| n.connection_cap()),
        }
    }

    /// Whether the approved policy has a network section (the workload then gets the proxy settings).
    pub fn has_network(&self) -> bool {
        self.approved.network.is_some()
    }

    /// The operations allowed now, for events.
    pub fn allowed(&self) -> String {
        let names: Vec<&str> = self.allowed.iter().map(|o| o.as_str()).collect();
        if names.is_empty() {
            "nothing".to_owned()
        } else {
            names.join(", ")
        }
    }
}

/// The network half of the gate at one revision, as the egress tasks read it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetView {
    /// The rules in force (empty: no egress).
    pub rules: Vec<NetRule>,
    /// The revision they belong to.
    pub revision: u64,
    /// The approved connection cap (the default without a network section: port forwards count against it).
    pub max_connections: u32,
}

impl NetView {
    /// The first rule that covers `host` (normalized) and `port`.
    pub fn rule_for(&self, host: &str, port: u16) -> Option<&NetRule> {
        self.rules.iter().find(|r| r.covers(host, port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use vm_protocol::identity::{IdSelector, RunAs, WORKLOAD};

    fn update(revision: u64, allow: &[Operation]) -> PolicyUpdate {
        PolicyUpdate { revision, allow: allow.to_vec(), run_as: None, network: None }
    }

    fn spawn_with_env(key: &str) -> Spawn {
        Spawn {
            id: vm_protocol::ProcId(1),
            argv: vec!["echo".into()],
            env: vec![vm_protocol::message::EnvVar { key: key.into(), value: "/tmp".into() }],
            cwd: None,
            pty: None,
            output_window: 1,
            rlimits: Vec::new(),
            root: None,
        }
    }

    #[test]
    fn restricts_and_restores_within_the_approved_and_closes_on_stale_or_wider() {
        let approved = SandboxPolicy {
            allow: [Operation::Exec, Operation::ListProcesses].into_iter().collect(),
            exec_programs: Some(vec!["echo".into()]),
            ..SandboxPolicy::default()
        };
        let mut gate = Gate::new(approved, WORKLOAD);
        assert_eq!(gate.admit(Operation::Exec, Some("echo")), Ok(()));
        assert_eq!(gate.admit(Operation::Exec, Some("sh")), Err(Denial::ProgramNotAllowed));
        assert_eq!(gate.admit(Operation::Signal, None), Err(Denial::NotAllowed));
        assert_eq!(gate.update(&update(1, &[Operation::ListProcesses])), UpdateOutcome::Applied);
        assert_eq!(gate.admit(Operation::Exec, Some("echo")), Err(Denial::NotAllowed));
        assert_eq!(gate.update(&update(2, &[Operation::Exec])), UpdateOutcome::Applied);
        assert_eq!(gate.admit(Operation::Exec, Some("echo")), Ok(()));
        // Widening past the approved policy: refused, and everything is denied until a valid newer revision.
        assert_eq!(gate.update(&update(3, &[Operation::Exec, Operation::Signal])), UpdateOutcome::NotApproved);
        assert_eq!(gate.admit(Operation::Exec, Some("echo")), Err(Denial::Closed));
        assert_eq!(gate.update(&update(3, &[Operation::Exec])), UpdateOutcome::Applied, "3 was never applied");
        assert_eq!(gate.update(&update(3, &[Operation::Exec])), UpdateOutcome::Stale);
        assert_eq!(gate.admit(Operation::ListProcesses, None), Err(Denial::Closed));
        assert_eq!(gate.update(&update(4, &[Operation::ListProcesses])), UpdateOutcome::Applied);
        assert_eq!(gate.admit(Operation::ListProcesses, None), Ok(()));
        assert_eq!(gate.revision(), 4);
    }

    #[test]
    fn an_allow_list_refuses_environment_that_picks_the_code() {
        let approved = SandboxPolicy {
            allow: [Operation::Exec].into_iter().collect(),
            exec_programs: Some(vec!["echo".into()]),
            ..SandboxPolicy::default()
        };
        let gate = Gate::new(approved, WORKLOAD);
        assert_eq!(gate.admit_spawn(&spawn_with_env("HOME"), 0), Ok(()));
        assert_eq!(gate.admit_spawn(&spawn_with_env("PATH"), 0), Err(Denial::LookupOverride));
        assert_eq!(gate.admit_spawn(&spawn_with_env("LD_PRELOAD"), 0), Err(Denial::LookupOverride));
        assert_eq!(Gate::default().admit_spawn(&spawn_with_env("PATH"), 0), Ok(()), "no allow-list, no restriction");
    }

    #[test]
    fn a_conflicting_identity_closes_admission_and_the_process_cap_holds() {
        let mut approved = SandboxPolicy::default();
        approved.caps.max_processes = Some(2);
        let mut gate = Gate::new(approved, WORKLOAD);
        assert_eq!(gate.admit_spawn(&spawn_with_env("HOME"), 1), Ok(()));
        assert_eq!(gate.admit_spawn(&spawn_with_env("HOME"), 2), Err(Denial::ProcessCap));
        let root = RunAs { user: Some(IdSelector("root".into())), group: None };
        let conflicting = PolicyUpdate { run_as: Some(root), ..update(1, &[Operation::Exec]) };
        assert_eq!(gate.update(&conflicting), UpdateOutcome::IdentityConflict);
        assert_eq!(gate.admit_spawn(&spawn_with_env("HOME"), 0), Err(Denial::Closed));
        let naming_it = RunAs { user: Some(IdSelector("sandbox".into())), group: Some(IdSelector("1000".into())) };
        assert_eq!(
            gate.update(&PolicyUpdate { run_as: Some(naming_it), ..update(2, &[Operation::Exec]) }),
            UpdateOutcome::Applied
        );
        assert_eq!(gate.admit_spawn(&spawn_with_env("HOME"), 0), Ok(()));
    }
}
