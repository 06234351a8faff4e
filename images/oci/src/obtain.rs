//! The one path from a source's name to a bootable image, for every entry point (`image pull`,
//! `image import`, `launch --image`, `create --image`, the gateway): resolve the source, pull what the
//! store lacks, build the disk, record the name.

use std::path::PathBuf;

use crate::catalog::{self, CatalogError};
use crate::disk::{self, DiskError};
use crate::fetch::{Fetch, FetchError, FromArchive, FromLayout, FromRegistry};
use crate::pull::{self, Image, Progress, PullError};
use crate::registry::{Options, Registry, RegistryError};
use crate::source::Source;
use crate::store::Store;
use crate::unpack::tree::Limits;

/// Why an image could not be obtained.
#[derive(Debug, thiserror::Error)]
pub enum ObtainError {
    /// Setting up the registry client.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Opening the source.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The pull.
    #[error(transparent)]
    Pull(#[from] PullError),
    /// The disk.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// Recording the name.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

/// When to ask the source again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Use what the store has under this name (a launch: pull on first use only).
    Cached,
    /// Resolve the name again (`image pull`): a moved tag is followed.
    Refresh,
}

/// The image `source` names, with its disk built; the disk's directory beside it.
///
/// # Errors
/// [`ObtainError`]; the store holds nothing half-made.
pub fn obtain(
    source: &Source,
    store: &Store,
    options: &Options,
    limits: Limits,
    freshness: Freshness,
    progress: &mut dyn Progress,
) -> Result<(Image, PathBuf), ObtainError> {
    let name = source.to_string();
    if freshness == Freshness::Cached {
        if let Some(manifest) = catalog::resolve(store, &name) {
            let dir = disk::disk_dir(store, &manifest);
            if let Some(image) = catalog::list(store).into_iter().find(|e| e.image.manifest == manifest) {
                catalog::touch(store, &manifest)?;
                return Ok((image.image, dir));
            }
        }
    }
    store.sweep_ingest();
    let mut fetch: Box<dyn Fetch> = match source {
        Source::Registry(reference) => {
            Box::new(FromRegistry { registry: Registry::new(options)?, reference: reference.clone() })
        }
        Source::OciLayout { dir, tag } => Box::new(FromLayout { dir: dir.clone(), tag: tag.clone() }),
        Source::DockerArchive(file) => Box::new(FromArchive::open(file, store)?),
    };
    let image = pull::pull(fetch.as_mut(), store, progress)?;
    let dir = disk::build(store, &image, limits)?;
    catalog::tag(store, &name, &image.manifest)?;
    Ok((image, dir))
}
