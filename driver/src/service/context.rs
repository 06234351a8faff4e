//! What every sandbox actor and the pool need from the driver: settings fixed at `serve`'s start.

use std::path::PathBuf;
use std::time::Duration;

use vm_contract::accel::AccelChoice;

use super::admission::Limits;
use crate::image::ImageSet;
use crate::state::StateDir;
use crate::telemetry::TelemetryConfig;

/// Shared settings. Its `Debug` names the collector headers, never their values.
pub struct Context {
    /// The state directory.
    pub state: StateDir,
    /// The session socket supervisors connect to.
    pub sessions_socket: PathBuf,
    /// The supervisor binary.
    pub supervisor: PathBuf,
    /// The boot images.
    pub images: ImageSet,
    /// The OCI images sandboxes' roots come from.
    pub oci: crate::oci::ImageRoots,
    /// The accelerator asked for.
    pub accel: AccelChoice,
    /// How VMMs are confined here.
    pub jail: crate::jail::JailConfig,
    /// Telemetry settings for supervisors.
    pub telemetry: TelemetryConfig,
    /// Collector headers, for each sandbox's auth bundle.
    pub otlp_headers: Vec<(String, String)>,
    /// Boot timeout.
    pub boot_timeout: Duration,
    /// Supervisor stop bound.
    pub stop_timeout: Duration,
    /// What may be admitted on this host.
    pub limits: Limits,
    /// How egress connections resolve and leave.
    pub egress: crate::sandbox::Egress,
    /// Whether a warm pool is configured (`serve --pool`).
    pub pool: bool,
    /// Where the OpenShell gateway that drives this `serve` listens, for the supervisors of its sandboxes.
    pub gateway: Option<vm_contract::gateway::GatewayEndpoint>,
    /// The test controls (all off but in the causal tests).
    pub controls: crate::controls::Controls,
    /// Saved boots starts restore from; none with `serve --cold`.
    pub templates: Option<crate::template::Templates>,
}

impl Context {
    /// What a VM of this driver is, in `layout`: booting `image` with `shape` on `root`, sharing `mounts`.
    pub fn vm_spec(
        &self,
        layout: vm_contract::layout::SandboxLayout,
        image: crate::image::Image,
        shape: vm_contract::shape::SandboxShape,
        root: Option<vm_contract::root::RootImage>,
        mounts: Vec<vm_contract::share::HostMount>,
    ) -> crate::sandbox::VmSpec {
        crate::sandbox::VmSpec {
            supervisor: self.supervisor.clone(),
            layout,
            image,
            root,
            shape,
            accel: self.accel,
            boot_timeout: self.boot_timeout,
            jail: self.jail,
            egress: self.egress.route(),
            mounts,
            tmpfs: Vec::new(),
            controls: self.controls,
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("state", &self.state)
            .field("supervisor", &self.supervisor)
            .field("accel", &self.accel)
            .field("jail", &self.jail)
            .field("otlp_headers", &self.otlp_headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}
