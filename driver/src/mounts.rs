//! Host directories for a sandbox (`--mount`, `SandboxSpec.mounts`), checked once for every entry point
//! before anything starts. The supervisor serves them ([`vm_contract::share`]); `docs/files.md` has the
//! rules.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use vm_contract::jail::Confinement;
use vm_contract::share::HostMount;
use vm_protocol::mounts::MAX_MOUNTS;

/// The guest paths' bytes together: each travels hex-encoded on the kernel command line, whose x86 limit
/// (2048 bytes) it shares with the boot's own arguments and QEMU's device list.
pub const MAX_TARGETS_BYTES: usize = 256;

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
    /// A mount lies beneath the source: the server's namespace cannot bind the directory without it.
    #[error("mount source {} has a mount beneath it ({}); share that mount, or a directory without one", .0.display(), .1)]
    HasSubmount(PathBuf, String),
    /// A source the mount syntax cannot carry.
    #[error("mount source {} must be valid UTF-8 without a comma", .0.display())]
    Unwritable(PathBuf),
    /// One mount inside another in the guest.
    #[error("mount targets {0} and {1} overlap: one would hide the other")]
    Nested(String, String),
    /// The guest paths together would not fit on the kernel command line.
    #[error("the mounts' guest paths are too long together (at most {MAX_TARGETS_BYTES} bytes)")]
    TargetsTooLong,
    /// Root without a jail: the server would run as root.
    #[error("as root, host directories need --confinement jail (under userns the file server would run as root)")]
    RootWithoutJail,
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
    if confinement != Confinement::Jail && rustix::process::geteuid().is_root() {
        return Err(MountError::RootWithoutJail);
    }
    if mounts.iter().map(|m| m.target.len()).sum::<usize>() > MAX_TARGETS_BYTES {
        return Err(MountError::TargetsTooLong);
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
        if !vm_contract::share::source_ok(&source) {
            return Err(MountError::Unwritable(source));
        }
        if let Some(under) = mount_beneath(&source) {
            return Err(MountError::HasSubmount(source, under));
        }
        if resolved.iter().any(|r| r.target == m.target) {
            return Err(MountError::SameTarget(m.target.clone()));
        }
        let inside = |outer: &str, inner: &str| inner.strip_prefix(outer).is_some_and(|rest| rest.starts_with('/'));
        if let Some(r) = resolved.iter().find(|r| inside(&r.target, &m.target) || inside(&m.target, &r.target)) {
            return Err(MountError::Nested(r.target.clone(), m.target.clone()));
        }
        resolved.push(HostMount { source, ..m.clone() });
    }
    Ok(resolved)
}

/// A mount point strictly beneath `dir`, from this process's mount table. (A user namespace's mount
/// namespace locks the mounts it copies, and a non-recursive bind of a directory with locked mounts beneath
/// it fails.)
fn mount_beneath(dir: &std::path::Path) -> Option<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    table
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .find(|point| std::path::Path::new(point).strip_prefix(dir).is_ok_and(|rest| !rest.as_os_str().is_empty()))
        .map(str::to_owned)
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
            (vec![mount(&dir, "/w", true), mount(&dir, "/w/in", true)], Confinement::Jail),
            (vec![mount(&dir, "/w/in", true), mount(&dir, "/w", true)], Confinement::Jail),
            ((0..4).map(|i| mount(&dir, &format!("/{i}{}", "x".repeat(90)), true)).collect(), Confinement::Jail),
        ];
        for (mounts, confinement) in bad {
            assert!(resolve(&mounts, confinement).is_err(), "{mounts:?}");
        }
        assert!(matches!(
            resolve(&[mount(std::path::Path::new("/"), "/w", true)], Confinement::Jail),
            Err(MountError::HasSubmount(..))
        ));
        // Siblings whose names share a prefix are not nested.
        assert!(resolve(&[mount(&dir, "/w", true), mount(&dir, "/wx", true)], Confinement::Jail).is_ok());
        std::fs::create_dir_all(dir.join("a,b")).unwrap();
        assert!(matches!(
            resolve(&[mount(&dir.join("a,b"), "/w", true)], Confinement::Jail),
            Err(MountError::Unwritable(_))
        ));
        if rustix::process::geteuid().is_root() {
            assert!(matches!(
                resolve(&[mount(&dir, "/w", true)], Confinement::Userns),
                Err(MountError::RootWithoutJail)
            ));
            // The temporary directory is root's here: read-write is refused, read-only is fine.
            assert!(matches!(resolve(&[mount(&dir, "/w", false)], Confinement::Jail), Err(MountError::RootOwned(_))));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
