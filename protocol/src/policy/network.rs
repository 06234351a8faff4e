//! The policy's `network` section: which destinations a sandbox's connections may reach (`docs/network.md`).
//!
//! A rule names a host (an exact name, one leading `*.` label, or an IP literal) and its ports. A name that
//! resolves to a loopback, private, link-local, shared or metadata address is refused unless the rule lists
//! that address in `allowed_ips`; the supervisor applies that check after resolving, on every answer.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{bounded, PolicyError};

/// The name that reaches the host's loopback, and only through a rule that names it exactly.
pub const HOST_GATEWAY: &str = "host.vm-driver.internal";

/// Most rules in a network section.
pub const MAX_RULES: usize = 256;
/// Most ports, and most `allowed_ips` entries, in one rule.
pub const MAX_RULE_ITEMS: usize = 64;
/// `max_connections` when the section does not say.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 64;
/// The highest `max_connections`.
pub const MAX_CONNECTIONS_CAP: u32 = 1024;
/// Longest host name (RFC 1035).
pub const MAX_HOST_BYTES: usize = 253;

/// What a sandbox's connections may reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// The approved rules: the most any later revision may allow.
    #[serde(deserialize_with = "crate::message::seq_deserialize")]
    pub allow: Vec<NetRule>,
    /// Most connections open at once (egress and port forwards together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
}

impl NetworkPolicy {
    /// The connection cap in force.
    pub fn connection_cap(&self) -> u32 {
        self.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS)
    }

    pub(super) fn validate(&self) -> Result<(), PolicyError> {
        if self.allow.len() > MAX_RULES {
            return Err(PolicyError::BadNetwork(format!("at most {MAX_RULES} rules")));
        }
        if self.max_connections.is_some_and(|n| n == 0 || n > MAX_CONNECTIONS_CAP) {
            return Err(PolicyError::BadNetwork(format!("max_connections must be 1 to {MAX_CONNECTIONS_CAP}")));
        }
        self.allow.iter().try_for_each(NetRule::validate)
    }
}

/// One destination rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetRule {
    /// `pypi.org`, `*.githubusercontent.com` (exactly one more label), [`HOST_GATEWAY`], or an IP literal.
    pub host: HostPattern,
    /// The ports it may reach: 1 to [`MAX_RULE_ITEMS`] of them, none 0.
    #[serde(deserialize_with = "crate::message::seq_deserialize")]
    pub ports: Vec<u16>,
    /// Non-public addresses the host may resolve to and still be reached. (Always written: a rule also travels
    /// in bincode, in a `PolicyUpdate`, where a skipped field would not decode.)
    #[serde(default, deserialize_with = "crate::message::seq_deserialize")]
    pub allowed_ips: Vec<IpRange>,
    /// What the supervisor does with TLS on this rule's CONNECT streams.
    #[serde(default)]
    pub tls: TlsMode,
    /// The requests allowed, when the supervisor sees them (plain HTTP, or TLS it intercepts); empty: any.
    #[serde(default, deserialize_with = "crate::message::seq_deserialize")]
    pub http: Vec<HttpRule>,
}

/// A rule's TLS handling (`docs/network.md`, Interception).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// The workload's TLS passes through untouched, end to end with the destination.
    #[default]
    Passthrough,
    /// The supervisor terminates the workload's TLS with a leaf of the sandbox's CA, reads each request, and
    /// makes its own TLS connection to the destination.
    Intercept,
}

/// Requests a rule allows, by method and path. A request matches when its method is listed (or none are)
/// and its path is listed (or none are). A path ending in `*` matches any path it is a prefix of.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpRule {
    /// `GET`, `POST`, ... (exact, case-sensitive as HTTP's are).
    #[serde(default, deserialize_with = "crate::message::seq_deserialize")]
    pub methods: Vec<String>,
    /// `/v1/chat/completions`, `/simple/*`.
    #[serde(default, deserialize_with = "crate::message::seq_deserialize")]
    pub paths: Vec<String>,
}

/// Longest path pattern or method of an [`HttpRule`].
pub const MAX_HTTP_ITEM_BYTES: usize = 1024;

