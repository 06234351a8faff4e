//! The jail's file system: a private mount namespace whose root is the VMM directory, holding only what
//! QEMU needs, read-only but for its two sockets.
//!
//! Its own network namespace (no interface but a down loopback) is made with it (`JAIL_NAMESPACES`).
//!
//! Inside: QEMU's binary at its own path; the shared-library and firmware directories (`/lib`, `/lib64`,
//! `/usr/lib`, `/usr/lib64`, `/usr/share/qemu`, or symlinks to them as on the host); the guest kernel and
//! initramfs as `/kernel` and `/initrd`; an image root's disk (read-only) and the sandbox's writable layer; `/dev/null`, `/dev/urandom` and, for KVM, `/dev/kvm`. No shell, no
//! `/etc`, `/proc`, `/sys` or `/tmp`, and nothing of the host's state directory.
//!
//! Mount points are made in the VMM directory on the host and stay there, empty, until the sandbox
//! directory is removed; the mounts themselves exist only in the namespace, and end with it.

use std::fs;
use std::path::{Path, PathBuf};

use rustix::mount::{
    mount_bind, mount_bind_recursive, mount_change, mount_remount, unmount, MountFlags, MountPropagationFlags,
    UnmountFlags,
};
use vm_contract::jail::{JailerArgs, JAIL_IMAGE_DISK, JAIL_INITRD, JAIL_KERNEL, JAIL_WRITABLE_DISK};

use crate::JailError;

/// Host directories QEMU loads code and firmware from. A symlink (merged /usr) is copied as a symlink.
const SYSTEM_DIRS: [&str; 5] = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/share/qemu"];

fn io(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> JailError {
    move |e| JailError::Step(what, e.into())
}

/// Builds the jail in `args.root` and makes it this process's root. Needs a fresh mount namespace.
pub fn enter(args: &JailerArgs) -> Result<(), JailError> {
    let root = &args.root;
    prepare(root)?;
    let qemu = args.exec.first().map(PathBuf::from).ok_or(JailError::NoProgram)?;
    bind_read_only(&qemu, &inside(root, &qemu), false)?;
    bind_read_only(&args.kernel, &root.join(JAIL_KERNEL), false)?;
    bind_read_only(&args.initrd, &root.join(JAIL_INITRD), false)?;
    if let Some(disk) = &args.image_disk {
        bind_read_only(disk, &root.join(JAIL_IMAGE_DISK), false)?;
    }
    if let Some(disk) = &args.writable_disk {
        bind_writable(disk, &root.join(JAIL_WRITABLE_DISK))?;
    }
    bind_read_only(Path::new("/dev/urandom"), &root.join("dev/urandom"), true)?;
    bind_device(Path::new("/dev/null"), &root.join("dev/null"))?;
    if args.kvm {
        bind_device(Path::new("/dev/kvm"), &root.join("dev/kvm"))?;
    }
    pivot(root)
}

/// Makes `root` a private mount point holding the system directories. Needs a fresh mount namespace.
pub(crate) fn prepare(root: &Path) -> Result<(), JailError> {
    // The supervisor's umask keeps its files private; the jail's directories must be searchable by the VMM.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
    // Nothing done here may reach the host's mounts.
    mount_change("/", MountPropagationFlags::PRIVATE | MountPropagationFlags::REC)
        .map_err(io("make the mounts private"))?;
    mount_bind(root, root).map_err(io("make the jail a mount point"))?;
    for dir in SYSTEM_DIRS {
        let dir = Path::new(dir);
        match fs::symlink_metadata(dir) {
            Ok(meta) if meta.file_type().is_symlink() => copy_symlink(dir, root)?,
            Ok(meta) if meta.is_dir() => bind_read_only(dir, &inside(root, dir), false)?,
            _ => {}
        }
    }
    Ok(())
}

/// Makes the prepared `root` this process's root, read-only.
pub(crate) fn pivot(root: &Path) -> Result<(), JailError> {
    rustix::process::chdir(root).map_err(io("enter the jail"))?;
    // The old root is stacked under the new one, then detached: nothing of it stays reachable.
    rustix::process::pivot_root(".", ".").map_err(io("pivot_root into the jail"))?;
    unmount(".", UnmountFlags::DETACH).map_err(io("detach the host's root"))?;
    rustix::process::chdir("/").map_err(io("enter the jail"))?;
    mount_remount("/", MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV, "")
        .map_err(io("make the jail read-only"))
}

/// `path` as seen from inside `root`.
pub(crate) fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// Recreates the symlink `link` inside the jail, pointing where it points on the host.
fn copy_symlink(link: &Path, root: &Path) -> Result<(), JailError> {
    let target = fs::read_link(link).map_err(JailError::step("read a system symlink"))?;
    match std::os::unix::fs::symlink(target, inside(root, link)) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(JailError::Step("copy a system symlink", e)),
        _ => Ok(()),
    }
}

/// Makes a mount point of `source`'s kind at `target` (a later start of the same sandbox finds it there).
fn mount_point(source: &Path, target: &Path) -> Result<(), JailError> {
    let parent = target.parent().unwrap_or(target);
    fs::create_dir_all(parent).map_err(JailError::step("make a mount point"))?;
    if source.is_dir() {
        fs::create_dir_all(target)
    } else {
        fs::OpenOptions::new().create(true).truncate(false).write(true).open(target).map(drop)
    }
    .map_err(JailError::step("make a mount point"))
}

/// Binds `source` at `target`, then makes that mount read-only and `nosuid` (and `nodev` unless `device`).
pub(crate) fn bind_read_only(source: &Path, target: &Path, device: bool) -> Result<(), JailError> {
    mount_point(source, target)?;
    mount_bind_recursive(source, target).map_err(io("bind a file into the jail"))?;
    let mut flags = MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID;
    if !device {
        flags |= MountFlags::NODEV;
    }
    mount_remount(target, flags, "").map_err(io("make a jail mount read-only"))
}

/// Binds the writable layer's file writable, `nosuid`, `nodev` and not executable.
fn bind_writable(source: &Path, target: &Path) -> Result<(), JailError> {
    mount_point(source, target)?;
    mount_bind(source, target).map_err(io("bind a disk into the jail"))?;
    mount_remount(target, MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC, "")
        .map_err(io("restrict a disk mount"))
}

/// Binds a device node writable (`/dev/null`, `/dev/kvm`), `nosuid` and not executable.
pub(crate) fn bind_device(source: &Path, target: &Path) -> Result<(), JailError> {
    mount_point(source, target)?;
    mount_bind(source, target).map_err(io("bind a device into the jail"))?;
    mount_remount(target, MountFlags::BIND | MountFlags::NOSUID | MountFlags::NOEXEC, "")
        .map_err(io("restrict a device mount"))
}
