//! Resource limits a spawned process starts with (`setrlimit`), as the OCI spec's `process.rlimits` and
//! Docker's `--ulimit` name them. The agent sets them in the child before it takes the workload's ids, so a
//! limit may be raised above the agent's own: the guest's kernel is the sandbox's, and what a process may use
//! of the host is bounded by the VM, not by these.

use serde::{Deserialize, Serialize};

/// One resource, by the name the kernel's `RLIMIT_*` constant has. An unknown name cannot be represented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Resource {
    /// `RLIMIT_AS`: address space bytes.
    As,
    /// `RLIMIT_CORE`: core file bytes.
    Core,
    /// `RLIMIT_CPU`: CPU seconds.
    Cpu,
    /// `RLIMIT_DATA`: data segment bytes.
    Data,
    /// `RLIMIT_FSIZE`: bytes of a file written.
    Fsize,
    /// `RLIMIT_LOCKS`: file locks.
    Locks,
    /// `RLIMIT_MEMLOCK`: locked memory bytes.
    Memlock,
    /// `RLIMIT_MSGQUEUE`: POSIX message queue bytes.
    Msgqueue,
    /// `RLIMIT_NICE`: the nice value's ceiling.
    Nice,
    /// `RLIMIT_NOFILE`: open descriptors.
    Nofile,
    /// `RLIMIT_NPROC`: processes of the user.
    Nproc,
    /// `RLIMIT_RSS`: resident bytes (not enforced by Linux).
    Rss,
    /// `RLIMIT_RTPRIO`: real-time priority.
    Rtprio,
    /// `RLIMIT_RTTIME`: real-time CPU microseconds.
    Rttime,
    /// `RLIMIT_SIGPENDING`: queued signals.
    Sigpending,
    /// `RLIMIT_STACK`: stack bytes.
    Stack,
}

/// Every resource, in the order above.
pub const RESOURCES: [Resource; 16] = [
    Resource::As,
    Resource::Core,
    Resource::Cpu,
    Resource::Data,
    Resource::Fsize,
    Resource::Locks,
    Resource::Memlock,
    Resource::Msgqueue,
    Resource::Nice,
    Resource::Nofile,
    Resource::Nproc,
    Resource::Rss,
    Resource::Rtprio,
    Resource::Rttime,
    Resource::Sigpending,
    Resource::Stack,
];

/// No limit (the kernel's `RLIM_INFINITY`).
pub const UNLIMITED: u64 = u64::MAX;

impl Resource {
    /// The name after `RLIMIT_`, lower case (`nofile`), as Docker's `--ulimit` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::As => "as",
            Self::Core => "core",
            Self::Cpu => "cpu",
            Self::Data => "data",
            Self::Fsize => "fsize",
            Self::Locks => "locks",
            Self::Memlock => "memlock",
            Self::Msgqueue => "msgqueue",
            Self::Nice => "nice",
            Self::Nofile => "nofile",
            Self::Nproc => "nproc",
            Self::Rss => "rss",
            Self::Rtprio => "rtprio",
            Self::Rttime => "rttime",
            Self::Sigpending => "sigpending",
            Self::Stack => "stack",
        }
    }

    /// The resource named `name` (`nofile`, or the OCI spec's `RLIMIT_NOFILE`), in any case.
    pub fn from_name(name: &str) -> Option<Self> {
        let lower = name.to_ascii_lowercase();
        let bare = lower.strip_prefix("rlimit_").unwrap_or(&lower);
        RESOURCES.into_iter().find(|r| r.name() == bare)
    }
}

/// A limit: the soft value a process meets, the hard one it may raise the soft value to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    /// Which resource.
    pub resource: Resource,
    /// The soft limit ([`UNLIMITED`] for none).
    pub soft: u64,
    /// The hard limit ([`UNLIMITED`] for none).
    pub hard: u64,
}

