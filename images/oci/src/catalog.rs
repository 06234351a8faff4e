//! What the store holds by name: references (the name a user pulled, pointing at a manifest digest) and
//! images (a built disk and its record), with when each image was last used, and least-recently-used
//! eviction of images no sandbox uses.
//!
//! ```text
//! <store>/refs/<sha256 of the name>.json   {"name": ..., "manifest": ...}
//! <store>/disks/<manifest hex>/used       touched at each use (its mtime is the last use)
//! ```
//!
//! Every file is written under a temporary name and renamed, so a reader never sees half of one.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::disk::{disk_dir, DISK_FILE, IMAGE_FILE};
use crate::pull::Image;
use crate::store::Store;

/// Why the catalog could not be read or changed.
#[derive(Debug, thiserror::Error)]
#[error("cannot update the image store at {}", path.display())]
pub struct CatalogError {
    /// Where.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

fn at(path: &Path) -> impl FnOnce(io::Error) -> CatalogError + '_ {
    move |source| CatalogError { path: path.to_owned(), source }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RefFile {
    name: String,
    manifest: Digest,
}

/// One image in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The names that point at it.
    pub names: Vec<String>,
    /// The image.
    pub image: Image,
    /// Bytes on disk: the disk and the image's blobs.
    pub bytes: u64,
    /// The last use (a pull, a launch).
    pub used: SystemTime,
}

fn ref_path(store: &Store, name: &str) -> PathBuf {
    store.root().join("refs").join(format!("{}.json", Digest::of(name.as_bytes()).hex()))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CatalogError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(at(dir))?;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, bytes).map_err(at(&tmp))?;
    fs::rename(&tmp, path).map_err(at(path))
}

/// Points `name` at `manifest` and marks the image used now.
///
/// # Errors
/// [`CatalogError`].
pub fn tag(store: &Store, name: &str, manifest: &Digest) -> Result<(), CatalogError> {
    let record = RefFile { name: name.to_owned(), manifest: manifest.clone() };
    let path = ref_path(store, name);
    write_atomic(
        &path,
        &serde_json::to_vec(&record).map_err(|e| CatalogError { path: path.clone(), source: e.into() })?,
    )?;
    touch(store, manifest)
}

/// The manifest `name` points at, if it has been pulled and its disk built.
pub fn resolve(store: &Store, name: &str) -> Option<Digest> {
    let text = fs::read(ref_path(store, name)).ok()?;
    let record: RefFile = serde_json::from_slice(&text).ok()?;
    disk_dir(store, &record.manifest).join(DISK_FILE).is_file().then_some(record.manifest)
}

/// Marks the image used now.
///
/// # Errors
/// [`CatalogError`].
pub fn touch(store: &Store, manifest: &Digest) -> Result<(), CatalogError> {
    let dir = disk_dir(store, manifest);
    if !dir.is_dir() {
        return Ok(());
    }
    let used = dir.join("used");
    write_atomic(&used, b"")
}

fn refs(store: &Store) -> Vec<RefFile> {
    let Ok(entries) = fs::read_dir(store.root().join("refs")) else { return Vec::new() };
    entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_slice(&fs::read(e.path()).ok()?).ok())
        .collect()
}

/// Every image whose disk is built, most recently used first.
pub fn list(store: &Store) -> Vec<Entry> {
    let refs = refs(store);
    let Ok(disks) = fs::read_dir(store.root().join("disks")) else { return Vec::new() };
    let mut out: Vec<Entry> = disks
        .flatten()
        .filter(|d| !d.file_name().to_string_lossy().starts_with('.'))
        .filter_map(|d| {
            let dir = d.path();
            let image: Image = serde_json::from_slice(&fs::read(dir.join(IMAGE_FILE)).ok()?).ok()?;
            let disk = fs::metadata(dir.join(DISK_FILE)).ok()?.len();
            let used = fs::metadata(dir.join("used")).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
            let names = refs.iter().filter(|r| r.manifest == image.manifest).map(|r| r.name.clone()).collect();
            Some(Entry { names, bytes: disk + image.stored_bytes(), image, used })
        })
        .collect();
    out.sort_by_key(|e| std::cmp::Reverse(e.used));
    out
}

