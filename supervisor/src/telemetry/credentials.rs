//! Live credentials: the OTLP collector headers (a bearer token) and the CA bundle, shared by the telemetry,
//! which rotates them, and the export task, which checks them before every export and rebuilds its exporter
//! when they changed. A rotation is validated before the swap, so a refused one changes nothing.
//!
//! Header values are secrets: no `Debug` here shows one, and every error is fixed text.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use rustix::fs::{Mode, OFlags};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};

/// Largest CA bundle read.
pub const MAX_CA_BYTES: u64 = 1024 * 1024;

/// A CA bundle as read: its path (for events) and its PEM text, holding at least one certificate.
#[derive(Clone, PartialEq, Eq)]
pub struct CaBundle {
    path: PathBuf,
    pem: Vec<u8>,
}

impl std::fmt::Debug for CaBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaBundle").field("path", &self.path).field("bytes", &self.pem.len()).finish()
    }
}

/// The CA bundle cannot be used. Fixed text; the path is not a secret but is kept out of the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CaError {
    /// Relative: the supervisor's working directory is the sandbox's.
    #[error("the OTLP CA bundle path is not absolute")]
    NotAbsolute,
    /// Missing, unreadable, not a regular file, or larger than [`MAX_CA_BYTES`].
    #[error("the OTLP CA bundle cannot be read")]
    Unreadable,
    /// No PEM certificate in it.
    #[error("the OTLP CA bundle holds no PEM certificate")]
    NoCertificate,
}

impl CaBundle {
    /// Reads and checks the bundle at `path`. Opened non-blocking, so a FIFO cannot hang the supervisor.
    ///
    /// # Errors
    /// [`CaError`].
    pub fn load(path: &Path) -> Result<Self, CaError> {
        if !path.is_absolute() {
            return Err(CaError::NotAbsolute);
        }
        let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
        let fd = rustix::fs::open(path, flags, Mode::empty()).map_err(|_| CaError::Unreadable)?;
        let file = std::fs::File::from(fd);
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            return Err(CaError::Unreadable);
        }
        let mut pem = Vec::new();
        file.take(MAX_CA_BYTES + 1).read_to_end(&mut pem).map_err(|_| CaError::Unreadable)?;
        if pem.len() as u64 > MAX_CA_BYTES {
            return Err(CaError::Unreadable);
        }
        let mut certs = CertificateDer::pem_slice_iter(&pem);
        if certs.next().is_none_or(|c| c.is_err()) || certs.any(|c| c.is_err()) {
            return Err(CaError::NoCertificate);
        }
        Ok(Self { path: path.to_owned(), pem })
    }

    /// Its PEM text.
    pub fn pem(&self) -> &[u8] {
        &self.pem
    }

    /// Its DER certificates.
    pub fn certificates(&self) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(&self.pem).filter_map(Result::ok).collect()
    }

    /// Where it was read.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// What the exporter presents to the collector.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    /// Request headers (secrets).
    pub headers: Vec<(String, String)>,
    /// The CA bundle for `https://` collectors.
    pub ca: Option<CaBundle>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("Credentials").field("header_names", &names).field("ca", &self.ca).finish()
    }
}

/// Whether every header is valid on the wire (gRPC metadata and HTTP alike).
pub fn headers_valid(headers: &[(String, String)]) -> bool {
    headers.iter().all(|(name, value)| {
        tonic::metadata::MetadataKey::<tonic::metadata::Ascii>::from_bytes(name.to_ascii_lowercase().as_bytes()).is_ok()
            && tonic::metadata::MetadataValue::<tonic::metadata::Ascii>::try_from(value.as_str()).is_ok()
    })
}

/// The credentials in force, versioned. Cloning shares them.
#[derive(Debug, Clone)]
pub struct LiveCredentials(Arc<Versioned>);

#[derive(Debug)]
struct Versioned {
    current: RwLock<(u64, Arc<Credentials>)>,
    /// Mirrors the version in `current`, for the export task's cheap check.
    version: AtomicU64,
}

impl LiveCredentials {
    /// Live credentials holding `credentials`, version 0.
    pub fn new(credentials: Credentials) -> Self {
        Self(Arc::new(Versioned { current: RwLock::new((0, Arc::new(credentials))), version: AtomicU64::new(0) }))
    }

