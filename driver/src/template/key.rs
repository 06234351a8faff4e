//! A template's key: the sha256 of everything that went into its saved boot. A changed input is another
//! key, so a stale template is never found; templates no key names any more are collected.
//!
//! Files go in by their identity (device, inode, size, modification and change times): any rewrite of a
//! kernel, an initramfs, QEMU or the supervisor changes its change time, which no user can set. An image root
//! goes in by its manifest digest. The host's TSC rate, measured at each start (a TCG guest is told it), is
//! not an input: measures differ by a few kHz, and a clone keeps its template's clock rate on the same host.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use sha2::{Digest as _, Sha256};
use vm_contract::jail::Confinement;

use crate::sandbox::VmSpec;

/// A template's key: 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TemplateKey(String);

impl TemplateKey {
    /// The key as text (a directory name).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `name` is a key's text.
    pub fn is_key(name: &str) -> bool {
        name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    }
}

/// Why a VM has no template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Ineligible {
    /// Host directories need the guest's RAM shared with their file servers, which a clone's is not.
    #[error("host directories are shared with it")]
    Mounts,
    /// A `userns` jail can mount no `/proc` for QEMU to name the RAM memfd by.
    #[error("its VMM is confined with a user namespace")]
    Userns,
    /// An input could not be read.
    #[error("an input of its boot cannot be read")]
    Unreadable,
}

/// The key of `vm`'s template, or why it has none.
///
/// # Errors
/// [`Ineligible`].
pub fn of(vm: &VmSpec) -> Result<TemplateKey, Ineligible> {
    if !vm.mounts.is_empty() {
        return Err(Ineligible::Mounts);
    }
    if vm.jail.confinement == Confinement::Userns {
        return Err(Ineligible::Userns);
    }
    let qemu = crate::doctor::on_path("qemu-system-x86_64").ok_or(Ineligible::Unreadable)?;
    let mut hash = Sha256::new();
    let mut field = |name: &str, value: &[u8]| {
        hash.update((name.len() as u64).to_le_bytes());
        hash.update(name.as_bytes());
        hash.update((value.len() as u64).to_le_bytes());
        hash.update(value);
    };
    field("format", b"vm-driver template 1");
    field("driver", env!("CARGO_PKG_VERSION").as_bytes());
    for (name, path) in [
        ("kernel", vm.image.kernel.as_path()),
        ("initrd", vm.image.initrd.as_path()),
        ("supervisor", vm.supervisor.as_path()),
        ("qemu", qemu.as_path()),
    ] {
        field(name, &identity(path).ok_or(Ineligible::Unreadable)?);
    }
    field("root", vm.root.as_ref().map_or("", |r| r.manifest.as_str()).as_bytes());
    field("shape", vm.shape.to_string().as_bytes());
    field("accel", vm.accel.as_str().as_bytes());
    field("confinement", vm.jail.confinement.as_str().as_bytes());
    for tmpfs in &vm.tmpfs {
        field("tmpfs", format!("{}:{}", tmpfs.target, tmpfs.options()).as_bytes());
    }
    Ok(TemplateKey(hash.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}

/// A file's identity: what any rewrite of it changes.
fn identity(path: &Path) -> Option<Vec<u8>> {
    let meta = std::fs::metadata(path).ok()?;
    let parts = [
        meta.dev(),
        meta.ino(),
        meta.len(),
        meta.mtime().cast_unsigned(),
        meta.mtime_nsec().cast_unsigned(),
        meta.ctime().cast_unsigned(),
        meta.ctime_nsec().cast_unsigned(),
    ];
    Some(parts.iter().flat_map(|p| p.to_le_bytes()).collect())
}
