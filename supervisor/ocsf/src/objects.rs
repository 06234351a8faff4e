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
    /// The profiles the event uses (`security_control` for the proxy's decisions); without one, the
    /// profile's attributes are not valid in the event.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<&'static str>,
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

/// `src_endpoint` / `dst_endpoint` (`network_endpoint`): where a call came from, or one end of a stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// Its name: the socket a call came through, or the proxy listener at a stream's guest end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Hostname (`sandbox` for the guest).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ip: Option<std::net::IpAddr>,
    /// TCP port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
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

/// `connection_info` (`network_connection_info`): one proxied TCP stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConnectionInfo {
    /// 1 = Inbound, 2 = Outbound.
    pub direction_id: u8,
    /// Its caption.
    pub direction: &'static str,
    /// Always `tcp`: the proxy carries nothing else.
    pub protocol_name: &'static str,
    /// 6 (TCP).
    pub protocol_num: u8,
    /// The stream id, which the open, close and HTTP events of one stream share.
    pub uid: String,
}

/// `traffic` (`network_traffic`), from the source's point of view as OCSF counts it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Traffic {
    /// `bytes_in + bytes_out`.
    pub bytes: u64,
    /// Destination to source.
    pub bytes_in: u64,
    /// Source to destination.
    pub bytes_out: u64,
}

/// `firewall_rule` (security_control profile): the egress rule that let a stream through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FirewallRule {
    /// The rule's host pattern (`*.example.com`).
    pub name: String,
    /// What it matched: the hostname asked for, or the literal address.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub match_details: Vec<String>,
}

/// `url`. Never a query or a full URL string: a query may carry secrets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Url {
    /// `http`.
    pub scheme: &'static str,
    /// Host asked for (or the literal address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Port.
    pub port: u16,
    /// Path, cut before any `?` or `#`.
    pub path: String,
}

/// `http_request`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HttpRequest {
    /// One of the methods OCSF enumerates; absent for others (then in `activity_name`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_method: Option<&'static str>,
    /// What was asked for.
    pub url: Url,
}

/// `http_response`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HttpResponse {
    /// Status code.
    pub code: u16,
}
