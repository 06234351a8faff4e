//! A supervisor's telemetry settings: one type on both paths into it. A cold start gets them in its
//! environment ([`crate::env`], [`TelemetryConfig::to_env`]); a pooled VM gets them in its claim
//! ([`crate::claim::Claim::telemetry`]). None of it is a secret: collector headers travel in the auth
//! bundle only.

use std::ffi::OsString;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::env;

/// What the driver was told about telemetry (flags or their environment equivalents), as the supervisor
/// takes it. Blank values count as unset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP endpoint for OCSF events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// `grpc` or `http/protobuf`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_protocol: Option<String>,
    /// OCSF schema version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<String>,
    /// Gateway name for the resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_name: Option<String>,
    /// `on` or `off`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ocsf_json: Option<String>,
    /// CA bundle for an `https://` collector (absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_ca: Option<PathBuf>,
}

impl TelemetryConfig {
    /// The supervisor's environment for these settings (a cold start).
    pub fn to_env(&self) -> Vec<(&'static str, OsString)> {
        [
            (env::OTLP_ENDPOINT, &self.otlp_endpoint),
            (env::OTLP_PROTOCOL, &self.otlp_protocol),
            (env::SCHEMA_VERSION, &self.schema_version),
            (env::GATEWAY_NAME, &self.gateway_name),
            (env::OCSF_JSON, &self.ocsf_json),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| (k, OsString::from(v))))
        .chain(self.otlp_ca.as_ref().map(|p| (env::OTLP_CA, p.clone().into_os_string())))
        .collect()
    }

    /// The settings in an environment, read through `lookup` (a variable's value by its name).
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let var = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        Self {
            otlp_endpoint: var(env::OTLP_ENDPOINT),
            otlp_protocol: var(env::OTLP_PROTOCOL),
            schema_version: var(env::SCHEMA_VERSION),
            gateway_name: var(env::GATEWAY_NAME),
            ocsf_json: var(env::OCSF_JSON),
            otlp_ca: var(env::OTLP_CA).map(PathBuf::from),
        }
    }

    /// The same, with blank values unset (as a claim's may be).
    pub fn normalized(&self) -> Self {
        let keep = |v: &Option<String>| v.clone().filter(|v| !v.trim().is_empty());
        Self {
            otlp_endpoint: keep(&self.otlp_endpoint),
            otlp_protocol: keep(&self.otlp_protocol),
            schema_version: keep(&self.schema_version),
            gateway_name: keep(&self.gateway_name),
            ocsf_json: keep(&self.ocsf_json),
            otlp_ca: self.otlp_ca.clone().filter(|p| !p.as_os_str().is_empty()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_and_the_claim_carry_the_same_settings() {
        let config = TelemetryConfig {
            otlp_endpoint: Some("http://127.0.0.1:4317".into()),
            gateway_name: Some("gw".into()),
            otlp_ca: Some("/etc/ca.pem".into()),
            ..TelemetryConfig::default()
        };
        let env: Vec<(String, String)> =
            config.to_env().into_iter().map(|(k, v)| (k.to_owned(), v.into_string().unwrap())).collect();
        let back = TelemetryConfig::from_env(|name| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()));
        assert_eq!(back, config);
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(serde_json::from_str::<TelemetryConfig>(&json).unwrap(), config);
        assert!(serde_json::from_str::<TelemetryConfig>(r#"{"LD_PRELOAD":"/x"}"#).is_err(), "only settings");
        let blank = TelemetryConfig { schema_version: Some(" ".into()), ..TelemetryConfig::default() };
        assert_eq!(blank.normalized(), TelemetryConfig::default());
        assert_eq!(TelemetryConfig::from_env(|_| Some(String::new())), TelemetryConfig::default());
    }
}
