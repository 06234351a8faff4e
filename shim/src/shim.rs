//! The shim's own commands, as containerd runs them: `start` spawns the long-lived shim (one per task, or one
//! per CRI pod: its socket is named after the task or the pod's sandbox) and prints its address; the daemon
//! serves the task service until `Shutdown`; `delete`, run in the bundle after a shim died, removes what it
//! left: the root disk, a mount, and (through the driver's reaper) a VM whose supervisor is gone.

use std::sync::Arc;

use containerd_shim::api::DeleteResponse;
use containerd_shim::asynchronous::{spawn, ExitSignal, Shim};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, Error, Flags, StartOpts};

use crate::settings::Settings;
use crate::task::TaskService;

/// The shim.
#[derive(Clone)]
pub struct VmShim {
    namespace: String,
    exit: Arc<ExitSignal>,
}

#[async_trait::async_trait]
impl Shim for VmShim {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Self { namespace: args.namespace.clone(), exit: Arc::new(ExitSignal::default()) }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        // A pod's tasks share one shim, named after the pod's sandbox: a container's start finds the pod's
        // shim listening and answers its address (as runc's and Kata's shims group).
        let pod = std::env::current_dir().ok().and_then(|bundle| crate::spec::pod_of(&bundle));
        let grouping = pod.unwrap_or_else(|| opts.id.clone());
        let address = spawn(opts, &grouping, Vec::new()).await?;
        // containerd reads it back after its own restart, to reconnect.
        containerd_shim::asynchronous::util::write_str_to_file("address", &address).await?;
        Ok(address)
    }

    async fn delete_shim(&mut self) -> Result<DeleteResponse, Error> {
        let bundle = std::env::current_dir().map_err(|e| Error::Other(e.to_string()))?;
        crate::rootfs::clean(&bundle);
        if let Ok(settings) = Settings::load() {
            let sandboxes = vm_driver::state::StateDir::open(&settings.state_dir).map(|s| s.sandboxes_dir());
            if let Ok(dir) = sandboxes {
                vm_driver::reap::reap_all(&dir, vm_driver::controls::Controls::default().reaper);
            }
        }
        let mut response = DeleteResponse::new();
        response.exit_status = 128 + 9;
        Ok(response)
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        // Fixed text: the file's path is the operator's, nothing of a tenant's.
        let settings = Settings::load().map_err(|e| e.to_string());
        TaskService::new(settings, self.namespace.clone(), publisher, Arc::clone(&self.exit))
    }
}

impl std::fmt::Debug for VmShim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmShim").field("namespace", &self.namespace).finish_non_exhaustive()
    }
}
