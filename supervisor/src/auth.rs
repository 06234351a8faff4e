//! The auth bundle: the supervisor's secrets (collector headers, session token), handed over in a 0600 file
//! that is read once and removed, so after start-up they live only in this process's memory.

use std::path::Path;

use vm_protocol::status::{AuthBundle, AUTH_BUNDLE_FILE};

/// The bundle exists but cannot be read or parsed. Fixed text: it holds secrets.
#[derive(Debug, thiserror::Error)]
#[error("the auth bundle is unreadable")]
pub struct BundleError;

/// Reads and removes the bundle in `sandbox_dir`; none is an empty bundle.
///
/// # Errors
/// [`BundleError`].
pub fn take(sandbox_dir: &Path) -> Result<AuthBundle, BundleError> {
    let path = sandbox_dir.join(AUTH_BUNDLE_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let _ = std::fs::remove_file(&path);
            serde_json::from_slice(&bytes).map_err(|_| BundleError)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(AuthBundle::default()),
        Err(_) => Err(BundleError),
    }
}
