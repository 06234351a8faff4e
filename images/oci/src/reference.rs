//! Image references as users write them: `REGISTRY/NAME[:TAG][@sha256:DIGEST]`. A name without a registry
//! is Docker Hub's (`python:3.12-slim` is `docker.io/library/python:3.12-slim`), as Docker resolves it; a
//! reference with neither tag nor digest means `:latest`.

use std::fmt;
use std::str::FromStr;

use crate::digest::{Digest, DigestError};

/// Docker Hub's name in references.
pub const DOCKER_HUB: &str = "docker.io";
/// The host Docker Hub's API answers on.
const DOCKER_HUB_API: &str = "registry-1.docker.io";
/// Longest reference accepted (Docker's own limit on a name is 255).
const MAX_REFERENCE_LEN: usize = 512;

/// A parsed, normalised reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reference {
    /// `docker.io`, `ghcr.io`, `127.0.0.1:5000`.
    pub registry: String,
    /// `library/python`.
    pub repository: String,
    /// The tag; `latest` when neither tag nor digest was given.
    pub tag: Option<String>,
    /// The digest, when pinned.
    pub digest: Option<Digest>,
}

/// Why a reference does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    /// Empty, too long, or with characters no reference has.
    #[error("malformed image reference {0:?}")]
    Malformed(String),
    /// The repository name breaks the distribution spec's grammar (lowercase, separators inside).
    #[error("invalid repository name {0:?} (lowercase letters, digits and . _ - / inside)")]
    Repository(String),
    /// The tag breaks the grammar.
    #[error("invalid tag {0:?}")]
    Tag(String),
    /// The digest is not one we accept.
    #[error(transparent)]
    Digest(#[from] DigestError),
}

impl Reference {
    /// The host and port to send API requests to.
    pub fn api_host(&self) -> &str {
        if self.registry == DOCKER_HUB {
            DOCKER_HUB_API
        } else {
            &self.registry
        }
    }

    /// What to ask the registry's manifest endpoint for: the digest if pinned, else the tag.
    pub fn manifest_ref(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".to_owned(),
        }
    }
}

impl FromStr for Reference {
    type Err = ReferenceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let malformed = || ReferenceError::Malformed(s.to_owned());
        if s.is_empty() || s.len() > MAX_REFERENCE_LEN || !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(malformed());
        }
        let (rest, digest) = match s.split_once('@') {
            Some((rest, digest)) => (rest, Some(digest.parse::<Digest>()?)),
            None => (s, None),
        };
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[last_slash..].find(':') {
            Some(i) => (&rest[..last_slash + i], Some(rest[last_slash + i + 1..].to_owned())),
            None => (rest, None),
        };
        let (registry, repository) = match name.split_once('/') {
            Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => {
                (first.to_owned(), path.to_owned())
            }
            _ if name.contains('/') => (DOCKER_HUB.to_owned(), name.to_owned()),
            _ => (DOCKER_HUB.to_owned(), format!("library/{name}")),
        };
        if !host_valid(&registry) {
            return Err(malformed());
        }
        if !repository_valid(&repository) {
            return Err(ReferenceError::Repository(repository));
        }
        if let Some(tag) = &tag {
            if !tag_valid(tag) {
                return Err(ReferenceError::Tag(tag.clone()));
            }
        }
        let tag = if tag.is_none() && digest.is_none() { Some("latest".to_owned()) } else { tag };
        Ok(Self { registry, repository, tag, digest })
    }
}

/// The distribution spec's path components: `[a-z0-9]+` joined by `.`, `_`, `__` or `-`s.
/// `HOST[:PORT]`: dot-separated labels of letters, digits and inner hyphens (`..` is none), or a bracketed
/// IPv6 address; a port of 1 to 5 digits.
fn host_valid(registry: &str) -> bool {
    let (host, port) = match registry.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, Some(port)),
        _ => (registry, None),
    };
    if port.is_some_and(|p| p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit())) {
        return false;
    }
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return !inner.is_empty() && inner.bytes().all(|b| b.is_ascii_hexdigit() || b == b':');
    }
    !host.is_empty()
        && host.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

fn repository_valid(repository: &str) -> bool {
    repository.len() <= 255
        && repository.split('/').all(|component| {
            let b = component.as_bytes();
            !b.is_empty()
                && b.first().is_some_and(u8::is_ascii_alphanumeric)
                && b.last().is_some_and(u8::is_ascii_alphanumeric)
                && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
        })
}

/// `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`.
fn tag_valid(tag: &str) -> bool {
    let b = tag.as_bytes();
    (1..=128).contains(&b.len())
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(c))
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(s: &str) -> String {
        s.parse::<Reference>().map_or_else(|e| format!("error: {e}"), |r| r.to_string())
    }

    #[test]
    fn short_names_resolve_as_docker_does() {
        assert_eq!(parsed("python:3.12-slim"), "docker.io/library/python:3.12-slim");
        assert_eq!(parsed("busybox"), "docker.io/library/busybox:latest");
        assert_eq!(parsed("user/tool"), "docker.io/user/tool:latest");
        assert_eq!(parsed("ghcr.io/org/app:v1"), "ghcr.io/org/app:v1");
        assert_eq!(parsed("127.0.0.1:5000/debian/py"), "127.0.0.1:5000/debian/py:latest");
        assert_eq!(parsed("localhost/app:1"), "localhost/app:1");
        let digest = Digest::of(b"m");
        let pinned: Reference = format!("127.0.0.1:5000/app@{digest}").parse().unwrap();
        assert_eq!((pinned.tag.clone(), pinned.manifest_ref()), (None, digest.to_string()));
        assert_eq!("python".parse::<Reference>().unwrap().api_host(), "registry-1.docker.io");
    }

    #[test]
    fn malformed_references_are_refused() {
        for bad in [
            "",
            "UPPER/case",
            "a//b",
            "a/b:",
            "a/b:-tag",
            "a b",
            "a/b@sha256:zz",
            "-a",
            "a/.b",
            "a/b:t\n",
            "../x",
            "a..b/x",
            "host:/x",
            "host:123456/x",
            "-h.io/x",
        ] {
            assert!(bad.parse::<Reference>().is_err(), "{bad:?} parsed");
        }
    }

    proptest::proptest! {
        #[test]
        fn parsing_never_panics_and_display_reparses(s in "\\PC{0,80}") {
            if let Ok(r) = s.parse::<Reference>() {
                proptest::prop_assert_eq!(r.to_string().parse::<Reference>().unwrap(), r);
            }
        }
    }
}