/// Removes the image `manifest`: its names, its disk, and the blobs no other image in the store uses.
///
/// # Errors
/// [`CatalogError`].
pub fn remove(store: &Store, manifest: &Digest) -> Result<(), CatalogError> {
    for r in refs(store).into_iter().filter(|r| &r.manifest == manifest) {
        let path = ref_path(store, &r.name);
        fs::remove_file(&path).map_err(at(&path))?;
    }
    let entries = list(store);
    let Some(gone) = entries.iter().find(|e| &e.image.manifest == manifest) else { return Ok(()) };
    let kept: BTreeSet<&Digest> = entries
        .iter()
        .filter(|e| &e.image.manifest != manifest)
        .flat_map(|e| e.image.layers.iter().map(|l| &l.digest).chain([&e.image.manifest, &e.image.config]))
        .collect();
    let dir = disk_dir(store, manifest);
    // The disk goes first: without it the image is not listed, whatever blobs are left.
    let trash = dir.with_file_name(format!(".rm-{}", manifest.hex()));
    fs::rename(&dir, &trash).map_err(at(&dir))?;
    fs::remove_dir_all(&trash).map_err(at(&trash))?;
    for digest in gone.image.layers.iter().map(|l| &l.digest).chain([manifest, &gone.image.config]) {
        if !kept.contains(digest) {
            let _ = fs::remove_file(store.blob_path(digest));
        }
    }
    Ok(())
}

/// Removes least-recently-used images not `in_use` until the store holds at most `max_bytes` of images.
/// Returns the manifests removed.
///
/// # Errors
/// [`CatalogError`].
pub fn evict(store: &Store, max_bytes: u64, in_use: &dyn Fn(&Digest) -> bool) -> Result<Vec<Digest>, CatalogError> {
    let mut entries = list(store);
    let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
    let mut removed = Vec::new();
    // Oldest last in `list`'s order.
    while total > max_bytes {
        let Some(pos) = entries.iter().rposition(|e| !in_use(&e.image.manifest)) else { break };
        let victim = entries.remove(pos);
        remove(store, &victim.image.manifest)?;
        total = total.saturating_sub(victim.bytes);
        removed.push(victim.image.manifest);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Compression, Layer, RunConfig};

    fn store(name: &str) -> Store {
        let dir = std::env::temp_dir().join(format!("vm-oci-catalog-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        Store::open(&dir).unwrap()
    }

    /// An image with one layer `shared` and one of its own, its blobs and disk present.
    fn image(store: &Store, name: &str, shared: &[u8], disk_bytes: usize) -> Image {
        let mut layers = Vec::new();
        for data in [shared, name.as_bytes()] {
            let digest = Digest::of(data);
            store.ingest(&digest, data.len() as u64, || Ok(data)).unwrap();
            layers.push(Layer {
                diff_id: digest.clone(),
                digest,
                size: data.len() as u64,
                compression: Compression::None,
            });
        }
        let config = format!("config of {name}");
        let config_digest = Digest::of(config.as_bytes());
        store.ingest(&config_digest, config.len() as u64, || Ok(config.as_bytes())).unwrap();
        let image = Image {
            manifest: Digest::of(format!("manifest of {name}").as_bytes()),
            config: config_digest,
            run: RunConfig::default(),
            layers,
        };
        let dir = disk_dir(store, &image.manifest);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(DISK_FILE), vec![0u8; disk_bytes]).unwrap();
        fs::write(dir.join(IMAGE_FILE), serde_json::to_vec(&image).unwrap()).unwrap();
        tag(store, name, &image.manifest).unwrap();
        image
    }

    #[test]
    fn names_resolve_list_and_go_with_their_image() {
        let s = store("names");
        let a = image(&s, "a:1", b"base", 100);
        let b = image(&s, "b:1", b"base", 100);
        assert_eq!(resolve(&s, "a:1"), Some(a.manifest.clone()));
        assert_eq!(list(&s).len(), 2);
        remove(&s, &a.manifest).unwrap();
        assert_eq!(resolve(&s, "a:1"), None);
        assert!(!s.has(&a.layers[1].digest) && !s.has(&a.config), "a's own blobs went");
        assert!(s.has(&b.layers[0].digest), "the shared layer stays for b");
        let _ = fs::remove_dir_all(s.root());
    }

    #[test]
    fn eviction_takes_the_least_recently_used_image_no_sandbox_uses() {
        let s = store("evict");
        let old = image(&s, "old:1", b"x", 1000);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let busy = image(&s, "busy:1", b"y", 1000);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let new = image(&s, "new:1", b"z", 1000);
        touch(&s, &old.manifest).unwrap();
        // old was used last, busy is in use: new goes.
        let removed = evict(&s, 2500, &|d| d == &busy.manifest).unwrap();
        assert_eq!(removed, vec![new.manifest.clone()]);
        assert_eq!(resolve(&s, "busy:1"), Some(busy.manifest.clone()));
        let removed = evict(&s, 0, &|d| d == &busy.manifest).unwrap();
        assert_eq!(removed, vec![old.manifest], "never the image in use");
        let _ = fs::remove_dir_all(s.root());
    }
}
