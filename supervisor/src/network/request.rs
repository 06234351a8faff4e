//! Reading an HTTP proxy request from the first bytes of a guest stream (the guest's loopback port 3128).
//!
//! The bytes come from the guest, so [`parse`] is pure, incremental (call it again with more bytes), bounded
//! by [`MAX_HEAD_BYTES`], and never panics. Two forms are accepted:
//! - `CONNECT host:port HTTP/1.x`: a tunnel; answer [`ESTABLISHED`] once dialed, then relay raw.
//! - `GET http://host[:port]/path HTTP/1.x`: the first request is rewritten to origin-form with
//!   `Connection: close`; what the workload sends after it is relayed raw, as its own bytes to the same
//!   destination (a server that honours the header answers the first request only).
//!
//! Every target host goes through [`normalize_host`], the same normalization the policy rules had.

use std::fmt;
use std::net::Ipv6Addr;

use vm_protocol::policy::network::normalize_host;

/// Largest request head, bytes: more without the blank line that ends it is [`RequestError::TooLarge`].
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Most header lines in a head; a head of many tiny headers is refused as too large.
const MAX_HEADERS: usize = 100;
/// Longest text [`reply`] puts in a body, chars.
const MAX_REASON_CHARS: usize = 256;
/// The answer to a CONNECT once its upstream is dialed.
pub const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// Headers that belong to the hop between client and proxy, never forwarded.
const HOP_BY_HOP: [&str; 4] = ["proxy-connection", "proxy-authorization", "connection", "keep-alive"];
/// Headers `Connection` may not drop: without them the upstream would frame the stream differently.
const END_TO_END: [&str; 3] = ["host", "content-length", "transfer-encoding"];

/// Where a stream asks to go: a normalized host (name or canonical IP literal, no brackets) and a port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// Normalized by [`normalize_host`].
    pub host: String,
    /// Never 0.
    pub port: u16,
}

impl Target {
    /// The host as a URL writes it: an IPv6 address in brackets.
    pub fn url_host(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        }
    }
}

/// `host:port`, `[v6]:port`.
impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.url_host(), self.port)
    }
}

/// A proxy request read from a stream's head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyRequest {
    /// Where to dial.
    pub target: Target,
    /// A tunnel, or one plain-HTTP request.
    pub kind: Kind,
    /// Bytes of the buffer the head used; any after it are the client's, to relay as they are.
    pub head_len: usize,
}

/// What the client asked the proxy for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// `CONNECT`: a raw tunnel to the target.
    Connect,
    /// An absolute-form `http://` request, to forward.
    Forward {
        /// As the client sent it (methods are case-sensitive).
        method: String,
        /// The path without its query, for events.
        path: String,
        /// The head to send upstream: origin-form request line, headers, `Connection: close`, blank line.
        head: Vec<u8>,
    },
}

/// Why a request head was refused. The text is fixed: nothing the client sent is repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub enum RequestError {
    /// Not an HTTP/1.x request head.
    Malformed,
    /// No complete head within [`MAX_HEAD_BYTES`], or too many headers.
    TooLarge,
    /// An HTTP version other than 1.0 and 1.1.
    Version,
    /// An absolute-form target whose scheme is not `http`.
    UnsupportedScheme,
    /// An origin-form (`/path`) or asterisk-form target: a request for an origin server, not a proxy.
    OriginForm,
    /// Not `host:port` (CONNECT) or `http://host[:port]/...`, or a bad host or port.
    BadTarget,
    /// A target with `user@` in it.
    UserInfo,
    /// `Content-Length` with `Transfer-Encoding`, or twice, or two `Host`s: the upstream could read it otherwise.
    Ambiguous,
}

impl RequestError {
    /// The HTTP status to answer with.
    pub fn status(&self) -> u16 {
        match self {
            Self::TooLarge => 431,
            Self::Version => 505,
            Self::UnsupportedScheme => 501,
            Self::Malformed | Self::OriginForm | Self::BadTarget | Self::UserInfo | Self::Ambiguous => 400,
        }
    }

    /// A fixed sentence for the client and the event.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::Malformed => "malformed request head",
            Self::TooLarge => "request head too large",
            Self::Version => "only HTTP/1.0 and HTTP/1.1 are supported",
            Self::UnsupportedScheme => "only http:// is forwarded; use CONNECT for https",
            Self::OriginForm => "a proxy request needs an absolute-form target (http://host/path)",
            Self::BadTarget => "bad target host or port",
            Self::UserInfo => "user info in the target is not supported",
            Self::Ambiguous => "ambiguous message framing or Host",
        }
    }
}

impl From<httparse::Error> for RequestError {
    fn from(e: httparse::Error) -> Self {
        match e {
            httparse::Error::Version => Self::Version,
            httparse::Error::TooManyHeaders => Self::TooLarge,
            _ => Self::Malformed,
        }
    }
}

