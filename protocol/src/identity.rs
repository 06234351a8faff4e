//! The workload identity: the user and group every workload process runs as in the guest.
//!
//! The VM driver fixes it; nothing a client sends chooses it. The guest image defines it (`/etc/passwd`,
//! `/etc/group`), the agent makes its home at boot and applies it to every process it starts, and a sandbox
//! policy may name it (`run_as`) but never select another: a conflicting selector is refused at create, at
//! the supervisor's start and in every live update (`docs/policy.md`).

use serde::{Deserialize, Serialize};

/// A user and group in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadIdentity {
    /// The user's and the group's name.
    pub name: &'static str,
    /// The uid.
    pub uid: u32,
    /// The gid.
    pub gid: u32,
    /// The home directory (`HOME`).
    pub home: &'static str,
}

/// The VM driver's fixed workload identity: an unprivileged `sandbox` user, never root.
pub const WORKLOAD: WorkloadIdentity =
    WorkloadIdentity { name: "sandbox", uid: 1000, gid: 1000, home: "/home/sandbox" };

impl WorkloadIdentity {
    /// Its `/etc/passwd` line.
    pub fn passwd_line(&self) -> String {
        format!("{0}:x:{1}:{2}:{0}:{3}:/bin/sh\n", self.name, self.uid, self.gid, self.home)
    }

    /// Its `/etc/group` line.
    pub fn group_line(&self) -> String {
        format!("{}:x:{}:\n", self.name, self.gid)
    }
}

/// A policy's selector of the user or group to run as: a name or a decimal id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdSelector(pub String);

impl IdSelector {
    /// Whether it names `name`, or the id `id`.
    pub fn selects(&self, name: &str, id: u32) -> bool {
        self.0 == name || self.0.parse::<u32>().is_ok_and(|n| n == id)
    }
}

/// Who a policy asks workloads to run as. Each part, when given, must select the fixed identity. (No field is
/// skipped when empty: updates travel in bincode, which has no optional fields.)
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunAs {
    /// The user: a name or a uid.
    #[serde(default)]
    pub user: Option<IdSelector>,
    /// The group: a name or a gid.
    #[serde(default)]
    pub group: Option<IdSelector>,
}

impl RunAs {
    /// The first part that selects someone other than `fixed`: `"user"` or `"group"`.
    pub fn conflict(&self, fixed: &WorkloadIdentity) -> Option<&'static str> {
        if self.user.as_ref().is_some_and(|u| !u.selects(fixed.name, fixed.uid)) {
            return Some("user");
        }
        if self.group.as_ref().is_some_and(|g| !g.selects(fixed.name, fixed.gid)) {
            return Some("group");
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_as(user: Option<&str>, group: Option<&str>) -> RunAs {
        RunAs { user: user.map(|u| IdSelector(u.into())), group: group.map(|g| IdSelector(g.into())) }
    }

    #[test]
    fn only_the_fixed_identity_is_selectable() {
        assert_eq!(RunAs::default().conflict(&WORKLOAD), None, "naming nobody conflicts with nothing");
        assert_eq!(run_as(Some("sandbox"), Some("1000")).conflict(&WORKLOAD), None);
        assert_eq!(run_as(Some("1000"), None).conflict(&WORKLOAD), None);
        assert_eq!(run_as(Some("root"), None).conflict(&WORKLOAD), Some("user"));
        assert_eq!(run_as(Some("0"), None).conflict(&WORKLOAD), Some("user"));
        assert_eq!(run_as(None, Some("0")).conflict(&WORKLOAD), Some("group"));
        assert_eq!(run_as(Some("01000"), None).conflict(&WORKLOAD), None, "a decimal id, leading zeros and all");
        assert_eq!(run_as(Some(" 1000"), None).conflict(&WORKLOAD), Some("user"));
        assert_eq!(WORKLOAD.passwd_line(), "sandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh\n");
        assert_eq!(WORKLOAD.group_line(), "sandbox:x:1000:\n");
    }
}
