//! Validated sandbox ids. Validation happens before any path is built from an id.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest accepted sandbox id.
pub const MAX_SANDBOX_ID_BYTES: usize = 128;

/// A sandbox id matching `[A-Za-z0-9._-]{1,128}`, and neither `.` nor `..`: safe as one path component.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SandboxId(String);

/// Why a string is not a sandbox id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SandboxIdError {
    /// Empty, or longer than [`MAX_SANDBOX_ID_BYTES`].
    #[error("sandbox id must be 1 to {MAX_SANDBOX_ID_BYTES} characters long, got {len}")]
    Length {
        /// The length that was given, in bytes.
        len: usize,
    },
    /// A character outside `[A-Za-z0-9._-]`.
    #[error("sandbox id may only contain A-Z, a-z, 0-9, '.', '_' and '-'")]
    Character,
    /// `.` or `..`.
    #[error("sandbox id may not be '.' or '..'")]
    DotName,
}

impl SandboxId {
    /// Validates `text` as a sandbox id.
    ///
    /// # Errors
    /// A [`SandboxIdError`] naming the rule that failed.
    pub fn parse(text: &str) -> Result<Self, SandboxIdError> {
        if text.is_empty() || text.len() > MAX_SANDBOX_ID_BYTES {
            return Err(SandboxIdError::Length { len: text.len() });
        }
        if !text.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
            return Err(SandboxIdError::Character);
        }
        if text == "." || text == ".." {
            return Err(SandboxIdError::DotName);
        }
        Ok(Self(text.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for SandboxId {
    type Err = SandboxIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl<'de> Deserialize<'de> for SandboxId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        for ok in ["a", "A-b_c.9", &"x".repeat(MAX_SANDBOX_ID_BYTES), "..."] {
            assert!(SandboxId::parse(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_paths_and_odd_characters() {
        assert!(matches!(SandboxId::parse(""), Err(SandboxIdError::Length { len: 0 })));
        assert!(matches!(SandboxId::parse(&"x".repeat(MAX_SANDBOX_ID_BYTES + 1)), Err(SandboxIdError::Length { .. })));
        for bad in ["a/b", "../x", "a b", "é", "a\0", "a\n"] {
            assert!(matches!(SandboxId::parse(bad), Err(SandboxIdError::Character)), "{bad:?}");
        }
        assert!(matches!(SandboxId::parse("."), Err(SandboxIdError::DotName)));
        assert!(matches!(SandboxId::parse(".."), Err(SandboxIdError::DotName)));
    }
}
