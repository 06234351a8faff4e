//! Network Activity (4001): the workload's TCP streams through the supervisor's proxy (the guest has no NIC,
//! so every connection is one of these), and what HTTP Activity (4002, `http.rs`) shares with it.

use std::net::IpAddr;

use serde::Serialize;

use vm_contract::logs::printable;

use crate::class::Class;
use crate::event::{set_status, Event, Severity, Source, Status};
use crate::objects::{ConnectionInfo, Endpoint, FirewallRule, HttpRequest, HttpResponse, Traffic, MAX_NAME_CHARS};

/// The profiles whose attributes these events use: `host` brings `device`; `security_control` brings
/// `firewall_rule`, `action_id` and `disposition_id`.
const PROFILES: [&str; 2] = ["host", "security_control"];
/// The guest's own name, as in `device.hostname`.
const GUEST: &str = "sandbox";

/// Network Activity activities used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetworkActivity {
    /// 1: the proxy connected the stream.
    Open,
    /// 2: the stream ended.
    Close,
    /// 5: the proxy refused the stream.
    Refuse,
}

/// Who opened a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The workload, through an egress listener (`http-proxy`, `socks5`).
    Outbound,
    /// A host client, through a port forward into the guest.
    Inbound,
}

/// What the supervisor knows about one stream. `hostname`, `ip` and `port` are its far end, the one that is
/// not the guest: the destination of an outbound stream, the host client of an inbound one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// Stream id.
    pub stream: u32,
    /// Who opened it.
    pub direction: Direction,
    /// The listener it came through: `http-proxy`, `socks5`, `port-forward`.
    pub listener: &'static str,
    /// The guest end's port: the listener's (3128, 1080) or the forwarded guest port.
    pub guest_port: Option<u16>,
    /// The far end's name as asked (normalized); absent for a literal address.
    pub hostname: Option<String>,
    /// The far end's address: the one resolved and dialed, or the host client's.
    pub ip: Option<IpAddr>,
    /// The far end's port.
    pub port: u16,
    /// The host pattern of the rule that matched (`*.example.com`).
    pub rule: Option<String>,
    /// Bytes to the guest (Close).
    pub bytes_in: u64,
    /// Bytes from the guest (Close).
    pub bytes_out: u64,
    /// How long the stream lasted (Close).
    pub duration_ms: Option<u64>,
}

/// The attributes only Network and HTTP Activity carry, flattened into [`Event`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkFields {
    /// The responder.
    pub dst_endpoint: Endpoint,
    /// The stream.
    pub connection_info: ConnectionInfo,
    /// Bytes each way, once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic: Option<Traffic>,
    /// Milliseconds the stream lasted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration: Option<u64>,
    /// The rule that matched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub firewall_rule: Option<FirewallRule>,
    /// 1 = Allowed, 2 = Denied: what the proxy did.
    pub action_id: u8,
    /// Its caption.
    pub action: &'static str,
    /// 1 = Allowed, 2 = Blocked.
    pub disposition_id: u8,
    /// Its caption.
    pub disposition: &'static str,
    /// The request (HTTP Activity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_request: Option<HttpRequest>,
    /// The response, when one came (HTTP Activity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http_response: Option<HttpResponse>,
}

impl Connection {
    pub(crate) fn hostname(&self) -> Option<String> {
        self.hostname.as_deref().map(|h| printable(h, MAX_NAME_CHARS))
    }

    /// The guest end, named by its listener.
    fn guest(&self) -> Endpoint {
        Endpoint {
            name: Some(self.listener.to_owned()),
            hostname: Some(GUEST.to_owned()),
            ip: None,
            port: self.guest_port,
        }
    }

    /// The far end; named `unknown` when nothing else identifies it, as OCSF needs one identifier.
    fn far(&self) -> Endpoint {
        let hostname = self.hostname();
        let name = (hostname.is_none() && self.ip.is_none()).then(|| "unknown".to_owned());
        Endpoint { name, hostname, ip: self.ip, port: Some(self.port) }
    }

    /// `(src_endpoint, dst_endpoint)`: the initiator first.
    fn ends(&self) -> (Endpoint, Endpoint) {
        match self.direction {
            Direction::Outbound => (self.guest(), self.far()),
            Direction::Inbound => (self.far(), self.guest()),
        }
    }

    /// OCSF counts from the initiator (`bytes_out`: source to destination), so an inbound stream swaps the
    /// guest's counts.
    pub(crate) fn traffic(&self) -> Traffic {
        let (bytes_in, bytes_out) = match self.direction {
            Direction::Outbound => (self.bytes_in, self.bytes_out),
            Direction::Inbound => (self.bytes_out, self.bytes_in),
        };
        Traffic { bytes: bytes_in.saturating_add(bytes_out), bytes_in, bytes_out }
    }

