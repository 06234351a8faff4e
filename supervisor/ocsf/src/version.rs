//! Which OCSF schema version events are emitted in.

use std::fmt;

/// The version used when none is configured: the latest release.
pub const DEFAULT_SCHEMA_VERSION: &str = "1.8.0";

/// Versions whose definitions these events were checked against.
pub const SUPPORTED_SCHEMA_VERSIONS: &[&str] = &["1.8.0"];

/// A schema version this build can emit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaVersion(&'static str);

/// A requested version this build cannot emit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("OCSF schema version {requested:?} is not supported (supported: {})", SUPPORTED_SCHEMA_VERSIONS.join(", "))]
pub struct UnsupportedVersion {
    /// What was asked for.
    pub requested: String,
}

impl SchemaVersion {
    /// Parses a requested version; an empty string means the default.
    ///
    /// # Errors
    /// [`UnsupportedVersion`].
    pub fn parse(text: &str) -> Result<Self, UnsupportedVersion> {
        let wanted = if text.trim().is_empty() { DEFAULT_SCHEMA_VERSION } else { text.trim() };
        SUPPORTED_SCHEMA_VERSIONS
            .iter()
            .find(|v| **v == wanted)
            .map(|v| Self(v))
            .ok_or_else(|| UnsupportedVersion { requested: text.to_owned() })
    }

    /// The version string.
    pub fn as_str(&self) -> &'static str {
        self.0
    }
}

impl Default for SchemaVersion {
    fn default() -> Self {
        Self(DEFAULT_SCHEMA_VERSION)
    }
}

impl fmt::Display for SchemaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_unknown_versions() {
        assert_eq!(SchemaVersion::parse("").unwrap().as_str(), "1.8.0");
        assert_eq!(SchemaVersion::parse("1.8.0").unwrap(), SchemaVersion::default());
        assert!(SchemaVersion::parse("1.1.0").is_err());
        assert!(SchemaVersion::parse("9").is_err());
    }
}
