//! Sandbox policy: which boundary operations a sandbox's clients may use. A policy is approved once, at
//! create; afterwards an operator may restrict or restore operations within it, by strictly increasing
//! revision ([`PolicyUpdate`]), never widen it. The supervisor enforces it at the boundary
//! (`vm_supervisor::policy`); `docs/policy.md` is the reference.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::identity::{RunAs, WorkloadIdentity};

pub mod network;

use self::network::{NetRule, NetworkPolicy};

/// One kind of boundary operation a client may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    /// Start a process (`Spawn`).
    Exec,
    /// Write to, or close, a process's stdin.
    Stdin,
    /// Send a process a signal.
    Signal,
    /// Resize a process's terminal.
    Resize,
    /// Take over a detached process (`Reattach`).
    Reattach,
    /// List the running processes.
    ListProcesses,
    /// Open a port forward into the guest's loopback.
    PortForward,
    /// Read files: `Read`, `List`, `Stat`, `CopyOut` ([`crate::files`]).
    FilesRead,
    /// Change files: `Write`, `MakeDir`, `Remove`, `Rename`, `CopyIn`.
    FilesWrite,
}

impl Operation {
    /// Every operation.
    pub const ALL: [Self; 9] = [
        Self::Exec,
        Self::Stdin,
        Self::Signal,
        Self::Resize,
        Self::Reattach,
        Self::ListProcesses,
        Self::PortForward,
        Self::FilesRead,
        Self::FilesWrite,
    ];

    /// Its name in policies, updates and events.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exec => "exec",
            Self::Stdin => "stdin",
            Self::Signal => "signal",
            Self::Resize => "resize",
            Self::Reattach => "reattach",
            Self::ListProcesses => "list_processes",
            Self::PortForward => "port_forward",
            Self::FilesRead => "files_read",
            Self::FilesWrite => "files_write",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Operation {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|o| o.as_str() == s).ok_or_else(|| PolicyError::UnknownOperation(bounded(s)))
    }
}

/// At most 64 characters of caller text in an error.
pub(crate) fn bounded(text: &str) -> String {
    let cut: String = text.chars().take(64).collect();
    if cut.len() < text.len() {
        format!("{cut}...")
    } else {
        cut
    }
}

/// Most programs in an exec allow-list.
pub const MAX_PROGRAMS: usize = 256;
/// Longest program name in an exec allow-list, bytes.
pub const MAX_PROGRAM_BYTES: usize = 4096;
/// Largest policy document, bytes.
pub const MAX_POLICY_BYTES: usize = 256 * 1024;
/// The highest `caps.max_processes`, and the supervisor's own bound on a sandbox's processes.
pub const MAX_PROCESSES_CAP: u32 = 256;

/// Why a policy or an update is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// Not a policy document.
    #[error("the policy is not valid JSON of the documented shape: {0}")]
    Malformed(String),
    /// An operation name nobody knows.
    #[error("unknown operation {0:?} (exec, stdin, signal, resize, reattach, list_processes, port_forward, files_read, files_write)")]
    UnknownOperation(String),
    /// An exec allow-list without exec.
    #[error("exec_programs is given but exec is not allowed")]
    ProgramsWithoutExec,
    /// An empty, oversized or NUL-holding program name, or too many.
    #[error("exec_programs: at most {MAX_PROGRAMS} names, each 1 to {MAX_PROGRAM_BYTES} bytes without NUL")]
    BadProgram,
    /// Larger than [`MAX_POLICY_BYTES`].
    #[error("the policy is larger than {MAX_POLICY_BYTES} bytes")]
    TooLarge,
    /// `run_as` selects a user or group other than the VM driver's fixed workload identity.
    #[error("run_as.{0} conflicts with the fixed workload identity (user and group sandbox, 1000:1000)")]
    IdentityConflict(&'static str),
    /// A resource cap out of range.
    #[error("caps.max_processes must be 1 to {MAX_PROCESSES_CAP}")]
    BadCap,
    /// The `network` section is not valid.
    #[error("network: {0}")]
    BadNetwork(String),
}

