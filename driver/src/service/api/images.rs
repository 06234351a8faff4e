//! The image RPCs (`PullImage`, `ListImages`, `RemoveImage`) on the store `serve` shares with its sandboxes'
//! starts: the same `vm_oci::obtain` path, off the async workers.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use futures_util::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use vm_oci::catalog::Entry;
use vm_oci::manifest::Layer;
use vm_oci::obtain::Freshness;
use vm_oci::pull::Progress;
use vm_protocol::driver_api::{pull_image_progress, ImageInfo, LayerProgress, PullImageProgress};

use crate::oci::{RemoveError, Throttle};
use crate::service::hub::Hub;

/// The stream `PullImage` answers with.
pub(super) type PullStream = Pin<Box<dyn Stream<Item = Result<PullImageProgress, Status>> + Send>>;

/// Progress messages queued for a slow client; beyond them, progress (never the result) is dropped.
const QUEUED: usize = 64;
/// The least time between two progress messages of one layer (its last is always sent).
const PROGRESS_EVERY: Duration = Duration::from_millis(200);

/// Pulls `reference` into the store, following a moved tag, streaming per-layer progress and then the image.
pub(super) fn pull(hub: &Arc<Hub>, reference: String) -> Result<PullStream, Status> {
    reference
        .parse::<vm_oci::source::Source>()
        .map_err(|e| Status::invalid_argument(format!("{reference} is not an image reference: {e}")))?;
    let (tx, rx) = mpsc::channel(QUEUED);
    let oci = hub.ctx.oci.clone();
    tokio::task::spawn_blocking(move || {
        let mut progress = Streamed { tx: tx.clone(), throttle: Throttle::new(PROGRESS_EVERY) };
        let last = match oci.obtain(&reference, Freshness::Refresh, &mut progress) {
            Ok((image, _)) => oci
                .find(image.manifest.as_str())
                .map(|entry| info(&entry, &crate::oci::in_use(&oci.sandboxes)))
                .map(|info| PullImageProgress { progress: Some(pull_image_progress::Progress::Image(info)) })
                .ok_or_else(|| Status::internal("the pulled image is not in the store")),
            Err(e) => Err(Status::failed_precondition(vm_contract::logs::chain(&e))),
        };
        let _ = tx.blocking_send(last);
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Every image in the store.
pub(super) async fn list(hub: &Arc<Hub>) -> Result<Vec<ImageInfo>, Status> {
    let oci = hub.ctx.oci.clone();
    tokio::task::spawn_blocking(move || {
        let used = crate::oci::in_use(&oci.sandboxes);
        vm_oci::catalog::list(&oci.store).iter().map(|e| info(e, &used)).collect()
    })
    .await
    .map_err(|_| Status::internal("the listing's task failed"))
}

/// Removes the image `reference` names, unless a sandbox uses it.
pub(super) async fn remove(hub: &Arc<Hub>, reference: String) -> Result<String, Status> {
    let oci = hub.ctx.oci.clone();
    let removed = tokio::task::spawn_blocking(move || oci.remove(&reference))
        .await
        .map_err(|_| Status::internal("the removal's task failed"))?;
    match removed {
        Ok(manifest) => Ok(manifest.to_string()),
        Err(e @ RemoveError::NotFound(_)) => Err(Status::not_found(e.to_string())),
        Err(e @ RemoveError::InUse(_)) => Err(Status::failed_precondition(e.to_string())),
        Err(e) => Err(Status::internal(vm_contract::logs::chain(&e))),
    }
}

fn info(entry: &Entry, in_use: &std::collections::HashSet<String>) -> ImageInfo {
    let manifest = entry.image.manifest.to_string();
    ImageInfo {
        in_use: in_use.contains(&manifest),
        manifest,
        names: entry.names.clone(),
        bytes: entry.bytes,
        last_used_ms: entry
            .used
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
    }
}

/// A pull's progress as stream messages.
struct Streamed {
    tx: mpsc::Sender<Result<PullImageProgress, Status>>,
    throttle: Throttle,
}

impl Progress for Streamed {
    fn layer(&mut self, index: usize, count: usize, layer: &Layer, done: u64) {
        if !self.throttle.due(done, layer.size) {
            return;
        }
        let layer = LayerProgress {
            index: u32::try_from(index + 1).unwrap_or(u32::MAX),
            count: u32::try_from(count).unwrap_or(u32::MAX),
            digest: layer.digest.to_string(),
            size: layer.size,
            done,
        };
        // A full queue drops progress only.
        let _ = self.tx.try_send(Ok(PullImageProgress { progress: Some(pull_image_progress::Progress::Layer(layer)) }));
    }
}
