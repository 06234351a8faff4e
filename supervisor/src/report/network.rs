//! Network Activity and HTTP Activity events: what the stream router refused, the port forwards, and what
//! each egress task reported.

use std::time::Instant;

use vm_ocsf::{Connection, Direction, NetworkActivity};
use vm_protocol::net::Listener;

use super::Reporter;
use crate::boundary::stream::{ForwardNote, Refused};
use crate::network::egress::{Decided, Report};

/// Longest method and path a finding repeats.
const FINDING_PATH_CHARS: usize = 256;

impl Reporter<'_> {
    /// A stream the router refused before it opened.
    pub(super) fn stream_refused(&mut self, refused: &Refused, now: Instant) {
        let Refused { id, listener, port, reason } = *refused;
        let conn = match (listener, port) {
            (Some(listener), _) => outbound(id.0, listener, None),
            (None, port) => inbound(id.0, port.unwrap_or(0)),
        };
        self.refused(&conn, reason, now);
    }

    /// A port forward opened or ended.
    pub(super) fn forward(&mut self, note: ForwardNote) {
        let (activity, conn) = match note {
            ForwardNote::Opened { id, port } => (NetworkActivity::Open, inbound(id.0, port)),
            ForwardNote::Closed { id, port, to_guest, from_guest } => (
                NetworkActivity::Close,
                Connection { bytes_in: to_guest, bytes_out: from_guest, ..inbound(id.0, port) },
            ),
        };
        let event = self.telemetry.source().network(activity, &conn, None);
        self.telemetry.emit(event);
    }

    /// A refused connection: a Network Activity refuse and a `policy_denied` finding (within its bucket).
    fn refused(&mut self, conn: &Connection, reason: &str, now: Instant) {
        let event = self.telemetry.source().network(NetworkActivity::Refuse, conn, Some(reason));
        self.telemetry.emit(event);
        let what = match (&conn.hostname, conn.ip) {
            (Some(host), _) => format!("{host}:{}", conn.port),
            (None, Some(ip)) => format!("{ip}:{}", conn.port),
            (None, None) => format!("stream {}", conn.stream),
        };
        self.limited_finding(false, now, &format!("connection to {what} refused: {reason}"));
    }

    /// An egress task's report.
    pub(super) fn egress(&mut self, report: Report, now: Instant) {
        match report {
            Report::Refused { id, listener, host, port, ip, reason } => {
                let mut conn = outbound(id.0, listener, None);
                (conn.hostname, conn.port, conn.ip) = (host, port.unwrap_or(0), ip);
                self.refused(&conn, reason, now);
            }
            Report::Opened(id, listener, decided) => {
                let conn = outbound(id.0, listener, Some(&decided));
                let event = self.telemetry.source().network(NetworkActivity::Open, &conn, None);
                self.telemetry.emit(event);
            }
            Report::Http(http) => {
                let conn =
                    Connection { bytes_in: http.bytes, ..outbound(http.id.0, Listener::Http, Some(&http.decided)) };
                let scheme = if http.tls { "https" } else { "http" };
                let denied = http.status == Some(403) && http.refused.is_some();
                let source = self.telemetry.source();
                let event = source.http_scheme(&conn, scheme, &http.method, &http.path, http.status, denied);
                self.telemetry.emit(event);
                if let Some(why) = http.refused {
                    let (host, port) = (&http.decided.host, http.decided.port);
                    let method = vm_contract::logs::printable(&http.method, 16);
                    let path = vm_contract::logs::printable(&http.path, FINDING_PATH_CHARS);
                    self.limited_finding(true, now, &format!("{method} {scheme}://{host}:{port}{path} refused: {why}"));
                }
            }
            Report::Finding { id, decided, detail } => {
                self.limited_finding(true, now, &format!("stream {} to {}: {detail}", id.0, decided.host));
            }
            Report::Closed { id, listener, decided, to_guest, from_guest, duration, why } => {
                let conn = Connection {
                    bytes_in: to_guest,
                    bytes_out: from_guest,
                    duration_ms: Some(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)),
                    ..outbound(id.0, listener, Some(&decided))
                };
                let event = self.telemetry.source().network(NetworkActivity::Close, &conn, why);
                self.telemetry.emit(event);
            }
            // The boundary forgets the stream; there is nothing to record.
            Report::Gone(_) => {}
        }
    }
}

fn listener_name(listener: Option<Listener>) -> &'static str {
    match listener {
        Some(Listener::Http) => "http-proxy",
        Some(Listener::Socks) => "socks5",
        None => "port-forward",
    }
}

fn outbound(id: u32, listener: Listener, decided: Option<&Decided>) -> Connection {
    Connection {
        stream: id,
        direction: Direction::Outbound,
        listener: listener_name(Some(listener)),
        guest_port: Some(listener.port()),
        hostname: decided.map(|d| d.host.clone()),
        ip: decided.and_then(|d| d.ip),
        port: decided.map_or(0, |d| d.port),
        rule: decided.map(|d| d.rule.clone()),
        bytes_in: 0,
        bytes_out: 0,
        duration_ms: None,
    }
}

fn inbound(id: u32, port: u16) -> Connection {
    Connection {
        stream: id,
        direction: Direction::Inbound,
        listener: "port-forward",
        guest_port: Some(port),
        hostname: None,
        ip: None,
        port,
        rule: None,
        bytes_in: 0,
        bytes_out: 0,
        duration_ms: None,
    }
}
