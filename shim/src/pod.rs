//! One task's microVM, through the driver library as `launch` and `serve` drive theirs: the sandbox
//! lifecycle's start (its supervisor, whose stdin is this shim's liveness pipe: a shim that dies takes its
//! VM with it), the attach connection every process of the task shares, and the lifecycle's stop and end.
//!
//! A task keeps its VM until its init process exits or the task is deleted, whichever is first; the
//! lifecycle task below is the only owner of the running sandbox. An ended sandbox's directory (its OCSF
//! record, audit chain and tombstone) is kept, and collected as `launch`'s are (`vm_driver::gc`: the newest
//! 64, none older than a week) at the next boot of any task on the node.

use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, watch};
use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxLayout;
use vm_contract::root::RootImage;
use vm_contract::tombstone::EndReason;
use vm_driver::attach_mux::{Conn, Connections};
use vm_driver::jail::JailRequest;
use vm_driver::sandbox::{self, Ended, Identity, StartSecrets, VmSpec};
use vm_driver::state::StateDir;

use crate::settings::Settings;
use crate::spec::Container;

/// Why a task's VM did not come up.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The host is not set up (boot image, supervisor, jail, state directory, mounts).
    #[error("{0:#}")]
    Setup(anyhow::Error),
    /// The supervisor or the guest failed to start.
    #[error("the sandbox failed to start: {0:#}")]
    Start(anyhow::Error),
}

/// A running task's VM.
#[derive(Debug)]
pub struct Pod {
    layout: SandboxLayout,
    connections: Arc<Connections>,
    /// The supervisor's pid: the task's pid as containerd sees it.
    pub pid: u32,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    ended: watch::Receiver<bool>,
}

impl Pod {
    /// Starts the VM with `root` and the container's mounts, and waits until its guest answers.
    ///
    /// # Errors
    /// [`BootError`]; nothing is left running, and the sandbox directory is removed.
    pub async fn boot(
        settings: &Settings,
        id: SandboxId,
        root: RootImage,
        container: &Container,
    ) -> Result<Self, BootError> {
        let setup = |e: anyhow::Error| BootError::Setup(e);
        let image =
            vm_driver::image::resolve(settings.boot_image.as_deref(), None, None).map_err(|e| setup(e.into()))?;
        let supervisor = sandbox::supervisor::locate().map_err(|e| setup(e.into()))?;
        let jail = JailRequest {
            asked: settings.confinement,
            ids: vm_contract::jail::IdRange::DEFAULT,
            memory_overhead_mib: vm_driver::jail::DEFAULT_MEMORY_OVERHEAD_MIB,
            pids: vm_driver::jail::DEFAULT_PIDS,
            cpu_percent: None,
        }
        .resolve(&supervisor)
        .map_err(|e| setup(e.into()))?;
        let mounts = vm_driver::mounts::resolve(&container.mounts, jail.confinement).map_err(|e| setup(e.into()))?;
        // As `launch` reads them: from the environment (containerd's), never argv.
        let otlp_headers = vm_driver::telemetry::headers_from_env().map_err(|e| setup(e.into()))?;
        let state = StateDir::open(&settings.state_dir).map_err(|e| setup(e.into()))?;
        // What shims killed before their delete left behind, then ended sandboxes past the retention.
        vm_driver::reap::reap_all(&state.sandboxes_dir(), vm_driver::controls::Controls::default().reaper);
        vm_driver::gc::collect(&state.sandboxes_dir(), vm_driver::gc::Retention::default());
        let layout = state.create_sandbox(&id).map_err(|e| setup(e.into()))?;
        let vm = VmSpec {
            supervisor,
            layout: layout.clone(),
            image,
            root: Some(root),
            shape: settings.shape,
            accel: settings.accel,
            boot_timeout: settings.boot_timeout,
            jail,
            egress: sandbox::EgressRoute::default(),
            mounts,
            tmpfs: container.tmpfs.clone(),
            controls: vm_driver::controls::Controls::default(),
        };
        let who = Identity {
            id: id.clone(),
            session: None,
            telemetry: settings.telemetry.clone(),
            policy: None,
            secrets: StartSecrets { otlp_headers, ..StartSecrets::default() },
            gateway: None,
        };
        let mut running = match sandbox::start(&vm, &who) {
            Ok(running) => running,
            Err(e) => {
                let _ = std::fs::remove_dir_all(layout.dir());
                return Err(BootError::Start(e.into()));
            }
        };
        if let Err(e) = running.ready().await {
            let stopping = running.stop(vm_contract::stop::driver_deadline()).await;
            stopping.end(EndReason::Failed).await;
            let _ = std::fs::remove_dir_all(layout.dir());
            return Err(BootError::Start(e.into()));
        }
        let pid = running.supervisor_pid().unwrap_or_default();
        let (stop_tx, stop_rx) = oneshot::channel();
        let (ended_tx, ended) = watch::channel(false);
        tokio::spawn(async move {
            let mut stop_rx = stop_rx;
            let reason = loop {
                tokio::select! {
                    ended = running.ended() => match ended {
                        Ended::VmmGone => {}
                        Ended::Exited(_) | Ended::Hung => break EndReason::Failed,
                    },
                    _ = &mut stop_rx => break EndReason::Stopped,
                }
            };
            let stopping = running.stop(vm_contract::stop::driver_deadline()).await;
            let clean = reason == EndReason::Stopped && stopping.stopped.in_order();
            stopping.end(if clean { EndReason::Stopped } else { EndReason::Failed }).await;
            let _ = ended_tx.send(true);
        });
        Ok(Self { layout, connections: Connections::new(false), pid, stop: Mutex::new(Some(stop_tx)), ended })
    }

    /// The attach connection every process of the task shares.
    ///
    /// # Errors
    /// The supervisor cannot be reached.
    pub async fn conn(&self) -> Result<Conn, vm_driver::attach_client::AttachError> {
        self.connections.get(&self.layout).await
    }

    /// Asks the VM to stop in order (SIGTERM, wait, close the pipe); returns at once.
    pub fn stop(&self) {
        if let Some(stop) = self.stop.lock().ok().and_then(|mut s| s.take()) {
            let _ = stop.send(());
        }
    }

    /// Waits until the VM is gone and the sandbox's end is done.
    pub async fn ended(&self) {
        let mut ended = self.ended.clone();
        let _ = ended.wait_for(|e| *e).await;
    }

    /// What the VM costs the host now ([`crate::stats`]); `None` once its VMM is gone.
    pub fn metrics(&self) -> Option<containerd_shim::protos::cgroups::metrics::Metrics> {
        crate::stats::vmm_metrics(self.layout.dir())
    }

    /// Whether the VM is gone.
    pub fn is_ended(&self) -> bool {
        *self.ended.borrow()
    }
}
