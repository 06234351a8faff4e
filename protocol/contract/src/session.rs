//! A supervisor's session with `vm-driver serve`, and the numbers that name one start of a sandbox.
//!
//! One JSON object per line on the driver's session socket: the supervisor sends [`SessionHello`], the driver
//! answers [`SessionReply`], the supervisor then reports its readiness endpoint with [`SessionNote`]. Either
//! side closing ends the session.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// One start of a sandbox: it increments on every start, so a late message of an earlier supervisor is
/// never mistaken for the current one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u64);

impl Generation {
    /// The generation after this one.
    #[must_use]
    pub fn next(self) -> Self {
        Self(self.0.saturating_add(1))
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for Generation {
    type Err = std::num::ParseIntError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Self)
    }
}

/// Identifies one supervisor's session (one start of one sandbox): 32 lowercase hex digits, chosen by the
/// driver. Not a secret (the token is); it names the session in events and in the supervisor's arguments.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionId(String);

/// Not 32 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a session id is 32 lowercase hex digits")]
pub struct BadSessionId;

impl SessionId {
    /// From 16 random bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SessionId {
    type Err = BadSessionId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        ok.then(|| Self(s.to_owned())).ok_or(BadSessionId)
    }
}

impl TryFrom<String> for SessionId {
    type Error = BadSessionId;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<SessionId> for String {
    fn from(id: SessionId) -> Self {
        id.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a supervisor presents when it opens its session.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionHello {
    /// The sandbox.
    pub sandbox_id: String,
    /// Its generation.
    pub generation: Generation,
    /// This start's session id (from the supervisor's arguments).
    pub session_id: SessionId,
    /// The token from the auth bundle.
    pub token: String,
}

impl fmt::Debug for SessionHello {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionHello")
            .field("sandbox_id", &self.sandbox_id)
            .field("generation", &self.generation)
            .field("session_id", &self.session_id)
            .finish_non_exhaustive()
    }
}

/// The driver's answer to a [`SessionHello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionReply {
    /// Whether the session is accepted.
    pub accepted: bool,
    /// Why not (fixed text).
    #[serde(default)]
    pub reason: String,
}

/// What the supervisor reports once accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionNote {
    /// `127.0.0.1:PORT` of the readiness listener.
    pub readiness: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_checked_and_hellos_hide_the_token() {
        let id = SessionId::from_bytes([0xab; 16]);
        assert_eq!(id.as_str().parse::<SessionId>().unwrap(), id);
        assert!("ABAB".parse::<SessionId>().is_err() && "zz".repeat(16).parse::<SessionId>().is_err());
        let hello =
            SessionHello { sandbox_id: "s".into(), generation: Generation(3), session_id: id, token: "t0ken".into() };
        assert!(!format!("{hello:?}").contains("t0ken"));
        assert!(serde_json::from_str::<SessionReply>(r#"{"accepted":true,"extra":1}"#).is_err());
    }
}
