//! The auth bundle: the supervisor's secrets (collector headers, session token), written by the driver into
//! a 0600 file created exclusively, read once by the supervisor and removed. Secrets never travel in argv or
//! an environment, and every error here is fixed text.

use std::fmt;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::layout::SandboxFile;

/// The contents of [`SandboxFile::AuthBundle`]. Its `Debug` never shows a value.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthBundle {
    /// Headers for the OTLP collector (from `OTEL_EXPORTER_OTLP_LOGS_HEADERS` or `OTEL_EXPORTER_OTLP_HEADERS`).
    pub otlp_headers: Vec<(String, String)>,
    /// The token this supervisor presents when it opens its session to the driver.
    #[serde(default)]
    pub session_token: Option<String>,
    /// The `Proxy-Authorization` value for the operator's upstream proxy (`--egress-proxy`).
    #[serde(default)]
    pub egress_proxy_authorization: Option<String>,
    /// The sandbox's secret credentials: the workload sees placeholders, the proxy swaps these in.
    #[serde(default)]
    pub secrets: Vec<vm_protocol::credentials::SecretCredential>,
    /// The sandbox token an OpenShell gateway minted for this sandbox: the supervisor presents it on every
    /// call to the gateway ([`crate::gateway`]).
    #[serde(default)]
    pub gateway_token: Option<String>,
}

impl fmt::Debug for AuthBundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.otlp_headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("AuthBundle")
            .field("otlp_header_names", &names)
            .field("session_token", &self.session_token.as_ref().map(|_| "<redacted>"))
            .field("egress_proxy_authorization", &self.egress_proxy_authorization.as_ref().map(|_| "<redacted>"))
            .field("secrets", &self.secrets)
            .field("gateway_token", &self.gateway_token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The bundle could not be written or read. Fixed text: it holds secrets.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// Writing failed.
    #[error("cannot write the sandbox's auth bundle")]
    Write(#[source] io::Error),
    /// It exists but cannot be read or parsed.
    #[error("the auth bundle is unreadable")]
    Unreadable,
}

impl AuthBundle {
    /// Writes the bundle into `dir`, mode 0600, created exclusively.
    ///
    /// # Errors
    /// [`BundleError::Write`].
    pub fn write(&self, dir: &Path) -> Result<(), BundleError> {
        let json = serde_json::to_vec(self).map_err(|e| BundleError::Write(e.into()))?;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join(SandboxFile::AuthBundle.name()))
            .map_err(BundleError::Write)?;
        file.write_all(&json).map_err(BundleError::Write)
    }

    /// Reads and removes the bundle in `dir`; none is an empty bundle.
    ///
    /// # Errors
    /// [`BundleError::Unreadable`].
    pub fn take(dir: &Path) -> Result<Self, BundleError> {
        let path = dir.join(SandboxFile::AuthBundle.name());
        match std::fs::read(&path) {
            Ok(bytes) => {
                let _ = std::fs::remove_file(&path);
                serde_json::from_slice(&bytes).map_err(|_| BundleError::Unreadable)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Self::default()),
            Err(_) => Err(BundleError::Unreadable),
        }
    }

    /// Removes a bundle nobody took (after a failed start).
    pub fn remove(dir: &Path) {
        let _ = std::fs::remove_file(dir.join(SandboxFile::AuthBundle.name()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_exclusive_taken_once_and_never_shown() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("bundle-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let b = AuthBundle {
            otlp_headers: vec![("authorization".into(), "Bearer s3cret".into())],
            session_token: Some("t0ken-value".into()),
            egress_proxy_authorization: Some("Basic cHJveHk=".into()),
            secrets: serde_json::from_str(r#"[{"name": "KEY", "value": "sk-v4lue", "hosts": ["a.example"]}]"#).unwrap(),
            gateway_token: Some("eyJ-gw-t0k".into()),
        };
        let shown = format!("{b:?}");
        assert!(!shown.contains("gw-t0k"), "{shown}");
        assert!(shown.contains("authorization") && !shown.contains("s3cret") && !shown.contains("t0ken"), "{shown}");
        assert!(!shown.contains("cHJveHk") && shown.contains("KEY") && !shown.contains("sk-v4lue"), "{shown}");
        b.write(&dir).unwrap();
        let mode = std::fs::metadata(dir.join("auth.json")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(b.write(&dir).is_err(), "created exclusively");
        assert_eq!(AuthBundle::take(&dir).unwrap(), b);
        assert_eq!(AuthBundle::take(&dir).unwrap(), AuthBundle::default(), "read once");
        std::fs::write(dir.join("auth.json"), r#"{"otlp_headers":[],"extra":1}"#).unwrap();
        assert!(AuthBundle::take(&dir).is_err(), "unknown fields are refused");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
