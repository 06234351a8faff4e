//! A sandbox's shape: how many vCPUs and how much guest memory. Checked once, here, and then trusted by the
//! command line, the API, the store and the supervisor's arguments alike.

use serde::{Deserialize, Serialize};

/// Most vCPUs a sandbox may have.
pub const MAX_CPUS: u32 = 64;
/// Least guest memory, in MiB: below this the guest kernel does not boot.
pub const MIN_MEMORY_MIB: u32 = 64;
/// Most guest memory, in MiB.
pub const MAX_MEMORY_MIB: u32 = 65_536;
/// vCPUs when none are asked for.
pub const DEFAULT_CPUS: u32 = 1;
/// Guest memory when none is asked for, in MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 256;

/// A valid shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawShape", into = "RawShape")]
pub struct SandboxShape {
    cpus: u8,
    memory_mib: u32,
}

/// Why a shape is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// vCPUs outside `1..=MAX_CPUS`.
    #[error("cpus must be 1 to {MAX_CPUS}, got {0}")]
    Cpus(u32),
    /// Memory outside `MIN_MEMORY_MIB..=MAX_MEMORY_MIB`.
    #[error("memory must be {MIN_MEMORY_MIB} to {MAX_MEMORY_MIB} MiB, got {0}")]
    Memory(u32),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShape {
    cpus: u32,
    memory_mib: u32,
}

impl SandboxShape {
    /// Checks a shape.
    ///
    /// # Errors
    /// [`ShapeError`] naming the value out of range.
    pub fn new(cpus: u32, memory_mib: u32) -> Result<Self, ShapeError> {
        let cpus = u8::try_from(cpus)
            .ok()
            .filter(|c| (1..=MAX_CPUS).contains(&u32::from(*c)))
            .ok_or(ShapeError::Cpus(cpus))?;
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&memory_mib) {
            return Err(ShapeError::Memory(memory_mib));
        }
        Ok(Self { cpus, memory_mib })
    }

    /// As an API request gives it: 0 means the default.
    ///
    /// # Errors
    /// As [`SandboxShape::new`].
    pub fn with_defaults(cpus: u32, memory_mib: u32) -> Result<Self, ShapeError> {
        let or = |v: u32, d: u32| if v == 0 { d } else { v };
        Self::new(or(cpus, DEFAULT_CPUS), or(memory_mib, DEFAULT_MEMORY_MIB))
    }

    /// vCPUs.
    pub fn cpus(self) -> u8 {
        self.cpus
    }

    /// Guest memory in MiB.
    pub fn memory_mib(self) -> u32 {
        self.memory_mib
    }
}

/// `CPUS:MIB`, as the supervisor's `--shape` takes it.
impl std::fmt::Display for SandboxShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.cpus, self.memory_mib)
    }
}

/// Not `CPUS:MIB`, or out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeParseError {
    /// Not two numbers.
    #[error("a shape is CPUS:MIB")]
    Syntax,
    /// Out of range.
    #[error(transparent)]
    Range(#[from] ShapeError),
}

impl std::str::FromStr for SandboxShape {
    type Err = ShapeParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (cpus, mib) = s.split_once(':').ok_or(ShapeParseError::Syntax)?;
        let number = |t: &str| t.parse::<u32>().map_err(|_| ShapeParseError::Syntax);
        Ok(Self::new(number(cpus)?, number(mib)?)?)
    }
}

impl Default for SandboxShape {
    fn default() -> Self {
        Self { cpus: 1, memory_mib: DEFAULT_MEMORY_MIB }
    }
}

impl TryFrom<RawShape> for SandboxShape {
    type Error = ShapeError;

    fn try_from(raw: RawShape) -> Result<Self, Self::Error> {
        Self::new(raw.cpus, raw.memory_mib)
    }
}

impl From<SandboxShape> for RawShape {
    fn from(s: SandboxShape) -> Self {
        Self { cpus: u32::from(s.cpus), memory_mib: s.memory_mib }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked_once_and_never_clamped() {
        assert!(SandboxShape::new(1, 64).is_ok() && SandboxShape::new(64, 65_536).is_ok());
        assert_eq!(SandboxShape::new(0, 256), Err(ShapeError::Cpus(0)));
        assert_eq!(SandboxShape::new(65, 256), Err(ShapeError::Cpus(65)));
        assert_eq!(SandboxShape::new(300, 256), Err(ShapeError::Cpus(300)), "not clamped to a u8");
        assert_eq!(SandboxShape::new(1, 63), Err(ShapeError::Memory(63)));
        assert_eq!(SandboxShape::with_defaults(0, 0).unwrap(), SandboxShape::default());
    }

    #[test]
    fn stored_shapes_are_validated_when_read() {
        let json = serde_json::to_string(&SandboxShape::new(2, 512).unwrap()).unwrap();
        assert_eq!(json, r#"{"cpus":2,"memory_mib":512}"#);
        assert!(serde_json::from_str::<SandboxShape>(r#"{"cpus":99,"memory_mib":512}"#).is_err());
        assert!(serde_json::from_str::<SandboxShape>(r#"{"cpus":1,"memory_mib":512,"x":1}"#).is_err());
        assert_eq!("2:512".parse::<SandboxShape>().unwrap(), SandboxShape::new(2, 512).unwrap());
        assert!("2x512".parse::<SandboxShape>().is_err() && "0:512".parse::<SandboxShape>().is_err());
    }
}
