//! Telemetry settings: from the environment the driver set, and the collector headers from the auth bundle.

use std::path::Path;

use vm_ocsf::{SchemaVersion, UnsupportedVersion};
use vm_protocol::status::{env, AuthBundle, AUTH_BUNDLE_FILE};

use super::otlp::{OtlpSettings, Protocol};

/// Everything that decides where OCSF events go.
#[derive(Debug, Clone)]
pub struct TelemetrySettings {
    /// Schema version of every event.
    pub schema: SchemaVersion,
    /// `openshell.gateway.name`.
    pub gateway_name: Option<String>,
    /// OTLP export, when an endpoint is set.
    pub otlp: Option<OtlpSettings>,
    /// OCSF JSON on the console and in the JSONL file.
    pub json: bool,
}

/// Why the settings are unusable; a start-up error.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The schema version cannot be emitted.
    #[error(transparent)]
    Schema(#[from] UnsupportedVersion),
    /// The protocol is neither `grpc` nor `http/protobuf`.
    #[error("{} must be grpc or http/protobuf", env::OTLP_PROTOCOL)]
    Protocol,
    /// The JSON switch is neither `on` nor `off`.
    #[error("{} must be on or off", env::OCSF_JSON)]
    Json,
    /// The auth bundle exists but cannot be read or parsed.
    #[error("the auth bundle is unreadable")]
    Bundle,
}

impl TelemetrySettings {
    /// Reads the settings from the environment and the auth bundle (which is then removed).
    ///
    /// # Errors
    /// [`SettingsError`].
    pub fn load(sandbox_dir: &Path) -> Result<Self, SettingsError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let schema = SchemaVersion::parse(&var(env::SCHEMA_VERSION).unwrap_or_default())?;
        let json = match var(env::OCSF_JSON).as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(_) => return Err(SettingsError::Json),
        };
        let bundle = read_bundle(&sandbox_dir.join(AUTH_BUNDLE_FILE))?;
        let otlp = match var(env::OTLP_ENDPOINT) {
            Some(endpoint) => Some(OtlpSettings {
                endpoint,
                protocol: Protocol::parse(&var(env::OTLP_PROTOCOL).unwrap_or_default())
                    .ok_or(SettingsError::Protocol)?,
                headers: bundle.otlp_headers,
            }),
            None => None,
        };
        Ok(Self { schema, gateway_name: var(env::GATEWAY_NAME), otlp, json })
    }
}

/// Reads and removes the bundle: after start-up the secret lives only in this process's memory.
fn read_bundle(path: &Path) -> Result<AuthBundle, SettingsError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let _ = std::fs::remove_file(path);
            serde_json::from_slice(&bytes).map_err(|_| SettingsError::Bundle)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(AuthBundle::default()),
        Err(_) => Err(SettingsError::Bundle),
    }
}
