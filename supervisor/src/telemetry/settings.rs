//! Telemetry settings: from the environment the driver set; collector headers come from the auth bundle.

use vm_contract::env;
use vm_ocsf::{SchemaVersion, UnsupportedVersion};

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
}

impl TelemetrySettings {
    /// Reads the settings from the environment; collector headers come from the auth bundle.
    ///
    /// # Errors
    /// [`SettingsError`].
    pub fn load(otlp_headers: Vec<(String, String)>) -> Result<Self, SettingsError> {
        Self::from_lookup(|name| std::env::var(name).ok(), otlp_headers)
    }

    /// Reads the settings through `lookup` (a variable's value by its name: the environment, or a pooled VM's
    /// claim); blank values count as unset.
    ///
    /// # Errors
    /// [`SettingsError`].
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
        otlp_headers: Vec<(String, String)>,
    ) -> Result<Self, SettingsError> {
        let var = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let schema = SchemaVersion::parse(&var(env::SCHEMA_VERSION).unwrap_or_default())?;
        let json = match var(env::OCSF_JSON).as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(_) => return Err(SettingsError::Json),
        };
        let otlp = match var(env::OTLP_ENDPOINT) {
            Some(endpoint) => Some(OtlpSettings {
                endpoint,
                protocol: Protocol::parse(&var(env::OTLP_PROTOCOL).unwrap_or_default())
                    .ok_or(SettingsError::Protocol)?,
                headers: otlp_headers,
                ca_path: var(env::OTLP_CA).map(std::path::PathBuf::from),
            }),
            None => None,
        };
        Ok(Self { schema, gateway_name: var(env::GATEWAY_NAME), otlp, json })
    }
}
