//! The versioned hello that opens every connection.
//!
//! The guest speaks first: as soon as the agent has its channel open it sends `link::ToHost::Hello`. The
//! host checks it and answers with `link::ToGuest::Hello`; the guest checks that in turn. Either side that finds a
//! mismatch says so plainly and closes. On the attach socket the supervisor plays the guest's part.
//!
//! **Version policy.** [`PROTOCOL_VERSION`] is one number that both sides must share exactly; any change to
//! a message's layout bumps it. The hello itself is frozen forever: it is enum variant 1 of all four channel
//! types (`link::{ToGuest, ToHost}`, `attach::{ToSupervisor, ToClient}`) and its fields never change, so two builds of any version can always tell each other apart with
//! [`HandshakeError::VersionMismatch`] instead of a decode error.

use serde::{Deserialize, Serialize};

use crate::frame::{self, FrameError};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 9;

/// First field of every hello: the bytes `VMBP`. Catches a peer that speaks something else entirely.
pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"VMBP");

/// The enum tag of `Hello` in every channel's message type (frozen).
const HELLO_TAG: u32 = 1;

/// A hello as the first message of any channel: it encodes to the bytes of `Hello(hello)` in each channel's
/// message type, so a handshake needs no message type.
#[derive(Debug)]
pub struct HelloFrame<'a>(pub &'a Hello);

impl Serialize for HelloFrame<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_newtype_variant("Hello", HELLO_TAG, "Hello", self.0)
    }
}

/// What one side tells the other when a connection opens. Its layout is frozen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Always [`HELLO_MAGIC`].
    pub magic: u32,
    /// The sender's [`PROTOCOL_VERSION`].
    pub version: u16,
    /// What the sender can do.
    pub capabilities: Capabilities,
    /// Name and version of the sending program, for logs only (e.g. `vm-agent 0.1.0`).
    pub software: String,
}

/// Bit set of optional abilities. Unknown bits are kept and ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities(pub u64);

impl Capabilities {
    /// Spawn processes with argv, env, cwd, piped stdio and exit statuses.
    pub const EXEC: Self = Self(1);
    /// Deliver named signals to a process group.
    pub const SIGNALS: Self = Self(1 << 1);
    /// Run a process on a pseudo-terminal and resize it.
    pub const PTY: Self = Self(1 << 2);
    /// Power the VM off on request.
    pub const POWER_OFF: Self = Self(1 << 3);
    /// Answer pings (used for latency measurement and liveness).
    pub const PING: Self = Self(1 << 4);
    /// Network streams: the loopback proxy listeners and port forwards ([`crate::net`]).
    pub const NET: Self = Self(1 << 5);
    /// File operations ([`crate::files`]).
    pub const FILES: Self = Self(1 << 6);

    /// No capabilities.
    pub const NONE: Self = Self(0);

    /// Both sets together.
    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// The capabilities of `required` that `self` lacks.
    #[must_use]
    pub const fn missing(self, required: Self) -> Self {
        Self(required.0 & !self.0)
    }

    /// Whether every capability of `other` is in `self`.
    pub const fn contains(self, other: Self) -> bool {
        self.missing(other).0 == 0
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The first frame was not a hello, or its magic was wrong: the peer speaks another protocol.
    #[error("peer does not speak the vm boundary protocol")]
    NotHello,
    /// The peer speaks another version.
    #[error("peer speaks protocol version {theirs}, this side speaks version {ours}")]
    VersionMismatch {
        /// Our version.
        ours: u16,
        /// The peer's version.
        theirs: u16,
    },
    /// The peer lacks capabilities this side needs.
    #[error("peer lacks required capabilities (bits {:#x})", missing.0)]
    MissingCapabilities {
        /// The missing bits.
        missing: Capabilities,
    },
}

impl Hello {
    /// This build's hello.
    pub fn ours(capabilities: Capabilities, software: impl Into<String>) -> Self {
        Self { magic: HELLO_MAGIC, version: PROTOCOL_VERSION, capabilities, software: software.into() }
    }

    /// `software` as safe to print in a log line: at most 64 characters, printable ASCII only (anything
    /// else becomes `?`). A peer's hello is untrusted; this is the only form of it that reaches logs.
    #[must_use]
    pub fn software_label(&self) -> String {
        self.software.chars().take(64).map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect()
    }

    /// Checks a peer's hello against this build and the capabilities this side needs.
    ///
    /// # Errors
    /// A [`HandshakeError`] naming the mismatch.
    pub fn check(&self, required: Capabilities) -> Result<(), HandshakeError> {
        if self.magic != HELLO_MAGIC {
            return Err(HandshakeError::NotHello);
        }
        if self.version != PROTOCOL_VERSION {
            return Err(HandshakeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: self.version });
        }
        let missing = self.capabilities.missing(required);
        if missing != Capabilities::NONE {
            return Err(HandshakeError::MissingCapabilities { missing });
        }
        Ok(())
    }
}

