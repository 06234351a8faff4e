//! The sandbox's CA in the trust the workload sees ([`vm_protocol::link::VmRequest::Trust`]): written alone
//! and after the image's system bundle (the first of [`SYSTEM_BUNDLE_FILES`]) under `/run/vm-driver` (a
//! tmpfs, nothing kept across a stop), and shown at that bundle's path by a read-only bind mount, so tools
//! that read only their default trust it too. The workload's environment names the files (the supervisor sets it).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use nix::mount::{mount, MsFlags};
use vm_protocol::link::MAX_CA_PEM_BYTES;
use vm_protocol::net::{SYSTEM_BUNDLE_FILES, TRUST_BUNDLE_FILE, TRUST_CA_FILE};

/// Why the CA could not be installed (fixed text).
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// Not one PEM certificate of at most [`MAX_CA_PEM_BYTES`].
    #[error("the CA is not one PEM certificate")]
    NotPem,
    /// Writing a file failed.
    #[error("cannot write the trust files")]
    Write(#[source] std::io::Error),
    /// The bind mount over the system bundle failed.
    #[error("cannot show the bundle at the system path")]
    Mount(#[source] nix::errno::Errno),
}

/// Writes the CA and the bundle, and shows the bundle at the system path. A second call replaces both.
///
/// # Errors
/// [`TrustError`].
pub fn install(ca_pem: &str) -> Result<(), TrustError> {
    let one_cert = ca_pem.len() <= MAX_CA_PEM_BYTES
        && ca_pem.starts_with("-----BEGIN CERTIFICATE-----\n")
        && ca_pem.trim_end().ends_with("-----END CERTIFICATE-----")
        && ca_pem.matches("-----BEGIN").count() == 1;
    if !one_cert {
        return Err(TrustError::NotPem);
    }
    let dir = Path::new(TRUST_CA_FILE).parent().unwrap_or(Path::new("/run"));
    fs::create_dir_all(dir).map_err(TrustError::Write)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(TrustError::Write)?;
    // The system bundle as the image has it (a mount of ours over it from an earlier call is read through),
    // or none: the bundle is then the CA alone, as the image trusted nothing else.
    let system = SYSTEM_BUNDLE_FILES.iter().map(Path::new).find(|p| p.is_file());
    let mut bundle = system.and_then(|p| fs::read(p).ok()).unwrap_or_default();
    if let Some(own) = bundle.windows(ca_pem.len()).position(|w| w == ca_pem.as_bytes()) {
        bundle.truncate(own);
    }
    if !bundle.is_empty() && !bundle.ends_with(b"\n") {
        bundle.push(b'\n');
    }
    bundle.extend_from_slice(ca_pem.as_bytes());
    write(Path::new(TRUST_CA_FILE), ca_pem.as_bytes())?;
    write(Path::new(TRUST_BUNDLE_FILE), &bundle)?;
    if let Some(system) = system {
        let flags = MsFlags::MS_BIND;
        mount(Some(TRUST_BUNDLE_FILE), system, None::<&str>, flags, None::<&str>).map_err(TrustError::Mount)?;
        let ro = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        mount(None::<&str>, system, None::<&str>, ro, None::<&str>).map_err(TrustError::Mount)?;
    }
    Ok(())
}

/// Writes `bytes` to a new file beside `path`, mode 0644, then renames it over `path`.
fn write(path: &Path, bytes: &[u8]) -> Result<(), TrustError> {
    let tmp = path.with_extension("new");
    let _ = fs::remove_file(&tmp);
    let mut file =
        fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(&tmp).map_err(TrustError::Write)?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(TrustError::Write)?;
    fs::rename(&tmp, path).map_err(TrustError::Write)
}
