//! Environment variables through which the driver passes telemetry settings to the supervisor. None of them
//! is a secret: collector headers travel in the auth bundle only.

/// OTLP collector endpoint for OCSF events; unset means no export.
pub const OTLP_ENDPOINT: &str = "OPENSHELL_OTLP_OCSF_ENDPOINT";
/// OCSF schema version (default 1.8.0).
pub const SCHEMA_VERSION: &str = "OPENSHELL_OTLP_OCSF_SCHEMA_VERSION";
/// Name of the gateway, for the `openshell.gateway.name` resource attribute.
pub const GATEWAY_NAME: &str = "OPENSHELL_GATEWAY_NAME";
/// `grpc` (default) or `http/protobuf`.
pub const OTLP_PROTOCOL: &str = "OPENSHELL_OTLP_OCSF_PROTOCOL";
/// Absolute path of a PEM CA bundle for an `https://` collector (rotated live by `RotateCredentials`).
pub const OTLP_CA: &str = "OPENSHELL_OTLP_OCSF_CA";
/// `on` (default) or `off`: OCSF JSON on the console and in the JSONL file.
pub const OCSF_JSON: &str = "OPENSHELL_OCSF_JSON";
/// Where the driver reads collector headers, in order (into the auth bundle, never passed on).
pub const HEADER_VARS: [&str; 2] = ["OTEL_EXPORTER_OTLP_LOGS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"];
