//! A sandbox's disks when it boots an image root: the image's (read-only, shared, made by the driver's
//! image store) and its own writable layer, made here on the first boot and kept across restarts.
//!
//! The writable layer is a sparse file formatted by `mkfs.ext4` with lazy initialisation, so a sandbox
//! that writes nothing costs the filesystem's metadata only (docs/benchmarks.md).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use vm_contract::jail::JailIds;
use vm_contract::layout::SandboxFile;
use vm_contract::root::RootImage;
use vm_contract::snapshot::SnapshotFile;

/// The VM's two disks, as QEMU opens them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disks {
    /// The image's disk (absolute).
    pub image: PathBuf,
    /// The sandbox's writable layer (absolute).
    pub writable: PathBuf,
}

/// Why the disks are not ready.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The image's disk is missing (removed from the store under the sandbox).
    #[error("the image's disk {} is missing", .0.display())]
    NoImage(PathBuf),
    /// `mkfs.ext4` is not installed.
    #[error("mkfs.ext4 (e2fsprogs) is not installed")]
    NoMkfs,
    /// Making the writable layer failed.
    #[error("cannot make the writable layer")]
    Writable(#[source] std::io::Error),
    /// `mkfs.ext4` failed.
    #[error("mkfs.ext4 failed ({0})")]
    Mkfs(std::process::ExitStatus),
}

/// The disks of `root`, the writable layer made (owned by the jail's ids, 0600) if this sandbox has none.
/// Runs in the sandbox directory.
///
/// # Errors
/// [`DiskError`]; a failed make leaves no writable layer behind.
/// A VM restored from a snapshot (`restored`: its directory) boots on a copy of the layer it was saved with.
pub fn prepare(root: &RootImage, ids: Option<JailIds>, restored: Option<&Path>) -> Result<Disks, DiskError> {
    prepare_in(Path::new("."), root, ids, restored)
}

fn prepare_in(
    sandbox_dir: &Path,
    root: &RootImage,
    ids: Option<JailIds>,
    restored: Option<&Path>,
) -> Result<Disks, DiskError> {
    if !root.disk.is_file() {
        return Err(DiskError::NoImage(root.disk.clone()));
    }
    let writable =
        std::path::absolute(sandbox_dir.join(SandboxFile::WritableDisk.name())).map_err(DiskError::Writable)?;
    match restored {
        Some(dir) => copy_sparse(&SnapshotFile::WritableDisk.path(dir), &writable)?,
        None if !writable.is_file() => make(&writable, root.disk_mib)?,
        None => {}
    }
    if let Some(ids) = ids {
        std::os::unix::fs::chown(&writable, Some(ids.uid), Some(ids.gid)).map_err(DiskError::Writable)?;
    }
    Ok(Disks { image: root.disk.clone(), writable })
}

/// Keeps the layer a VM was saved with, beside its snapshot.
///
/// # Errors
/// [`DiskError::Writable`].
pub fn save(snapshot_dir: &Path) -> Result<(), DiskError> {
    copy_sparse(Path::new(SandboxFile::WritableDisk.name()), &SnapshotFile::WritableDisk.path(snapshot_dir))
}

/// Copies `from` to `to` (0600) as it is, holes kept: only the data extents are read and written. Under a
/// temporary name, renamed once whole.
fn copy_sparse(from: &Path, to: &Path) -> Result<(), DiskError> {
    use rustix::fs::SeekFrom;
    use std::io::{Read, Seek, Write};
    let partial = to.with_extension("partial");
    let copied = (|| {
        let mut source = fs::File::open(from)?;
        let len = source.metadata()?.len();
        let mut target = fs::File::create(&partial)?;
        target.set_permissions(fs::Permissions::from_mode(0o600))?;
        target.set_len(len)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < len {
            // The next data extent: ENXIO past the last one.
            let Ok(start) = rustix::fs::seek(&source, SeekFrom::Data(at)) else { break };
            let end = rustix::fs::seek(&source, SeekFrom::Hole(start)).map_err(std::io::Error::from)?;
            source.seek(std::io::SeekFrom::Start(start))?;
            target.seek(std::io::SeekFrom::Start(start))?;
            let mut left = end - start;
            while left > 0 {
                let want = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
                let n = source.read(&mut buf[..want])?;
                if n == 0 {
                    break;
                }
                target.write_all(&buf[..n])?;
                left -= n as u64;
            }
            at = end;
        }
        target.sync_all()?;
        fs::rename(&partial, to)
    })();
    if copied.is_err() {
        let _ = fs::remove_file(&partial);
    }
    copied.map_err(DiskError::Writable)
}

