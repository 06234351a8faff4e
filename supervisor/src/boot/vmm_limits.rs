//! What the VMM's own cgroups say about its end: whether it was stopped by its memory limit or refused by its
//! pids limit. The driver made the cgroups and `vm-jailer` put QEMU in them; the supervisor only reads their
//! counters, v1 or v2 alike.

use std::path::{Path, PathBuf};

/// A limit the VMM ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitHit {
    /// Killed by the out-of-memory killer inside its memory limit.
    Memory,
    /// A process or thread was refused at its pids limit.
    Pids,
}

impl LimitHit {
    /// Fixed text for findings and errors.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Memory => "the VMM exceeded its memory limit and was killed",
            Self::Pids => "the VMM was refused a thread at its pids limit",
        }
    }
}

/// The limits hit in `cgroups`.
pub fn hits(cgroups: &[PathBuf]) -> Vec<LimitHit> {
    let mut found = Vec::new();
    for cgroup in cgroups {
        // v2 `memory.events` and v1 `memory.oom_control` both count `oom_kill`; `pids.events` counts `max`.
        if ["memory.events", "memory.oom_control"].iter().any(|f| counter(cgroup, f, "oom_kill") > 0) {
            found.push(LimitHit::Memory);
        }
        if counter(cgroup, "pids.events", "max") > 0 {
            found.push(LimitHit::Pids);
        }
    }
    found.dedup();
    found
}

/// The value of `key` in a flat-keyed cgroup file, 0 when absent.
fn counter(cgroup: &Path, file: &str, key: &str) -> u64 {
    let text = std::fs::read_to_string(cgroup.join(file)).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_v1_and_v2_counters() {
        let dir = std::env::temp_dir().join(format!("vmm-limits-{}", std::process::id()));
        let (v2, v1) = (dir.join("v2"), dir.join("v1"));
        for d in [&v2, &v1] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(v2.join("memory.events"), "low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n").unwrap();
        std::fs::write(v2.join("pids.events"), "max 0\n").unwrap();
        std::fs::write(v1.join("memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n").unwrap();
        std::fs::write(v1.join("pids.events"), "max 3\n").unwrap();
        assert_eq!(hits(std::slice::from_ref(&v2)), vec![LimitHit::Memory]);
        assert_eq!(hits(std::slice::from_ref(&v1)), vec![LimitHit::Pids]);
        assert_eq!(hits(&[dir.join("none")]), vec![]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
