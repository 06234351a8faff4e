//! Host directories for a sandbox (`--mount`, `SandboxSpec.mounts`), checked once for every entry point
//! before anything starts. The supervisor serves them ([`vm_contract::share`]); `docs/files.md` has the
//! rules.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use vm_contract::jail::Confinement;
use vm_contract::share::HostMount;
use vm_protocol::mounts::MAX_MOUNTS;

/// Why the mounts cannot be had.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// More than [`MAX_MOUNTS`].
    #[error("at most {MAX_MOUNTS} host directories may be mounted")]
    TooMany,
    /// The source is missing or not a directory.
    #[error("mount source {} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    /// Two mounts at one guest path.
    #[error("two mounts at {0}")]
    SameTarget(String),
    /// A read-write mount of a directory root owns.
    #[error(
        "mount source {} is owned by root: a read-write mount writes as the directory's owner, never as root; \
         chown it to the user whose files these are, or add readonly", .0.display()
    )]
    RootOwned(PathBuf),
    /// No namespaces to confine the file server in.
    #[error("host directories need jail or userns confinement (this driver runs with none)")]
    Unconfined,
}

/// `mounts` with each source resolved to an absolute, symlink-free directory, checked.
///
/// # Errors
/// [`MountError`].
pub fn resolve(mounts: &[HostMount], confinement: Confinement) -> Result<Vec<HostMount>, MountError> {
    if mounts.is_empty() {
        return Ok(Vec::new());
    }
    if mounts.len() > MAX_MOUNTS {
        return Err(MountError::TooMany);
    }
    if confinement == Confinement::None {
        return Err(MountError::Unconfined);
    }
    let mut resolved: Vec<HostMount> = Vec::with_capacity(mounts.len());
    for m in mounts {
        let source = std::fs::canonicalize(&m.source).map_err(|_| MountError::NotADirectory(m.source.clone()))?;
        let meta = std::fs::metadata(&source).map_err(|_| MountError::NotADirectory(m.source.clone()))?;
        if !meta.is_dir() {
            return Err(MountError::NotADirectory(m.source.clone()));
        }
        if !m.readonly && meta.uid() == 0 && confinement == Confinement::Jail {
            return Err(MountError::RootOwned(source));
        }
        if resolved.iter().any(|r| r.target == m.target) {
            return Err(MountError::SameTarget(m.target.clone()));
        }
        resolved.push(HostMount { source, ..m.clone() });
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(src: &std::path::Path, dst: &str, readonly: bool) -> HostMount {
        HostMount { source: src.to_owned(), target: dst.into(), readonly }
    }

    #[test]
    fn sources_resolve_and_bad_sets_are_refused() {
        let dir = std::env::temp_dir().join(format!("vm-driver-mounts-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("real")).unwrap();
        let _ = std::os::unix::fs::symlink(dir.join("real"), dir.join("link"));
        std::fs::write(dir.join("file"), b"x").unwrap();
        let got = resolve(&[mount(&dir.join("link"), "/work", true)], Confinement::Jail).unwrap();
        assert_eq!(got[0].source, std::fs::canonicalize(dir.join("real")).unwrap());
        assert!(resolve(&[], Confinement::None).unwrap().is_empty());
        let bad = [
            (vec![mount(&dir.join("missing"), "/w", true)], Confinement::Jail),
            (vec![mount(&dir.join("file"), "/w", true)], Confinement::Jail),
            (vec![mount(&dir, "/w", true), mount(&dir, "/w", true)], Confinement::Jail),
            (vec![mount(&dir, "/w", true)], Confinement::None),
            ((0..=MAX_MOUNTS).map(|i| mount(&dir, &format!("/w{i}"), true)).collect(), Confinement::Jail),
        ];
        for (mounts, confinement) in bad {
            assert!(resolve(&mounts, confinement).is_err(), "{mounts:?}");
        }
        if rustix::process::geteuid().is_root() {
            // The temporary directory is root's here: read-write is refused, read-only is fine.
            assert!(matches!(resolve(&[mount(&dir, "/w", false)], Confinement::Jail), Err(MountError::RootOwned(_))));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
