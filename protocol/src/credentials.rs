//! Credential rotation: new OTLP collector headers (a bearer token) and a new CA bundle path, sent by the
//! driver over a supervisor's attach socket and never forwarded to the guest. The supervisor swaps its
//! credential slots, so the next export uses them, and answers with [`RotationOutcome`].
//!
//! It also carries the sandbox's secret credentials ([`SecretCredential`], `docs/network.md`, Placeholders):
//! values the workload sees only as placeholders, swapped in by the supervisor's proxy for the hosts each is
//! bound to. A rotation replaces credentials by name; the next request uses the new value.
//!
//! Header and credential values are secrets: no `Debug` here shows one.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Most headers in one rotation.
pub const MAX_HEADERS: usize = 64;

/// New credentials for a sandbox's OTLP export. `None` keeps what is in force.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialRotation {
    /// Replaces every collector header (name, value).
    #[serde(deserialize_with = "headers")]
    pub headers: Option<Vec<(String, String)>>,
    /// Replaces the CA bundle (an absolute path to a PEM file on the host) used for `https://` collectors.
    pub ca_path: Option<String>,
    /// Replaces the sandbox's secret credentials of the same names (each name must exist).
    #[serde(default, deserialize_with = "secrets")]
    pub secrets: Option<Vec<SecretCredential>>,
}

/// Most secret credentials a sandbox holds.
pub const MAX_SECRETS: usize = 32;
/// Longest secret value.
pub const MAX_SECRET_BYTES: usize = 8 * 1024;
/// Most hosts one credential is bound to.
pub const MAX_SECRET_HOSTS: usize = 16;

/// One secret the workload sees only as a placeholder in the environment variable `name`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretCredential {
    /// The environment variable that holds the placeholder (`OPENAI_API_KEY`).
    pub name: String,
    /// The secret.
    pub value: String,
    /// The hosts (network rule patterns) whose intercepted requests may carry it.
    #[serde(deserialize_with = "crate::message::seq_deserialize")]
    pub hosts: Vec<crate::policy::network::HostPattern>,
    /// A header the proxy sets on every intercepted request to a bound host.
    #[serde(default)]
    pub inject: Option<Inject>,
    /// Whether the placeholder is also replaced in the request's path and query (off: headers only).
    #[serde(default)]
    pub in_url: bool,
}

/// A header set from a credential: `format` with its one `{}` replaced by the value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inject {
    /// The header's name (`Authorization`).
    pub header: String,
    /// Its value, `{}` standing for the secret (`Bearer {}`).
    pub format: String,
}

impl fmt::Debug for SecretCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretCredential")
            .field("name", &self.name)
            .field("hosts", &self.hosts)
            .field("inject", &self.inject.as_ref().map(|i| &i.header))
            .field("in_url", &self.in_url)
            .finish_non_exhaustive()
    }
}

/// Why a credential list was refused (fixed text, never a value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// More than [`MAX_SECRETS`], or two with one name.
    #[error("at most 32 credentials, each name once")]
    Count,
    /// A name that is not an environment variable name (`[A-Za-z_][A-Za-z0-9_]*`, at most 128 bytes).
    #[error("a credential name must be an environment variable name")]
    Name,
    /// An empty value, one over [`MAX_SECRET_BYTES`], or one with a byte no header value may hold.
    #[error("a credential value must be 1 to 8192 printable bytes")]
    Value,
    /// No host, or more than [`MAX_SECRET_HOSTS`].
    #[error("a credential must name 1 to 16 hosts")]
    Hosts,
    /// An inject header name that is no HTTP token or one the proxy owns (`Host`, framing, hop-by-hop,
    /// `Proxy-*`), or a format without exactly one `{}`.
    #[error("an inject header must be an end-to-end header name and a format with one {{}}")]
    Inject,
}

impl SecretCredential {
    /// Checks a whole list.
    ///
    /// # Errors
    /// [`SecretError`].
    pub fn validate_all(list: &[Self]) -> Result<(), SecretError> {
        let mut names: Vec<&str> = list.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        if list.len() > MAX_SECRETS || names.len() != list.len() {
            return Err(SecretError::Count);
        }
        list.iter().try_for_each(Self::validate)
    }

    fn validate(&self) -> Result<(), SecretError> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 128
            && !self.name.starts_with(|c: char| c.is_ascii_digit())
            && self.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !name_ok {
            return Err(SecretError::Name);
        }
        if self.value.is_empty() || self.value.len() > MAX_SECRET_BYTES || !self.value.bytes().all(header_byte) {
            return Err(SecretError::Value);
        }
        if self.hosts.is_empty() || self.hosts.len() > MAX_SECRET_HOSTS {
            return Err(SecretError::Hosts);
        }
        if let Some(inject) = &self.inject {
            // Never a header of the hop, the framing or the destination: the proxy sets or drops those.
            let reserved = ["host", "content-length", "transfer-encoding", "connection", "te", "upgrade", "trailer"];
            let lowered = inject.header.to_ascii_lowercase();
            let token = !inject.header.is_empty()
                && inject.header.len() <= 128
                && inject.header.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
                && !reserved.contains(&lowered.as_str())
                && !lowered.starts_with("proxy-")
                && lowered != "keep-alive";
            if !token || inject.format.matches("{}").count() != 1 || !inject.format.bytes().all(header_byte) {
                return Err(SecretError::Inject);
            }
        }
        Ok(())
    }

    /// Whether the credential may go to `host` (normalized).
    pub fn bound_to(&self, host: &str) -> bool {
        self.hosts.iter().any(|h| h.matches(host))
    }
}