/// The policy approved at create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxPolicy {
    /// The approved operations: the most any later revision may allow. Absent, the default policy's:
    /// every operation (a policy of only `network` rules, say, restricts nothing else).
    #[serde(default = "every_operation")]
    pub allow: BTreeSet<Operation>,
    /// When given, `exec` only of these programs: `argv[0]` exactly as the client sends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_programs: Option<Vec<String>>,
    /// Who workloads run as: when given, it must select the fixed workload identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<RunAs>,
    /// Resource caps, enforced by the supervisor at the boundary.
    #[serde(default, skip_serializing_if = "Caps::is_empty")]
    pub caps: Caps,
    /// What connections may reach; none at all without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
}

/// Resource caps of a policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Caps {
    /// Most workload processes running at once; a further `exec` is denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_processes: Option<u32>,
}

impl Caps {
    fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What an absent `allow` approves: every operation, as no policy at all does.
fn every_operation() -> BTreeSet<Operation> {
    Operation::ALL.into_iter().collect()
}

impl Default for SandboxPolicy {
    /// Every operation, any program, no caps, no network: what a sandbox without a policy gets.
    fn default() -> Self {
        Self { allow: every_operation(), exec_programs: None, run_as: None, caps: Caps::default(), network: None }
    }
}

impl SandboxPolicy {
    /// Parses and validates a policy document (JSON) against the workload identity the VM driver fixes.
    ///
    /// # Errors
    /// [`PolicyError`], saying what is wrong.
    pub fn parse(text: &str, identity: &WorkloadIdentity) -> Result<Self, PolicyError> {
        if text.len() > MAX_POLICY_BYTES {
            return Err(PolicyError::TooLarge);
        }
        let policy: Self = serde_json::from_str(text).map_err(|e| match e.to_string() {
            // serde names the unknown variant; say it our way.
            m if m.contains("unknown variant") => {
                PolicyError::UnknownOperation(bounded(m.split('`').nth(1).unwrap_or_default()))
            }
            m => PolicyError::Malformed(bounded(&m)),
        })?;
        policy.validate(identity)?;
        Ok(policy)
    }

    /// Checks the rules [`SandboxPolicy::parse`] applies.
    ///
    /// # Errors
    /// [`PolicyError`].
    pub fn validate(&self, identity: &WorkloadIdentity) -> Result<(), PolicyError> {
        if let Some(part) = self.run_as.as_ref().and_then(|r| r.conflict(identity)) {
            return Err(PolicyError::IdentityConflict(part));
        }
        if self.caps.max_processes.is_some_and(|n| n == 0 || n > MAX_PROCESSES_CAP) {
            return Err(PolicyError::BadCap);
        }
        if let Some(network) = &self.network {
            network.validate()?;
        }
        if let Some(programs) = &self.exec_programs {
            if !self.allow.contains(&Operation::Exec) {
                return Err(PolicyError::ProgramsWithoutExec);
            }
            let bad = |p: &String| p.is_empty() || p.len() > MAX_PROGRAM_BYTES || p.contains('\0');
            if programs.len() > MAX_PROGRAMS || programs.iter().any(bad) {
                return Err(PolicyError::BadProgram);
            }
        }
        Ok(())
    }

