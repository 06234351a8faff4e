//! One read-only disk per image: the layers merged ([`crate::unpack`]), written out under a staging
//! directory, and made into an EROFS image by `mkfs.erofs` (erofs-utils). Why EROFS: it is read-only by
//! design (no journal, nothing a guest could replay), compact, and built from a directory by a well-kept
//! tool; the guest kernel has it as a module. Two builds of one image give the same bytes: every time is
//! set to 0 (`-T0`), the UUID comes from the manifest's digest (`-U`), and entries are written in name order.
//!
//! ```text
//! <store>/disks/<manifest hex>/rootfs.erofs   the disk
//! <store>/disks/<manifest hex>/image.json     the image (config, layers), for launches and `image ls`
//! ```
//!
//! The directory is built as `disks/.build-*` and renamed into place whole, so a killed build leaves
//! nothing that looks complete; concurrent builds of one image wait for the first.

use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::digest::Digest;
use crate::layer;
use crate::pull::Image;
use crate::store::Store;
use crate::unpack::tree::{Limits, Tree, UnpackError};
use crate::unpack::write::{self, DirSpool, WriteError};

/// The disk's file name.
pub const DISK_FILE: &str = "rootfs.erofs";
/// The image record's file name.
pub const IMAGE_FILE: &str = "image.json";

static BUILDS: AtomicU64 = AtomicU64::new(0);

/// Why a disk could not be built.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The store's files.
    #[error("cannot build the image disk in {}", path.display())]
    Io {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A layer could not be applied (its cause names the entry).
    #[error("layer {index} ({digest}) cannot be applied")]
    Layer {
        /// From 1.
        index: usize,
        /// The layer's blob.
        digest: Digest,
        /// Why.
        #[source]
        source: UnpackError,
    },
    /// A layer's uncompressed stream failed its `diff_id`, or broke after the tree had read it.
    #[error("layer {index} ({digest}) does not match the config's diff_id")]
    DiffId {
        /// From 1.
        index: usize,
        /// The layer's blob.
        digest: Digest,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Writing the merged tree.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// `mkfs.erofs` could not run or failed.
    #[error("mkfs.erofs failed{}: install erofs-utils (scripts/deps)", status.map_or(String::new(), |s| format!(" ({s})")))]
    Mkfs {
        /// Its exit status, if it ran.
        status: Option<std::process::ExitStatus>,
    },
}

/// Where an image's disk lives once built.
pub fn disk_dir(store: &Store, manifest: &Digest) -> PathBuf {
    store.root().join("disks").join(manifest.hex())
}

/// Builds (unless built already) the disk of `image`, whose layers are in `store`. Returns the disk's
/// directory.
///
/// # Errors
/// [`DiskError`]; nothing is left in `disks/` but what was there.
pub fn build(store: &Store, image: &Image, limits: Limits) -> Result<PathBuf, DiskError> {
    let disks = store.root().join("disks");
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| DiskError::Io { path, source }
    };
    fs::DirBuilder::new().recursive(true).mode(0o700).create(&disks).map_err(io(&disks))?;
    let target = disk_dir(store, &image.manifest);
    let lock_path = disks.join(format!(".{}.lock", image.manifest.hex()));
    let _lock = crate::bounded::lock(&lock_path).map_err(io(&lock_path))?;
    if target.join(DISK_FILE).is_file() {
        return Ok(target);
    }
    let n = BUILDS.fetch_add(1, Ordering::Relaxed);
    let staging = disks.join(format!(".build-{}-{}-{n}", image.manifest.hex(), std::process::id()));
    let built = build_in(store, image, limits, &staging);
    let result = built.and_then(|()| fs::rename(&staging, &target).map_err(io(&target)));
    if result.is_err() {
        let _ = fs::remove_dir_all(&staging);
    }
    result.map(|()| target)
}

fn build_in(store: &Store, image: &Image, limits: Limits, staging: &Path) -> Result<(), DiskError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| DiskError::Io { path, source }
    };
    fs::DirBuilder::new().mode(0o700).create(staging).map_err(io(staging))?;
    let mut spool = DirSpool::create(&staging.join("spool")).map_err(io(staging))?;
    let mut tree = Tree::new(limits);
    for (i, l) in image.layers.iter().enumerate() {
        let index = i + 1;
        let blob = store.blob_path(&l.digest);
        let mut stream = layer::open(&blob, l, limits.bytes).map_err(io(&blob))?;
        tree.apply(&mut stream, &mut spool).map_err(|source| DiskError::Layer {
            index,
            digest: l.digest.clone(),
            source,
        })?;
        stream.finish().map_err(|source| DiskError::DiffId { index, digest: l.digest.clone(), source })?;
    }
    let root = staging.join("root");
    let owners = rustix::process::geteuid().is_root();
    write::write(tree.root(), &spool, &root, owners)?;
    let disk = staging.join(DISK_FILE);
    make_erofs(&root, &disk, &uuid_of(&image.manifest), owners)?;
    shareable(&disk).map_err(io(&disk))?;
    let record = serde_json::to_vec_pretty(image)
        .map_err(|e| DiskError::Io { path: staging.join(IMAGE_FILE), source: e.into() })?;
    fs::write(staging.join(IMAGE_FILE), record).map_err(io(&staging.join(IMAGE_FILE)))?;
    for scratch in ["root", "spool"] {
        let _ = fs::remove_dir_all(staging.join(scratch));
    }
    Ok(())
}

/// Makes `disk` an EROFS image of the tree at `root`, every time set to 0 and `uuid` its UUID, so that
/// one tree always gives the same bytes. Without `owners` every file is root's (a tree written by a user
/// other than root is that user's).
///
/// # Errors
/// [`DiskError::Mkfs`].
pub fn make_erofs(root: &Path, disk: &Path, uuid: &str, owners: bool) -> Result<(), DiskError> {
    let mut mkfs = Command::new("mkfs.erofs");
    mkfs.arg("-T0").arg("-x-1").arg(format!("-U{uuid}"));
    if !owners {
        mkfs.arg("--all-root");
    }
    let status = mkfs
        .arg(disk)
        .arg(root)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(DiskError::Mkfs { status: Some(s) }),
        Err(_) => Err(DiskError::Mkfs { status: None }),
    }
}

/// Makes the disk readable by every VMM (0444): each runs as a uid of its own, and reaches the file only
/// through its jail's bind mount, since the store's directories stay 0700.
pub fn shareable(disk: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(disk, fs::Permissions::from_mode(0o444))
}

/// A UUID made of the digest's first 16 bytes.
fn uuid_of(digest: &Digest) -> String {
    let h = digest.hex();
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}
