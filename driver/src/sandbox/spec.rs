//! What a start is given: the VM ([`VmSpec`], the same for a pooled VM and a sandbox's own) apart from the
//! identity it is bound to ([`Identity`], with its session and secrets), and how egress leaves the host.

use std::path::PathBuf;
use std::time::Duration;

use vm_contract::accel::AccelChoice;
use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxLayout;
use vm_contract::root::RootImage;
use vm_contract::session::{Generation, SessionId};
use vm_contract::shape::SandboxShape;
use vm_protocol::policy::SandboxPolicy;

use crate::controls::Controls;
use crate::image::Image;
use crate::jail::JailConfig;
use crate::telemetry::TelemetryConfig;

/// What a VM is: what it boots, how it is confined and leashed, how its egress leaves. The same for a pooled
/// VM and a sandbox's own; it has no identity, credential or policy, so a pooled VM, started from this alone
/// ([`super::start_pooled`]), cannot be given one. All of it is trusted input.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// The `vm-supervisor` binary.
    pub supervisor: PathBuf,
    /// Its directory.
    pub layout: SandboxLayout,
    /// What to boot.
    pub image: Image,
    /// The image root; the built-in root when `None`.
    pub root: Option<RootImage>,
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// The accelerator asked for.
    pub accel: AccelChoice,
    /// How long the guest may take to boot.
    pub boot_timeout: Duration,
    /// How QEMU is confined.
    pub jail: JailConfig,
    /// Where egress connections resolve and leave (none of it secret).
    pub egress: EgressRoute,
    /// Host directories, resolved ([`crate::mounts::resolve`]).
    pub mounts: Vec<vm_contract::share::HostMount>,
    /// Memory file systems the guest mounts.
    pub tmpfs: Vec<vm_protocol::tmpfs::GuestTmpfs>,
    /// The test controls (all off but in the causal tests).
    pub controls: Controls,
}

/// Who a sandbox is and what it may hold: bound at its start, or at a pooled VM's claim ([`super::Running::claim`]),
/// never at a pooled VM's boot.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The sandbox.
    pub id: SandboxId,
    /// `serve` only: the session this start opens.
    pub session: Option<SessionSpec>,
    /// Telemetry settings (the supervisor's environment at a cold start, the claim line at a claim).
    pub telemetry: TelemetryConfig,
    /// The approved policy; none: every operation.
    pub policy: Option<SandboxPolicy>,
    /// What goes into the auth bundle (0600) and nowhere else.
    pub secrets: StartSecrets,
    /// `serve`: the OpenShell gateway that created the sandbox, which its supervisor speaks for it to.
    pub gateway: Option<vm_contract::gateway::GatewayBinding>,
}

/// A start's secrets, for the auth bundle only. Its `Debug` shows names, never values.
#[derive(Clone, Default)]
pub struct StartSecrets {
    /// Collector headers.
    pub otlp_headers: Vec<(String, String)>,
    /// The operator's upstream proxy's `Proxy-Authorization` value.
    pub egress_proxy_authorization: Option<String>,
    /// The sandbox's credentials.
    pub credentials: Vec<vm_protocol::credentials::SecretCredential>,
    /// The sandbox token of the gateway that created the sandbox.
    pub gateway_token: Option<String>,
}

impl std::fmt::Debug for StartSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartSecrets")
            .field("otlp_headers", &self.otlp_headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>())
            .field("egress_proxy_authorization", &self.egress_proxy_authorization.is_some())
            .field("credentials", &self.credentials)
            .field("gateway_token", &self.gateway_token.is_some())
            .finish()
    }
}

/// Where a VM's egress resolves and leaves: the operator's settings without their credential.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressRoute {
    /// A DNS server for egress names instead of the system resolver.
    pub resolver: Option<std::net::SocketAddr>,
    /// The upstream proxy, `HOST:PORT`.
    pub proxy: Option<String>,
    /// Certificates trusted for intercepted destinations beside the system's (`--egress-ca`), absolute.
    pub ca: Option<PathBuf>,
}

/// The operator's egress settings (`--egress-resolver`, `--egress-proxy`, `--egress-proxy-credentials`),
/// the same for every sandbox of a driver; none of it is the sandbox's to see or change.
#[derive(Clone, Default)]
pub struct Egress {
    /// A DNS server for egress names instead of the system resolver.
    pub resolver: Option<std::net::SocketAddr>,
    /// The upstream proxy, `HOST:PORT`.
    pub proxy: Option<String>,
    /// Its `Proxy-Authorization` value, for the auth bundle only.
    pub proxy_authorization: Option<String>,
    /// Certificates trusted for intercepted destinations beside the system's (`--egress-ca`), absolute.
    pub ca: Option<PathBuf>,
}

impl Egress {
    /// Where egress leaves, without the credential.
    pub fn route(&self) -> EgressRoute {
        EgressRoute { resolver: self.resolver, proxy: self.proxy.clone(), ca: self.ca.clone() }
    }
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress")
            .field("resolver", &self.resolver)
            .field("proxy", &self.proxy)
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

/// The session a supervisor of `serve` opens.
#[derive(Clone)]
pub struct SessionSpec {
    /// `serve`'s session socket.
    pub socket: PathBuf,
    /// This start's generation.
    pub generation: Generation,
    /// This start's session id.
    pub id: SessionId,
    /// The token it presents (256 bits; written to the auth bundle only).
    pub token: String,
}

impl std::fmt::Debug for SessionSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionSpec")
            .field("socket", &self.socket)
            .field("generation", &self.generation)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}
