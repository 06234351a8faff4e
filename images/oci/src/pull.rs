//! A pull: the source's manifest (through an index to `linux/amd64`), its config, and its layers, each
//! into the store verified. What it yields is what the disk builder and a sandbox need.

use std::io::Read;

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::fetch::{Fetch, FetchError};
use crate::manifest::{self, Layer, ManifestError, Parsed, RunConfig, MAX_CONFIG_BYTES};
use crate::store::{Store, StoreError};

/// A pulled image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// The image manifest's digest (its identity in the store).
    pub manifest: Digest,
    /// The config blob's digest.
    pub config: Digest,
    /// What of its config a sandbox honours.
    pub run: RunConfig,
    /// Its layers, in order.
    pub layers: Vec<Layer>,
}

impl Image {
    /// Bytes of its layers as stored (compressed).
    pub fn stored_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }
}

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// Reading the source.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// A manifest, index or config.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An index whose platform entry is another index.
    #[error("the linux/amd64 entry of the index is not an image manifest")]
    NestedIndex,
    /// The config's descriptor says it is larger than we read.
    #[error("the image config is {0} bytes (at most {MAX_CONFIG_BYTES})")]
    ConfigTooLarge(u64),
}

/// What a pull reports as it goes.
pub trait Progress {
    /// Layer `index` (from 0) of `count` has `done` of its bytes.
    fn layer(&mut self, index: usize, count: usize, layer: &Layer, done: u64);
}

/// Reports nothing.
#[derive(Debug, Default)]
pub struct Quiet;

impl Progress for Quiet {
    fn layer(&mut self, _: usize, _: usize, _: &Layer, _: u64) {}
}

/// Pulls what `fetch` names into `store`.
///
/// # Errors
/// [`PullError`]; whatever was stored before it is whole and verified.
pub fn pull(fetch: &mut dyn Fetch, store: &Store, progress: &mut dyn Progress) -> Result<Image, PullError> {
    let top = fetch.top()?;
    let fetched = match manifest::parse(&top.bytes, top.content_type.as_deref())? {
        Parsed::Index(index) => fetch.manifest(&manifest::digest_of(manifest::pick_platform(&index)?)?)?,
        Parsed::Image(_) => top,
    };
    let Parsed::Image(image) = manifest::parse(&fetched.bytes, fetched.content_type.as_deref())? else {
        return Err(PullError::NestedIndex);
    };
    let config = image.config();
    if config.size() > MAX_CONFIG_BYTES {
        return Err(PullError::ConfigTooLarge(config.size()));
    }
    let config_digest = manifest::digest_of(config)?;
    let config_path = fetch.blob(store, &config_digest, config.size(), &mut |_| {})?;
    let mut config_bytes = Vec::new();
    std::fs::File::open(&config_path)
        .and_then(|f| f.take(MAX_CONFIG_BYTES).read_to_end(&mut config_bytes))
        .map_err(|source| StoreError::Io { path: config_path.clone(), source })?;
    let (run, layers) = manifest::config(&config_bytes, &image)?;
    for (index, layer) in layers.iter().enumerate() {
        let mut done = 0;
        progress.layer(index, layers.len(), layer, 0);
        fetch.blob(store, &layer.digest, layer.size, &mut |n| {
            done += n;
            progress.layer(index, layers.len(), layer, done);
        })?;
        progress.layer(index, layers.len(), layer, layer.size);
    }
    // The manifest itself, so the store holds everything the image's digest covers.
    store.ingest(&fetched.digest, fetched.bytes.len() as u64, || Ok(fetched.bytes.as_slice()))?;
    Ok(Image { manifest: fetched.digest, config: config_digest, run, layers })
}