/// Reads a proxy request head from the start of `buf`, all the stream's bytes so far.
///
/// `Ok(None)`: the head is not complete yet; call again with more bytes.
///
/// # Errors
/// The head is not a proxy request this proxy serves, or is over [`MAX_HEAD_BYTES`].
pub fn parse(buf: &[u8]) -> Result<Option<ProxyRequest>, RequestError> {
    // Look only within the bound, so a bad byte past it reads as a too-large head whatever the split.
    let window = buf.get(..MAX_HEAD_BYTES).unwrap_or(buf);
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(window)? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial if buf.len() > MAX_HEAD_BYTES => return Err(RequestError::TooLarge),
        httparse::Status::Partial => return Ok(None),
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(RequestError::Malformed);
    };
    // httparse lets obs-text through in the target; nothing but visible ASCII reaches a log or upstream.
    if !target.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(RequestError::BadTarget);
    }
    if method == "CONNECT" {
        let target = authority(target, None)?;
        return Ok(Some(ProxyRequest { target, kind: Kind::Connect, head_len }));
    }
    let (target, origin) = absolute(target)?;
    let path = origin.split_once('?').map_or(origin.as_str(), |(p, _)| p).to_owned();
    let head = rewrite(&format!("{method} {origin} HTTP/1.{version}"), req.headers, &target)?;
    let kind = Kind::Forward { method: method.to_owned(), path, head };
    Ok(Some(ProxyRequest { target, kind, head_len }))
}

/// Splits an absolute-form `http://authority/rest` into its target and origin-form `/rest`.
fn absolute(target: &str) -> Result<(Target, String), RequestError> {
    if target.starts_with('/') || target == "*" {
        return Err(RequestError::OriginForm);
    }
    let (scheme, rest) = target.split_once("://").ok_or(RequestError::BadTarget)?;
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(RequestError::UnsupportedScheme);
    }
    // A fragment is never sent on the wire.
    if rest.contains('#') {
        return Err(RequestError::BadTarget);
    }
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (auth, tail) = rest.split_at(end);
    let origin = if tail.starts_with('/') { tail.to_owned() } else { format!("/{tail}") };
    Ok((authority(auth, Some(80))?, origin))
}

/// Reads `host[:port]` or `[v6][:port]`; the port is required when there is no default.
fn authority(text: &str, default_port: Option<u16>) -> Result<Target, RequestError> {
    if text.contains('@') {
        return Err(RequestError::UserInfo);
    }
    let end = if text.starts_with('[') {
        let close = text.find(']').ok_or(RequestError::BadTarget)?;
        // Brackets hold an IPv6 address only (no zone, no IPv4, no name).
        text.get(1..close).and_then(|v6| v6.parse::<Ipv6Addr>().ok()).ok_or(RequestError::BadTarget)?;
        close + 1
    } else {
        text.find(':').unwrap_or(text.len())
    };
    let (host, rest) = text.split_at(end);
    let port = match rest.strip_prefix(':') {
        Some(digits) => port(digits)?,
        None if rest.is_empty() => default_port.ok_or(RequestError::BadTarget)?,
        None => return Err(RequestError::BadTarget),
    };
    let host = normalize_host(host).ok_or(RequestError::BadTarget)?;
    Ok(Target { host, port })
}

/// A decimal port, 1 to 65535 (`u16::from_str` alone would take `+80`).
fn port(digits: &str) -> Result<u16, RequestError> {
    if digits.is_empty() || digits.len() > 5 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(RequestError::BadTarget);
    }
    digits.parse::<u16>().ok().filter(|&p| p != 0).ok_or(RequestError::BadTarget)
}

