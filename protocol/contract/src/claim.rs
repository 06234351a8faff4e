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

use crate::ids::SandboxId;
use crate::session::{Generation, SessionId};
use crate::telemetry::TelemetryConfig;

/// The longest claim line the supervisor reads, newline included.
pub const MAX_LINE: usize = 16 * 1024;

/// A pooled VM's new identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    /// The sandbox it now serves.
    pub sandbox_id: SandboxId,
    /// `serve`'s session this start opens; `launch` has none.
    pub session: Option<ClaimSession>,
    /// The sandbox's generation.
    pub generation: Generation,
    /// Telemetry settings: the same type a cold start gets in its environment.
    pub telemetry: TelemetryConfig,
    /// Where the VM came from, for the start event.
    pub origin: Origin,
}

/// The session with `serve` a claimed sandbox opens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimSession {
    /// The session's id.
    pub id: SessionId,
    /// `serve`'s session socket.
    pub socket: PathBuf,
}

/// Where a sandbox's VM came from: booted for it, a warm pool's VM, or restored from a saved boot (a
/// template, `docs/templates.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Booted for this sandbox.
    Cold,
    /// Booted or restored ahead of demand by `serve`'s pool, then claimed.
    Pool,
    /// Restored from a template for this sandbox, then claimed.
    Template,
}

impl Origin {
    /// The word reports and events use.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Cold => "cold",
            Self::Pool => "pool",
            Self::Template => "template",
        }
    }
}

/// A claim line that cannot be used. Fixed text: the line is not echoed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// Longer than [`MAX_LINE`].
    #[error("the claim line is longer than {MAX_LINE} bytes")]
    TooLong,
    /// Not a claim (or one with a field a claim may not carry).
    #[error("the claim line is not a claim")]
    Malformed,
}

impl Claim {
    /// The identity the claimed supervisor takes on: the sandbox's, in place of its slot's.
    pub fn identity(&self) -> crate::args::IdentityArgs {
        crate::args::IdentityArgs {
            sandbox_id: self.sandbox_id.clone(),
            session_id: self.session.as_ref().map(|s| s.id.clone()),
            generation: self.generation,
            session_socket: self.session.as_ref().map(|s| s.socket.clone()),
        }
    }

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
        serde_json::from_slice(line.trim_ascii_end()).map_err(|_| ClaimError::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> Claim {
        Claim {
            sandbox_id: SandboxId::parse("box-1").unwrap(),
            session: Some(ClaimSession {
                id: SessionId::from_bytes([3; 16]),
                socket: "/run/vm-driver/sessions.sock".into(),
            }),
            generation: Generation(1),
            telemetry: TelemetryConfig { gateway_name: Some("gw".into()), ..TelemetryConfig::default() },
            origin: Origin::Pool,
        }
    }

    #[test]
    fn lines_round_trip_and_refuse_what_is_not_a_claim() {
        let line = claim().to_line().unwrap();
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        assert_eq!(Claim::from_line(line.as_bytes()).unwrap(), claim());
        assert_eq!(Claim::from_line(b"{}"), Err(ClaimError::Malformed));
        assert_eq!(Claim::from_line(&[0xff; 40]), Err(ClaimError::Malformed));
        assert_eq!(Claim::from_line(&vec![b' '; MAX_LINE + 1]), Err(ClaimError::TooLong));
        let line = claim().to_line().unwrap();
        let other = line.replace(r#""gateway_name""#, r#""LD_PRELOAD""#);
        assert_eq!(Claim::from_line(other.as_bytes()), Err(ClaimError::Malformed), "only telemetry settings");
        let bad_id = line.replace("box-1", "../x");
        assert_eq!(Claim::from_line(bad_id.as_bytes()), Err(ClaimError::Malformed));
        let cold = line.replace(r#""pool""#, r#""cold""#);
        assert_eq!(Claim::from_line(cold.as_bytes()).unwrap().origin, Origin::Cold);
        let unknown = line.replace(r#""pool""#, r#""warm""#);
        assert_eq!(Claim::from_line(unknown.as_bytes()), Err(ClaimError::Malformed));
        let launch = Claim { session: None, ..claim() };
        let identity = Claim::from_line(launch.to_line().unwrap().as_bytes()).unwrap().identity();
        assert_eq!((identity.session_id, identity.session_socket), (None, None), "a launch's claim opens no session");
    }
}
