//! The security record of a sandbox as OCSF events (Open Cybersecurity Schema Framework).
//!
//! | class | uid | emitted for |
//! |---|---|---|
//! | Application Lifecycle | 6002 | sandbox and VM start, stop, failure |
//! | Process Activity | 1007 | launch and terminate (with exit code) of every workload process |
//! | Detection Finding | 2004 | liveness lost, watchdog action, admission refused, guest protocol violation, telemetry dropped, log capped |
//! | Device Config State Change | 5019 | configuration (policy) changes of the sandbox |
//!
//! Every event carries `class_uid`, `category_uid`, `activity_id`, `type_uid = class_uid * 100 + activity_id`,
//! `severity_id`, `time` (ms since the epoch), `metadata.product` (name, vendor, version) and
//! `metadata.version` (the schema version), plus the objects its class requires. The end-to-end tests validate
//! emitted events against the official OCSF 1.8.0 definitions.
//!
//! This crate is pure: it builds events and formats them; `vm-supervisor` owns the sinks.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod event;
mod version;

pub use event::{
    Actor, Api, AppInfo, Device, Endpoint, Event, Finding, FindingInfo, Lifecycle, Metadata, ProcessActivity,
    ProcessInfo, Product, Service, Severity, Source, Status, MAX_CMD_LINE_CHARS, MAX_NAME_CHARS,
};
pub use version::{SchemaVersion, UnsupportedVersion, DEFAULT_SCHEMA_VERSION, SUPPORTED_SCHEMA_VERSIONS};