    fn connection_info(&self) -> ConnectionInfo {
        let (direction_id, direction) = match self.direction {
            Direction::Inbound => (1, "Inbound"),
            Direction::Outbound => (2, "Outbound"),
        };
        ConnectionInfo { direction_id, direction, protocol_name: "tcp", protocol_num: 6, uid: self.stream.to_string() }
    }

    fn firewall_rule(&self) -> Option<FirewallRule> {
        let matched = self.hostname().or_else(|| self.ip.map(|ip| ip.to_string()));
        self.rule.as_deref().map(|rule| FirewallRule {
            name: printable(rule, MAX_NAME_CHARS),
            match_details: matched.into_iter().collect(),
        })
    }

    /// `stream 7 (http-proxy) to api.example.com (192.0.2.1) port 443`, for messages.
    fn summary(&self) -> String {
        let host = match (self.hostname(), self.ip) {
            (Some(h), Some(ip)) => format!("{h} ({ip})"),
            (Some(h), None) => h,
            (None, Some(ip)) => ip.to_string(),
            (None, None) => "unknown".to_owned(),
        };
        let guest = self.guest_port.map(|p| format!(" port {p}")).unwrap_or_default();
        match self.direction {
            Direction::Outbound => format!("stream {} ({}) to {host} port {}", self.stream, self.listener, self.port),
            Direction::Inbound => {
                format!("stream {} ({}) from {host} port {} to the guest{guest}", self.stream, self.listener, self.port)
            }
        }
    }

    /// The fields both classes share; `allowed` is the proxy's decision.
    pub(crate) fn fields(&self, allowed: bool) -> NetworkFields {
        let (action_id, action, disposition_id, disposition) =
            if allowed { (1, "Allowed", 1, "Allowed") } else { (2, "Denied", 2, "Blocked") };
        NetworkFields {
            dst_endpoint: self.ends().1,
            connection_info: self.connection_info(),
            traffic: None,
            duration: None,
            firewall_rule: self.firewall_rule(),
            action_id,
            action,
            disposition_id,
            disposition,
            http_request: None,
            http_response: None,
        }
    }
}