/// The head to send upstream: origin-form, hop-by-hop headers dropped, `Connection: close` added.
fn rewrite(line: &str, headers: &[httparse::Header<'_>], target: &Target) -> Result<Vec<u8>, RequestError> {
    let named = |name: &'static str| headers.iter().filter(move |h| h.name.eq_ignore_ascii_case(name));
    if named("host").count() > 1
        || named("content-length").count() > 1
        || (named("content-length").next().is_some() && named("transfer-encoding").next().is_some())
    {
        return Err(RequestError::Ambiguous);
    }
    // Headers the client marked hop-by-hop in `Connection` go too.
    let listed: Vec<&[u8]> = named("connection")
        .flat_map(|h| h.value.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
        .collect();
    let is = |list: &[&str], name: &str| list.iter().any(|h| name.eq_ignore_ascii_case(h));
    let hop = |name: &str| {
        is(&HOP_BY_HOP, name)
            || (!is(&END_TO_END, name) && listed.iter().any(|t| t.eq_ignore_ascii_case(name.as_bytes())))
    };
    let mut head = Vec::with_capacity(MAX_HEAD_BYTES / 4);
    head.extend_from_slice(format!("{line}\r\n").as_bytes());
    // The target decides where the request goes; a client's own Host (another name behind the same CDN)
    // is replaced, as RFC 9112 3.2.2 asks of a proxy.
    for h in headers.iter().filter(|h| !hop(h.name) && !h.name.eq_ignore_ascii_case("host")) {
        head.extend_from_slice(h.name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(h.value);
        head.extend_from_slice(b"\r\n");
    }
    let host = if target.port == 80 { target.url_host() } else { target.to_string() };
    head.extend_from_slice(format!("Host: {host}\r\n").as_bytes());
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(head)
}

/// A complete plain-text answer that closes the connection, e.g. `reply(403, "not allowed by policy")`.
///
/// Control characters in `reason` become spaces and it is cut to a bound, so it cannot end the head early.
pub fn reply(status: u16, reason: &str) -> Vec<u8> {
    let status = if (100..=599).contains(&status) { status } else { 500 };
    let body: String = reason.chars().take(MAX_REASON_CHARS).map(|c| if c.is_control() { ' ' } else { c }).collect();
    let phrase = phrase(status);
    let len = body.len() + 1;
    format!(
        "HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n{body}\n"
    )
    .into_bytes()
}

/// The reason phrase for the statuses a proxy sends.
fn phrase(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        403 => "Forbidden",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Error",
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use RequestError as E;

    fn ok(buf: &[u8]) -> ProxyRequest {
        parse(buf).unwrap().unwrap()
    }

    fn target(host: &str, port: u16) -> Target {
        Target { host: host.to_owned(), port }
    }

    fn forward(buf: &[u8]) -> (String, String) {
        match ok(buf).kind {
            Kind::Forward { head, path, .. } => (String::from_utf8(head).unwrap(), path),
            Kind::Connect => panic!("not a forward"),
        }
    }

    #[test]
    fn connect_to_name_ipv4_and_ipv6() {
        let r = ok(b"CONNECT Example.COM.:443 HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03");
        assert_eq!((r.target, r.kind, r.head_len), (target("example.com", 443), Kind::Connect, 46));
        assert_eq!(ok(b"CONNECT 10.0.0.1:22 HTTP/1.0\r\n\r\n").target, target("10.0.0.1", 22));
        assert_eq!(ok(b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n").target, target("::1", 8443));
        assert_eq!(ok(b"CONNECT [::ffff:127.0.0.1]:80 HTTP/1.1\r\n\r\n").target, target("127.0.0.1", 80));
        let bad = "a.com a.com: a.com:0 a.com:65536 a.com:+80 ::1:443 [a.com]:443 [::1]443 2130706433:1 http://a.com:1";
        for t in bad.split(' ').chain(["/", "[fe80::1%25eth0]:1"]) {
            assert_eq!(parse(format!("CONNECT {t} HTTP/1.1\r\n\r\n").as_bytes()), Err(E::BadTarget), "{t}");
        }
        assert_eq!(parse(b"CONNECT u:p@a.com:443 HTTP/1.1\r\n\r\n"), Err(E::UserInfo));
    }

    #[test]
    fn absolute_form_is_rewritten() {
        let req = b"GET HTTP://Pypi.org/simple/x?a=1&b HTTP/1.1\r\nHost: pypi.org\r\nProxy-Connection: keep-alive\r\n\
            Proxy-Authorization: Basic eA==\r\nConnection: keep-alive, X-Hop, Content-Length\r\nX-Hop: 1\r\n\
            Keep-Alive: 5\r\nContent-Length: 0\r\n\r\nbody";
        let r = ok(req);
        assert_eq!((r.target, r.head_len), (target("pypi.org", 80), req.len() - 4));
        assert!(matches!(r.kind, Kind::Forward { method, .. } if method == "GET"));
        let (head, path) = forward(req);
        let want = "GET /simple/x?a=1&b HTTP/1.1\r\nContent-Length: 0\r\nHost: pypi.org\r\nConnection: close\r\n\r\n";
        assert_eq!((head.as_str(), path.as_str()), (want, "/simple/x"));
        // No Host: one is added; methods pass as sent (case-sensitive, the origin decides).
        let (head, path) = forward(b"post http://[::1]:8080?q HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi");
        assert_eq!(head, "post /?q HTTP/1.0\r\nContent-Length: 2\r\nHost: [::1]:8080\r\nConnection: close\r\n\r\n");
        assert_eq!(path, "/");
        assert!(forward(b"GET http://a.com HTTP/1.1\r\n\r\n").0.starts_with("GET / HTTP/1.1\r\nHost: a.com\r\n"));
        // The target names the host: a client's other Host (fronting behind a CDN) is replaced.
        let (head, _) = forward(b"GET http://a.com/ HTTP/1.1\r\nHost: b.com\r\n\r\n");
        assert_eq!(head, "GET / HTTP/1.1\r\nHost: a.com\r\nConnection: close\r\n\r\n");
    }

    #[test]
    fn refusals_and_injection() {
        for (req, want) in [
            (&b"GET https://a.com/ HTTP/1.1\r\n\r\n"[..], E::UnsupportedScheme),
            (b"GET ftp://a.com/ HTTP/1.1\r\n\r\n", E::UnsupportedScheme),
            (b"GET / HTTP/1.1\r\nHost: a.com\r\n\r\n", E::OriginForm),
            (b"OPTIONS * HTTP/1.1\r\n\r\n", E::OriginForm),
            (b"GET a.com:80 HTTP/1.1\r\n\r\n", E::BadTarget),
            (b"connect a.com:443 HTTP/1.1\r\n\r\n", E::BadTarget),
            (b"GET http://u@a.com/ HTTP/1.1\r\n\r\n", E::UserInfo),
            (b"GET http://a.com/#f HTTP/1.1\r\n\r\n", E::BadTarget),
            (b"GET http://a.com/ HTTP/2.0\r\n\r\n", E::Version),
            (b"POST http://a.com/ HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", E::Ambiguous),
            (b"GET http://a.com/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", E::Ambiguous),
            // Header injection: CR or LF inside the target or a value, bytes that are not visible ASCII.
            (b"GET http://a.com/\r\nX: y HTTP/1.1\r\n\r\n", E::Malformed),
            (b"GET http://a.com/ HTTP/1.1\r\nX: a\rInjected: b\r\n\r\n", E::Malformed),
            (b"CONNECT a.com:443\rX HTTP/1.1\r\n\r\n", E::Malformed),
            (b"GET http://a.com/\xc3\xa9 HTTP/1.1\r\n\r\n", E::BadTarget),
            (b"GET http://a.com\x00/ HTTP/1.1\r\n\r\n", E::Malformed),
        ] {
            assert_eq!(parse(req), Err(want), "{:?}", String::from_utf8_lossy(req));
        }
        assert_eq!((E::OriginForm.status(), E::UnsupportedScheme.status(), E::Version.status()), (400, 501, 505));
    }

    #[test]
    fn incomplete_and_too_large() {
        assert_eq!(parse(b""), Ok(None));
        assert_eq!(parse(b"CONNECT a.com:443 HTTP/1.1\r\nHost: a\r\n"), Ok(None));
        let mut big = b"GET http://a.com/ HTTP/1.1\r\nX: ".to_vec();
        big.resize(MAX_HEAD_BYTES, b'a');
        assert_eq!(parse(&big), Ok(None));
        big.push(b'a');
        assert_eq!((parse(&big), E::TooLarge.status()), (Err(E::TooLarge), 431));
    }

    #[test]
    fn replies() {
        let r = String::from_utf8(reply(403, "not allowed\r\n\r\nX")).unwrap();
        let want =
            "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: 17\r\nConnection: close\r\n\r\n";
        assert_eq!(r, format!("{want}not allowed    X\n"));
        assert!(reply(E::UnsupportedScheme.status(), E::UnsupportedScheme.describe())
            .starts_with(b"HTTP/1.1 501 Not Implemented\r\n"));
    }

    /// Pieces that make requests likely to get far into the parser, half of them after a valid request line.
    fn pieces() -> impl Strategy<Value = Vec<u8>> {
        let pieces = "GET ~CONNECT ~http://~HTTPS://~a.com~[::1]~:~443~@~/p~?q~#~ HTTP/1.1~\r\n~\n~\r~Host: h~\
            Connection: x~Content-Length: 1~X: \x7f~\u{e9}~ ";
        let piece = prop::sample::select(pieces.split('~').collect::<Vec<_>>());
        let start = prop::sample::select(vec!["", "GET http://a.com/p HTTP/1.1\r\n", "CONNECT a.com:1 HTTP/1.1\r\n"]);
        (start, prop::collection::vec(piece, 0..24)).prop_map(|(s, v)| (s.to_owned() + &v.concat()).into_bytes())
    }

    proptest! {
        #[test]
        fn never_panics_and_is_incremental(
            buf in prop_oneof![prop::collection::vec(any::<u8>(), 0..600), pieces()],
        ) {
            let whole = parse(&buf);
            for cut in 0..=buf.len() {
                let part = parse(&buf[..cut]);
                prop_assert!(part == Ok(None) || part == whole, "cut {cut}: {part:?} vs {whole:?}");
            }
        }
    }
}