impl HttpRule {
    fn validate(&self, host: &HostPattern) -> Result<(), PolicyError> {
        let bad = |what: &str| PolicyError::BadNetwork(format!("{host}: http rule: {what}"));
        if self.methods.len() > MAX_RULE_ITEMS || self.paths.len() > MAX_RULE_ITEMS {
            return Err(bad(&format!("at most {MAX_RULE_ITEMS} methods and {MAX_RULE_ITEMS} paths")));
        }
        let token = |m: &String| {
            !m.is_empty() && m.len() <= 32 && m.bytes().all(|b| b.is_ascii_uppercase() || b == b'-' || b == b'_')
        };
        if !self.methods.iter().all(token) {
            return Err(bad("a method must be an upper-case HTTP method"));
        }
        let path_ok = |p: &String| {
            p.starts_with('/')
                && p.len() <= MAX_HTTP_ITEM_BYTES
                && p.bytes().all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#' && b != b'%')
                && !p.trim_end_matches('*').contains('*')
                && p.split('/').all(|seg| seg != "." && seg != "..")
        };
        if !self.paths.iter().all(path_ok) {
            return Err(bad("a path must start with /, hold no ?, #, %, . or .. segment, and end in at most one *"));
        }
        Ok(())
    }

    /// Whether the request `method` on `path` (without its query) matches.
    pub fn matches(&self, method: &str, path: &str) -> bool {
        let method_ok = self.methods.is_empty() || self.methods.iter().any(|m| m == method);
        let path_ok = self.paths.is_empty()
            || self.paths.iter().any(|p| match p.strip_suffix('*') {
                Some(prefix) => path.starts_with(prefix),
                None => p == path,
            });
        method_ok && path_ok
    }
}

impl NetRule {
    fn validate(&self) -> Result<(), PolicyError> {
        let host = &self.host;
        if self.ports.is_empty() || self.ports.len() > MAX_RULE_ITEMS || self.ports.contains(&0) {
            return Err(PolicyError::BadNetwork(format!(
                "{host}: ports must list 1 to {MAX_RULE_ITEMS} ports, none 0"
            )));
        }
        if self.allowed_ips.len() > MAX_RULE_ITEMS {
            return Err(PolicyError::BadNetwork(format!("{host}: at most {MAX_RULE_ITEMS} allowed_ips")));
        }
        if self.http.len() > MAX_RULE_ITEMS {
            return Err(PolicyError::BadNetwork(format!("{host}: at most {MAX_RULE_ITEMS} http rules")));
        }
        // The sandbox's CA names DNS hosts only: a leaf for an address would be one no client checks by name.
        if self.tls == TlsMode::Intercept && host.as_str().parse::<IpAddr>().is_ok() {
            return Err(PolicyError::BadNetwork(format!("{host}: tls intercept needs a host name, not an address")));
        }
        self.http.iter().try_for_each(|h| h.validate(host))
    }

    /// Whether the rule lets `method` reach `path` (the path without its query). With HTTP rules, a path
    /// whose meaning a server may change is refused, as it cannot be judged as the destination will read
    /// it: `.` or `..` segments, `;` (path parameters, `..;/`), `\`, and an encoded dot, slash, backslash
    /// or percent sign.
    pub fn allows_request(&self, method: &str, path: &str) -> bool {
        if self.http.is_empty() {
            return true;
        }
        let lowered = path.to_ascii_lowercase();
        let unclear = path.split('/').any(|s| s == "." || s == "..")
            || path.contains([';', '\\'])
            || ["%2e", "%2f", "%5c", "%25"].iter().any(|e| lowered.contains(e));
        !unclear && self.http.iter().any(|h| h.matches(method, path))
    }

    /// Whether the rule covers `host` (normalized, see [`normalize_host`]) and `port`.
    pub fn covers(&self, host: &str, port: u16) -> bool {
        self.ports.contains(&port) && self.host.matches(host)
    }

    /// Whether `ip` (canonical: a mapped IPv6 address already made IPv4) is in `allowed_ips`.
    pub fn lists(&self, ip: IpAddr) -> bool {
        self.allowed_ips.iter().any(|r| r.0.contains(&ip))
    }
}

