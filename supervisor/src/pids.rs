//! Recording this sandbox's processes (pid and start time) for the driver's orphan reaper.

use std::path::Path;

use vm_protocol::status::{ProcessRecord, SandboxPids, PIDS_FILE};

/// The record of a live process, read from `/proc/<pid>/stat`.
pub fn record(pid: i32) -> Option<ProcessRecord> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let start_time = text.rsplit_once(") ")?.1.split(' ').nth(19)?.parse().ok()?;
    Some(ProcessRecord { pid, start_time })
}

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
