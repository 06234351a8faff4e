//! Entry names: `./usr/bin/python3`, `usr/lib/`, `usr//share/./doc` all clean to their components. A name
//! that starts with `/` or holds `..` is refused rather than rewritten: no tool that builds images writes one,
//! so one that does is crafted.

/// Longest entry name accepted, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest component (Linux's `NAME_MAX`).
pub const MAX_NAME_BYTES: usize = 255;

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The name starts with `/`.
    #[error("absolute path {0:?}")]
    Absolute(String),
    /// The name holds a `..` component.
    #[error("path with '..' {0:?}")]
    DotDot(String),
    /// Too long, a component too long, or a NUL inside.
    #[error("unusable path {0:?}")]
    Unusable(String),
}

/// The components of `name`; empty for the root itself (`./`).
///
/// # Errors
/// [`PathError`] for an absolute name, a `..`, a NUL, or a name or component over the limits.
pub fn components(name: &[u8]) -> Result<Vec<Vec<u8>>, PathError> {
    let shown = || String::from_utf8_lossy(&name[..name.len().min(200)]).into_owned();
    if name.len() > MAX_PATH_BYTES || name.contains(&0) {
        return Err(PathError::Unusable(shown()));
    }
    if name.first() == Some(&b'/') {
        return Err(PathError::Absolute(shown()));
    }
    let mut out = Vec::new();
    for part in name.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err(PathError::DotDot(shown())),
            _ if part.len() > MAX_NAME_BYTES => return Err(PathError::Unusable(shown())),
            _ => out.push(part.to_vec()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(name: &str) -> Result<Vec<String>, PathError> {
        components(name.as_bytes()).map(|c| c.into_iter().map(|p| String::from_utf8(p).unwrap()).collect())
    }

    #[test]
    fn names_clean_to_components() {
        assert_eq!(clean("./usr/bin/python3").unwrap(), ["usr", "bin", "python3"]);
        assert_eq!(clean("usr//share/./doc/").unwrap(), ["usr", "share", "doc"]);
        assert!(clean("./").unwrap().is_empty());
        assert!(matches!(clean("/etc/passwd"), Err(PathError::Absolute(_))));
        assert!(matches!(clean("a/../../etc"), Err(PathError::DotDot(_))));
        assert!(matches!(clean(".."), Err(PathError::DotDot(_))));
        assert!(matches!(components(b"a\0b"), Err(PathError::Unusable(_))));
        assert!(matches!(clean(&"x".repeat(256)), Err(PathError::Unusable(_))));
    }

    proptest::proptest! {
        #[test]
        fn no_component_is_empty_dot_or_dotdot(name in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            if let Ok(parts) = components(&name) {
                for p in parts {
                    proptest::prop_assert!(!p.is_empty() && p != b"." && p != b".." && !p.contains(&b'/'));
                }
            }
        }
    }
}