impl Source {
    /// An event of a network class for `conn`, with its endpoints, the stream and the proxy's decision.
    pub(crate) fn stream_event(
        &self,
        class: Class,
        activity: (u32, &'static str),
        severity: Severity,
        message: String,
        conn: &Connection,
        fields: NetworkFields,
    ) -> Event {
        let mut event = self.base(class, activity, severity, message);
        event.metadata.profiles.extend(PROFILES);
        event.device = Some(self.device());
        event.src_endpoint = Some(conn.ends().0);
        event.network = Some(fields);
        event
    }

    /// Network Activity (4001): a stream opened, closed (with its bytes and duration) or was refused.
    /// `detail` is fixed text (why it was refused, or how it ended), never payload.
    pub fn network(&self, activity: NetworkActivity, conn: &Connection, detail: Option<&str>) -> Event {
        let (id, name) = match activity {
            NetworkActivity::Open => (1, "Open"),
            NetworkActivity::Close => (2, "Close"),
            NetworkActivity::Refuse => (5, "Refuse"),
        };
        let refused = activity == NetworkActivity::Refuse;
        let detail = detail.map(|d| printable(d, MAX_NAME_CHARS));
        let mut message = match activity {
            NetworkActivity::Open => format!("{} opened", conn.summary()),
            NetworkActivity::Close => format!(
                "{} closed: {} B to the guest, {} B from it{}",
                conn.summary(),
                conn.bytes_in,
                conn.bytes_out,
                conn.duration_ms.map(|ms| format!(", {ms} ms")).unwrap_or_default()
            ),
            NetworkActivity::Refuse => format!("{} refused", conn.summary()),
        };
        if let Some(rule) = &conn.rule {
            message.push_str(&format!(" (rule {})", printable(rule, MAX_NAME_CHARS)));
        }
        if let Some(d) = &detail {
            message.push_str(&format!(": {d}"));
        }
        let mut fields = conn.fields(!refused);
        if activity == NetworkActivity::Close {
            fields.traffic = Some(conn.traffic());
            fields.duration = conn.duration_ms;
        }
        let severity = if refused { Severity::Low } else { Severity::Informational };
        let mut event = self.stream_event(Class::NETWORK_ACTIVITY, (id, name), severity, message, conn, fields);
        set_status(&mut event, if refused { Status::Failure } else { Status::Success }, detail);
        event
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::version::SchemaVersion;

    /// An allowed egress stream, closed after some traffic.
    pub(crate) fn egress() -> Connection {
        Connection {
            stream: 7,
            direction: Direction::Outbound,
            listener: "http-proxy",
            guest_port: Some(3128),
            hostname: Some("api.example.com".into()),
            ip: Some(IpAddr::from([192, 0, 2, 1])),
            port: 443,
            rule: Some("*.example.com".into()),
            bytes_in: 1200,
            bytes_out: 300,
            duration_ms: Some(52),
        }
    }

    pub(crate) fn json(event: &Event) -> serde_json::Value {
        serde_json::from_str(&event.to_json()).unwrap()
    }

    pub(crate) fn source() -> Source {
        Source::new(SchemaVersion::default(), "sb1", "vm-supervisor", "0.1.0")
    }

    #[test]
    fn open_names_both_ends_the_stream_and_the_rule() {
        let e = json(&source().network(NetworkActivity::Open, &egress(), None));
        assert_eq!(
            (e["class_uid"].as_u64(), e["activity_id"].as_u64(), e["type_uid"].as_u64()),
            (Some(4001), Some(1), Some(400_101))
        );
        assert_eq!(e["src_endpoint"], serde_json::json!({"name": "http-proxy", "hostname": "sandbox", "port": 3128}));
        assert_eq!(
            e["dst_endpoint"],
            serde_json::json!({"hostname": "api.example.com", "ip": "192.0.2.1", "port": 443})
        );
        let info = serde_json::json!({"direction_id": 2, "direction": "Outbound", "protocol_name": "tcp", "protocol_num": 6, "uid": "7"});
        assert_eq!(e["connection_info"], info);
        assert_eq!(
            e["firewall_rule"],
            serde_json::json!({"name": "*.example.com", "match_details": ["api.example.com"]})
        );
        assert_eq!(e["metadata"]["profiles"], serde_json::json!(["host", "security_control"]));
        assert_eq!(
            (e["action_id"].as_u64(), e["disposition_id"].as_u64(), e["status_id"].as_u64()),
            (Some(1), Some(1), Some(1))
        );
        assert_eq!(e["severity_id"], 1);
        assert!(e.get("traffic").is_none() && e.get("duration").is_none(), "{e}");
        assert_eq!(e["device"]["hostname"], "sandbox");
    }

    #[test]
    fn close_carries_traffic_and_duration() {
        let event = source().network(NetworkActivity::Close, &egress(), None);
        assert!(event.shorthand().starts_with("OCSF NETWORK:CLOSE [Informational] stream 7"), "{}", event.shorthand());
        let e = json(&event);
        assert_eq!(e["traffic"], serde_json::json!({"bytes": 1500, "bytes_in": 1200, "bytes_out": 300}));
        assert_eq!((e["duration"].as_u64(), e["type_uid"].as_u64()), (Some(52), Some(400_102)));
    }

    #[test]
    fn refuse_is_a_denied_failure_with_its_reason() {
        let conn = Connection { rule: None, ip: None, ..egress() };
        let e = json(&source().network(NetworkActivity::Refuse, &conn, Some("no rule allows this host")));
        assert_eq!((e["activity_id"].as_u64(), e["activity_name"].as_str()), (Some(5), Some("Refuse")));
        assert_eq!((e["status_id"].as_u64(), e["status_detail"].as_str()), (Some(2), Some("no rule allows this host")));
        assert_eq!(
            (e["action_id"].as_u64(), e["disposition_id"].as_u64(), e["severity_id"].as_u64()),
            (Some(2), Some(2), Some(2))
        );
        assert!(e.get("firewall_rule").is_none() && e["dst_endpoint"].get("ip").is_none(), "{e}");
        assert!(e["message"].as_str().unwrap().ends_with("refused: no rule allows this host"), "{e}");
    }

    #[test]
    fn an_inbound_stream_starts_at_the_host_and_counts_from_it() {
        let conn = Connection {
            direction: Direction::Inbound,
            listener: "port-forward",
            guest_port: Some(8080),
            hostname: None,
            ip: Some(IpAddr::from([127, 0, 0, 1])),
            port: 50_000,
            rule: None,
            ..egress()
        };
        let e = json(&source().network(NetworkActivity::Close, &conn, None));
        assert_eq!(e["src_endpoint"], serde_json::json!({"ip": "127.0.0.1", "port": 50_000}));
        assert_eq!(e["dst_endpoint"], serde_json::json!({"name": "port-forward", "hostname": "sandbox", "port": 8080}));
        assert_eq!(e["connection_info"]["direction_id"], 1);
        // The host sent the guest's 1200 B in; OCSF's bytes_out is source to destination.
        assert_eq!(e["traffic"], serde_json::json!({"bytes": 1500, "bytes_in": 300, "bytes_out": 1200}));
    }

    #[test]
    fn a_far_end_with_nothing_known_is_still_identified() {
        let conn = Connection { hostname: None, ip: None, ..egress() };
        let e = json(&source().network(NetworkActivity::Refuse, &conn, None));
        assert_eq!(e["dst_endpoint"], serde_json::json!({"name": "unknown", "port": 443}));
        assert!(e.get("status_detail").is_none());
    }
}
