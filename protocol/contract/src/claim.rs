//! Claiming a pooled VM: the one line the driver writes on a pooled supervisor's liveness pipe.
//!
//! A pooled supervisor (`--pooled`) boots its VM with no identity: no sandbox id of its own, no session, no
//! telemetry settings, no credentials, no policy. When `serve` hands the VM to a sandbox it first writes the
//! auth bundle, the policy and the launch descriptor into the (renamed) sandbox directory, then this line on
//! the supervisor's stdin, which only the driver can write. The line carries the trusted, non-secret part of
//! the identity, in the role the argv plays for a cold start: the descriptor is admitted against it. Secrets
//! stay in the auth bundle. After the line the pipe is the liveness pipe again: EOF means the driver is gone.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::env;
use crate::ids::SandboxId;
use crate::session::{Generation, SessionId};

/// The longest claim line the supervisor reads, newline included.
pub const MAX_LINE: usize = 16 * 1024;

/// The telemetry settings a claim may carry: the [`env`] variables a cold start gets in its environment.
pub const SETTINGS: [&str; 6] =
    [env::OTLP_ENDPOINT, env::OTLP_PROTOCOL, env::SCHEMA_VERSION, env::GATEWAY_NAME, env::OCSF_JSON, env::OTLP_CA];

/// A pooled VM's new identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    /// The sandbox it now serves.
    pub sandbox_id: SandboxId,
    /// The session this start opens.
    pub session_id: SessionId,
    /// The sandbox's generation.
    pub generation: Generation,
    /// `serve`'s session socket.
    pub session_socket: PathBuf,
    /// Telemetry settings, as `(variable, value)` pairs of [`SETTINGS`].
    pub telemetry: Vec<(String, String)>,
}

/// A claim line that cannot be used. Fixed text: the line is not echoed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// Longer than [`MAX_LINE`].
    #[error("the claim line is longer than {MAX_LINE} bytes")]
    TooLong,
    /// Not a claim.
    #[error("the claim line is not a claim")]
    Malformed,
    /// A telemetry setting the claim may not carry.
    #[error("the claim carries a setting that is not a telemetry setting")]
    UnknownSetting,
}

impl Claim {
    /// One line of JSON, newline included.
    ///
    /// # Errors
    /// [`ClaimError::TooLong`].
    pub fn to_line(&self) -> Result<String, ClaimError> {
        let mut line = serde_json::to_string(self).map_err(|_| ClaimError::Malformed)?;
        line.push('\n');
        if line.len() > MAX_LINE {
            return Err(ClaimError::TooLong);
        }
        Ok(line)
    }

    /// Parses one line (without or with its newline).
    ///
    /// # Errors
    /// [`ClaimError`].
    pub fn from_line(line: &[u8]) -> Result<Self, ClaimError> {
        if line.len() > MAX_LINE {
            return Err(ClaimError::TooLong);
        }
        let claim: Self = serde_json::from_slice(line.trim_ascii_end()).map_err(|_| ClaimError::Malformed)?;
        if claim.telemetry.iter().any(|(k, _)| !SETTINGS.contains(&k.as_str())) {
            return Err(ClaimError::UnknownSetting);
        }
        Ok(claim)
    }

    /// The value of telemetry setting `var`, when set and not blank.
    pub fn setting(&self, var: &str) -> Option<String> {
        self.telemetry.iter().find(|(k, v)| k == var && !v.trim().is_empty()).map(|(_, v)| v.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> Claim {
        Claim {
            sandbox_id: SandboxId::parse("box-1").unwrap(),
            session_id: SessionId::from_bytes([3; 16]),
            generation: Generation(1),
            session_socket: "/run/vm-driver/sessions.sock".into(),
            telemetry: vec![(env::GATEWAY_NAME.into(), "gw".into())],
        }
    }

    #[test]
    fn lines_round_trip_and_refuse_what_is_not_a_claim() {
        let line = claim().to_line().unwrap();
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        assert_eq!(Claim::from_line(line.as_bytes()).unwrap(), claim());
        assert_eq!(claim().setting(env::GATEWAY_NAME).as_deref(), Some("gw"));
        assert_eq!(Claim::from_line(b"{}"), Err(ClaimError::Malformed));
        assert_eq!(Claim::from_line(&[0xff; 40]), Err(ClaimError::Malformed));
        assert_eq!(Claim::from_line(&vec![b' '; MAX_LINE + 1]), Err(ClaimError::TooLong));
        let mut other = claim();
        other.telemetry.push(("LD_PRELOAD".into(), "/x".into()));
        let line = other.to_line().unwrap();
        assert_eq!(Claim::from_line(line.as_bytes()), Err(ClaimError::UnknownSetting));
        let bad_id = line.replace("box-1", "../x");
        assert_eq!(Claim::from_line(bad_id.as_bytes()), Err(ClaimError::Malformed));
    }
}
