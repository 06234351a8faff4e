//! Recording this sandbox's processes (pid and start time) for the driver's orphan reaper.

use std::path::Path;

use vm_protocol::status::{SandboxPids, PIDS_FILE};

/// Writes the pids file in the current (sandbox) directory atomically: a reader sees the old or the new.
///
/// # Errors
/// The file cannot be written.
pub fn write(pids: &SandboxPids) -> std::io::Result<()> {
    let tmp = format!("{PIDS_FILE}.tmp");
    let json = serde_json::to_vec(pids).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, Path::new(PIDS_FILE))
}
