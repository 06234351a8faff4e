//! A host that is itself a chroot (sbuild, pbuilder, schroot, a debootstrap'd directory entered with
//! `chroot`, bound onto itself first or not): the kernel refuses a user namespace to a chrooted process
//! (`EPERM`), and where `/` is a directory, not a mount point, no mount can be made private from it and
//! `pivot_root` refuses it (`EINVAL`).
//!
//! [`rebase`] gives a fresh mount namespace a root that is a mount point, the chroot's own directory, and
//! the root of that namespace, and puts this process at it, so the jail is then built as on any host and
//! the kernel no longer counts it chrooted. Nothing of it reaches the host: every mount of the namespace is
//! made private before the first one is made.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::mount::{mount_bind_recursive, mount_change, unmount, MountPropagationFlags, UnmountFlags};

use crate::JailError;

/// Deeper than any real directory tree: a loop ends here.
const MAX_DEPTH: usize = 256;

fn io(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> JailError {
    move |e| JailError::Step(what, e.into())
}

/// Whether to [`rebase`]: unless this process is at its mount namespace's root
/// ([`vm_contract::chroot::Root`]). Where that cannot be told (PID 1 in another mount namespace), the climb
/// in [`rebase`] finds out. Asked before this process leaves PID 1's mount namespace, which it compares with.
pub(crate) fn may_be_chrooted() -> bool {
    vm_contract::chroot::Root::of_this_process().chrooted() != Some(false)
}

/// In a fresh mount namespace of a chrooted root process: leaves the chroot for the namespace's real root
/// (the classic climb: a `chroot` into a directory below, which leaves the working directory outside the
/// root, then `..` until `..` is `.`, naming each directory on the way), makes every mount private there
/// (unless `private` is off: the `jail-chroot-shared-mounts` control), binds the chroot's directory onto
/// itself with what is mounted in it, and `pivot_root`s into it, the old root detached. A chroot whose
/// directory is already a mount point (bound onto itself) gets a bind of that mount onto itself, with what
/// is mounted in it, the same way.
///
/// Where the climb names no directory, `..` of this root is itself: the root was already the namespace's,
/// as the kernel counts it, and it is left as it was (the shared check could not tell).
///
/// The climb needs CAP_SYS_CHROOT, which the jailer has as root and drops, with every capability, before
/// the exec; the namespace is this process's alone.
pub(crate) fn rebase(below: &Path, private: bool) -> Result<(), JailError> {
    rustix::process::chdir("/").map_err(io("leave the chroot"))?;
    rustix::process::chroot(below).map_err(io("leave the chroot"))?;
    let mut names = Vec::new();
    loop {
        let here = fs::metadata(".").map_err(JailError::step("leave the chroot"))?;
        let up = fs::metadata("..").map_err(JailError::step("leave the chroot"))?;
        if (here.dev(), here.ino()) == (up.dev(), up.ino()) {
            break;
        }
        if names.len() >= MAX_DEPTH {
            return Err(JailError::Step("leave the chroot", std::io::ErrorKind::InvalidInput.into()));
        }
        names.push(name_in_parent(&here)?);
        rustix::process::chdir("..").map_err(io("leave the chroot"))?;
    }
    rustix::process::chroot(".").map_err(io("leave the chroot"))?;
    if names.is_empty() {
        return Ok(());
    }
    if private {
        mount_change("/", MountPropagationFlags::PRIVATE | MountPropagationFlags::REC)
            .map_err(io("make the mounts private"))?;
    }
    let dir: PathBuf = std::iter::once(PathBuf::from("/")).chain(names.into_iter().rev().map(PathBuf::from)).collect();
    mount_bind_recursive(&dir, &dir).map_err(io("make the chroot a mount point"))?;
    rustix::process::chdir(&dir).map_err(io("enter the chroot again"))?;
    rustix::process::pivot_root(".", ".").map_err(io("pivot_root into the chroot"))?;
    unmount(".", UnmountFlags::DETACH).map_err(io("detach the host's root"))?;
    rustix::process::chdir("/").map_err(io("enter the chroot again"))
}

/// The name of the working directory (`here`) in its parent, by device and inode.
fn name_in_parent(here: &fs::Metadata) -> Result<std::ffi::OsString, JailError> {
    let entries = fs::read_dir("..").map_err(JailError::step("leave the chroot"))?;
    for entry in entries.flatten() {
        // Through the entry's path, not readdir's inode: a mount point names what is mounted on it.
        let Ok(meta) = fs::symlink_metadata(entry.path()) else { continue };
        if meta.is_dir() && (meta.dev(), meta.ino()) == (here.dev(), here.ino()) {
            return Ok(entry.file_name());
        }
    }
    Err(JailError::Step("leave the chroot", std::io::ErrorKind::NotFound.into()))
}