/// A rule's host: validated and normalized when parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPattern(String);

impl HostPattern {
    /// The pattern as written (normalized).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `host` (normalized) matches: exactly, or for `*.suffix` a name of one more label than
    /// `suffix` that ends with it. [`HOST_GATEWAY`] only ever matches itself.
    pub fn matches(&self, host: &str) -> bool {
        match self.0.strip_prefix("*.") {
            None => self.0 == host,
            Some(_) if host == HOST_GATEWAY => false,
            Some(suffix) => host
                .strip_suffix(suffix)
                .and_then(|head| head.strip_suffix('.'))
                .is_some_and(|label| !label.is_empty() && !label.contains('.')),
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for HostPattern {
    type Err = PolicyError;
    fn from_str(text: &str) -> Result<Self, PolicyError> {
        let bad = || PolicyError::BadNetwork(format!("host {:?}: not a name, *.name or IP address", bounded(text)));
        let (wild, rest) = match text.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let name = normalize_host(rest).ok_or_else(bad)?;
        // A wildcard over an address, or over a bare top-level label, would match far more than it says.
        if wild && (name.parse::<IpAddr>().is_ok() || !name.contains('.')) {
            return Err(bad());
        }
        Ok(Self(if wild { format!("*.{name}") } else { name }))
    }
}

impl Serialize for HostPattern {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for HostPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A destination host as rules compare it: lowercase, without a trailing dot or IPv6 brackets; an IP literal
/// in its canonical text. `None` for anything that is neither a DNS name (labels of letters, digits and inner
/// hyphens or underscores, each 1 to 63 bytes) nor an IP address.
pub fn normalize_host(text: &str) -> Option<String> {
    let text = text.strip_suffix('.').unwrap_or(text);
    let bare = text.strip_prefix('[').and_then(|t| t.strip_suffix(']'));
    if let Ok(ip) = bare.unwrap_or(text).parse::<IpAddr>() {
        return Some(ip.to_canonical().to_string());
    }
    if bare.is_some() || text.is_empty() || text.len() > MAX_HOST_BYTES {
        return None;
    }
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    // An all-digit last label is what getaddrinfo would read as an address (`2130706433`, `127.1`): never a name.
    let last_numeric = text.rsplit('.').next().is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
    (text.split('.').all(label_ok) && !last_numeric).then(|| text.to_ascii_lowercase())
}

/// An address range of `allowed_ips`: `10.0.0.0/8`, or one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpRange(pub IpNet);

impl Serialize for IpRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(&self.0)
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for IpRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let net = if d.is_human_readable() {
            let text = String::deserialize(d)?;
            let net = text.parse::<IpNet>().or_else(|_| text.parse::<IpAddr>().map(IpNet::from));
            net.map_err(|_| serde::de::Error::custom(format!("{:?} is not an address or range", bounded(&text))))?
        } else {
            IpNet::deserialize(d)?
        };
        // Mapped IPv6 ranges never contain the IPv4 addresses they name: keep every range canonical.
        Ok(Self(match net {
            IpNet::V6(v6) => match v6.addr().to_ipv4_mapped() {
                Some(v4) => IpNet::new(IpAddr::V4(v4), v6.prefix_len().saturating_sub(96)).unwrap_or(net),
                None => net,
            },
            v4 => v4,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(host: &str) -> NetRule {
        NetRule {
            host: host.parse().unwrap(),
            ports: vec![443],
            allowed_ips: Vec::new(),
            tls: TlsMode::Passthrough,
            http: Vec::new(),
        }
    }

    #[test]
    fn http_rules_match_method_and_path_and_refuse_what_they_cannot_judge() {
        let json = r#"{"host": "api.example.com", "ports": [443], "tls": "intercept",
            "http": [{"methods": ["POST"], "paths": ["/v1/chat/completions", "/v1/files/*"]}]}"#;
        let r: NetRule = serde_json::from_str(json).unwrap();
        r.validate().unwrap();
        assert_eq!(r.tls, TlsMode::Intercept);
        assert!(r.allows_request("POST", "/v1/chat/completions"));
        assert!(r.allows_request("POST", "/v1/files/abc"));
        assert!(!r.allows_request("GET", "/v1/chat/completions"));
        assert!(!r.allows_request("POST", "/v1/chat/completions/x"));
        assert!(!r.allows_request("POST", "/v1/models"));
        assert!(rule("a.com").allows_request("DELETE", "/anything"), "no http rules: any request");
        assert!(!r.allows_request("POST", "/v1/files/../admin"), "a path a server may read otherwise");
        assert!(!r.allows_request("POST", "/v1/files/%2E%2E/admin"));
        for unclear in ["/v1/files/..;/admin", "/v1/files/a\\..\\b", "/v1/files/%252e%252e/x", "/v1/files/%5c"] {
            assert!(!r.allows_request("POST", unclear), "{unclear}");
        }
        assert!(r.allows_request("POST", "/v1/files/my%20file"), "other escapes are judged as written");
        for bad in [
            r#"{"paths": ["v1"]}"#,
            r#"{"paths": ["/a/../b"]}"#,
            r#"{"paths": ["/a*b"]}"#,
            r#"{"paths": ["/a?x=1"]}"#,
            r#"{"paths": ["/%2e"]}"#,
            r#"{"methods": ["get"]}"#,
        ] {
            let h: HttpRule = serde_json::from_str(bad).unwrap();
            assert!(h.validate(&r.host).is_err(), "{bad}");
        }
        let literal = NetRule { host: "10.0.0.1".parse().unwrap(), tls: TlsMode::Intercept, ..rule("a.com") };
        assert!(literal.validate().is_err(), "no interception of an address");
    }

    #[test]
    fn hosts_are_normalized_and_wildcards_take_one_label() {
        assert_eq!(normalize_host("PyPI.org."), Some("pypi.org".into()));
        assert_eq!(normalize_host("[::ffff:127.0.0.1]"), Some("127.0.0.1".into()));
        for bad in ["", "a..b", "-a.com", "a b", "2130706433", "127.1", "0x7f.1", "[pypi.org]", "a.b.c.0"] {
            assert_eq!(normalize_host(bad), None, "{bad}");
        }
        let wild = rule("*.githubusercontent.com");
        assert!(wild.covers("raw.githubusercontent.com", 443));
        assert!(!wild.covers("raw.githubusercontent.com", 80));
        assert!(!wild.covers("githubusercontent.com", 443));
        assert!(!wild.covers("a.b.githubusercontent.com", 443));
        assert!(!wild.covers("evilgithubusercontent.com", 443));
        assert!(!rule("*.vm-driver.internal").covers(HOST_GATEWAY, 443));
        assert!(rule(HOST_GATEWAY).covers(HOST_GATEWAY, 443));
        for bad in ["*.com", "*.10.0.0.1", "*.*.a.com", "a.*.com"] {
            assert!(bad.parse::<HostPattern>().is_err(), "{bad}");
        }
    }

    #[test]
    fn allowed_ips_take_ranges_and_addresses_and_stay_canonical() {
        let r: NetRule = serde_json::from_str(
            r#"{"host":"db.example","ports":[5432],"allowed_ips":["10.0.0.0/8","192.168.1.7","::ffff:172.16.0.0/108"]}"#,
        )
        .unwrap();
        assert!(r.lists("10.2.3.4".parse().unwrap()));
        assert!(r.lists("192.168.1.7".parse().unwrap()) && !r.lists("192.168.1.8".parse().unwrap()));
        assert!(r.lists("172.16.9.9".parse().unwrap()), "a mapped range is judged as IPv4");
        let back: NetRule = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        for rule in [r.clone(), NetRule { allowed_ips: Vec::new(), ..r.clone() }] {
            let wire = bincode::serialize(&rule).unwrap();
            assert_eq!(bincode::deserialize::<NetRule>(&wire).unwrap(), rule);
        }
        assert!(serde_json::from_str::<NetRule>(r#"{"host":"a.b","ports":[1],"allowed_ips":["10/8"]}"#).is_err());
    }
}
