//! What a sandbox directory remembers across driver restarts: the accepted spec (written once, at create),
//! the last start's generation, the `stopped` marker (present while the sandbox was stopped on purpose,
//! written before stopping), and the tombstone (`vm_contract::tombstone`).

use std::collections::BTreeMap;
use std::fs;
use std::io;

use serde::{Deserialize, Serialize};
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::session::Generation;
use vm_contract::shape::SandboxShape;
use vm_protocol::policy::SandboxPolicy;

/// The spec as stored (made from the API's in `super::api`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredSpec {
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// Environment of every process.
    pub env: BTreeMap<String, String>,
    /// The boot image's name; empty for the default.
    #[serde(default)]
    pub boot_image: String,
    /// The OCI image of its root, as asked for; the built-in root when `None`. The image a start actually
    /// used is pinned in the sandbox's root file ([`crate::oci::ImageRoots::pinned`]).
    #[serde(default)]
    pub image: Option<String>,
    /// The writable layer's size in MiB, with an image.
    #[serde(default = "default_disk_mib")]
    pub disk_mib: u32,
    /// The approved policy; none: every operation.
    #[serde(default)]
    pub policy: Option<SandboxPolicy>,
    /// Host directories, resolved at create.
    #[serde(default)]
    pub mounts: Vec<vm_contract::share::HostMount>,
    /// What the OpenShell gateway that created the sandbox asked of it (its token is kept apart, in
    /// [`SandboxFile::GatewayToken`]); none for a sandbox of the driver's own API.
    #[serde(default)]
    pub gateway: Option<vm_contract::gateway::GatewaySandbox>,
}

fn default_disk_mib() -> u32 {
    vm_contract::root::DEFAULT_DISK_MIB
}

/// Writes the spec.
///
/// # Errors
/// I/O.
pub fn save_spec(layout: &SandboxLayout, spec: &StoredSpec) -> io::Result<()> {
    fs::write(layout.path(SandboxFile::Spec), serde_json::to_vec(spec).map_err(io::Error::other)?)
}

/// Keeps the token the gateway minted for the sandbox (0600, created exclusively: it is written once, at
/// create).
///
/// # Errors
/// I/O.
pub fn save_gateway_token(layout: &SandboxLayout, token: &str) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = layout.path(SandboxFile::GatewayToken);
    let mut file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    file.write_all(token.as_bytes())
}

/// The token the gateway minted for the sandbox, if it kept one.
pub fn gateway_token(layout: &SandboxLayout) -> Option<String> {
    fs::read_to_string(layout.path(SandboxFile::GatewayToken)).ok().filter(|t| !t.is_empty())
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
