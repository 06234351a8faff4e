//! `RotateCredentials`: new OTLP collector credentials for a running sandbox, forwarded to its supervisor
//! over the attach socket (never through the guest) and remembered, in memory only, for its later starts.
//! Every status here is fixed text: a header value never reaches a reply or a log line.

use tonic::{Response, Status};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome, MAX_HEADERS};
use vm_protocol::driver_api::{RotateCredentialsRequest, RotateCredentialsResponse};

use super::registry::Registry;

/// Validates, forwards and records one rotation.
///
/// # Errors
/// `INVALID_ARGUMENT` for a malformed request, `FAILED_PRECONDITION` for a refused rotation,
/// `UNAVAILABLE` when the supervisor cannot be reached.
pub async fn rotate(
    reg: &Registry,
    req: RotateCredentialsRequest,
) -> Result<Response<RotateCredentialsResponse>, Status> {
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
    reg.serving(&id)?;
    let rotation = CredentialRotation { headers, ca_path };
    let outcome = crate::attach_client::rotate_credentials(&reg.ctx.state.layout(&id), rotation.clone())
        .await
        .map_err(|_| Status::unavailable("supervisor unreachable"))?;
    match outcome {
        RotationOutcome::Applied => {
            reg.record_rotation(&id, rotation);
            Ok(Response::new(RotateCredentialsResponse { outcome: outcome.describe().into() }))
        }
        refused => Err(Status::failed_precondition(format!("credentials rotation {}", refused.describe()))),
    }
}
