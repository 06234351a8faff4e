//! The OCSF objects the event classes require, as this crate fills them.

use serde::Serialize;

use vm_contract::logs::printable;

/// The OCSF `product` object; used for `metadata.product` and for `app`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Product {
    /// Product name.
    pub name: String,
    /// Vendor.
    pub vendor_name: String,
    /// Version.
    pub version: String,
    /// A unique id, where the product is an instance (a sandbox).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// `metadata`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Metadata {
    /// The schema version.
    pub version: String,
    /// What produced the event.
    pub product: Product,
    /// Sequence number of the event within its sandbox, for finding gaps.
    pub sequence: u64,
}

/// `device`: the sandbox's VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    /// 6 = Virtual.
    pub type_id: u8,
    /// "Virtual".
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The sandbox id.
    pub name: String,
    /// The sandbox id.
    pub uid: String,
    /// The guest hostname.
    pub hostname: String,
}

/// `actor`: who caused the activity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Actor {
    /// The acting application.
    pub app_name: String,
    /// Its instance (the sandbox id).
    pub app_uid: String,
}

/// `api`: the control-plane call an API Activity records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Api {
    /// The call (`UpdatePolicy`, `RotateCredentials`).
    pub operation: String,
    /// Who serves it.
    pub service: Service,
}

/// `service`: the endpoint's service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Service {
    /// Its name.
    pub name: String,
}

/// `src_endpoint`: where a call came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// Its name (the socket it came through).
    pub name: String,
}

/// `process`: a workload process inside the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessInfo {
    /// Pid inside the guest, once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// argv\[0\]'s file name.
    pub name: String,
    /// argv joined by spaces.
    pub cmd_line: String,
    /// `<sandbox>/<process id>`.
    pub uid: String,
}

/// Longest `cmd_line` in an event, in characters; a longer one is cut and ends in `...`.
pub const MAX_CMD_LINE_CHARS: usize = 1024;
/// Longest process `name` in an event, in characters.
pub const MAX_NAME_CHARS: usize = 256;

impl ProcessInfo {
    /// Describes a process from its argv: the workload chose it, so it is cut to a bound and every control
    /// character (newline, ESC) becomes `?`, and no event, shorthand line or terminal gets one.
    pub fn new(sandbox: &str, id: u32, pid: Option<i32>, argv: &[String]) -> Self {
        let name = argv.first().map(|a| a.rsplit('/').next().unwrap_or(a)).unwrap_or_default();
        Self {
            pid,
            name: printable(name, MAX_NAME_CHARS),
            cmd_line: printable(&argv.join(" "), MAX_CMD_LINE_CHARS),
            uid: format!("{sandbox}/{id}"),
        }
    }
}

/// `finding_info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FindingInfo {
    /// Unique id of the finding.
    pub uid: String,
    /// One-line title.
    pub title: String,
    /// What exactly was observed (fixed text plus ids; never payload).
    pub desc: String,
    /// A stable kind for filtering.
    pub types: Vec<String>,
}

/// The application whose lifecycle an event reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppInfo {
    /// `sandbox` or `microvm`.
    pub name: String,
    /// Version of what runs it (supervisor, agent).
    pub version: String,
}
