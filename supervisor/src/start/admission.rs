//! Admission: what a sandbox passes before it is served, cold or claimed alike.
//!
//! ```text
//! launch descriptor against the trusted arguments (before any credential is read)
//!   -> auth bundle (read once, then gone) -> telemetry under the sandbox's identity
//!   -> session settings -> the approved policy -> egress secrets (credentials, the sandbox's CA)
//!   -> the gateway binding, with its token (a sandbox an OpenShell gateway created)
//! ```

use std::path::Path;
use std::time::SystemTime;

use vm_contract::args::SupervisorArgs;
use vm_contract::auth::{AuthBundle, BundleError};
use vm_contract::claim::Claim;
use vm_contract::descriptor::{LaunchDescriptor, Mismatch, Trusted};
use vm_contract::layout::SandboxFile;
use vm_contract::root::{RootFileError, RootImage};
use vm_contract::session::SessionHello;
use vm_protocol::policy::{PolicyError, SandboxPolicy};

use super::fail::{Failure, Outlet};
use super::sandbox::Sandbox;
use crate::network::intercept::secrets::Secrets;
use crate::network::intercept::{InterceptError, Interceptor};
use crate::safeguards::Safeguards;
use crate::serve::session::SessionConfig;
use crate::telemetry::console::Console;
use crate::telemetry::settings::{SettingsError, TelemetrySettings};
use crate::telemetry::{Telemetry, TelemetryError};