/// Why a set of limits cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RlimitError {
    /// A soft limit above its hard one.
    #[error("the soft limit of {0} is above its hard limit")]
    SoftAboveHard(&'static str),
    /// One resource limited twice.
    #[error("{0} is limited twice")]
    Twice(&'static str),
    /// More limits than there are resources.
    #[error("more than 16 limits")]
    TooMany,
}

/// Checks limits before they are applied: each resource at most once, no soft limit above its hard one. With
/// each resource once, a valid set has at most [`RESOURCES`]'s length.
///
/// # Errors
/// [`RlimitError`], for the first one wrong.
pub fn check(limits: &[Rlimit]) -> Result<(), RlimitError> {
    // Before the pairwise look: a decoded list may hold thousands.
    if limits.len() > RESOURCES.len() {
        return Err(RlimitError::TooMany);
    }
    for (i, limit) in limits.iter().enumerate() {
        if limit.soft > limit.hard {
            return Err(RlimitError::SoftAboveHard(limit.resource.name()));
        }
        if limits[..i].iter().any(|earlier| earlier.resource == limit.resource) {
            return Err(RlimitError::Twice(limit.resource.name()));
        }
    }
    Ok(())
}

/// Parses Docker's `--ulimit` form: `NAME=SOFT[:HARD]`, where a value is a number or `-1` / `unlimited` for
/// none, and a missing hard limit equals the soft one.
///
/// # Errors
/// A fixed-text reason.
pub fn parse_ulimit(text: &str) -> Result<Rlimit, &'static str> {
    let (name, values) = text.split_once('=').ok_or("a --ulimit is NAME=SOFT[:HARD]")?;
    let resource = Resource::from_name(name).ok_or("a --ulimit names no known resource (nofile, nproc, core, ...)")?;
    let value = |v: &str| match v {
        "-1" | "unlimited" => Ok(UNLIMITED),
        _ => v.parse::<u64>().map_err(|_| "a --ulimit value is a number, -1 or unlimited"),
    };
    let (soft, hard) = match values.split_once(':') {
        Some((soft, hard)) => (value(soft)?, value(hard)?),
        None => (value(values)?, value(values)?),
    };
    let limit = Rlimit { resource, soft, hard };
    check(&[limit]).map_err(|_| "a --ulimit's soft limit is above its hard limit")?;
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_oci_form_is_accepted() {
        for r in RESOURCES {
            assert_eq!(Resource::from_name(r.name()), Some(r));
            assert_eq!(Resource::from_name(&format!("RLIMIT_{}", r.name().to_uppercase())), Some(r));
        }
        assert_eq!(Resource::from_name("files"), None);
        assert_eq!(Resource::from_name("rlimit_"), None);
    }

    #[test]
    fn ulimits_parse_as_docker_takes_them() {
        let nofile = |soft, hard| Ok(Rlimit { resource: Resource::Nofile, soft, hard });
        assert_eq!(parse_ulimit("nofile=256:512"), nofile(256, 512));
        assert_eq!(parse_ulimit("nofile=256"), nofile(256, 256));
        assert_eq!(parse_ulimit("nofile=-1"), nofile(UNLIMITED, UNLIMITED));
        assert_eq!(parse_ulimit("nofile=10:unlimited"), nofile(10, UNLIMITED));
        for bad in ["nofile", "nofile=", "nofile=a", "nofile=512:256", "files=1", "nofile=1:2:3", "=1"] {
            assert!(parse_ulimit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_set_names_each_resource_once_with_soft_under_hard() {
        let l = |resource, soft, hard| Rlimit { resource, soft, hard };
        assert_eq!(check(&[l(Resource::Nofile, 1, 2), l(Resource::Core, 0, 0)]), Ok(()));
        assert_eq!(check(&[l(Resource::Nofile, 3, 2)]), Err(RlimitError::SoftAboveHard("nofile")));
        assert_eq!(check(&[l(Resource::Core, 0, 0), l(Resource::Core, 1, 1)]), Err(RlimitError::Twice("core")));
        let all: Vec<Rlimit> = RESOURCES.iter().map(|r| l(*r, 1, 1)).collect();
        assert_eq!(check(&all), Ok(()));
        assert_eq!(check(&[all.clone(), all].concat()), Err(RlimitError::TooMany));
    }
}
