//! The accelerator: what a caller asks for ([`AccelChoice`]) and what a VM runs on ([`Accelerator`]).

mod probe;

pub use probe::{Host, KvmUnusable};

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The hardware-assisted or emulated CPU a VM runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accelerator {
    /// Linux KVM.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
}

impl Accelerator {
    /// `kvm` or `tcg`, as QEMU's `-accel` and every report spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Tcg => "tcg",
        }
    }
}

impl fmt::Display for Accelerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a caller asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    /// KVM where it can boot the guest, otherwise TCG (says why once).
    #[default]
    Auto,
    /// KVM, or fail: never falls back.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
}

impl AccelChoice {
    /// `auto`, `kvm` or `tcg`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Kvm => "kvm",
            Self::Tcg => "tcg",
        }
    }
}

impl fmt::Display for AccelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Not `auto`, `kvm` or `tcg`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("accelerator must be auto, kvm or tcg")]
pub struct UnknownAccel;

impl FromStr for AccelChoice {
    type Err = UnknownAccel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Self::Auto, Self::Kvm, Self::Tcg].into_iter().find(|c| c.as_str() == s).ok_or(UnknownAccel)
    }
}