/// Why a sandbox was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    /// The launch descriptor was not admitted.
    #[error("the launch descriptor was refused")]
    Descriptor(#[source] Mismatch),
    /// The auth bundle is unreadable.
    #[error("cannot read the auth bundle")]
    Bundle(#[source] BundleError),
    /// The telemetry settings are unusable.
    #[error("bad telemetry settings")]
    Settings(#[source] SettingsError),
    /// A telemetry sink could not start.
    #[error("cannot start telemetry")]
    Telemetry(#[source] TelemetryError),
    /// A session socket was given without a session id or token.
    #[error("a session socket was given without a session id, or the auth bundle has no session token")]
    NoSessionToken,
    /// The approved policy in the sandbox directory is not valid.
    #[error("the sandbox's policy is not valid")]
    Policy(#[source] PolicyError),
    /// The approved policy in the sandbox directory cannot be read.
    #[error("cannot read the sandbox's policy")]
    PolicyUnreadable(#[source] std::io::Error),
    /// The sandbox's image root cannot be read.
    #[error("cannot read the sandbox's image root")]
    Root(#[source] RootFileError),
    /// The credentials in the auth bundle are not valid.
    #[error("the sandbox's credentials are not valid")]
    Secrets(#[source] vm_protocol::credentials::SecretError),
    /// The system's RNG failed while making placeholders.
    #[error("cannot make credential placeholders")]
    Placeholders(#[source] std::io::Error),
    /// `--egress-ca` cannot be read.
    #[error("--egress-ca cannot be read or holds no PEM certificate")]
    EgressCa,
    /// TLS interception could not be set up.
    #[error("cannot set up TLS interception")]
    Intercept(#[source] InterceptError),
    /// The supervisor could not make itself non-dumpable while it holds secrets.
    #[error("cannot make the supervisor non-dumpable")]
    Dumpable(#[source] std::io::Error),
    /// The gateway binding cannot be read.
    #[error(transparent)]
    Gateway(#[from] vm_contract::gateway::BindingError),
    /// A gateway binding came without the gateway's token, or a token without a binding.
    #[error("the gateway binding and the gateway's token must come together")]
    GatewayToken,
}

/// Where the telemetry settings come from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SettingsFrom<'a> {
    /// A cold start's environment.
    Environment,
    /// A pooled VM's claim.
    Claim(&'a Claim),
}

impl SettingsFrom<'_> {
    fn settings(self, headers: Vec<(String, String)>) -> Result<TelemetrySettings, SettingsError> {
        match self {
            Self::Environment => TelemetrySettings::load(headers),
            Self::Claim(claim) => TelemetrySettings::from_config(&claim.telemetry, headers),
        }
    }
}

/// An admitted sandbox: its telemetry running, its session settings, its policy and its image root.
pub(crate) struct Admitted {
    pub(crate) sandbox: Sandbox,
    pub(crate) session: Option<SessionConfig>,
    pub(crate) policy: SandboxPolicy,
    pub(crate) root: Option<RootImage>,
    /// What egress holds that the guest never sees.
    pub(crate) egress: EgressSecrets,
    /// The OpenShell gateway that created the sandbox, and its token for it.
    pub(crate) gateway: Option<crate::gateway::Gateway>,
    /// Where its VM came from (a claim says; otherwise booted for it).
    pub(crate) origin: vm_contract::claim::Origin,
}

/// The upstream proxy's login and the sandbox's credentials (from the auth bundle), and its CA.
#[derive(Debug, Default)]
pub(crate) struct EgressSecrets {
    /// The upstream proxy's `Proxy-Authorization`.
    pub(crate) proxy_authorization: Option<String>,
    /// The credentials and their placeholders.
    pub(crate) secrets: Secrets,
    /// TLS interception, when some approved rule asks for it.
    pub(crate) intercept: Option<std::sync::Arc<Interceptor>>,
}

/// Admits the sandbox `args` names, in the sandbox directory. The admission span starts here and is exported
/// once the sinks are up.
///
/// # Errors
/// A [`Failure`] to report, through the sinks that were up when admission stopped.
pub(crate) fn admit(
    args: &SupervisorArgs,
    safeguards: &Safeguards,
    console: Console,
    from: SettingsFrom<'_>,
) -> Result<Admitted, Failure> {
    let started = SystemTime::now();
    if let Err(mismatch) = descriptor(args, safeguards) {
        let settings = Box::new(from.settings(Vec::new()));
        let sandbox_id = args.identity.sandbox_id.to_string();
        let outlet = Outlet::Refused { console, settings, sandbox_id, controls: safeguards.telemetry };
        return Err(Failure::new(AdmitError::Descriptor(mismatch), outlet));
    }
    let (telemetry, bundle) = match start_telemetry(args, safeguards, &console, from) {
        Ok(started) => started,
        Err(e) => return Err(Failure::new(e, Outlet::Console(console))),
    };
    let mut sandbox = Sandbox::open(telemetry, console, args);
    let session = match session(args, bundle.session_token.clone()) {
        Ok(session) => session,
        Err(e) => return Err(Failure::new(e, Outlet::Sandbox(Box::new(sandbox)))),
    };
    let checked = policy().and_then(|policy| {
        let root = RootImage::read(Path::new(".")).map_err(AdmitError::Root)?;
        let binding = vm_contract::gateway::GatewayBinding::read(Path::new("."))?;
        let gateway = match (binding, bundle.gateway_token.clone()) {
            (Some(binding), Some(token)) => Some(crate::gateway::Gateway::new(binding, token)),
            (None, None) => None,
            _ => return Err(AdmitError::GatewayToken),
        };
        if gateway.is_some() {
            // The token in memory: as for the egress keys, no process of this user may read it.
            rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
                .map_err(|e| AdmitError::Dumpable(e.into()))?;
        }
        let egress = egress_secrets(args, safeguards, &policy, bundle)?;
        Ok((policy, root, egress, gateway))
    });
    sandbox.telemetry().spans().admission(started, checked.is_ok());
    let (policy, root, egress, gateway) = match checked {
        Ok(checked) => checked,
        Err(e) => return Err(Failure::new(e, Outlet::Sandbox(Box::new(sandbox)))),
    };
    let allowed: Vec<&str> = policy.allow.iter().map(|o| o.as_str()).collect();
    sandbox.config_change(&format!("policy revision 0 approved; allowed: {}", allowed.join(", ")));
    if let Some(network) = &policy.network {
        let hosts: Vec<&str> = network.allow.iter().map(|r| r.host.as_str()).collect();
        sandbox.config_change(&format!("network rules approved: {}", hosts.join(", ")));
    }
    if let Some(root) = &root {
        sandbox.config_change(&format!("image root {}", root.manifest));
    }
    if egress.intercept.is_some() {
        sandbox.config_change(&format!("sandbox CA made for intercepted hosts: {}", ca_hosts(&policy).join(", ")));
    }
    let names: Vec<String> = egress.secrets.env().into_iter().map(|(name, _)| name).collect();
    if !names.is_empty() {
        sandbox.config_change(&format!("credentials held as placeholders: {}", names.join(", ")));
    }
    if let Some(gateway) = &gateway {
        sandbox.config_change(&format!("OpenShell gateway at {} drives this sandbox", gateway.endpoint_url()));
    }
    let origin = match from {
        SettingsFrom::Claim(claim) => claim.origin,
        SettingsFrom::Environment => vm_contract::claim::Origin::Cold,
    };
    Ok(Admitted { sandbox, session, policy, root, egress, gateway, origin })
}

fn ca_hosts(policy: &SandboxPolicy) -> Vec<&str> {
    let rules = policy.network.iter().flat_map(|n| &n.allow);
    rules.filter(|r| r.tls == vm_protocol::policy::network::TlsMode::Intercept).map(|r| r.host.as_str()).collect()
}

/// The credentials of `bundle` with their placeholders, and the sandbox's CA when a rule intercepts.
fn egress_secrets(
    args: &SupervisorArgs,
    safeguards: &Safeguards,
    policy: &SandboxPolicy,
    bundle: AuthBundle,
) -> Result<EgressSecrets, AdmitError> {
    vm_protocol::credentials::SecretCredential::validate_all(&bundle.secrets).map_err(AdmitError::Secrets)?;
    let secrets = Secrets::new(bundle.secrets).map_err(AdmitError::Placeholders)?;
    let extra = match &args.vm.egress_ca {
        Some(path) => {
            crate::telemetry::credentials::CaBundle::load(path).map_err(|_| AdmitError::EgressCa)?.certificates()
        }
        None => Vec::new(),
    };
    let rules = policy.network.as_ref().map_or(&[][..], |n| &n.allow[..]);
    let intercept = Interceptor::new(args.identity.sandbox_id.as_str(), rules, &extra, safeguards.swap_placeholders)
        .map_err(AdmitError::Intercept)?
        .map(std::sync::Arc::new);
    // Keys in memory: no process of this user may read it (ptrace, /proc/PID/mem) or find it in a core.
    if intercept.is_some() || !secrets.is_empty() {
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
            .map_err(|e| AdmitError::Dumpable(e.into()))?;
    }
    Ok(EgressSecrets { proxy_authorization: bundle.egress_proxy_authorization, secrets, intercept })
}

/// Admits the launch descriptor against the trusted arguments, before any credential is read or the policy
/// discovered.
fn descriptor(args: &SupervisorArgs, safeguards: &Safeguards) -> Result<(), Mismatch> {
    if !safeguards.admit_descriptor {
        return Ok(());
    }
    let trusted = Trusted {
        backend: args.vm.backend,
        sandbox_id: args.identity.sandbox_id.as_str(),
        session_id: args.identity.session_id.as_ref(),
        generation: args.identity.generation,
    };
    LaunchDescriptor::read(Path::new(".")).and_then(|d| d.admit(&trusted))
}

/// The auth bundle (read once, then gone) and the sinks its settings ask for.
fn start_telemetry(
    args: &SupervisorArgs,
    safeguards: &Safeguards,
    console: &Console,
    from: SettingsFrom<'_>,
) -> Result<(Telemetry, AuthBundle), AdmitError> {
    let mut bundle = AuthBundle::take(Path::new(".")).map_err(AdmitError::Bundle)?;
    let settings = from.settings(std::mem::take(&mut bundle.otlp_headers)).map_err(AdmitError::Settings)?;
    let telemetry =
        Telemetry::start(console.handle(), args.identity.sandbox_id.as_str(), &settings, safeguards.telemetry)
            .map_err(AdmitError::Telemetry)?;
    Ok((telemetry, bundle))
}

/// The session with `vm-driver serve`, where the arguments name its socket.
fn session(args: &SupervisorArgs, token: Option<String>) -> Result<Option<SessionConfig>, AdmitError> {
    match (&args.identity.session_socket, &args.identity.session_id, token) {
        (Some(socket), Some(session_id), Some(token)) => Ok(Some(SessionConfig {
            socket: socket.clone(),
            hello: SessionHello {
                sandbox_id: args.identity.sandbox_id.to_string(),
                generation: args.identity.generation,
                session_id: session_id.clone(),
                token,
            },
        })),
        (Some(_), _, _) => Err(AdmitError::NoSessionToken),
        (None, _, _) => Ok(None),
    }
}

/// The policy the driver approved, a trusted input like the arguments; without one, everything is allowed.
/// Only a missing file means "no policy": any other failure to read it must not open everything.
fn policy() -> Result<SandboxPolicy, AdmitError> {
    match std::fs::read_to_string(SandboxFile::Policy.name()) {
        Ok(text) => SandboxPolicy::parse(&text, &vm_protocol::identity::WORKLOAD).map_err(AdmitError::Policy),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(SandboxPolicy::default()),
        Err(e) => Err(AdmitError::PolicyUnreadable(e)),
    }
}
