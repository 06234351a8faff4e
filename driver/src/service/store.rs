//! What a sandbox directory remembers across driver restarts: the accepted spec (written once, at create),
//! the last start's generation, the `stopped` marker (present while the sandbox was stopped on purpose,
//! written before stopping), and the tombstone (`vm_contract::tombstone`).

use std::collections::BTreeMap;
use std::fs;
use std::io;

use serde::{Deserialize, Serialize};
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::session::Generation;
use vm_contract::shape::{SandboxShape, ShapeError};
use vm_protocol::driver_api::{ReadinessKind, SandboxSpec};
use vm_protocol::policy::{PolicyError, SandboxPolicy};

/// The spec as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredSpec {
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// Environment of every process.
    pub env: BTreeMap<String, String>,
    /// The image's name; empty for the default.
    #[serde(default)]
    pub image: String,
    /// The approved policy; none: every operation.
    #[serde(default)]
    pub policy: Option<SandboxPolicy>,
}

/// Why a spec from the API cannot be accepted.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// vCPUs or memory out of range.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The policy is not valid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl StoredSpec {
    /// From the API, with defaults filled in.
    ///
    /// # Errors
    /// [`SpecError`] for a shape out of range or a policy that is not valid.
    pub fn from_api(spec: &SandboxSpec) -> Result<Self, SpecError> {
        let policy = if spec.policy.is_empty() {
            None
        } else {
            Some(SandboxPolicy::parse(&spec.policy, &vm_protocol::identity::WORKLOAD)?)
        };
        Ok(Self {
            shape: SandboxShape::with_defaults(spec.cpus, spec.memory_mib)?,
            env: spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            image: spec.image.clone(),
            policy,
        })
    }

    /// Back to the API.
    pub fn to_api(&self) -> SandboxSpec {
        SandboxSpec {
            cpus: u32::from(self.shape.cpus()),
            memory_mib: self.shape.memory_mib(),
            env: self.env.clone().into_iter().collect(),
            readiness: ReadinessKind::ReadinessTcp.into(),
            image: self.image.clone(),
            policy: self.policy.as_ref().map(SandboxPolicy::to_json).unwrap_or_default(),
        }
    }
}

/// Writes the spec.
///
/// # Errors
/// I/O.
pub fn save_spec(layout: &SandboxLayout, spec: &StoredSpec) -> io::Result<()> {
    fs::write(layout.path(SandboxFile::Spec), serde_json::to_vec(spec).map_err(io::Error::other)?)
}

/// Reads the spec; `None` for a directory that is not a served sandbox (a `launch` one, say).
pub fn load_spec(layout: &SandboxLayout) -> Option<StoredSpec> {
    serde_json::from_slice(&fs::read(layout.path(SandboxFile::Spec)).ok()?).ok()
}

/// The last generation (0 when never started).
pub fn generation(layout: &SandboxLayout) -> Generation {
    fs::read_to_string(layout.path(SandboxFile::Generation))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or_default()
}

/// Records the generation being started.
///
/// # Errors
/// I/O.
pub fn set_generation(layout: &SandboxLayout, generation: Generation) -> io::Result<()> {
    fs::write(layout.path(SandboxFile::Generation), generation.to_string())
}

/// Marks (or unmarks) the sandbox as stopped on purpose; written before stopping starts.
///
/// # Errors
/// I/O.
pub fn set_stopped(layout: &SandboxLayout, stopped: bool) -> io::Result<()> {
    let marker = layout.path(SandboxFile::Stopped);
    if stopped {
        fs::write(marker, b"")
    } else {
        match fs::remove_file(marker) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// Whether the sandbox was stopped on purpose.
pub fn is_stopped(layout: &SandboxLayout) -> bool {
    layout.path(SandboxFile::Stopped).exists()
}
