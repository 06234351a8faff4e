//! The processes of one sandbox, named by pid and start time for the driver's orphan reaper.

use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::layout::SandboxFile;

/// A process named by pid and start time (field 22 of `/proc/<pid>/stat`), so a reused pid is never
/// mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessRecord {
    /// The pid.
    pub pid: i32,
    /// Start time in clock ticks since boot.
    pub start_time: u64,
}

impl ProcessRecord {
    /// The record of `pid` as it runs now, from `/proc/<pid>/stat`; `None` when it is gone or a zombie (it has
    /// exited and only waits to be reaped).
    pub fn read(pid: i32) -> Option<Self> {
        Self::read_with_parent(pid).map(|(record, _)| record)
    }

    /// The record of `pid`, only if it runs as a child of `parent`: how a process names a grandchild whose
    /// pid it was told (QEMU, a child of `vm-jailer`) without the risk that the pid is already another's.
    pub fn read_child_of(pid: i32, parent: i32) -> Option<Self> {
        Self::read_with_parent(pid).filter(|(_, ppid)| *ppid == parent).map(|(record, _)| record)
    }

    fn read_with_parent(pid: i32) -> Option<(Self, i32)> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let fields: Vec<&str> = text.rsplit_once(") ")?.1.split(' ').collect();
        if fields.first() == Some(&"Z") {
            return None;
        }
        Some((Self { pid, start_time: fields.get(19)?.parse().ok()? }, fields.get(1)?.parse().ok()?))
    }

    /// This very process.
    pub fn current() -> Option<Self> {
        Self::read(i32::try_from(std::process::id()).ok()?)
    }

    /// Whether the process this record names still runs.
    pub fn is_alive(&self) -> bool {
        Self::read(self.pid).as_ref() == Some(self)
    }
}

/// The contents of [`SandboxFile::Pids`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxPids {
    /// The supervisor itself.
    pub supervisor: ProcessRecord,
    /// The VMM, once started.
    pub vmm: Option<ProcessRecord>,
    /// The lease watchdog, once started.
    pub watchdog: Option<ProcessRecord>,
}

impl SandboxPids {
    /// Writes the pids file into `dir` atomically: a reader sees the old or the new.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write(&self, dir: &Path) -> io::Result<()> {
        let path = dir.join(SandboxFile::Pids.name());
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(self).map_err(io::Error::other)?)?;
        std::fs::rename(&tmp, &path)
    }

    /// Reads the pids file of `dir`; `None` when there is none, or it is not ours.
    pub fn read(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(SandboxFile::Pids.name())).ok()?).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_named_only_with_its_real_parent() {
        let me = i32::try_from(std::process::id()).unwrap();
        let parent = std::os::unix::process::parent_id();
        let parent = i32::try_from(parent).unwrap();
        assert_eq!(ProcessRecord::read_child_of(me, parent), ProcessRecord::current());
        assert!(ProcessRecord::read_child_of(me, parent + 1).is_none());
        assert!(ProcessRecord::read_child_of(me, me).is_none());
    }
}