/// Makes a sparse ext4 filesystem of `mib` at `path`: under a temporary name, renamed once whole.
fn make(path: &Path, mib: u32) -> Result<(), DiskError> {
    let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"].into_iter().map(Path::new).find(|p| p.is_file());
    let mkfs = mkfs.ok_or(DiskError::NoMkfs)?;
    let partial = path.with_extension("partial");
    let made = (|| {
        let file = fs::File::create(&partial).map_err(DiskError::Writable)?;
        file.set_permissions(fs::Permissions::from_mode(0o600)).map_err(DiskError::Writable)?;
        file.set_len(u64::from(mib) << 20).map_err(DiskError::Writable)?;
        drop(file);
        // No reserved blocks (one user), and nothing zeroed ahead (the file is sparse and reads as zeros).
        let status = Command::new(mkfs)
            .args(["-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
            .arg(&partial)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(DiskError::Writable)?;
        if !status.success() {
            return Err(DiskError::Mkfs(status));
        }
        fs::rename(&partial, path).map_err(DiskError::Writable)
    })();
    if made.is_err() {
        let _ = fs::remove_file(&partial);
    }
    made
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(disk: PathBuf, mib: u32) -> RootImage {
        RootImage { manifest: "sha256:00".into(), disk, disk_mib: mib, run: vm_contract::root::RunConfig::default() }
    }

    #[test]
    fn a_missing_image_disk_is_named_and_makes_no_writable_layer() {
        let dir = std::env::temp_dir().join(format!("vm-disks-missing-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let err = prepare_in(&dir, &root(dir.join("gone.erofs"), 16), None, None).unwrap_err();
        assert!(matches!(err, DiskError::NoImage(_)), "{err}");
        assert!(!dir.join(SandboxFile::WritableDisk.name()).exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_writable_layer_is_a_sparse_private_ext4_of_its_size_made_once() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("vm-disks-made-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("image.erofs"), b"image").unwrap();
        let disks = prepare_in(&dir, &root(dir.join("image.erofs"), 64), None, None).unwrap();
        let meta = fs::metadata(&disks.writable).unwrap();
        assert_eq!(meta.len(), 64 << 20);
        assert!(meta.blocks() * 512 < 4 << 20, "sparse: {} bytes allocated", meta.blocks() * 512);
        assert_eq!(meta.mode() & 0o777, 0o600);
        let bytes = fs::read(&disks.writable).unwrap();
        assert_eq!(bytes[0x438..0x43a], [0x53, 0xef], "the ext4 superblock's magic");
        // A second boot keeps what the first made (its writes).
        fs::write(&disks.writable, b"kept").unwrap();
        prepare_in(&dir, &root(dir.join("image.erofs"), 64), None, None).unwrap();
        assert_eq!(fs::read(&disks.writable).unwrap(), b"kept");
        assert!(!dir.join("disk.partial").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_restore_boots_on_a_sparse_copy_of_the_saved_layer() {
        let dir = std::env::temp_dir().join(format!("vm-disks-copy-{}", std::process::id()));
        let (saved, slot) = (dir.join("snapshot"), dir.join("slot"));
        fs::create_dir_all(&saved).unwrap();
        fs::create_dir_all(&slot).unwrap();
        fs::write(dir.join("image.erofs"), b"image").unwrap();
        // 64 MiB with data at its start and at 40 MiB, holes between.
        let layer = fs::File::create(SnapshotFile::WritableDisk.path(&saved)).unwrap();
        layer.set_len(64 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&layer, b"head", 0).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&layer, b"middle", 40 << 20).unwrap();
        let disks = prepare_in(&slot, &root(dir.join("image.erofs"), 64), None, Some(&saved)).unwrap();
        let bytes = fs::read(&disks.writable).unwrap();
        assert_eq!(bytes.len(), 64 << 20);
        assert_eq!((&bytes[..4], &bytes[40 << 20..(40 << 20) + 6]), (&b"head"[..], &b"middle"[..]));
        assert!(bytes[4..40 << 20].iter().all(|b| *b == 0));
        use std::os::unix::fs::MetadataExt;
        let allocated = fs::metadata(&disks.writable).unwrap().blocks() * 512;
        assert!(allocated < 1 << 20, "holes kept: {allocated} bytes allocated");
        fs::remove_dir_all(&dir).unwrap();
    }
}
