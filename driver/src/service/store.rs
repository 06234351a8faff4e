//! What a sandbox directory remembers across driver restarts.
//!
//! ```text
//! spec.json        the accepted spec (written once, at create)
//! generation       the last start's generation
//! stopped          present while the sandbox was stopped on purpose (written before stopping)
//! terminated.json  the tombstone: how the last supervisor ended
//! ```

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};
use vm_protocol::driver_api::{ReadinessKind, SandboxSpec};

use crate::reap::{Tombstone, TOMBSTONE_FILE};

const SPEC_FILE: &str = "spec.json";
const GENERATION_FILE: &str = "generation";
const STOPPED_MARKER: &str = "stopped";

/// The spec as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSpec {
    /// vCPUs.
    pub cpus: u32,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// Environment of every process.
    pub env: BTreeMap<String, String>,
}

impl StoredSpec {
    /// From the API, with defaults filled in.
    pub fn from_api(spec: &SandboxSpec) -> Self {
        Self {
            cpus: if spec.cpus == 0 { 1 } else { spec.cpus },
            memory_mib: if spec.memory_mib == 0 { 256 } else { spec.memory_mib },
            env: spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        }
    }

    /// Back to the API.
    pub fn to_api(&self) -> SandboxSpec {
        SandboxSpec {
            cpus: self.cpus,
            memory_mib: self.memory_mib,
            env: self.env.clone().into_iter().collect(),
            readiness: ReadinessKind::ReadinessTcp.into(),
        }
    }
}

/// Writes the spec.
///
/// # Errors
/// I/O.
pub fn save_spec(dir: &Path, spec: &StoredSpec) -> io::Result<()> {
    fs::write(dir.join(SPEC_FILE), serde_json::to_vec(spec).map_err(io::Error::other)?)
}

/// Reads the spec; `None` for a directory that is not a served sandbox (a `launch` one, say).
pub fn load_spec(dir: &Path) -> Option<StoredSpec> {
    serde_json::from_slice(&fs::read(dir.join(SPEC_FILE)).ok()?).ok()
}

/// The last generation (0 when never started).
pub fn generation(dir: &Path) -> u64 {
    fs::read_to_string(dir.join(GENERATION_FILE)).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(0)
}

/// Records the generation being started.
///
/// # Errors
/// I/O.
pub fn set_generation(dir: &Path, generation: u64) -> io::Result<()> {
    fs::write(dir.join(GENERATION_FILE), generation.to_string())
}

/// Marks (or unmarks) the sandbox as stopped on purpose; written before stopping starts.
///
/// # Errors
/// I/O.
pub fn set_stopped(dir: &Path, stopped: bool) -> io::Result<()> {
    let marker = dir.join(STOPPED_MARKER);
    if stopped {
        fs::write(marker, b"")
    } else {
        match fs::remove_file(marker) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// Whether the sandbox was stopped on purpose.
pub fn is_stopped(dir: &Path) -> bool {
    dir.join(STOPPED_MARKER).exists()
}

/// The tombstone of the last supervisor, if any.
pub fn tombstone(dir: &Path) -> Option<Tombstone> {
    serde_json::from_slice(&fs::read(dir.join(TOMBSTONE_FILE)).ok()?).ok()
}

/// Removes a stale tombstone before a new start.
pub fn clear_tombstone(dir: &Path) {
    let _ = fs::remove_file(dir.join(TOMBSTONE_FILE));
}
