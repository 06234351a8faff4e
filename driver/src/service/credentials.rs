//! `RotateCredentials`: new OTLP collector credentials for a running sandbox, forwarded to its supervisor
//! over the attach socket (never through the guest) and remembered, in memory only, for its later starts.
//! Every status here is fixed text: a header value never reaches a reply or a log line.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use tonic::{Response, Status};
use vm_contract::ids::SandboxId;
use vm_protocol::credentials::{CredentialRotation, RotationOutcome, MAX_HEADERS};
use vm_protocol::driver_api::{RotateCredentialsRequest, RotateCredentialsResponse};

use super::hub::Hub;

/// Validates, forwards and records one rotation.
///
/// # Errors
/// `INVALID_ARGUMENT` for a malformed request, `FAILED_PRECONDITION` for a refused rotation,
/// `UNAVAILABLE` when the supervisor cannot be reached.
pub async fn rotate(hub: &Hub, req: RotateCredentialsRequest) -> Result<Response<RotateCredentialsResponse>, Status> {
    let id = super::api::sandbox_id(&req.sandbox_id)?;
    let headers = req.headers.map(|h| h.header.into_iter().map(|h| (h.name, h.value)).collect::<Vec<_>>());
    if headers.as_ref().is_some_and(|h| h.is_empty() || h.len() > MAX_HEADERS) {
        return Err(Status::invalid_argument(format!("headers: 1 to {MAX_HEADERS} when given")));
    }
    let ca_path = Some(req.ca_path).filter(|p| !p.is_empty());
    if ca_path.as_deref().is_some_and(|p| !p.starts_with('/')) {
        return Err(Status::invalid_argument("ca_path must be absolute"));
    }
    if headers.is_none() && ca_path.is_none() {
        return Err(Status::invalid_argument(RotationOutcome::Empty.describe()));
    }
    hub.serving(&id)?;
    let rotation = CredentialRotation { headers, ca_path };
    let outcome = crate::attach_client::rotate_credentials(&hub.ctx.state.layout(&id), rotation.clone())
        .await
        .map_err(|_| Status::unavailable("supervisor unreachable"))?;
    match outcome {
        RotationOutcome::Applied => {
            hub.record_rotation(&id, rotation);
            Ok(Response::new(RotateCredentialsResponse { outcome: outcome.describe().into() }))
        }
        refused => Err(Status::failed_precondition(format!("credentials rotation {}", refused.describe()))),
    }
}

/// Credentials rotated since the driver started, per sandbox (in memory only), merged over earlier ones, for
/// each sandbox's later starts. Its `Debug` shows no header.
#[derive(Default)]
pub struct Rotations {
    rotated: Mutex<HashMap<SandboxId, CredentialRotation>>,
}

impl std::fmt::Debug for Rotations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rotations").finish_non_exhaustive()
    }
}

impl Rotations {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, CredentialRotation>> {
        self.rotated.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records an applied rotation, merged over earlier ones.
    pub fn record(&self, id: &SandboxId, rotation: CredentialRotation) {
        let mut rotated = self.lock();
        let merged = rotated.entry(id.clone()).or_default();
        if rotation.headers.is_some() {
            merged.headers = rotation.headers;
        }
        if rotation.ca_path.is_some() {
            merged.ca_path = rotation.ca_path;
        }
    }

    /// The credentials rotated for `id`, if any.
    pub fn get(&self, id: &SandboxId) -> Option<CredentialRotation> {
        self.lock().get(id).cloned()
    }

    /// Forgets `id` (it was deleted).
    pub fn forget(&self, id: &SandboxId) {
        self.lock().remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotation_merges_over_the_last_and_is_forgotten_with_its_sandbox() {
        let rotations = Rotations::default();
        let id = SandboxId::parse("a").unwrap_or_else(|e| panic!("{e}"));
        let headers = Some(vec![("k".to_owned(), "v".to_owned())]);
        rotations.record(&id, CredentialRotation { headers: headers.clone(), ca_path: None });
        rotations.record(&id, CredentialRotation { headers: None, ca_path: Some("/ca".into()) });
        let merged = rotations.get(&id).unwrap_or_default();
        assert_eq!((merged.headers, merged.ca_path.as_deref()), (headers, Some("/ca")));
        rotations.forget(&id);
        assert!(rotations.get(&id).is_none());
    }
}
