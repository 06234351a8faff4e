//! OCI image roots for sandboxes (docs/images.md): the store and registry settings every entry point
//! shares, a sandbox's root from a reference (pulled on first use through `vm_oci::obtain`, the one path),
//! the image a sandbox keeps across its restarts, and which images sandboxes use.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::root::RootImage;
use vm_oci::catalog::{self, CatalogError, Entry};
use vm_oci::digest::Digest;
use vm_oci::obtain::{obtain, Freshness, ObtainError};
use vm_oci::pull::{Image, Progress};
use vm_oci::reference::ReferenceError;
use vm_oci::registry::Options;
use vm_oci::source::Source;
use vm_oci::store::Store;
use vm_oci::unpack::tree::Limits;

/// Why a sandbox's image root could not be had.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// The reference is not one.
    #[error("{0} is not an image reference")]
    Reference(String, #[source] ReferenceError),
    /// The pull or the disk failed.
    #[error("cannot get the image {0}")]
    Obtain(String, #[source] ObtainError),
    /// The disk's path could not be made absolute.
    #[error("cannot locate the image's disk")]
    Path(#[source] std::io::Error),
}

/// Why an image was not removed.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// No image of that name or digest.
    #[error("no image {0} in the store")]
    NotFound(String),
    /// A sandbox uses it.
    #[error("image {0} is in use by a sandbox (remove the sandbox first)")]
    InUse(String),
    /// The store refused.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

/// Where images come from and are kept.
#[derive(Debug, Clone)]
pub struct ImageRoots {
    /// The local store.
    pub store: Store,
    /// How registries are reached.
    pub registry: Options,
    /// The store's cap (`--image-cache-max`): past it, least recently used images no sandbox uses go.
    pub max_bytes: Option<u64>,
    /// The sandboxes whose images are in use ([`in_use`]).
    pub sandboxes: PathBuf,
}

impl ImageRoots {
    /// The image `reference` names, from the store or pulled into it (`freshness`), with its disk built.
    ///
    /// # Errors
    /// [`RootError`]; the store holds nothing half-made.
    pub fn obtain(
        &self,
        reference: &str,
        freshness: Freshness,
        progress: &mut dyn Progress,
    ) -> Result<(Image, PathBuf), RootError> {
        let source: Source = reference.parse().map_err(|e| RootError::Reference(reference.to_owned(), e))?;
        let got = obtain(&source, &self.store, &self.registry, Limits::default(), freshness, progress)
            .map_err(|e| RootError::Obtain(source.to_string(), e))?;
        self.evict(&got.0.manifest);
        Ok(got)
    }

    /// Keeps the store under its cap: the least recently used images first, never one a sandbox uses, nor
    /// `keep` (the image just obtained, whose sandbox is not made yet). Best effort: an image that cannot be
    /// removed now stays until the next try.
    pub fn evict(&self, keep: &Digest) -> Vec<Digest> {
        let Some(max) = self.max_bytes else { return Vec::new() };
        let used = in_use(&self.sandboxes);
        catalog::evict(&self.store, max, &|d| d == keep || used.contains(d.as_str())).unwrap_or_default()
    }

    /// A sandbox's root on the image `reference` names, pulled on first use, with a writable layer of
    /// `disk_mib`.
    ///
    /// # Errors
    /// [`RootError`].
    pub fn root(&self, reference: &str, disk_mib: u32, progress: &mut dyn Progress) -> Result<RootImage, RootError> {
        let (image, dir) = self.obtain(reference, Freshness::Cached, progress)?;
        Ok(RootImage {
            manifest: image.manifest.to_string(),
            disk: std::path::absolute(dir.join(vm_oci::disk::DISK_FILE)).map_err(RootError::Path)?,
            disk_mib,
            run: image.run,
        })
    }

    /// The image named `reference` (a name as pulled, or its manifest digest).
    pub fn find(&self, reference: &str) -> Option<Entry> {
        // A short name is listed as it resolves: `python:3` as `docker.io/library/python:3`.
        let canonical = reference.parse::<Source>().map_or_else(|_| reference.to_owned(), |s| s.to_string());
        catalog::list(&self.store).into_iter().find(|e| {
            e.image.manifest.as_str() == reference || e.names.iter().any(|n| *n == canonical || *n == reference)
        })
    }

    /// Removes the image `reference` names, unless a sandbox uses it ([`in_use`]).
    ///
    /// # Errors
    /// [`RemoveError`].
    pub fn remove(&self, reference: &str) -> Result<Digest, RemoveError> {
        let entry = self.find(reference).ok_or_else(|| RemoveError::NotFound(reference.to_owned()))?;
        if in_use(&self.sandboxes).contains(entry.image.manifest.as_str()) {
            return Err(RemoveError::InUse(reference.to_owned()));
        }
        catalog::remove(&self.store, &entry.image.manifest)?;
        Ok(entry.image.manifest)
    }

    /// The root a sandbox's earlier start used, if its image's disk is still in the store: a restart keeps
    /// its image (its writable layer was written over it), even if the name has moved since.
    pub fn pinned(&self, layout: &SandboxLayout) -> Option<RootImage> {
        let root = RootImage::read(layout.dir()).ok().flatten()?;
        let manifest: Digest = root.manifest.parse().ok()?;
        let disk = vm_oci::disk::disk_dir(&self.store, &manifest).join(vm_oci::disk::DISK_FILE);
        (disk == root.disk && disk.is_file()).then_some(root)
    }
}

/// Spaces a pull's progress reports: at most one per `every` for a layer, but always its last (done).
#[derive(Debug)]
pub struct Throttle {
    every: std::time::Duration,
    last: Option<std::time::Instant>,
}

impl Throttle {
    /// Reports at most every `every`.
    pub fn new(every: std::time::Duration) -> Self {
        Self { every, last: None }
    }

    /// Whether a report of `done` of `size` bytes is due now.
    pub fn due(&mut self, done: u64, size: u64) -> bool {
        if done < size && self.last.is_some_and(|t| t.elapsed() < self.every) {
            return false;
        }
        self.last = Some(std::time::Instant::now());
        true
    }
}

/// The manifests of the images the sandboxes under `sandboxes` use: every sandbox that may run again (a
/// `serve` sandbox, running or stopped) or has not ended (a `launch`), by its root file.
pub fn in_use(sandboxes: &Path) -> HashSet<String> {
    let Ok(dirs) = std::fs::read_dir(sandboxes) else { return HashSet::new() };
    dirs.flatten()
        .filter_map(|entry| {
            let layout = SandboxLayout::new(entry.path());
            let may_run = layout.path(SandboxFile::Spec).exists() || !layout.path(SandboxFile::Tombstone).exists();
            let root = RootImage::read(layout.dir()).ok().flatten()?;
            may_run.then_some(root.manifest)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_spaces_reports_but_never_drops_a_layers_last() {
        let mut throttle = Throttle::new(std::time::Duration::from_secs(60));
        assert!(throttle.due(0, 100), "the first report");
        assert!(!throttle.due(50, 100), "within the interval");
        assert!(throttle.due(100, 100), "the layer's end");
    }

    #[test]
    fn an_image_is_in_use_while_a_sandbox_may_run_on_it() {
        let dir = std::env::temp_dir().join(format!("vm-driver-in-use-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let root = |manifest: &str| RootImage {
            manifest: manifest.into(),
            disk: "/store/disks/x/rootfs.erofs".into(),
            disk_mib: 64,
            run: vm_contract::root::RunConfig::default(),
        };
        for (name, manifest, files) in [
            ("launch-running", "sha256:a", &[][..]),
            ("launch-ended", "sha256:b", &[SandboxFile::Tombstone][..]),
            ("served-stopped", "sha256:c", &[SandboxFile::Spec, SandboxFile::Tombstone][..]),
        ] {
            let layout = SandboxLayout::new(dir.join(name));
            std::fs::create_dir_all(layout.dir()).unwrap();
            RootImage::write(Some(&root(manifest)), &layout).unwrap();
            for file in files {
                std::fs::write(layout.path(*file), b"{}").unwrap();
            }
        }
        std::fs::create_dir_all(dir.join("built-in-root")).unwrap();
        let used = in_use(&dir);
        assert_eq!(used, ["sha256:a", "sha256:c"].into_iter().map(String::from).collect());
        assert!(in_use(&dir.join("missing")).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
