//! A sandbox's image root at each start: the image an earlier start pinned, else pulled (on first use)
//! while the sandbox is PROVISIONING, its progress on `Watch` as `pulling-image` events.

use std::sync::Arc;
use std::time::Duration;

use vm_contract::ids::SandboxId;
use vm_contract::root::RootImage;
use vm_oci::manifest::Layer;
use vm_oci::pull::Progress;

use super::{Actor, State};
use crate::oci::Throttle;
use crate::service::hub::Hub;

/// The least time between two progress events of one pull (the last of each layer is always sent).
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

impl Actor {
    /// The root this start boots: `Ok(None)` for the built-in root, `Err(detail)` when the image cannot be had.
    pub(super) async fn image_root(&mut self) -> Result<Option<RootImage>, String> {
        let Some(reference) = self.record.spec.image.clone() else { return Ok(None) };
        let oci = self.hub.ctx.oci.clone();
        if let Some(root) = oci.pinned(&self.layout) {
            return Ok(Some(root));
        }
        let note = format!("pulling image {reference}");
        self.set(State::Provisioning, note.clone());
        self.hub.events.platform(&self.record.id, "pulling-image", note);
        let (hub, id, disk_mib) = (Arc::clone(&self.hub), self.record.id.clone(), self.record.spec.disk_mib);
        let pulled = tokio::task::spawn_blocking(move || {
            let mut progress = OnWatch { hub: &hub, id: &id, throttle: Throttle::new(PROGRESS_EVERY) };
            oci.root(&reference, disk_mib, &mut progress)
        })
        .await;
        match pulled {
            Ok(Ok(root)) => {
                let note = format!("image {} ready", root.manifest);
                self.hub.events.platform(&self.record.id, "pulling-image", note);
                Ok(Some(root))
            }
            Ok(Err(e)) => Err(format!("cannot start: {}", vm_contract::logs::chain(&e))),
            Err(_) => Err("cannot start: the pull's task failed".into()),
        }
    }
}

/// A pull's progress as platform events.
struct OnWatch<'a> {
    hub: &'a Hub,
    id: &'a SandboxId,
    throttle: Throttle,
}

impl Progress for OnWatch<'_> {
    fn layer(&mut self, index: usize, count: usize, layer: &Layer, done: u64) {
        if !self.throttle.due(done, layer.size) {
            return;
        }
        let note = format!("layer {}/{count} {}: {done} of {} bytes", index + 1, layer.digest, layer.size);
        self.hub.events.platform(self.id, "pulling-image", note);
    }
}
