//! What the warm pool holds: `serve --pool COUNT[:CPUS:MIB[:IMAGE]]`, repeatable. `IMAGE` is an OCI image
//! reference, the pooled VMs' root (docs/images.md); they boot the default boot image.

use vm_contract::shape::SandboxShape;

use crate::image::Image;

/// Pooled VMs of one shape and root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolTarget {
    /// How many to keep booted and unclaimed.
    pub count: u32,
    /// Their vCPUs and memory; a create must ask for exactly these to claim one.
    pub shape: SandboxShape,
    /// Their root: an OCI image reference as its source names it (`vm_oci::source::Source`'s spelling),
    /// pulled before the first of them boots; `None`: the built-in root.
    pub image: Option<String>,
}

/// The most pooled VMs of one target.
pub const MAX_COUNT: u32 = 64;

/// A `--pool` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// Not `COUNT[:CPUS:MIB[:IMAGE]]`.
    #[error("--pool takes COUNT[:CPUS:MIB[:IMAGE]], e.g. 2 or 2:1:256 or 1:2:512:python:3.12-slim")]
    Syntax,
    /// The count is out of range.
    #[error("--pool: the count must be 1 to {MAX_COUNT}")]
    Count,
    /// The shape is out of range.
    #[error("--pool: {0}")]
    Shape(#[from] vm_contract::shape::ShapeError),
    /// The image is not a reference.
    #[error("--pool: image: {0}")]
    Image(String),
}

impl std::str::FromStr for PoolTarget {
    type Err = TargetError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        // The image's own colons (a tag, a port, `oci:DIR:TAG`) stay in its part.
        let parts: Vec<&str> = text.splitn(4, ':').collect();
        let number = |s: &str| s.parse::<u32>().map_err(|_| TargetError::Syntax);
        let count = number(parts[0])?;
        if count == 0 || count > MAX_COUNT {
            return Err(TargetError::Count);
        }
        let (shape, image) = match parts[1..] {
            [] => (SandboxShape::default(), None),
            [cpus, mib] => (SandboxShape::with_defaults(number(cpus)?, number(mib)?)?, None),
            [cpus, mib, image] => {
                let source: vm_oci::source::Source = image.parse().map_err(|e| TargetError::Image(format!("{e}")))?;
                (SandboxShape::with_defaults(number(cpus)?, number(mib)?)?, Some(source.to_string()))
            }
            _ => return Err(TargetError::Syntax),
        };
        Ok(Self { count, shape, image })
    }
}

/// What a pooled VM must match to be claimed: the shape, the boot image's files, and the root (the image's
/// reference as the create names it, canonical, with the default writable layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolKey {
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// The boot image, resolved.
    pub image: Image,
    /// The root's reference; `None`: the built-in root.
    pub root: Option<String>,
}

/// A create's root as a pool key names it (`Some(None)`: the built-in root): its reference canonical, and
/// only with the default writable layer (pooled VMs have that one); `None` when no pooled VM can serve it.
pub fn root_key(image: Option<&str>, disk_mib: u32) -> Option<Option<String>> {
    match image {
        None => Some(None),
        Some(_) if disk_mib != vm_contract::root::DEFAULT_DISK_MIB => None,
        Some(reference) => reference.parse::<vm_oci::source::Source>().ok().map(|s| Some(s.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counts_shapes_and_images() {
        let t: PoolTarget = "2".parse().unwrap();
        assert_eq!((t.count, t.shape, t.image), (2, SandboxShape::default(), None));
        let t: PoolTarget = "1:2:512:python:3.12-slim".parse().unwrap();
        assert_eq!((t.count, t.shape), (1, SandboxShape::new(2, 512).unwrap()));
        assert_eq!(t.image.as_deref(), Some("docker.io/library/python:3.12-slim"));
        let t: PoolTarget = "1:1:256:127.0.0.1:5000/e2e/py:1".parse().unwrap();
        assert_eq!(t.image.as_deref(), Some("127.0.0.1:5000/e2e/py:1"));
        assert_eq!("3:1:256".parse::<PoolTarget>().unwrap().shape, SandboxShape::new(1, 256).unwrap());
        for bad in ["", "x", "0", "65", "1:2", "1:2:512:a b", "1:2:512:../x", "1:2:512:UPPER", "1:0:99999999"] {
            assert!(bad.parse::<PoolTarget>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_create_matches_a_root_by_its_canonical_reference_and_the_default_layer() {
        let default = vm_contract::root::DEFAULT_DISK_MIB;
        assert_eq!(root_key(None, 1), Some(None));
        assert_eq!(root_key(Some("python:3"), default), Some(Some("docker.io/library/python:3".into())));
        assert_eq!(root_key(Some("python:3"), 64), None, "another layer size boots cold");
    }
}
