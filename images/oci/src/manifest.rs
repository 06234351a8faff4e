//! Manifests, indexes and configs: OCI's and Docker's schema 2, parsed with `oci-spec` after a bound on
//! their size. An index (or Docker manifest list) resolves to its `linux/amd64` entry and nothing else; a
//! Docker schema 1 manifest, a foreign layer, and any media type not listed here are refused by name.

use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType};
use serde::{Deserialize, Serialize};

use crate::digest::{Digest, DigestError};

/// Largest manifest or index read (containerd's bound).
pub const MAX_MANIFEST_BYTES: u64 = 4 * 1024 * 1024;
/// Largest image config read.
pub const MAX_CONFIG_BYTES: u64 = 8 * 1024 * 1024;
/// Most layers an image may have.
pub const MAX_LAYERS: usize = 256;

/// What every registry request's `Accept` lists.
pub const ACCEPT: [&str; 4] = [OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST];

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";

/// Why a manifest, index or config was refused.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Over [`MAX_MANIFEST_BYTES`] or [`MAX_CONFIG_BYTES`].
    #[error("{what} is larger than {limit} bytes")]
    TooLarge {
        /// `manifest` or `config`.
        what: &'static str,
        /// The bound.
        limit: u64,
    },
    /// Not JSON of the expected shape.
    #[error("malformed {what}")]
    Malformed {
        /// `manifest`, `index` or `config`.
        what: &'static str,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A media type we do not handle.
    #[error("unsupported media type {0:?}")]
    MediaType(String),
    /// Docker's schema 1.
    #[error("Docker schema 1 manifests are not supported (push the image again with a current tool)")]
    Schema1,
    /// The index has no `linux/amd64` image.
    #[error("no linux/amd64 image in the index (it has: {0})")]
    Platform(String),
    /// A descriptor's digest is not one we accept.
    #[error("descriptor digest")]
    Digest(#[from] DigestError),
    /// The config's `rootfs.diff_ids` do not match the layers.
    #[error("the config lists {diff_ids} layer digests for {layers} layers")]
    DiffIds {
        /// In the config.
        diff_ids: usize,
        /// In the manifest.
        layers: usize,
    },
    /// Over [`MAX_LAYERS`].
    #[error("the image has {0} layers (at most {MAX_LAYERS})")]
    TooManyLayers(usize),
}

/// A manifest or an index, by its media type.
#[derive(Debug)]
pub enum Parsed {
    /// A multi-platform index.
    Index(Box<ImageIndex>),
    /// One image.
    Image(Box<ImageManifest>),
}

#[derive(Deserialize)]
struct Peek {
    #[serde(rename = "schemaVersion")]
    schema_version: Option<u32>,
    #[serde(rename = "mediaType")]
    media_type: Option<String>,
    manifests: Option<serde_json::Value>,
}

/// Parses a manifest or index (`content_type`: the registry's `Content-Type`, if any).
///
/// # Errors
/// [`ManifestError`].
pub fn parse(bytes: &[u8], content_type: Option<&str>) -> Result<Parsed, ManifestError> {
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge { what: "manifest", limit: MAX_MANIFEST_BYTES });
    }
    let peek: Peek =
        serde_json::from_slice(bytes).map_err(|source| ManifestError::Malformed { what: "manifest", source })?;
    if peek.schema_version == Some(1) {
        return Err(ManifestError::Schema1);
    }
    // The document's own media type wins over the header (both are the registry's word; the document is
    // what the digest covers).
    let media_type = peek.media_type.as_deref().or(content_type.map(|c| c.split(';').next().unwrap_or(c).trim()));
    let index = match media_type {
        Some(OCI_INDEX | DOCKER_LIST) => true,
        Some(OCI_MANIFEST | DOCKER_MANIFEST) => false,
        Some(t) if t.contains("distribution.manifest.v1") => return Err(ManifestError::Schema1),
        Some("application/json") | None => peek.manifests.is_some(),
        Some(other) => return Err(ManifestError::MediaType(other.to_owned())),
    };
    if index {
        let index = ImageIndex::from_reader(bytes).map_err(|e| malformed("index", e))?;
        Ok(Parsed::Index(Box::new(index)))
    } else {
        let manifest = ImageManifest::from_reader(bytes).map_err(|e| malformed("manifest", e))?;
        Ok(Parsed::Image(Box::new(manifest)))
    }
}

