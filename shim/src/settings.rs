//! The node's settings for every task the shim runs: a JSON file, `/etc/vm-driver/containerd-shim.json`
//! (or `$VM_DRIVER_SHIM_CONFIG`, which containerd passes on from its own environment). Every field is
//! optional; a missing file is every default. docs/kubernetes.md lists them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use vm_contract::accel::AccelChoice;
use vm_contract::jail::Confinement;
use vm_contract::root::DEFAULT_DISK_MIB;
use vm_contract::shape::{SandboxShape, DEFAULT_MEMORY_MIB};

/// Where the settings are when the environment names no file.
pub const DEFAULT_PATH: &str = "/etc/vm-driver/containerd-shim.json";
/// The environment variable naming another file.
pub const PATH_ENV: &str = "VM_DRIVER_SHIM_CONFIG";
/// The most bytes of the file read.
const MAX_BYTES: u64 = 64 * 1024;

/// Why the settings are unusable.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// Unreadable, too large, or not the format.
    #[error("the shim's settings file {0} is unreadable or malformed")]
    File(PathBuf),
    /// The shape is out of bounds.
    #[error("the shim's settings ask for an impossible VM shape")]
    Shape(#[from] vm_contract::shape::ShapeError),
}

/// The settings as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    state_dir: Option<PathBuf>,
    boot_image: Option<PathBuf>,
    accel: Option<AccelChoice>,
    confinement: Option<Confinement>,
    cpus: Option<u32>,
    memory_mib: Option<u32>,
    disk_mib: Option<u32>,
    boot_timeout_secs: Option<u64>,
    otlp_endpoint: Option<String>,
    otlp_protocol: Option<String>,
}

/// The settings in force.
#[derive(Debug, Clone)]
pub struct Settings {
    /// vm-driver's state directory for these sandboxes (default: the driver's).
    pub state_dir: PathBuf,
    /// The boot image directory (default: the driver's).
    pub boot_image: Option<PathBuf>,
    /// The accelerator.
    pub accel: AccelChoice,
    /// The VMM's confinement (default: the strongest the host gives).
    pub confinement: Option<Confinement>,
    /// Every task's VM.
    pub shape: SandboxShape,
    /// The writable layer over the container's root, MiB.
    pub disk_mib: u32,
    /// How long a boot may take.
    pub boot_timeout: Duration,
    /// Where each sandbox's OCSF events go besides its `events.jsonl` (an OTLP collector, when set).
    pub telemetry: vm_driver::telemetry::TelemetryConfig,
}

impl Settings {
    /// The settings from the file the environment names, else the default path.
    ///
    /// # Errors
    /// [`SettingsError`].
    pub fn load() -> Result<Self, SettingsError> {
        let path = std::env::var_os(PATH_ENV).map_or_else(|| PathBuf::from(DEFAULT_PATH), PathBuf::from);
        Self::from_file(&path)
    }

    fn from_file(path: &Path) -> Result<Self, SettingsError> {
        use std::io::Read;
        let file = match std::fs::File::open(path) {
            Ok(file) => {
                let mut bytes = Vec::new();
                let read = file.take(MAX_BYTES + 1).read_to_end(&mut bytes);
                if read.is_err() || bytes.len() as u64 > MAX_BYTES {
                    return Err(SettingsError::File(path.to_owned()));
                }
                serde_json::from_slice(&bytes).map_err(|_| SettingsError::File(path.to_owned()))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => File::default(),
            Err(_) => return Err(SettingsError::File(path.to_owned())),
        };
        Ok(Self {
            state_dir: file.state_dir.unwrap_or_else(vm_driver::state::default_root),
            boot_image: file.boot_image,
            accel: file.accel.unwrap_or_default(),
            confinement: file.confinement,
            shape: SandboxShape::new(file.cpus.unwrap_or(1), file.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB))?,
            disk_mib: file.disk_mib.unwrap_or(DEFAULT_DISK_MIB),
            boot_timeout: Duration::from_secs(file.boot_timeout_secs.unwrap_or(60)),
            telemetry: vm_driver::telemetry::TelemetryConfig {
                otlp_endpoint: file.otlp_endpoint,
                otlp_protocol: file.otlp_protocol,
                ..Default::default()
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_is_every_default_and_a_bad_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let settings = Settings::from_file(&dir.path().join("none.json")).unwrap();
        assert_eq!((settings.shape, settings.disk_mib), (SandboxShape::default(), DEFAULT_DISK_MIB));
        let path = dir.path().join("s.json");
        std::fs::write(&path, r#"{"cpus": 2, "memory_mib": 512, "accel": "tcg", "state_dir": "/tmp/x"}"#).unwrap();
        let settings = Settings::from_file(&path).unwrap();
        assert_eq!((settings.shape, settings.accel), (SandboxShape::new(2, 512).unwrap(), AccelChoice::Tcg));
        std::fs::write(&path, r#"{"cpu": 2}"#).unwrap();
        assert!(matches!(Settings::from_file(&path), Err(SettingsError::File(_))), "a misspelt key");
        std::fs::write(&path, r#"{"cpus": 999}"#).unwrap();
        assert!(matches!(Settings::from_file(&path), Err(SettingsError::Shape(_))));
    }
}
