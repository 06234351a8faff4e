//! HTTP Activity (4002): a request the proxy read (plain HTTP it forwarded, or HTTPS it intercepted), with
//! no query, header value or body recorded.

use std::borrow::Cow;

use vm_contract::logs::printable;

use crate::class::Class;
use crate::event::{set_status, Event, Severity, Source, Status};
use crate::network::Connection;
use crate::objects::{HttpRequest, HttpResponse, Url};

/// Longest URL path in an event, in characters.
pub const MAX_PATH_CHARS: usize = 1024;

/// HTTP Activity's activity for a method (methods are case-sensitive): id, caption, OCSF's `http_method`.
fn http_activity(method: &str) -> Option<(u32, &'static str, &'static str)> {
    Some(match method {
        "CONNECT" => (1, "Connect", "CONNECT"),
        "DELETE" => (2, "Delete", "DELETE"),
        "GET" => (3, "Get", "GET"),
        "HEAD" => (4, "Head", "HEAD"),
        "OPTIONS" => (5, "Options", "OPTIONS"),
        "POST" => (6, "Post", "POST"),
        "PUT" => (7, "Put", "PUT"),
        "TRACE" => (8, "Trace", "TRACE"),
        "PATCH" => (9, "Patch", "PATCH"),
        _ => return None,
    })
}

/// The path without its query or fragment (either may carry secrets), bounded and printable.
fn bare_path(path: &str) -> String {
    let bare = path.split(['?', '#']).next().unwrap_or_default();
    if bare.is_empty() {
        "/".to_owned()
    } else {
        printable(bare, MAX_PATH_CHARS)
    }
}

impl Source {
    /// HTTP Activity (4002): a plain-HTTP (absolute-form) request through the proxy, and its response's
    /// `status` when one came. The path's query is never recorded.
    pub fn http(&self, conn: &Connection, method: &str, path: &str, status: Option<u16>) -> Event {
        self.http_scheme(conn, "http", method, path, status, false)
    }

    /// The same for a request of `scheme` (`https` for an intercepted one); `denied` when the proxy refused
    /// it and answered itself.
    pub fn http_scheme(
        &self,
        conn: &Connection,
        scheme: &'static str,
        method: &str,
        path: &str,
        status: Option<u16>,
        denied: bool,
    ) -> Event {
        let known = http_activity(method);
        let (id, name) = known.map_or((99, "Other"), |(id, name, _)| (id, name));
        let method = known.map_or_else(|| printable(method, 16), |(_, _, m)| m.to_owned());
        let url = Url {
            scheme,
            hostname: conn.hostname().or_else(|| conn.ip.map(|ip| ip.to_string())),
            port: conn.port,
            path: bare_path(path),
        };
        let host = match url.hostname.as_deref() {
            Some(h) if h.contains(':') => format!("[{h}]"),
            h => h.unwrap_or("unknown").to_owned(),
        };
        let code = status.map(|c| format!(": {c}")).unwrap_or_default();
        let message = format!("{method} {scheme}://{host}:{}{} (stream {}){code}", url.port, url.path, conn.stream);
        let mut fields = conn.fields(!denied);
        fields.http_request = Some(HttpRequest { http_method: known.map(|k| k.2), url });
        fields.http_response = status.map(|code| HttpResponse { code });
        if conn.bytes_in > 0 || conn.bytes_out > 0 {
            fields.traffic = Some(conn.traffic());
        }
        fields.duration = conn.duration_ms;
        let mut event =
            self.stream_event(Class::HTTP_ACTIVITY, (id, name), Severity::Informational, message, conn, fields);
        if known.is_none() {
            // OCSF's Other: activity_name carries the source's own name.
            event.activity_name = Cow::Owned(method);
        }
        if let Some(code) = status {
            set_status(&mut event, if code < 400 { Status::Success } else { Status::Failure }, None);
        }
        event
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::tests::{egress, json, source};
    use crate::objects::MAX_NAME_CHARS;

    #[test]
    fn http_maps_every_method_and_keeps_no_query() {
        let methods = ["CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "POST", "PUT", "TRACE", "PATCH"];
        for (i, method) in methods.into_iter().enumerate() {
            let e = json(&source().http(&egress(), method, "/a?token=s3cret#frag", Some(200)));
            assert_eq!(e["activity_id"].as_u64(), Some(i as u64 + 1), "{method}");
            assert_eq!(e["type_uid"].as_u64(), Some(400_200 + i as u64 + 1));
            assert_eq!(e["http_request"]["http_method"], method);
            assert_eq!(
                e["http_request"]["url"],
                serde_json::json!({"scheme": "http", "hostname": "api.example.com", "port": 443, "path": "/a"})
            );
            assert!(!e.to_string().contains("s3cret") && !e.to_string().contains("frag"), "{e}");
        }
    }

    #[test]
    fn http_records_the_response_and_bytes() {
        let e = json(&source().http(&egress(), "POST", "", Some(404)));
        assert_eq!(e["http_response"], serde_json::json!({"code": 404}));
        assert_eq!((e["status_id"].as_u64(), e["http_request"]["url"]["path"].as_str()), (Some(2), Some("/")));
        assert_eq!(e["traffic"]["bytes"], 1500);
        let e = json(&source().http(&Connection { bytes_in: 0, bytes_out: 0, ..egress() }, "GET", "/", None));
        assert!(e.get("http_response").is_none() && e.get("status_id").is_none() && e.get("traffic").is_none(), "{e}");
    }

    #[test]
    fn an_unknown_method_is_other_and_named_by_the_request() {
        let event = source().http(&egress(), "PROPFIND\n\u{1b}[2J", "/dav", Some(207));
        assert_eq!((event.activity_id, event.type_uid), (99, 400_299));
        assert_eq!(event.type_name, "HTTP Activity: Other");
        assert_eq!(event.activity_name, "PROPFIND??[2J");
        let e = json(&event);
        assert!(e["http_request"].get("http_method").is_none(), "{e}");
        assert!(!event.shorthand().contains('\n') && !event.shorthand().contains('\u{1b}'));
        // Case matters: `get` is not GET.
        assert_eq!(source().http(&egress(), "get", "/", None).activity_id, 99);
    }

    #[test]
    fn names_the_workload_chose_are_bounded_and_printable() {
        let conn = Connection { hostname: Some(format!("a\n{}", "b".repeat(5000))), ..egress() };
        let e = source().http(&conn, "GET", &format!("/\u{7}{}", "p".repeat(5000)), None);
        let json = e.to_json();
        assert!(!json.contains("\\n") && !json.contains("\\u0007"), "{json}");
        let url = &e.network.as_ref().unwrap().http_request.as_ref().unwrap().url;
        assert!(url.path.chars().count() <= MAX_PATH_CHARS + 3);
        assert!(url.hostname.as_ref().unwrap().chars().count() <= MAX_NAME_CHARS + 3);
    }
}
