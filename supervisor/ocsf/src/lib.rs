//! The security record of a sandbox as OCSF events (Open Cybersecurity Schema Framework).
//!
//! | class | uid | emitted for |
//! |---|---|---|
//! | Application Lifecycle | 6002 | sandbox and VM start, stop, failure |
//! | Process Activity | 1007 | launch and terminate (with exit code) of every workload process |
//! | Detection Finding | 2004 | `liveness_lost`, `lease_lost`, `watchdog_action`, `admission_refused`, `guest_protocol_violation`, `telemetry_dropped`, `log_capped`, `vmm_limit`, `policy_denied`, `descriptor_mismatch`, `tar_refused` |
//! | Device Config State Change | 5019 | configuration (policy) changes of the sandbox |
//! | API Activity | 6003 | control-plane calls through the attach socket (`UpdatePolicy`, `RotateCredentials`) |
//! | Network Activity | 4001 | open, close (bytes, duration) and refusal of every workload TCP stream through the proxy |
//! | File System Activity | 1001 | every file operation of the files API (path and bytes moved, never contents) |
//! | HTTP Activity | 4002 | plain-HTTP requests through the proxy (method, host, port, path without its query, status) |
//!
//! Each class is a [`Class`] (uid, caption, category, console shorthand, OTLP event name), defined once in
//! [`Class::ALL`]; the builders of [`Source`] stamp it on their events, and every sink names an event by it.
//! Every event carries `class_uid`, `category_uid`, `activity_id`, `type_uid = class_uid * 100 + activity_id`,
//! `severity_id`, `time` (ms since the epoch), `metadata.product` (name, vendor, version) and
//! `metadata.version` (the schema version), plus the objects its class requires. The end-to-end tests validate
//! emitted events against the official OCSF 1.8.0 definitions.
//!
//! This crate is pure: it builds events and formats them; `vm-supervisor` owns the sinks.
//!
//! ```
//! use vm_ocsf::{Class, SchemaVersion, Source, Status};
//!
//! let source = Source::new(SchemaVersion::default(), "sandbox-1", "vm-supervisor", "0.1.0");
//! let event = source.api_update("UpdatePolicy", "attach.sock", Status::Success, "revision 1 applied");
//! assert_eq!(event.class, Class::API_ACTIVITY);
//! assert!(event.shorthand().starts_with("OCSF API:UPDATE"));
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod class;
mod event;
mod file;
mod finding;
mod http;
mod network;
mod objects;
mod version;

pub use class::{Category, Class};
pub use event::{Event, Lifecycle, ProcessActivity, Severity, Source, Status};
pub use file::{FileActivity, FileObject, MAX_FILE_PATH_CHARS};
pub use finding::Finding;
pub use http::MAX_PATH_CHARS;
pub use network::{Connection, Direction, NetworkActivity, NetworkFields};
pub use objects::{
    Actor, Api, AppInfo, ConnectionInfo, Device, Endpoint, FindingInfo, FirewallRule, HttpRequest, HttpResponse,
    Metadata, ProcessInfo, Product, Service, Traffic, Url, MAX_CMD_LINE_CHARS, MAX_NAME_CHARS,
};
pub use version::{SchemaVersion, UnsupportedVersion, DEFAULT_SCHEMA_VERSION, SUPPORTED_SCHEMA_VERSIONS};

#[cfg(test)]
mod tests {
    use super::{Class, Finding};

    /// The table at the top of this file: a row per class, and every finding kind.
    #[test]
    fn the_crate_doc_table_names_every_class_and_finding() {
        let doc = include_str!("lib.rs");
        for class in Class::ALL {
            assert!(doc.contains(&format!("//! | {} | {} |", class.caption, class.uid)), "{class:?}");
        }
        for finding in Finding::ALL {
            assert!(doc.contains(&format!("`{}`", finding.kind())), "{finding:?}");
        }
    }
}
