//! `RotateCredentials`: new OTLP collector credentials for a running sandbox, forwarded to its supervisor
//! over the attach socket (never through the guest) and remembered, in memory only, for its later starts.
//! Every error here is fixed text: a header value never reaches a reply or a log line. The request is
//! checked in `super::api`.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use vm_contract::ids::SandboxId;
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};

use super::hub::{Hub, ServingError};

/// Why a rotation was not applied. Every text is fixed: a header value never reaches it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RotateError {
    /// The sandbox cannot take it now.
    #[error(transparent)]
    Serving(#[from] ServingError),
    /// The supervisor did not answer.
    #[error("supervisor unreachable")]
    Unreachable,
    /// The supervisor refused it; nothing changed.
    #[error("credentials rotation {}", .0.describe())]
    Refused(RotationOutcome),
}

/// Forwards one rotation to sandbox `id`'s supervisor and, once applied, records it for its later starts.
///
/// # Errors
/// [`RotateError`].
pub async fn rotate(hub: &Hub, id: &SandboxId, rotation: CredentialRotation) -> Result<(), RotateError> {
    hub.serving(id)?;
    let outcome = crate::attach_client::rotate_credentials(&hub.ctx.state.layout(id), rotation.clone())
        .await
        .map_err(|_| RotateError::Unreachable)?;
    match outcome {
        RotationOutcome::Applied => {
            hub.record_rotation(id, rotation);
            Ok(())
        }
        refused => Err(RotateError::Refused(refused)),
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
        // Credentials by name: a rotation names only those it changes.
        if let Some(new) = rotation.secrets {
            let held = merged.secrets.get_or_insert_with(Vec::new);
            for credential in new {
                held.retain(|c| c.name != credential.name);
                held.push(credential);
            }
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
        let secret = |name: &str, value: &str| vm_protocol::credentials::SecretCredential {
            name: name.into(),
            value: value.into(),
            hosts: vec!["a.example".parse().unwrap_or_else(|e| panic!("{e}"))],
            inject: None,
            in_url: false,
        };
        let secrets = |list: Vec<_>| CredentialRotation { secrets: Some(list), ..CredentialRotation::default() };
        rotations.record(&id, CredentialRotation { headers: headers.clone(), ..CredentialRotation::default() });
        rotations.record(&id, CredentialRotation { ca_path: Some("/ca".into()), ..CredentialRotation::default() });
        rotations.record(&id, secrets(vec![secret("A", "1"), secret("B", "2")]));
        rotations.record(&id, secrets(vec![secret("B", "3")]));
        let merged = rotations.get(&id).unwrap_or_default();
        assert_eq!((merged.headers, merged.ca_path.as_deref()), (headers, Some("/ca")));
        let held: Vec<(String, String)> =
            merged.secrets.unwrap_or_default().into_iter().map(|c| (c.name, c.value)).collect();
        assert_eq!(held, [("A".to_owned(), "1".to_owned()), ("B".to_owned(), "3".to_owned())], "merged by name");
        rotations.forget(&id);
        assert!(rotations.get(&id).is_none());
    }
}