    /// The document [`SandboxPolicy::parse`] reads back.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// A live restriction or restoration: the operations allowed from now on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyUpdate {
    /// Must be greater than every revision applied before.
    pub revision: u64,
    /// The operations allowed from now on (a subset of the approved ones).
    #[serde(deserialize_with = "crate::message::seq_deserialize")]
    pub allow: Vec<Operation>,
    /// When given, must select the fixed workload identity, as at create.
    pub run_as: Option<RunAs>,
    /// The network rules allowed from now on, each one of the approved rules; `None` allows every approved
    /// rule. Each update states the whole state, as `allow` does.
    #[serde(default, deserialize_with = "seq_option")]
    pub network: Option<Vec<NetRule>>,
}

/// An optional list, bounded as [`crate::message::seq_deserialize`] bounds lists.
fn seq_option<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<NetRule>>, D::Error> {
    #[derive(Deserialize)]
    struct Bounded(#[serde(deserialize_with = "crate::message::seq_deserialize")] Vec<NetRule>);
    Ok(Option::<Bounded>::deserialize(d)?.map(|b| b.0))
}

/// What became of a [`PolicyUpdate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateOutcome {
    /// Applied: these operations are allowed from the next one admitted.
    Applied,
    /// Its revision was not above the last applied one: admission is closed until a newer valid update.
    Stale,
    /// It allowed an operation or a network rule that was never approved: admission is closed until a newer
    /// valid update.
    NotApproved,
    /// Its `run_as` selects someone other than the fixed workload identity: admission is closed until a newer
    /// valid update.
    IdentityConflict,
}

impl UpdateOutcome {
    /// Fixed text for events and errors.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Stale => "refused: the revision is not above the last applied one; admission closed",
            Self::NotApproved => "refused: it allows an operation or network rule never approved; admission closed",
            Self::IdentityConflict => {
                "refused: its run_as conflicts with the fixed workload identity; admission closed"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::identity::{IdSelector, WORKLOAD};

    fn parse(text: &str) -> Result<SandboxPolicy, PolicyError> {
        SandboxPolicy::parse(text, &WORKLOAD)
    }

    #[test]
    fn identity_selectors_and_caps_are_checked() {
        let p = parse(r#"{"allow":["exec"],"run_as":{"user":"sandbox","group":"1000"},"caps":{"max_processes":2}}"#);
        let p = p.unwrap();
        assert_eq!(p.caps.max_processes, Some(2));
        assert_eq!(p.run_as.as_ref().and_then(|r| r.user.clone()), Some(IdSelector("sandbox".into())));
        assert_eq!(parse(&p.to_json()).unwrap(), p);
        assert_eq!(parse(r#"{"allow":["exec"],"run_as":{"user":"root"}}"#), Err(PolicyError::IdentityConflict("user")));
        assert_eq!(parse(r#"{"allow":["exec"],"run_as":{"group":"0"}}"#), Err(PolicyError::IdentityConflict("group")));
        assert_eq!(parse(r#"{"allow":["exec"],"caps":{"max_processes":0}}"#), Err(PolicyError::BadCap));
        assert_eq!(parse(r#"{"allow":["exec"],"caps":{"max_processes":257}}"#), Err(PolicyError::BadCap));
        assert!(matches!(parse(r#"{"allow":[],"caps":{"cpu":1}}"#), Err(PolicyError::Malformed(_))));
        assert!(matches!(parse(r#"{"allow":[],"run_as":{"uid":0}}"#), Err(PolicyError::Malformed(_))));
    }

    #[test]
    fn an_absent_allow_approves_every_operation_as_no_policy_does() {
        // docs/network.md's example: rules alone.
        let p = parse(r#"{"network":{"allow":[{"host":"pypi.org","ports":[443]}]}}"#).unwrap();
        assert_eq!(p.allow, SandboxPolicy::default().allow);
        assert!(p.network.is_some());
        assert_eq!(parse(&p.to_json()).unwrap(), p);
        assert_eq!(parse("{}").unwrap(), SandboxPolicy::default());
        // An allow-list of programs needs exec, which the default set has.
        assert!(parse(r#"{"exec_programs":["/bin/echo"]}"#).unwrap().allow.contains(&Operation::Exec));
        // Given, even empty, it is what is approved.
        assert!(parse(r#"{"allow":[],"network":{"allow":[]}}"#).unwrap().allow.is_empty());
        // Unknown fields are still refused.
        assert!(matches!(parse(r#"{"network":{"allow":[]},"alow":["exec"]}"#), Err(PolicyError::Malformed(_))));
    }

    #[test]
    fn policies_parse_validate_and_round_trip() {
        let p = parse(r#"{"allow":["exec","list_processes"],"exec_programs":["/bin/echo"]}"#).unwrap();
        assert_eq!(p.allow.len(), 2);
        assert_eq!(parse(&p.to_json()).unwrap(), p);
        assert_eq!(parse(&SandboxPolicy::default().to_json()).unwrap(), SandboxPolicy::default());
        assert_eq!(parse(r#"{"allow":["fly"]}"#), Err(PolicyError::UnknownOperation("fly".into())));
        assert_eq!(parse(r#"{"allow":["stdin"],"exec_programs":["x"]}"#), Err(PolicyError::ProgramsWithoutExec));
        assert_eq!(parse(r#"{"allow":["exec"],"exec_programs":[""]}"#), Err(PolicyError::BadProgram));
        assert!(matches!(parse(r#"{"allow":[],"extra":1}"#), Err(PolicyError::Malformed(_))));
        assert!(matches!(parse("not json"), Err(PolicyError::Malformed(_))));
        assert_eq!("list_processes".parse::<Operation>(), Ok(Operation::ListProcesses));
    }
}
