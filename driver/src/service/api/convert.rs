//! Between the service's own types and the API's messages, both ways, and its errors as statuses: the only
//! place either crosses.

use tonic::Status;
use vm_contract::ids::SandboxId;
use vm_contract::jail::Confinement;
use vm_contract::shape::{SandboxShape, ShapeError};
use vm_contract::share::HostMount;
use vm_protocol::credentials::{
    CredentialRotation, Inject, RotationOutcome, SecretCredential, SecretError, MAX_HEADERS,
};
use vm_protocol::driver_api::{
    watch_event, Credential, ListPoolResponse, Mount, PlatformEvent, PoolTarget as ApiTarget, PooledVm, ReadinessKind,
    RotateCredentialsRequest, Sandbox, SandboxSpec, SandboxState, WatchEvent,
};
use vm_protocol::policy::{PolicyError, SandboxPolicy};

use crate::service::actor::{StartError, StopError};
use crate::service::credentials::RotateError;
use crate::service::events::Event;
use crate::service::hub::{AskError, CreateError, ServingError};
use crate::service::pool::{PoolListing, PoolTarget};
use crate::service::record::{SandboxRecord, State};
use crate::service::store::StoredSpec;

/// Why a spec from the API cannot be accepted.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// vCPUs or memory out of range.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The policy is not valid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A mount's guest path is not valid.
    #[error(
        "mount target {0:?}: an absolute guest path of at most {max} bytes, without . or .., and not /, /proc, \
         /sys, /dev or /run",
        max = vm_protocol::mounts::MAX_TARGET_BYTES
    )]
    MountTarget(String),
    /// A mount's host path is relative: the service's working directory is not the client's.
    #[error("mount source {0:?} must be an absolute host path")]
    MountSource(String),
    /// The mounts cannot be had.
    #[error(transparent)]
    Mounts(#[from] crate::mounts::MountError),
}

