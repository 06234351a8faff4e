//! The container's root from containerd's snapshotter, made a disk the guest boots from: the rootfs mounts
//! `Create` names (an overlay of the image's committed snapshots and the container's own) are mounted on the
//! bundle's `rootfs`, made one EROFS image by `mkfs.erofs` (`vm_oci::disk`, as an image from our own store
//! is), and unmounted again at once. The guest writes to its own layer, never to the host's snapshot: what a
//! container writes is not in containerd's snapshot (docs/kubernetes.md).
//!
//! A fresh container's disk is its image's, made once per node and kept ([`layers`]).
//!
//! ```text
//! <bundle>/rootfs                 containerd's mounts, only while the disk is made
//! <bundle>/vmdriver-root.erofs    the disk (0444), removed at Delete: the image's kept disk, hard-linked
//! ```

use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};

use containerd_shim::protos::api::Mount;
use sha2::Digest as _;

use self::layers::Layers;

mod layers;

/// The disk's file in the bundle.
pub const DISK_FILE: &str = "vmdriver-root.erofs";
/// Where images' disks are kept, in the shim's state directory.
pub const KEPT_DIR: &str = "containerd-roots";

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

/// The task's disk in `bundle`: the image's kept in `kept` (made there first when it is not) for a fresh
/// container, else one of its own made of `mounts`.
///
/// # Errors
/// [`RootfsError`]; nothing stays mounted and no disk is left in the bundle.
pub async fn make_disk(bundle: &Path, mounts: &[Mount], uuid_seed: &str, kept: &Path) -> Result<PathBuf, RootfsError> {
    let disk = bundle.join(DISK_FILE);
    let _ = std::fs::remove_file(&disk);
    if let Some(layers) = Layers::of(mounts) {
        let linked = match image_disk(bundle, &layers, kept).await {
            Some(image_disk) => std::fs::hard_link(image_disk, &disk).is_ok(),
            None => false,
        };
        if linked {
            return Ok(disk);
        }
    }
    // Not a fresh container, or its image's disk could not be kept or linked (another file system than the
    // bundle's): a disk of its own.
    build(bundle, mounts, &disk, &uuid_of(uuid_seed)).await?;
    Ok(disk)
}

/// The kept disk of `layers` in `kept`, made first when there is none; `None` when it cannot be.
async fn image_disk(bundle: &Path, layers: &Layers, kept: &Path) -> Option<PathBuf> {
    let (image_disk, partial) = layers::paths(kept, &layers.key);
    if image_disk.exists() {
        layers::touch(&image_disk);
        return Some(image_disk);
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(kept).ok()?;
    build(bundle, &[layers.view()], &partial, &uuid_of(&layers.key)).await.ok()?;
    // Two shims making the same image's disk at once: either rename leaves a whole one.
    let renamed = std::fs::rename(&partial, &image_disk);
    if renamed.is_err() {
        let _ = std::fs::remove_file(&partial);
        return None;
    }
    layers::evict(kept);
    Some(image_disk)
}

/// Mounts `mounts` on `bundle/rootfs`, makes `disk` of what is there (0444), unmounts.
///
/// # Errors
/// [`RootfsError`]; nothing stays mounted and `disk` is not left.
async fn build(bundle: &Path, mounts: &[Mount], disk: &Path, uuid: &str) -> Result<(), RootfsError> {
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
    let made = {
        let (rootfs, disk, uuid) = (rootfs.clone(), disk.to_owned(), uuid.to_owned());
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
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            let _ = std::fs::remove_file(disk);
            Err(RootfsError::Disk(e))
        }
        Err(_) => {
            let _ = std::fs::remove_file(disk);
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
