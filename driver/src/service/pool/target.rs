//! What the warm pool holds: `serve --pool COUNT[:CPUS:MIB[:IMAGE]]`, repeatable.

use vm_contract::shape::SandboxShape;

use crate::image::Image;

/// Pooled VMs of one shape and image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolTarget {
    /// How many to keep booted and unclaimed.
    pub count: u32,
    /// Their vCPUs and memory; a create must ask for exactly these to claim one.
    pub shape: SandboxShape,
    /// Their image's name; empty: the default.
    pub image: String,
}

/// The most pooled VMs of one target.
pub const MAX_COUNT: u32 = 64;

/// A `--pool` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// Not `COUNT[:CPUS:MIB[:IMAGE]]`.
    #[error("--pool takes COUNT[:CPUS:MIB[:IMAGE]], e.g. 2 or 2:1:256 or 1:2:512:alpine")]
    Syntax,
    /// The count is out of range.
    #[error("--pool: the count must be 1 to {MAX_COUNT}")]
    Count,
    /// The shape is out of range.
    #[error("--pool: {0}")]
    Shape(#[from] vm_contract::shape::ShapeError),
    /// The image name is not one path component.
    #[error("--pool: image name: {0}")]
    Image(#[from] vm_contract::ids::SandboxIdError),
}

impl std::str::FromStr for PoolTarget {
    type Err = TargetError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = text.split(':').collect();
        let number = |s: &str| s.parse::<u32>().map_err(|_| TargetError::Syntax);
        let count = number(parts[0])?;
        if count == 0 || count > MAX_COUNT {
            return Err(TargetError::Count);
        }
        let (shape, image) = match parts[1..] {
            [] => (SandboxShape::default(), String::new()),
            [cpus, mib] => (SandboxShape::with_defaults(number(cpus)?, number(mib)?)?, String::new()),
            [cpus, mib, image] => {
                vm_contract::ids::SandboxId::parse(image)?;
                (SandboxShape::with_defaults(number(cpus)?, number(mib)?)?, image.to_owned())
            }
            _ => return Err(TargetError::Syntax),
        };
        Ok(Self { count, shape, image })
    }
}

/// What a pooled VM must match to be claimed: the shape, and the image's files (so the default image named
/// explicitly matches it too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolKey {
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// The image, resolved.
    pub image: Image,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counts_shapes_and_images() {
        let t: PoolTarget = "2".parse().unwrap();
        assert_eq!((t.count, t.shape, t.image.as_str()), (2, SandboxShape::default(), ""));
        let t: PoolTarget = "1:2:512:alpine".parse().unwrap();
        assert_eq!((t.count, t.shape, t.image.as_str()), (1, SandboxShape::new(2, 512).unwrap(), "alpine"));
        assert_eq!("3:1:256".parse::<PoolTarget>().unwrap().shape, SandboxShape::new(1, 256).unwrap());
        for bad in ["", "x", "0", "65", "1:2", "1:2:512:../x", "1:2:512:a:b", "1:0:99999999"] {
            assert!(bad.parse::<PoolTarget>().is_err(), "{bad}");
        }
    }
}
