//! Credential rotation: new OTLP collector headers (a bearer token) and a new CA bundle path, sent by the
//! driver over a supervisor's attach socket and never forwarded to the guest. The supervisor swaps its
//! credential slots, so the next export uses them, and answers with [`RotationOutcome`].
//!
//! Header values are secrets: [`CredentialRotation`]'s `Debug` shows header names only.

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
}

impl fmt::Debug for CredentialRotation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Option<Vec<&str>> = self.headers.as_ref().map(|h| h.iter().map(|(k, _)| k.as_str()).collect());
        f.debug_struct("CredentialRotation").field("header_names", &names).field("ca_path", &self.ca_path).finish()
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
    /// Neither headers nor a CA path were given.
    Empty,
}

impl RotationOutcome {
    /// Fixed text for events and errors; never a value.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::NoCollector => "refused: the sandbox exports to no OTLP collector",
            Self::BadHeader => "refused: a header name or value is not valid on the wire",
            Self::CaUnreadable => "refused: the CA bundle is unreadable or holds no PEM certificate",
            Self::Empty => "refused: neither headers nor a CA path were given",
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
        };
        let shown = format!("{r:?}");
        assert!(shown.contains("authorization") && shown.contains("/etc/ca.pem") && !shown.contains("s3cret"));
    }
}
