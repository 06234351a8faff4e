//! Where an image comes from, named as skopeo names transports:
//!
//! - `REGISTRY/NAME[:TAG|@DIGEST]` (or `docker://...`): a registry ([`crate::registry`]);
//! - `oci:DIR[:TAG]`: an OCI image layout, its manifest chosen by the `org.opencontainers.image.ref.name`
//!   annotation (or the only one, without a tag);
//! - `docker-archive:FILE`: `docker save` output.
//!
//! Every source yields the same thing: a manifest's bytes and blobs by digest, all checked against their
//! digests on the way into the store. Files of a layout or an archive are untrusted as much as a
//! registry's answers: a layout's blobs are opened by validated digest only, and an archive is read as a
//! stream, its entries' names only ever looked up, never opened on the host.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::reference::{Reference, ReferenceError};

/// An image source.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Source {
    /// A registry.
    Registry(Reference),
    /// An OCI image layout directory, and the tag to pick from it.
    OciLayout {
        /// The layout's directory.
        dir: PathBuf,
        /// The `ref.name` annotation to pick.
        tag: Option<String>,
    },
    /// A `docker save` tar.
    DockerArchive(PathBuf),
}

impl FromStr for Source {
    type Err = ReferenceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(rest) = s.strip_prefix("oci:") {
            // `oci:DIR:TAG`: the tag is after the last colon that is not inside the path.
            let (dir, tag) = match rest.rsplit_once(':') {
                Some((dir, tag)) if !tag.contains('/') && !dir.is_empty() => (dir, Some(tag.to_owned())),
                _ => (rest, None),
            };
            if dir.is_empty() {
                return Err(ReferenceError::Malformed(s.to_owned()));
            }
            return Ok(Self::OciLayout { dir: PathBuf::from(dir), tag: tag.filter(|t| !t.is_empty()) });
        }
        if let Some(file) = s.strip_prefix("docker-archive:") {
            if file.is_empty() {
                return Err(ReferenceError::Malformed(s.to_owned()));
            }
            return Ok(Self::DockerArchive(PathBuf::from(file)));
        }
        let reference = s.strip_prefix("docker://").unwrap_or(s);
        Ok(Self::Registry(reference.parse()?))
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Registry(r) => write!(f, "{r}"),
            Self::OciLayout { dir, tag: Some(tag) } => write!(f, "oci:{}:{tag}", dir.display()),
            Self::OciLayout { dir, tag: None } => write!(f, "oci:{}", dir.display()),
            Self::DockerArchive(file) => write!(f, "docker-archive:{}", file.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_parse_as_skopeo_names_them() {
        let parse = |s: &str| s.parse::<Source>().unwrap();
        assert_eq!(
            parse("oci:/srv/layout:py"),
            Source::OciLayout { dir: "/srv/layout".into(), tag: Some("py".into()) }
        );
        assert_eq!(parse("oci:./layout"), Source::OciLayout { dir: "./layout".into(), tag: None });
        assert_eq!(parse("docker-archive:/tmp/img.tar"), Source::DockerArchive("/tmp/img.tar".into()));
        assert_eq!(parse("docker://python:3.12").to_string(), "docker.io/library/python:3.12");
        assert_eq!(parse("127.0.0.1:5000/app").to_string(), "127.0.0.1:5000/app:latest");
        assert!("oci:".parse::<Source>().is_err());
        assert!("docker-archive:".parse::<Source>().is_err());
    }
}
