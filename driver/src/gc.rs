//! Collecting the directories ended `launch` sandboxes leave behind.
//!
//! A launch that does not end cleanly (or runs with `--keep`) keeps its sandbox directory for diagnosis, and
//! the reaper tombstones the ones whose supervisor died. Without collection they pile up forever. Every
//! driver start (after reaping) removes ended launch sandboxes beyond the newest [`Retention::keep`] and any
//! older than [`Retention::max_age`]. Only directories with a tombstone are candidates (nothing runs in
//! them), and never a sandbox of `serve` (it has a `spec.json`: `serve` owns its lifetime).

use std::path::Path;
use std::time::Duration;

use vm_contract::layout::SandboxFile;
use vm_contract::tombstone::Tombstone;

/// How many ended launch sandboxes are kept, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// The newest this many are kept.
    pub keep: usize,
    /// None older than this is kept.
    pub max_age: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self { keep: 64, max_age: Duration::from_secs(7 * 24 * 3600) }
    }
}

/// Removes the ended launch sandboxes `retention` does not keep; returns how many.
pub fn collect(sandboxes_dir: &Path, retention: Retention) -> usize {
    let Ok(entries) = std::fs::read_dir(sandboxes_dir) else { return 0 };
    let mut ended: Vec<(u64, std::path::PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|dir| !dir.join(SandboxFile::Spec.name()).exists())
        .filter_map(|dir| Some((Tombstone::read(&dir)?.at_unix, dir)))
        .collect();
    // Newest first.
    ended.sort_by_key(|e| std::cmp::Reverse(e.0));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut removed = 0;
    for (i, (at, dir)) in ended.iter().enumerate() {
        let too_old = now.saturating_sub(*at) > retention.max_age.as_secs();
        if (i >= retention.keep || too_old) && std::fs::remove_dir_all(dir).is_ok() {
            crate::audit::forget(dir);
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_contract::tombstone::EndReason;

    #[test]
    fn keeps_the_newest_and_the_running_and_never_a_served_sandbox() {
        let root = std::env::temp_dir().join(format!("gc-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let make = |name: &str, at: Option<u64>, served: bool| {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
            if let Some(at_unix) = at {
                let json = serde_json::to_vec(&Tombstone { reason: EndReason::Stopped, at_unix }).unwrap_or_default();
                std::fs::write(dir.join(SandboxFile::Tombstone.name()), json).unwrap_or_else(|e| panic!("{e}"));
            }
            if served {
                std::fs::write(dir.join(SandboxFile::Spec.name()), b"{}").unwrap_or_else(|e| panic!("{e}"));
            }
        };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        make("old", Some(now - 10 * 24 * 3600), false);
        make("a", Some(now - 30), false);
        make("b", Some(now - 20), false);
        make("c", Some(now - 10), false);
        make("running", None, false);
        make("served", Some(now - 40 * 24 * 3600), true);
        let removed = collect(&root, Retention { keep: 2, max_age: Duration::from_secs(7 * 24 * 3600) });
        assert_eq!(removed, 2);
        for (name, kept) in
            [("old", false), ("a", false), ("b", true), ("c", true), ("running", true), ("served", true)]
        {
            assert_eq!(root.join(name).exists(), kept, "{name}");
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}
