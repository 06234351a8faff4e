//! Getting a source's manifests and blobs into the store, the same way for every source.

use std::collections::HashMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use crate::bounded::read_up_to;
use crate::digest::Digest;
use crate::manifest::{self, MAX_MANIFEST_BYTES};
use crate::reference::Reference;
use crate::registry::{Fetched, Registry, RegistryError};
use crate::store::{Store, StoreError};

/// Largest file of a `docker save` archive (a layer); past it the archive is refused.
const MAX_ARCHIVE_FILE_BYTES: u64 = 16 * 1024 * 1024 * 1024;
/// Largest `index.json` of a layout or `manifest.json` of an archive.
const MAX_INDEX_BYTES: u64 = 1024 * 1024;

/// Why a source could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The registry.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A file of a layout or archive.
    #[error("cannot read {}", path.display())]
    Read {
        /// Which.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The layout or archive lacks what it must hold, or holds it malformed.
    #[error("{}: {why}", path.display())]
    Malformed {
        /// Which.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// Bytes of a blob arrived (for progress bars).
pub type OnBytes<'a> = &'a mut dyn FnMut(u64);

/// A source opened for fetching.
pub trait Fetch {
    /// The manifest (or index) the source names.
    ///
    /// # Errors
    /// [`FetchError`].
    fn top(&mut self) -> Result<Fetched, FetchError>;

    /// A manifest by digest (an index's entry).
    ///
    /// # Errors
    /// [`FetchError`].
    fn manifest(&mut self, digest: &Digest) -> Result<Fetched, FetchError>;

    /// The blob `digest` of `size` bytes, in the store (fetched unless already there).
    ///
    /// # Errors
    /// [`FetchError`].
    fn blob(&mut self, store: &Store, digest: &Digest, size: u64, on_bytes: OnBytes<'_>)
        -> Result<PathBuf, FetchError>;
}

/// Counts bytes as they are read.
struct Counting<'a, R> {
    inner: R,
    on_bytes: OnBytes<'a>,
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        (self.on_bytes)(n as u64);
        Ok(n)
    }
}

/// A registry repository.
#[derive(Debug)]
pub struct FromRegistry {
    /// The client.
    pub registry: Registry,
    /// The image.
    pub reference: Reference,
}

impl Fetch for FromRegistry {
    fn top(&mut self) -> Result<Fetched, FetchError> {
        let fetched = self.registry.manifest(&self.reference, &self.reference.manifest_ref())?;
        if let Some(pinned) = &self.reference.digest {
            check_pin(pinned, &fetched)?;
        }
        Ok(fetched)
    }

    fn manifest(&mut self, digest: &Digest) -> Result<Fetched, FetchError> {
        let fetched = self.registry.manifest(&self.reference, digest.as_str())?;
        check_pin(digest, &fetched)?;
        Ok(fetched)
    }

    fn blob(
        &mut self,
        store: &Store,
        digest: &Digest,
        size: u64,
        on_bytes: OnBytes<'_>,
    ) -> Result<PathBuf, FetchError> {
        let mut failed = None;
        let stored = store.ingest(digest, size, || {
            self.registry.blob(&self.reference, digest).map(|inner| Counting { inner, on_bytes }).map_err(|e| {
                failed = Some(e);
                io::Error::other("registry")
            })
        });
        match (stored, failed) {
            (_, Some(e)) => Err(e.into()),
            (stored, None) => Ok(stored?),
        }
    }
}

/// A manifest fetched by digest must have that digest.
fn check_pin(digest: &Digest, fetched: &Fetched) -> Result<(), FetchError> {
    if &fetched.digest == digest {
        return Ok(());
    }
    Err(FetchError::Malformed {
        path: PathBuf::from(digest.as_str()),
        why: format!("the manifest fetched by this digest has digest {}", fetched.digest),
    })
}

/// An OCI image layout.
#[derive(Debug)]
pub struct FromLayout {
    /// The layout's directory.
    pub dir: PathBuf,
    /// The tag to pick.
    pub tag: Option<String>,
}

impl FromLayout {
    fn blob_path(&self, digest: &Digest) -> PathBuf {
        // The digest was validated: its hex is one path component.
        self.dir.join("blobs/sha256").join(digest.hex())
    }

    fn read(&self, digest: &Digest, limit: u64) -> Result<Fetched, FetchError> {
        let path = self.blob_path(digest);
        let bytes = read_bounded(&path, limit)?;
        let fetched = Fetched { digest: Digest::of(&bytes), bytes, content_type: None };
        check_pin(digest, &fetched)?;
        Ok(fetched)
    }
}

impl Fetch for FromLayout {
    fn top(&mut self) -> Result<Fetched, FetchError> {
        let path = self.dir.join("index.json");
        let bytes = read_bounded(&path, MAX_INDEX_BYTES)?;
        let malformed = |why: String| FetchError::Malformed { path: path.clone(), why };
        let index = oci_spec::image::ImageIndex::from_reader(bytes.as_slice()).map_err(|e| malformed(e.to_string()))?;
        let name = |d: &oci_spec::image::Descriptor| {
            d.annotations().as_ref().and_then(|a| a.get("org.opencontainers.image.ref.name")).cloned()
        };
        let chosen = match &self.tag {
            Some(tag) => index.manifests().iter().find(|d| name(d).as_deref() == Some(tag.as_str())),
            None if index.manifests().len() == 1 => index.manifests().first(),
            None => None,
        };
        let Some(chosen) = chosen else {
            let tags: Vec<String> = index.manifests().iter().filter_map(name).collect();
            return Err(malformed(format!(
                "no manifest tagged {:?} (tags: {})",
                self.tag.as_deref().unwrap_or(""),
                tags.join(", ")
            )));
        };
        let digest = manifest::digest_of(chosen).map_err(|e| malformed(e.to_string()))?;
        self.read(&digest, MAX_MANIFEST_BYTES)
    }

    fn manifest(&mut self, digest: &Digest) -> Result<Fetched, FetchError> {
        self.read(digest, MAX_MANIFEST_BYTES)
    }

    fn blob(
        &mut self,
        store: &Store,
        digest: &Digest,
        size: u64,
        on_bytes: OnBytes<'_>,
    ) -> Result<PathBuf, FetchError> {
        let path = self.blob_path(digest);
        Ok(store.ingest(digest, size, || std::fs::File::open(&path).map(|inner| Counting { inner, on_bytes }))?)
    }
}

fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FetchError> {
    let read = |source| FetchError::Read { path: path.to_owned(), source };
    let file = std::fs::File::open(path).map_err(read)?;
    read_up_to(file, limit)
        .map_err(read)?
        .ok_or_else(|| FetchError::Malformed { path: path.to_owned(), why: format!("larger than {limit} bytes") })
}

/// A `docker save` archive: every file stored by the digest it has, in one pass over the archive, and a
/// manifest made from its `manifest.json` (the archive has none of its own by digest).
#[derive(Debug)]
pub struct FromArchive {
    manifest: Fetched,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ArchiveEntry {
    config: String,
    layers: Vec<String>,
}

impl FromArchive {
    /// Reads the archive at `path` into `store`.
    ///
    /// # Errors
    /// [`FetchError`].
    pub fn open(path: &Path, store: &Store) -> Result<Self, FetchError> {
        let read = |source| FetchError::Read { path: path.to_owned(), source };
        let malformed = |why: &str| FetchError::Malformed { path: path.to_owned(), why: why.to_owned() };
        let file = std::fs::File::open(path).map_err(read)?;
        let mut files: HashMap<Vec<u8>, (Digest, u64)> = HashMap::new();
        let mut links: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        let mut index = None;
        let mut archive = tar::Archive::new(file);
        for entry in archive.entries().map_err(read)? {
            let mut entry = entry.map_err(read)?;
            let name = clean(&entry.path_bytes());
            match entry.header().entry_type() {
                tar::EntryType::Regular if name == b"manifest.json" => {
                    let bytes = read_up_to(&mut entry, MAX_INDEX_BYTES).map_err(read)?;
                    index = Some(bytes.ok_or_else(|| malformed("manifest.json is too large"))?);
                }
                tar::EntryType::Regular => {
                    let stored = store.ingest_unnamed(&mut entry, MAX_ARCHIVE_FILE_BYTES)?;
                    files.insert(name, stored);
                }
                tar::EntryType::Symlink => {
                    let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                    links.insert(name, target);
                }
                _ => {}
            }
        }
        let index = index.ok_or_else(|| malformed("no manifest.json: not a docker save archive"))?;
        let entries: Vec<ArchiveEntry> =
            serde_json::from_slice(&index).map_err(|_| malformed("malformed manifest.json"))?;
        let [entry] = entries.as_slice() else {
            return Err(malformed("the archive must hold exactly one image"));
        };
        let find = |name: &str| -> Result<(Digest, u64), FetchError> {
            let name = clean(name.as_bytes());
            // A layer named twice is a symlink to the first, relative to the link's directory.
            let resolved = links.get(&name).map_or(name.clone(), |target| {
                let dir = name.iter().rposition(|c| *c == b'/').map_or(&b""[..], |i| &name[..i]);
                clean(&[dir, b"/", target].concat())
            });
            files.get(&resolved).cloned().ok_or_else(|| malformed("manifest.json names a file the archive lacks"))
        };
        let (config, config_size) = find(&entry.config)?;
        let mut layers = Vec::new();
        for layer in &entry.layers {
            let (digest, size) = find(layer)?;
            let gzip = {
                let mut magic = [0u8; 2];
                let blob = std::fs::File::open(store.blob_path(&digest)).map_err(read)?;
                let n = blob.take(2).read(&mut magic).map_err(read)?;
                n == 2 && magic == [0x1f, 0x8b]
            };
            let media_type = if gzip {
                "application/vnd.oci.image.layer.v1.tar+gzip"
            } else {
                "application/vnd.oci.image.layer.v1.tar"
            };
            layers.push(serde_json::json!({"mediaType": media_type, "digest": digest.as_str(), "size": size}));
        }
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config.as_str(), "size": config_size},
            "layers": layers,
        });
        let bytes = serde_json::to_vec(&manifest).map_err(|_| malformed("manifest"))?;
        Ok(Self { manifest: Fetched { digest: Digest::of(&bytes), bytes, content_type: None } })
    }
}

/// `./a//b` -> `a/b`, for looking names up (never for opening them).
fn clean(name: &[u8]) -> Vec<u8> {
    name.split(|b| *b == b'/').filter(|p| !p.is_empty() && *p != b".").collect::<Vec<_>>().join(&b'/')
}

impl Fetch for FromArchive {
    fn top(&mut self) -> Result<Fetched, FetchError> {
        Ok(self.manifest.clone())
    }

    fn manifest(&mut self, digest: &Digest) -> Result<Fetched, FetchError> {
        Err(FetchError::Malformed {
            path: PathBuf::from(digest.as_str()),
            why: "a docker save archive has no index".into(),
        })
    }

    fn blob(
        &mut self,
        store: &Store,
        digest: &Digest,
        size: u64,
        on_bytes: OnBytes<'_>,
    ) -> Result<PathBuf, FetchError> {
        let path = store.blob_path(digest);
        let stored = std::fs::metadata(&path).map_err(|source| FetchError::Read { path: path.clone(), source })?;
        if stored.len() != size {
            return Err(FetchError::Malformed { path, why: "stored blob size differs".into() });
        }
        on_bytes(size);
        Ok(path)
    }
}
