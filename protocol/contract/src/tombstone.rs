//! The tombstone: how the last supervisor of a sandbox ended, written by the driver once it is gone.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::layout::SandboxFile;

/// Why a sandbox's generation ended.
/// The words are the stored form (and what earlier versions wrote).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EndReason {
    /// Stopped in order, on request or because its workload finished.
    #[serde(rename = "stopped")]
    Stopped,
    /// It failed: a failed start, or the supervisor ended on its own.
    #[serde(rename = "failed")]
    Failed,
    /// Deleted through the API.
    #[serde(rename = "deleted")]
    Deleted,
    /// `serve` went down; the sandbox keeps its intent to run.
    #[serde(rename = "driver shutdown")]
    DriverShutdown,
    /// The supervisor was gone and the reaper killed what it left.
    #[serde(rename = "orphan reaped: supervisor gone, VM killed")]
    OrphanReaped,
    /// The supervisor was gone and nothing was left running.
    #[serde(rename = "supervisor gone")]
    SupervisorGone,
}

/// The contents of [`SandboxFile::Tombstone`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tombstone {
    /// What happened.
    pub reason: EndReason,
    /// Seconds since the epoch.
    pub at_unix: u64,
}

impl Tombstone {
    /// Writes a tombstone for `reason` into `dir`.
    pub fn write(dir: &Path, reason: EndReason) {
        let at_unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if let Ok(json) = serde_json::to_vec(&Self { reason, at_unix }) {
            let _ = std::fs::write(dir.join(SandboxFile::Tombstone.name()), json);
        }
    }

    /// The tombstone of `dir`, if any.
    pub fn read(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(SandboxFile::Tombstone.name())).ok()?).ok()
    }

    /// Whether `dir` has one.
    pub fn exists(dir: &Path) -> bool {
        dir.join(SandboxFile::Tombstone.name()).exists()
    }

    /// Removes it, before a new generation starts.
    pub fn clear(dir: &Path) {
        let _ = std::fs::remove_file(dir.join(SandboxFile::Tombstone.name()));
    }
}
