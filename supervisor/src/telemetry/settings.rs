//! Telemetry settings: from the [`TelemetryConfig`] the driver set (in the environment, or in a claim);
//! collector headers come from the auth bundle.

use vm_contract::env;
use vm_contract::telemetry::TelemetryConfig;
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
    /// The settings of a cold start: its environment's ([`TelemetryConfig::from_env`]).
    ///
    /// # Errors
    /// [`SettingsError`].
    pub fn load(otlp_headers: Vec<(String, String)>) -> Result<Self, SettingsError> {
        Self::from_config(&TelemetryConfig::from_env(|var| std::env::var(var).ok()), otlp_headers)
    }

    /// The settings `config` gives (from the environment of a cold start, or a pooled VM's claim); collector
    /// headers come from the auth bundle.
    ///
    /// # Errors
    /// [`SettingsError`].
    pub fn from_config(config: &TelemetryConfig, otlp_headers: Vec<(String, String)>) -> Result<Self, SettingsError> {
        let config = config.normalized();
        let schema = SchemaVersion::parse(config.schema_version.as_deref().unwrap_or_default())?;
        let json = match config.ocsf_json.as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(_) => return Err(SettingsError::Json),
        };
        let otlp = match config.otlp_endpoint {
            Some(endpoint) => Some(OtlpSettings {
                endpoint,
                protocol: Protocol::parse(config.otlp_protocol.as_deref().unwrap_or_default())
                    .ok_or(SettingsError::Protocol)?,
                headers: otlp_headers,
                ca_path: config.otlp_ca,
            }),
            None => None,
        };
        Ok(Self { schema, gateway_name: config.gateway_name, otlp, json })
    }
}
