//! The launch descriptor: what the driver hands a supervisor about the sandbox it is to run, as a backend
//! name and an opaque payload (`descriptor.json`, 0600, written at every start).
//!
//! The supervisor admits it before it installs any credential or reads the policy: the backend comes from
//! its trusted arguments (`--backend`), never from the descriptor, and picks the payload's decoder; the
//! decoded sandbox id, session and generation must equal the trusted ones. Anything else stops the start
//! with a `descriptor_mismatch` finding (`docs/policy.md`, "Startup admission").

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::layout::SandboxFile;
use crate::session::{Generation, SessionId};

/// Largest descriptor file, bytes.
pub const MAX_DESCRIPTOR_BYTES: u64 = 64 * 1024;

/// A sandbox backend: how a supervisor runs its sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Backend {
    /// A QEMU microVM (this driver's only backend).
    #[default]
    Microvm,
}

impl Backend {
    /// Its name in descriptors and argv.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Microvm => "microvm",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The descriptor: a backend's name and its payload, opaque to everyone but that backend's decoder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchDescriptor {
    /// The backend the payload is for.
    pub backend: String,
    /// The payload (for [`Backend::Microvm`], a [`MicrovmPayload`] as JSON).
    pub payload: String,
}

/// What the microVM backend's payload says about the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MicrovmPayload {
    /// The sandbox id.
    pub sandbox_id: String,
    /// `serve`'s session, when the sandbox has one.
    pub session_id: Option<String>,
    /// The start's generation.
    pub generation: u64,
}

/// The trusted inputs a descriptor is checked against: the supervisor's own arguments.
#[derive(Debug, Clone, Copy)]
pub struct Trusted<'a> {
    /// `--backend`.
    pub backend: Backend,
    /// `--sandbox-id`.
    pub sandbox_id: &'a str,
    /// `--session-id`.
    pub session_id: Option<&'a SessionId>,
    /// `--generation`.
    pub generation: Generation,
}

/// Why a descriptor was not admitted. Fixed text: nothing of the descriptor is repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    /// Missing, unreadable, too large or not a descriptor.
    #[error("the launch descriptor is missing or malformed")]
    Unreadable,
    /// It names another backend than the trusted one.
    #[error("the launch descriptor is for another backend")]
    Backend,
    /// The payload does not decode for the trusted backend.
    #[error("the launch descriptor's payload does not decode")]
    Payload,
    /// Another sandbox.
    #[error("the launch descriptor names another sandbox")]
    Sandbox,
    /// Another session.
    #[error("the launch descriptor names another session")]
    Session,
    /// Another generation.
    #[error("the launch descriptor names another generation")]
    Generation,
}

impl LaunchDescriptor {
    /// The microVM backend's descriptor for a start.
    pub fn microvm(payload: &MicrovmPayload) -> Self {
        Self { backend: Backend::Microvm.as_str().into(), payload: serde_json::to_string(payload).unwrap_or_default() }
    }

    /// Writes it into `dir` (0600), replacing an earlier start's.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(SandboxFile::Descriptor.name());
        let _ = std::fs::remove_file(&path);
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
        file.write_all(serde_json::to_string(self).unwrap_or_default().as_bytes())
    }

    /// Reads the descriptor in `dir`.
    ///
    /// # Errors
    /// [`Mismatch::Unreadable`].
    pub fn read(dir: &Path) -> Result<Self, Mismatch> {
        use std::io::Read;
        let file = std::fs::File::open(dir.join(SandboxFile::Descriptor.name())).map_err(|_| Mismatch::Unreadable)?;
        let mut text = String::new();
        file.take(MAX_DESCRIPTOR_BYTES).read_to_string(&mut text).map_err(|_| Mismatch::Unreadable)?;
        serde_json::from_str(&text).map_err(|_| Mismatch::Unreadable)
    }

    /// Admits it against `trusted`: the trusted backend names the decoder, and the decoded identity must be
    /// the trusted one.
    ///
    /// # Errors
    /// The first [`Mismatch`].
    pub fn admit(&self, trusted: &Trusted<'_>) -> Result<(), Mismatch> {
        if self.backend != trusted.backend.as_str() {
            return Err(Mismatch::Backend);
        }
        let decoded: MicrovmPayload = match trusted.backend {
            Backend::Microvm => serde_json::from_str(&self.payload).map_err(|_| Mismatch::Payload)?,
        };
        if decoded.sandbox_id != trusted.sandbox_id {
            return Err(Mismatch::Sandbox);
        }
        if decoded.session_id.as_deref() != trusted.session_id.map(SessionId::as_str) {
            return Err(Mismatch::Session);
        }
        if decoded.generation != trusted.generation.0 {
            return Err(Mismatch::Generation);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_trusted_identity_is_admitted() {
        let session = SessionId::from_bytes([1; 16]);
        let trusted = Trusted {
            backend: Backend::Microvm,
            sandbox_id: "box",
            session_id: Some(&session),
            generation: Generation(3),
        };
        let good =
            MicrovmPayload { sandbox_id: "box".into(), session_id: Some(session.as_str().into()), generation: 3 };
        assert_eq!(LaunchDescriptor::microvm(&good).admit(&trusted), Ok(()));
        let cases = [
            (MicrovmPayload { sandbox_id: "other".into(), ..good.clone() }, Mismatch::Sandbox),
            (
                MicrovmPayload { session_id: Some(SessionId::from_bytes([2; 16]).as_str().into()), ..good.clone() },
                Mismatch::Session,
            ),
            (MicrovmPayload { session_id: None, ..good.clone() }, Mismatch::Session),
            (MicrovmPayload { generation: 2, ..good.clone() }, Mismatch::Generation),
        ];
        for (payload, why) in cases {
            assert_eq!(LaunchDescriptor::microvm(&payload).admit(&trusted), Err(why));
        }
        let other_backend = LaunchDescriptor { backend: "container".into(), ..LaunchDescriptor::microvm(&good) };
        assert_eq!(other_backend.admit(&trusted), Err(Mismatch::Backend));
        let garbage = LaunchDescriptor { payload: "{not json".into(), ..LaunchDescriptor::microvm(&good) };
        assert_eq!(garbage.admit(&trusted), Err(Mismatch::Payload));
    }

    #[test]
    fn it_round_trips_through_its_file_and_a_bad_file_is_unreadable() {
        let dir = std::env::temp_dir().join(format!("descriptor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(LaunchDescriptor::read(&dir), Err(Mismatch::Unreadable));
        let desc =
            LaunchDescriptor::microvm(&MicrovmPayload { sandbox_id: "a".into(), session_id: None, generation: 0 });
        desc.write(&dir).unwrap();
        assert_eq!(LaunchDescriptor::read(&dir), Ok(desc));
        std::fs::write(dir.join(SandboxFile::Descriptor.name()), "x".repeat(100_000)).unwrap();
        assert_eq!(LaunchDescriptor::read(&dir), Err(Mismatch::Unreadable));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