    /// Bumped by every applied rotation.
    pub fn version(&self) -> u64 {
        self.0.version.load(Ordering::Acquire)
    }

    /// The credentials in force and their version.
    pub fn current(&self) -> (u64, Arc<Credentials>) {
        let current = self.0.current.read().unwrap_or_else(PoisonError::into_inner);
        (current.0, Arc::clone(&current.1))
    }

    /// Validates `rotation` and swaps it in; the new version is returned with [`RotationOutcome::Applied`].
    /// The CA bundle is read here, so the next export never fails on it.
    pub fn rotate(&self, rotation: &CredentialRotation) -> (RotationOutcome, u64) {
        if rotation.headers.is_none() && rotation.ca_path.is_none() {
            return (RotationOutcome::Empty, self.version());
        }
        if rotation.headers.as_deref().is_some_and(|h| !headers_valid(h)) {
            return (RotationOutcome::BadHeader, self.version());
        }
        let ca = match rotation.ca_path.as_deref().map(|p| CaBundle::load(Path::new(p))) {
            Some(Ok(ca)) => Some(ca),
            Some(Err(_)) => return (RotationOutcome::CaUnreadable, self.version()),
            None => None,
        };
        let mut current = self.0.current.write().unwrap_or_else(PoisonError::into_inner);
        let mut next = Credentials::clone(&current.1);
        if let Some(headers) = &rotation.headers {
            next.headers.clone_from(headers);
        }
        if ca.is_some() {
            next.ca = ca;
        }
        let version = current.0 + 1;
        *current = (version, Arc::new(next));
        self.0.version.store(version, Ordering::Release);
        (RotationOutcome::Applied, version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CERT: &str = "-----BEGIN CERTIFICATE-----\nMIIBdDCCARqgAwIBAgIUQ0E=\n-----END CERTIFICATE-----\n";

    fn temp(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("creds-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn rotations_are_validated_before_the_swap() {
        let live = LiveCredentials::new(Credentials { headers: vec![("k".into(), "old".into())], ca: None });
        let good = temp("good.pem", CERT);
        let bad = temp("bad.pem", "not a certificate");
        let rotate = |headers: Option<Vec<(String, String)>>, ca: Option<&Path>| {
            live.rotate(&CredentialRotation {
                headers,
                ca_path: ca.map(|p| p.to_string_lossy().into_owned()),
                secrets: None,
            })
        };
        assert_eq!(rotate(None, None).0, RotationOutcome::Empty);
        assert_eq!(rotate(Some(vec![("k".into(), "a\nb".into())]), None).0, RotationOutcome::BadHeader);
        assert_eq!(rotate(Some(vec![("k".into(), "new".into())]), Some(&bad)).0, RotationOutcome::CaUnreadable);
        assert_eq!(rotate(None, Some(Path::new("relative.pem"))).0, RotationOutcome::CaUnreadable);
        assert_eq!(rotate(None, Some(Path::new("/nonexistent/ca.pem"))).0, RotationOutcome::CaUnreadable);
        assert_eq!(rotate(None, Some(Path::new("/dev/null"))).0, RotationOutcome::CaUnreadable, "not a file");
        assert_eq!(live.version(), 0, "nothing refused was swapped in");
        assert_eq!(live.current().1.headers, vec![("k".to_owned(), "old".to_owned())]);
        assert_eq!(rotate(Some(vec![("k".into(), "new".into())]), Some(&good)), (RotationOutcome::Applied, 1));
        let (version, now) = live.current();
        assert_eq!((version, now.headers[0].1.as_str()), (1, "new"));
        assert_eq!(now.ca.as_ref().map(CaBundle::path), Some(good.as_path()));
        assert_eq!(rotate(Some(vec![("k".into(), "newer".into())]), None), (RotationOutcome::Applied, 2));
        assert!(live.current().1.ca.is_some(), "a CA path not given is kept");
        let shown = format!("{:?}", live.current().1);
        assert!(!shown.contains("newer"), "{shown}");
        let _ = std::fs::remove_file(good);
        let _ = std::fs::remove_file(bad);
    }
}
