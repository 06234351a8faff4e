//! The container's root from containerd's snapshotter, made a disk the guest boots from: the rootfs mounts
//! `Create` names (an overlay of the image's committed snapshots and the container's own) are mounted on the
//! bundle's `rootfs`, made one EROFS image by `mkfs.erofs` (`vm_oci::disk`, as an image from our own store
//! is), and unmounted again at once. The guest writes to its own layer, never to the host's snapshot: what a
//! container writes is not in containerd's snapshot (docs/kubernetes.md).
//!
//! ```text
//! <bundle>/rootfs                 containerd's mounts, only while the disk is made
//! <bundle>/vmdriver-root.erofs    the disk (0444), removed at Delete
//! ```

use std::path::{Path, PathBuf};

use containerd_shim::protos::api::Mount;
use sha2::Digest as _;

/// The disk's file in the bundle.
pub const DISK_FILE: &str = "vmdriver-root.erofs";

/// Why the root could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// A mount containerd named failed.
    #[error("cannot mount the container's rootfs ({0})")]
    Mount(String),
    /// Without mounts the bundle's `rootfs` must already be the root.
    #[error("the bundle has no rootfs directory")]
    NoRootfs,
    /// `mkfs.erofs` or the disk's file.
    #[error("cannot make the container's root disk")]
    Disk(#[source] vm_oci::disk::DiskError),
}

/// Mounts `mounts` on `bundle/rootfs`, makes the disk of what is there, unmounts; returns the disk.
///
/// # Errors
/// [`RootfsError`]; nothing stays mounted and no disk is left.
pub async fn make_disk(bundle: &Path, mounts: &[Mount], uuid_seed: &str) -> Result<PathBuf, RootfsError> {
    let rootfs = bundle.join("rootfs");
    let mut mounted = false;
    for m in mounts {
        if let Err(e) = containerd_shim::util::mount_rootfs(m, &rootfs).await {
            unmount(&rootfs);
            return Err(RootfsError::Mount(e.to_string()));
        }
        mounted = true;
    }
    if !rootfs.is_dir() {
        return Err(RootfsError::NoRootfs);
    }
    let disk = bundle.join(DISK_FILE);
    let uuid = uuid_of(uuid_seed);
    let made = {
        let (rootfs, disk) = (rootfs.clone(), disk.clone());
        tokio::task::spawn_blocking(move || {
            let _ = std::fs::remove_file(&disk);
            vm_oci::disk::make_erofs(&rootfs, &disk, &uuid, true)?;
            vm_oci::disk::shareable(&disk).map_err(|source| vm_oci::disk::DiskError::Io { path: disk, source })
        })
        .await
    };
    if mounted {
        unmount(&rootfs);
    }
    match made {
        Ok(Ok(())) => Ok(disk),
        Ok(Err(e)) => {
            let _ = std::fs::remove_file(&disk);
            Err(RootfsError::Disk(e))
        }
        Err(_) => {
            let _ = std::fs::remove_file(&disk);
            Err(RootfsError::Disk(vm_oci::disk::DiskError::Mkfs { status: None }))
        }
    }
}

/// Removes the disk and anything still mounted on the bundle's `rootfs` (a shim killed mid-Create).
pub fn clean(bundle: &Path) {
    unmount(&bundle.join("rootfs"));
    let _ = std::fs::remove_file(bundle.join(DISK_FILE));
}

/// Unmounts every mount stacked on `path`; best effort.
fn unmount(path: &Path) {
    while rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH).is_ok() {}
}

/// A UUID for the disk, from the task's namespace and id: one task's disk always has the same one.
fn uuid_of(seed: &str) -> String {
    let h: String = sha2::Sha256::digest(seed.as_bytes()).iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}