/// A byte a header value may hold: visible ASCII and space.
fn header_byte(b: u8) -> bool {
    b == b' ' || b.is_ascii_graphic()
}

fn secrets<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<SecretCredential>>, D::Error> {
    #[derive(Deserialize)]
    struct Bounded(#[serde(deserialize_with = "crate::message::seq_deserialize")] Vec<SecretCredential>);
    let list = Option::<Bounded>::deserialize(d)?.map(|b| b.0);
    if let Some(list) = &list {
        SecretCredential::validate_all(list).map_err(serde::de::Error::custom)?;
    }
    Ok(list)
}

impl fmt::Debug for CredentialRotation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Option<Vec<&str>> = self.headers.as_ref().map(|h| h.iter().map(|(k, _)| k.as_str()).collect());
        let secrets: Option<Vec<&str>> = self.secrets.as_ref().map(|s| s.iter().map(|c| c.name.as_str()).collect());
        f.debug_struct("CredentialRotation")
            .field("header_names", &names)
            .field("ca_path", &self.ca_path)
            .field("secret_names", &secrets)
            .finish()
    }
}

fn headers<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<(String, String)>>, D::Error> {
    #[derive(Deserialize)]
    struct Bounded(#[serde(deserialize_with = "crate::message::seq_deserialize")] Vec<(String, String)>);
    let headers = Option::<Bounded>::deserialize(d)?.map(|b| b.0);
    if headers.as_ref().is_some_and(|h| h.len() > MAX_HEADERS) {
        return Err(serde::de::Error::custom("too many headers"));
    }
    Ok(headers)
}

/// What became of a [`CredentialRotation`]. A refused rotation changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RotationOutcome {
    /// Swapped: the next export uses the new credentials.
    Applied,
    /// The sandbox exports to no collector.
    NoCollector,
    /// A header name or value is not valid on the wire.
    BadHeader,
    /// The CA bundle cannot be read, or holds no PEM certificate.
    CaUnreadable,
    /// Neither headers, a CA path nor credentials were given.
    Empty,
    /// A secret credential names none the sandbox holds.
    UnknownSecret,
}

impl RotationOutcome {
    /// Fixed text for events and errors; never a value.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::NoCollector => "refused: the sandbox exports to no OTLP collector",
            Self::BadHeader => "refused: a header name or value is not valid on the wire",
            Self::CaUnreadable => "refused: the CA bundle is unreadable or holds no PEM certificate",
            Self::Empty => "refused: neither headers, a CA path nor credentials were given",
            Self::UnknownSecret => "refused: a credential names none the sandbox holds",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_a_value() {
        let r = CredentialRotation {
            headers: Some(vec![("authorization".into(), "Bearer s3cret".into())]),
            ca_path: Some("/etc/ca.pem".into()),
            secrets: Some(vec![secret("KEY", "sk-t0p")]),
        };
        let shown = format!("{r:?}");
        assert!(shown.contains("authorization") && shown.contains("/etc/ca.pem") && !shown.contains("s3cret"));
        assert!(shown.contains("KEY") && !shown.contains("sk-t0p"), "{shown}");
    }

    fn secret(name: &str, value: &str) -> SecretCredential {
        SecretCredential {
            name: name.into(),
            value: value.into(),
            hosts: vec!["api.example.com".parse().unwrap()],
            inject: Some(Inject { header: "Authorization".into(), format: "Bearer {}".into() }),
            in_url: false,
        }
    }

    #[test]
    fn credentials_are_checked_as_a_list() {
        assert_eq!(SecretCredential::validate_all(&[secret("A", "v"), secret("B", "w")]), Ok(()));
        assert_eq!(SecretCredential::validate_all(&[secret("A", "v"), secret("A", "w")]), Err(SecretError::Count));
        assert_eq!(SecretCredential::validate_all(&[secret("1A", "v")]), Err(SecretError::Name));
        assert_eq!(SecretCredential::validate_all(&[secret("A", "a\r\nX: y")]), Err(SecretError::Value));
        let mut two = secret("A", "v");
        two.inject = Some(Inject { header: "Authorization".into(), format: "{} {}".into() });
        assert_eq!(SecretCredential::validate_all(&[two]), Err(SecretError::Inject));
        for header in ["Host", "Content-Length", "Proxy-Authorization", "Transfer-Encoding"] {
            let mut c = secret("A", "v");
            c.inject = Some(Inject { header: header.into(), format: "{}".into() });
            assert_eq!(SecretCredential::validate_all(&[c]), Err(SecretError::Inject), "{header}");
        }
        let json = r#"[{"name": "K", "value": "v", "hosts": ["api.openai.com"],
            "inject": {"header": "Authorization", "format": "Bearer {}"}}]"#;
        let list: Vec<SecretCredential> = serde_json::from_str(json).unwrap();
        assert!(list[0].bound_to("api.openai.com") && !list[0].bound_to("evil.com"));
    }
}
