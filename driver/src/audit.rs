//! The driver's side of a sandbox's audit chain (`vm-audit`): the head each orderly stop sealed, kept
//! outside the sandbox directory (the anchor, `<state>/audit/<id>.json`, 0600), and the verification of
//! a chain against it.
//!
//! The anchor is what catches a chain rewritten as a whole, cut at its tail, or replaced by an older copy:
//! a forger who can rewrite `<sandbox>/audit.db` consistently still has to find and rewrite this file too,
//! and every OTLP record already carried the head to the collector as it left.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use vm_audit::verify::{Report, VerifyError};
use vm_audit::Head;
use vm_contract::layout::SandboxFile;

/// Bigger than any `events.jsonl` the supervisor writes (its cap), for the line check.
const MAX_EVENTS_BYTES: u64 = 256 << 20;

/// The anchor of the sandbox whose directory is `sandbox_dir` (`<state>/sandboxes/<id>`).
pub fn anchor_path(sandbox_dir: &Path) -> Option<PathBuf> {
    let id = sandbox_dir.file_name()?.to_str()?;
    let state = sandbox_dir.parent()?.parent()?;
    Some(state.join("audit").join(format!("{id}.json")))
}

/// Keeps `head` as the sandbox's anchor: written whole (a temporary file, synced, renamed), 0600.
pub fn keep_anchor(sandbox_dir: &Path, head: &Head) {
    let Some(path) = anchor_path(sandbox_dir) else { return };
    let write = || -> std::io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir)?;
        let staging = path.with_extension("json.new");
        let mut file = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&staging)?;
        file.write_all(&serde_json::to_vec(head).map_err(std::io::Error::other)?)?;
        file.sync_all()?;
        fs::rename(&staging, &path)
    };
    if write().is_err() {
        tracing::warn!("cannot keep the audit chain's head outside the sandbox directory");
    }
}

/// The anchor kept for the sandbox, if any.
pub fn anchor(sandbox_dir: &Path) -> Option<Head> {
    serde_json::from_slice(&fs::read(anchor_path(sandbox_dir)?).ok()?).ok()
}

/// Removes the anchor, with the sandbox.
pub fn forget(sandbox_dir: &Path) {
    if let Some(path) = anchor_path(sandbox_dir) {
        let _ = fs::remove_file(path);
    }
}

/// What `vm-driver audit` reads: a sandbox directory, or a chain's file.
#[derive(Debug, Clone)]
pub struct Target {
    /// The chain.
    pub db: PathBuf,
    /// The sandbox directory, when known: its `events.jsonl` and anchor.
    pub sandbox_dir: Option<PathBuf>,
}

impl Target {
    /// A sandbox directory, or a path to an `audit.db`.
    pub fn at(path: &Path) -> Self {
        if path.is_dir() {
            Self { db: path.join(SandboxFile::Audit.name()), sandbox_dir: Some(path.to_owned()) }
        } else {
            Self { db: path.to_owned(), sandbox_dir: None }
        }
    }

    /// Verifies the chain against the anchor and `events.jsonl`, where the sandbox directory is known.
    ///
    /// # Errors
    /// [`VerifyError`]: no chain there, or not one SQLite can read.
    pub fn verify(&self) -> Result<(Report, Option<Head>), VerifyError> {
        if !self.db.is_file() {
            return Err(VerifyError::NotAChain);
        }
        let anchor = self.sandbox_dir.as_deref().and_then(anchor);
        let events = self.sandbox_dir.as_deref().and_then(|dir| read_capped(&dir.join(SandboxFile::Events.name())));
        let report = vm_audit::verify::verify(&self.db, anchor.as_ref(), events.as_deref())?;
        Ok((report, anchor))
    }
}

fn read_capped(path: &Path) -> Option<Vec<u8>> {
    let meta = fs::symlink_metadata(path).ok()?;
    (meta.is_file() && meta.len() <= MAX_EVENTS_BYTES).then(|| fs::read(path).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_anchor_lives_beside_the_sandboxes_not_among_them() {
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join("sandboxes").join("box-1");
        assert_eq!(anchor_path(&dir).unwrap(), state.path().join("audit/box-1.json"));
        let head = Head { seq: 7, hash: [9; 32] };
        keep_anchor(&dir, &head);
        assert_eq!(anchor(&dir), Some(head));
        use std::os::unix::fs::PermissionsExt as _;
        let mode = fs::metadata(anchor_path(&dir).unwrap()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        forget(&dir);
        assert_eq!(anchor(&dir), None);
    }
}
