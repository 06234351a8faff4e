//! Fetching pinned Debian packages and unpacking them, with the `.deb`'s sha256 checked before use.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One pinned package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pin {
    /// Debian package name.
    pub package: String,
    /// Exact version, epoch included.
    pub version: String,
    /// sha256 of the `.deb` as listed in Debian's Packages index.
    pub sha256: String,
    /// Path of the `.deb` in a Debian mirror (`pool/...`), for hosts whose package lists lack it.
    pub filename: String,
}

/// A `.deb`'s checksum did not match its pin.
#[derive(Debug, thiserror::Error)]
#[error("{package} {version}: sha256 is {found}, the pin says {expected}")]
pub struct ChecksumMismatch {
    package: String,
    version: String,
    expected: String,
    found: String,
}

/// Hex sha256 of a file.
///
/// # Errors
/// The file cannot be read.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Hex sha256 of bytes.
pub fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Returns the cached `.deb` for `pin`, downloading it with `apt-get download` when it is missing.
///
/// # Errors
/// The download fails (the version may have left the archive: bump the pin), or the checksum differs.
pub fn fetch(pin: &Pin, mirrors: &[String], cache: &Path) -> Result<PathBuf> {
    let debs = cache.join("debs");
    fs::create_dir_all(&debs).with_context(|| format!("cannot create {}", debs.display()))?;
    let name = format!("{}_{}_amd64.deb", pin.package, pin.version.replace(':', "%3a"));
    let cached = debs.join(&name);
    if cached.exists() && sha256_file(&cached)? == pin.sha256 {
        return Ok(cached);
    }
    let staging = debs.join(format!(".download-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    let result = download(pin, mirrors, &staging).and_then(|deb| verify_into(pin, &deb, &cached));
    let _ = fs::remove_dir_all(&staging);
    result?;
    Ok(cached)
}

/// Fetches the `.deb` into `staging`: `apt-get download` first, then each mirror by pool path.
fn download(pin: &Pin, mirrors: &[String], staging: &Path) -> Result<PathBuf> {
    let spec = format!("{}={}", pin.package, pin.version);
    let apt = Command::new("apt-get").args(["download", "-q", &spec]).current_dir(staging).output();
    if apt.as_ref().is_ok_and(|o| o.status.success()) {
        return find_deb(staging, &spec);
    }
    let target = staging.join("package.deb");
    for mirror in mirrors {
        let url = format!("{}/{}", mirror.trim_end_matches('/'), pin.filename);
        let status = Command::new("curl")
            .args(["-fsSL", "--retry", "2", "-o"])
            .arg(&target)
            .arg(&url)
            .status()
            .context("cannot run curl")?;
        if status.success() {
            return Ok(target);
        }
    }
    let apt_error = apt.map_or_else(|e| e.to_string(), |o| String::from_utf8_lossy(&o.stderr).trim().to_owned());
    bail!(
        "cannot fetch {spec}: apt-get download failed ({apt_error}) and no mirror had {}; run `apt-get update`, \
         or bump images/pins.json if this version has left the archive",
        pin.filename
    )
}

fn find_deb(staging: &Path, spec: &str) -> Result<PathBuf> {
    fs::read_dir(staging)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download {spec} produced no .deb"))
}

/// Checks the sha256 and moves the `.deb` into the cache.
fn verify_into(pin: &Pin, deb: &Path, cached: &Path) -> Result<()> {
    let found = sha256_file(deb)?;
    if found != pin.sha256 {
        return Err(ChecksumMismatch {
            package: pin.package.clone(),
            version: pin.version.clone(),
            expected: pin.sha256.clone(),
            found,
        }
        .into());
    }
    fs::rename(deb, cached).with_context(|| format!("cannot move {} into the cache", deb.display()))
}

/// Unpacks a `.deb`'s files into `dest` with `dpkg-deb -x`.
///
/// # Errors
/// `dpkg-deb` is missing or fails.
pub fn extract(deb: &Path, dest: &Path) -> Result<()> {
    fs::create_dir_all(dest).with_context(|| format!("cannot create {}", dest.display()))?;
    let status = Command::new("dpkg-deb").arg("-x").arg(deb).arg(dest).status().context("cannot run dpkg-deb")?;
    if !status.success() {
        bail!("dpkg-deb -x {} failed ({status})", deb.display());
    }
    Ok(())
}