fn malformed(what: &'static str, e: oci_spec::OciSpecError) -> ManifestError {
    let source = match e {
        oci_spec::OciSpecError::SerDe(e) => e,
        other => serde::de::Error::custom(other.to_string()),
    };
    ManifestError::Malformed { what, source }
}

/// The index's `linux/amd64` manifest (any variant); never another platform.
///
/// # Errors
/// [`ManifestError::Platform`] listing what the index has.
pub fn pick_platform(index: &ImageIndex) -> Result<&Descriptor, ManifestError> {
    let platform = |d: &Descriptor| d.platform().as_ref().map(|p| (p.os().to_string(), p.architecture().to_string()));
    index
        .manifests()
        .iter()
        .find(|d| platform(d).is_some_and(|(os, arch)| os == "linux" && arch == "amd64"))
        .ok_or_else(|| {
            let seen: Vec<String> =
                index.manifests().iter().filter_map(platform).map(|(os, arch)| format!("{os}/{arch}")).collect();
            ManifestError::Platform(if seen.is_empty() { "no platforms".to_owned() } else { seen.join(", ") })
        })
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// A plain tar.
    None,
    /// gzip.
    Gzip,
    /// zstd.
    Zstd,
}

/// The compression a layer's media type names.
///
/// # Errors
/// [`ManifestError::MediaType`] for anything else (a foreign layer included).
pub fn layer_compression(media_type: &MediaType) -> Result<Compression, ManifestError> {
    match media_type {
        MediaType::ImageLayer | MediaType::ImageLayerNonDistributable => Ok(Compression::None),
        MediaType::ImageLayerGzip | MediaType::ImageLayerNonDistributableGzip => Ok(Compression::Gzip),
        MediaType::ImageLayerZstd | MediaType::ImageLayerNonDistributableZstd => Ok(Compression::Zstd),
        MediaType::Other(t) if t == DOCKER_LAYER => Ok(Compression::Gzip),
        other => Err(ManifestError::MediaType(other.to_string())),
    }
}

/// A digest from a descriptor, as ours (sha256 only).
///
/// # Errors
/// [`ManifestError::Digest`].
pub fn digest_of(descriptor: &Descriptor) -> Result<Digest, ManifestError> {
    Ok(descriptor.digest().to_string().parse()?)
}

/// One layer to fetch and apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    /// The blob.
    pub digest: Digest,
    /// Its size.
    pub size: u64,
    /// How it is compressed.
    pub compression: Compression,
    /// The digest of the uncompressed tar (the config's `diff_id`).
    pub diff_id: Digest,
}

/// What of an image's config a sandbox honours (docs/images.md): the supervisor's contract, so the two
/// read one type.
pub use vm_contract::root::RunConfig;

/// The config's checked checks: the run settings, and the layers' diff ids (one per layer, in order).
///
/// # Errors
/// [`ManifestError`].
pub fn config(bytes: &[u8], manifest: &ImageManifest) -> Result<(RunConfig, Vec<Layer>), ManifestError> {
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(ManifestError::TooLarge { what: "config", limit: MAX_CONFIG_BYTES });
    }
    match manifest.config().media_type() {
        MediaType::ImageConfig => {}
        MediaType::Other(t) if t == DOCKER_CONFIG => {}
        other => return Err(ManifestError::MediaType(other.to_string())),
    }
    let layers = manifest.layers();
    if layers.len() > MAX_LAYERS {
        return Err(ManifestError::TooManyLayers(layers.len()));
    }
    let image = ImageConfiguration::from_reader(bytes).map_err(|e| malformed("config", e))?;
    let diff_ids = image.rootfs().diff_ids();
    if diff_ids.len() != layers.len() {
        return Err(ManifestError::DiffIds { diff_ids: diff_ids.len(), layers: layers.len() });
    }
    let layers = layers
        .iter()
        .zip(diff_ids)
        .map(|(d, diff_id)| {
            Ok(Layer {
                digest: digest_of(d)?,
                size: d.size(),
                compression: layer_compression(d.media_type())?,
                diff_id: diff_id.parse()?,
            })
        })
        .collect::<Result<Vec<_>, ManifestError>>()?;
    let c = image.config().clone().unwrap_or_default();
    let run = RunConfig {
        env: c.env().clone().unwrap_or_default(),
        working_dir: c.working_dir().clone().filter(|w| !w.is_empty()),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
        stop_signal: c.stop_signal().clone().filter(|s| !s.is_empty()),
        user: c.user().clone().filter(|u| !u.is_empty()),
    };
    Ok((run, layers))
}

#[cfg(test)]
mod tests;