/// Reads the version out of a first frame's body without decoding the rest, so a peer of another version
/// gets [`HandshakeError::VersionMismatch`] even if its later fields would not decode.
///
/// # Errors
/// [`HandshakeError::NotHello`] when the body does not start like a hello.
pub fn peek_version(body: &[u8]) -> Result<u16, HandshakeError> {
    let tag = body.first_chunk::<4>().map(|b| u32::from_le_bytes(*b));
    let magic = body.get(4..8).and_then(|b| b.first_chunk::<4>()).map(|b| u32::from_le_bytes(*b));
    let version = body.get(8..10).and_then(|b| b.first_chunk::<2>()).map(|b| u16::from_le_bytes(*b));
    match (tag, magic, version) {
        (Some(HELLO_TAG), Some(HELLO_MAGIC), Some(v)) => Ok(v),
        _ => Err(HandshakeError::NotHello),
    }
}

/// Either a frame problem or a handshake mismatch, for code that reads the first frame itself.
#[derive(Debug, thiserror::Error)]
pub enum FirstFrameError {
    /// The frame itself was bad.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The frame was a hello that does not match.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
}

/// Decodes the body of the first frame on a connection, of any channel, as a hello and checks it.
///
/// # Errors
/// [`FirstFrameError`] for a bad frame, a message other than a hello, or a mismatch.
pub fn accept_first(body: &[u8], required: Capabilities) -> Result<Hello, FirstFrameError> {
    let version = peek_version(body)?;
    if version != PROTOCOL_VERSION {
        return Err(HandshakeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: version }.into());
    }
    // The tag is the hello's (`peek_version` checked it); the rest is exactly one `Hello`.
    let hello = frame::decode_body::<Hello>(body.get(4..).unwrap_or_default())?;
    hello.check(required)?;
    Ok(hello)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::{ToClient, ToSupervisor};
    use crate::link::{ToGuest, ToHost};

    fn body_of<M: Serialize>(msg: &M) -> Vec<u8> {
        let mut wire = Vec::new();
        frame::encode(msg, &mut wire).unwrap();
        wire.split_off(frame::HEADER_BYTES)
    }

    #[test]
    fn software_label_is_printable_and_bounded() {
        let hostile = Hello::ours(Capabilities::NONE, format!("agent\n\x1b[2J{}", "x".repeat(100)));
        let label = hostile.software_label();
        assert_eq!(label.len(), 64);
        assert!(label.starts_with("agent??[2J"), "{label}");
        assert_eq!(Hello::ours(Capabilities::NONE, "vm-agent 0.1.0").software_label(), "vm-agent 0.1.0");
    }

    #[test]
    fn accepts_a_matching_hello() {
        let body = body_of(&ToHost::Hello(Hello::ours(Capabilities::EXEC, "test")));
        let hello = accept_first(&body, Capabilities::EXEC).unwrap();
        assert_eq!(hello.software, "test");
    }

    #[test]
    fn rejects_unknown_version_before_decoding_the_rest() {
        let mut hello = Hello::ours(Capabilities::EXEC, "future");
        hello.version = PROTOCOL_VERSION + 1;
        let mut body = body_of(&ToHost::Hello(hello));
        // A future hello might carry more fields; the version must still come through.
        body.extend_from_slice(b"new fields");
        let err = accept_first(&body, Capabilities::EXEC).unwrap_err();
        assert!(matches!(
            err,
            FirstFrameError::Handshake(HandshakeError::VersionMismatch { theirs, .. }) if theirs == PROTOCOL_VERSION + 1
        ));
    }

    #[test]
    fn rejects_missing_capabilities() {
        let body = body_of(&ToHost::Hello(Hello::ours(Capabilities::EXEC, "old")));
        let err = accept_first(&body, Capabilities::EXEC.union(Capabilities::PTY)).unwrap_err();
        assert!(matches!(
            err,
            FirstFrameError::Handshake(HandshakeError::MissingCapabilities { missing }) if missing == Capabilities::PTY
        ));
    }

    #[test]
    fn rejects_a_first_frame_that_is_not_a_hello() {
        let body = body_of(&ToHost::Pong { nonce: 1 });
        assert!(matches!(
            accept_first(&body, Capabilities::NONE),
            Err(FirstFrameError::Handshake(HandshakeError::NotHello))
        ));
    }

    #[test]
    fn hello_tag_is_frozen_on_both_channels_in_both_directions() {
        let hello = Hello::ours(Capabilities::NONE, "x");
        let generic = body_of(&HelloFrame(&hello));
        assert_eq!(peek_version(&generic), Ok(PROTOCOL_VERSION));
        for body in [
            body_of(&ToHost::Hello(hello.clone())),
            body_of(&ToGuest::Hello(hello.clone())),
            body_of(&ToClient::Hello(hello.clone())),
            body_of(&ToSupervisor::Hello(hello.clone())),
        ] {
            assert_eq!(body, generic);
        }
        assert_eq!(accept_first(&generic, Capabilities::NONE).unwrap(), hello);
    }
}