/// A spec's mounts, checked and resolved.
///
/// # Errors
/// [`SpecError::MountTarget`], [`SpecError::MountSource`] or [`SpecError::Mounts`].
pub fn host_mounts(spec: &SandboxSpec, confinement: Confinement) -> Result<Vec<HostMount>, SpecError> {
    let mounts = spec
        .mounts
        .iter()
        .map(|m| {
            if !vm_protocol::mounts::target_ok(&m.target) {
                return Err(SpecError::MountTarget(m.target.clone()));
            }
            if !std::path::Path::new(&m.source).is_absolute() {
                return Err(SpecError::MountSource(m.source.clone()));
            }
            Ok(HostMount { source: m.source.clone().into(), target: m.target.clone(), readonly: m.readonly })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(crate::mounts::resolve(&mounts, confinement)?)
}

/// A spec from the API, with defaults filled in and its mounts resolved.
///
/// # Errors
/// [`SpecError`] for a shape out of range, a policy that is not valid or mounts that cannot be had.
pub fn stored_spec(spec: &SandboxSpec, confinement: Confinement) -> Result<StoredSpec, SpecError> {
    let policy = if spec.policy.is_empty() {
        None
    } else {
        Some(SandboxPolicy::parse(&spec.policy, &vm_protocol::identity::WORKLOAD)?)
    };
    Ok(StoredSpec {
        shape: SandboxShape::with_defaults(spec.cpus, spec.memory_mib)?,
        env: spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        boot_image: spec.boot_image.clone(),
        image: (!spec.image.is_empty()).then(|| spec.image.clone()),
        disk_mib: if spec.disk_mib == 0 { vm_contract::root::DEFAULT_DISK_MIB } else { spec.disk_mib },
        policy,
        mounts: host_mounts(spec, confinement)?,
        gateway: None,
    })
}

/// A stored spec, as the API shows it.
pub fn spec(spec: &StoredSpec) -> SandboxSpec {
    SandboxSpec {
        cpus: u32::from(spec.shape.cpus()),
        memory_mib: spec.shape.memory_mib(),
        env: spec.env.clone().into_iter().collect(),
        readiness: ReadinessKind::ReadinessTcp.into(),
        boot_image: spec.boot_image.clone(),
        image: spec.image.clone().unwrap_or_default(),
        disk_mib: spec.disk_mib,
        policy: spec.policy.as_ref().map(SandboxPolicy::to_json).unwrap_or_default(),
        mounts: spec
            .mounts
            .iter()
            .map(|m| Mount { source: m.source.display().to_string(), target: m.target.clone(), readonly: m.readonly })
            .collect(),
    }
}

fn state(state: State) -> SandboxState {
    match state {
        State::Provisioning => SandboxState::Provisioning,
        State::Ready => SandboxState::Ready,
        State::Stopping => SandboxState::Stopping,
        State::Stopped => SandboxState::Stopped,
        State::Failed => SandboxState::Failed,
    }
}

/// A sandbox's record, as the API shows it.
pub fn sandbox(record: &SandboxRecord) -> Sandbox {
    Sandbox {
        sandbox_id: record.id.to_string(),
        state: state(record.state).into(),
        spec: Some(spec(&record.spec)),
        accelerator: record.accelerator.map(|a| a.as_str().to_owned()).unwrap_or_default(),
        confinement: record.confinement.as_str().into(),
        readiness_endpoint: record.readiness_endpoint.clone(),
        detail: record.detail.clone(),
        generation: record.generation.0,
        running_intent: record.running_intent,
        origin: record.origin.map_or("", vm_contract::claim::Origin::as_str).into(),
    }
}

/// A change, as `Watch` streams it.
pub fn watch_event(event: &Event) -> WatchEvent {
    let event = match event {
        Event::Changed(record) => watch_event::Event::Changed(sandbox(record)),
        Event::Platform(note) => watch_event::Event::Platform(PlatformEvent {
            sandbox_id: note.sandbox.to_string(),
            kind: note.kind.clone(),
            message: note.message.clone(),
            time_ms: note.time_ms,
        }),
    };
    WatchEvent { event: Some(event) }
}

fn target(t: &PoolTarget) -> ApiTarget {
    ApiTarget {
        count: t.count,
        cpus: u32::from(t.shape.cpus()),
        memory_mib: t.shape.memory_mib(),
        image: t.image.clone().unwrap_or_default(),
    }
}

/// The pool, as `ListPool` shows it.
pub fn pool(listing: PoolListing) -> ListPoolResponse {
    let vms = listing
        .vms
        .into_iter()
        .map(|vm| PooledVm {
            slot_id: vm.slot.to_string(),
            cpus: u32::from(vm.target.shape.cpus()),
            memory_mib: vm.target.shape.memory_mib(),
            image: vm.target.image.unwrap_or_default(),
            state: vm.state.into(),
            supervisor_pid: vm.supervisor_pid,
            vmm_pid: vm.vmm_pid,
        })
        .collect();
    ListPoolResponse { vms, targets: listing.targets.iter().map(target).collect() }
}

impl From<CreateError> for Status {
    fn from(e: CreateError) -> Self {
        let text = e.to_string();
        match e {
            CreateError::Closing => Self::unavailable(text),
            CreateError::Exists(_) => Self::already_exists(text),
            CreateError::Refused(_) => Self::resource_exhausted(text),
            CreateError::Image(_) => Self::invalid_argument(text),
            CreateError::ClaimTask
            | CreateError::MoveSlot(_)
            | CreateError::CreateDir(_)
            | CreateError::SaveSpec(_)
            | CreateError::Vanished => Self::internal(text),
        }
    }
}

impl From<ServingError> for Status {
    fn from(e: ServingError) -> Self {
        match e {
            ServingError::NotFound(_) => Self::not_found(e.to_string()),
            ServingError::Stopped(_) => Self::failed_precondition(e.to_string()),
            ServingError::NotReady { .. } => Self::unavailable(e.to_string()),
        }
    }
}

impl From<AskError> for Status {
    fn from(e: AskError) -> Self {
        Self::not_found(e.to_string())
    }
}

impl From<StopError> for Status {
    fn from(e: StopError) -> Self {
        // The cause names the failed write: a path and an errno, none of them a secret.
        Self::internal(vm_contract::logs::chain(&e))
    }
}

impl From<StartError> for Status {
    fn from(e: StartError) -> Self {
        match e {
            StartError::CleaningUp => Self::unavailable(e.to_string()),
            StartError::Refused(_) => Self::resource_exhausted(e.to_string()),
            StartError::Marker(..) => Self::internal(vm_contract::logs::chain(&e)),
        }
    }
}

/// A rotation request, checked: the sandbox and its new credentials. Every status is fixed text.
///
/// # Errors
/// `INVALID_ARGUMENT` for a malformed request.
pub fn rotation(req: RotateCredentialsRequest) -> Result<(SandboxId, CredentialRotation), Status> {
    let id = super::sandbox_id(&req.sandbox_id)?;
    let headers = req.headers.map(|h| h.header.into_iter().map(|h| (h.name, h.value)).collect::<Vec<_>>());
    if headers.as_ref().is_some_and(|h| h.is_empty() || h.len() > MAX_HEADERS) {
        return Err(Status::invalid_argument(format!("headers: 1 to {MAX_HEADERS} when given")));
    }
    let ca_path = Some(req.ca_path).filter(|p| !p.is_empty());
    if ca_path.as_deref().is_some_and(|p| !p.starts_with('/')) {
        return Err(Status::invalid_argument("ca_path must be absolute"));
    }
    let secrets = Some(credentials(req.credentials)?).filter(|s| !s.is_empty());
    if headers.is_none() && ca_path.is_none() && secrets.is_none() {
        return Err(Status::invalid_argument(RotationOutcome::Empty.describe()));
    }
    Ok((id, CredentialRotation { headers, ca_path, secrets }))
}

/// The API's credentials, checked. Every status is fixed text: none shows a value.
///
/// # Errors
/// `INVALID_ARGUMENT` for a credential that is not valid.
pub fn credentials(list: Vec<Credential>) -> Result<Vec<SecretCredential>, Status> {
    let bad = |e: SecretError| Status::invalid_argument(format!("credentials: {e}"));
    if list.len() > vm_protocol::credentials::MAX_SECRETS {
        return Err(bad(SecretError::Count));
    }
    let converted = list
        .into_iter()
        .map(|c| {
            let hosts = c.hosts.iter().map(|h| h.parse()).collect::<Result<Vec<_>, _>>();
            Ok(SecretCredential {
                name: c.name,
                value: c.value,
                hosts: hosts.map_err(|_| bad(SecretError::Hosts))?,
                inject: c.inject.map(|i| Inject { header: i.header, format: i.format }),
                in_url: c.in_url,
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    SecretCredential::validate_all(&converted).map_err(bad)?;
    Ok(converted)
}

impl From<RotateError> for Status {
    fn from(e: RotateError) -> Self {
        match e {
            RotateError::Serving(e) => e.into(),
            RotateError::Unreachable => Self::unavailable(e.to_string()),
            RotateError::Refused(_) => Self::failed_precondition(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(source: &str, target: &str) -> SandboxSpec {
        SandboxSpec {
            mounts: vec![Mount { source: source.into(), target: target.into(), readonly: true }],
            ..SandboxSpec::default()
        }
    }

    #[test]
    fn an_api_mount_needs_an_absolute_source_and_a_valid_target() {
        let tmp = std::env::temp_dir();
        let resolved = host_mounts(&spec(tmp.to_str().unwrap(), "/work"), Confinement::Jail).unwrap();
        assert_eq!(resolved[0].source, std::fs::canonicalize(&tmp).unwrap());
        assert!(matches!(host_mounts(&spec("tmp", "/work"), Confinement::Jail), Err(SpecError::MountSource(_))));
        assert!(matches!(
            host_mounts(&spec(tmp.to_str().unwrap(), "/proc"), Confinement::Jail),
            Err(SpecError::MountTarget(_))
        ));
    }
}
