//! The jail's file system: a private mount namespace whose root is the VMM directory, holding only what
//! QEMU needs, read-only but for its two sockets.
//!
//! Its own network namespace (no interface but a down loopback) is made with it (`JAIL_NAMESPACES`).
//!
//! Inside: QEMU's binary and the objects of its ELF dependency closure ([`crate::closure`]), each at the
//! path the loader opens, through copies of the host's symlinks on the way; the accelerator module QEMU
//! loads for TCG and the `microvm` firmware, at the paths QEMU derives from its own; the guest kernel and
//! initramfs as `/kernel` and `/initrd`; an image root's disk (read-only) and the sandbox's writable layer;
//! `/dev/null`, `/dev/urandom` and, for KVM, `/dev/kvm`. No other library or data file of the host, no
//! shell, no `/etc`, `/proc`, `/sys` or `/tmp`, and nothing of the host's state directory.
//!
//! Mount points are made in the VMM directory on the host and stay there, empty, until the sandbox
//! directory is removed; the mounts themselves exist only in the namespace, and end with it.

use std::collections::{HashSet, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::path::{Component, Path, PathBuf};

use rustix::mount::{
    mount_bind, mount_bind_recursive, mount_change, mount_remount, unmount, MountFlags, MountPropagationFlags,
    UnmountFlags,
};
use vm_contract::jail::{JailerArgs, JAIL_IMAGE_DISK, JAIL_INITRD, JAIL_KERNEL, JAIL_WRITABLE_DISK, MICROVM_FIRMWARE};

use crate::JailError;

/// Where QEMU looks for its modules, relative to its binary's directory's parent.
const MODULE_DIRS: [&str; 3] = ["lib/x86_64-linux-gnu/qemu", "lib64/qemu", "lib/qemu"];

/// The loader's limit on symlinks followed for one path.
const MAX_LINKS: usize = 40;

fn io(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> JailError {
    move |e| JailError::Step(what, e.into())
}

/// Builds the jail in `args.root` and makes it this process's root. Needs a fresh mount namespace.
pub fn enter(args: &JailerArgs, safeguards: crate::Safeguards) -> Result<(), JailError> {
    let root = &args.root;
    prepare(root)?;
    let qemu = args.exec.first().map(PathBuf::from).ok_or(JailError::NoProgram)?;
    let mut files = JailFiles::new(root);
    files.program(&qemu)?;
    files.qemu_data(&qemu, args.kvm)?;
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
    if args.guest_ram_fd.is_some() {
        own_processes_only_proc(root, safeguards.proc_own_only)?;
    }
    pivot(root)
}

/// QEMU names its RAM memfd `/proc/self/fd/N`, so a jail with one has a `/proc`: the host's PID namespace's
/// (the jailer's own; a new one's can only be mounted from inside it), showing QEMU only the processes of its
/// own uid (itself and its jailer, `hidepid=invisible`) and nothing but them (`subset=pid`: no `/proc/sys`,
/// no `/proc/meminfo`).
fn own_processes_only_proc(root: &Path, own_only: bool) -> Result<(), JailError> {
    let proc = root.join("proc");
    fs::create_dir_all(&proc).map_err(JailError::step("make a mount point"))?;
    let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    // Control (`jail-proc-shows-all`): every process of the host.
    let options = if own_only { c"hidepid=invisible,subset=pid" } else { c"" };
    rustix::mount::mount("proc", &proc, "proc", flags, options).map_err(io("mount a /proc of QEMU's own processes"))
}

/// Makes `root` a private mount point. Needs a fresh mount namespace whose `/` is a mount point (in a
/// chroot, [`crate::chroot::rebase`] first).
pub(crate) fn prepare(root: &Path) -> Result<(), JailError> {
    // The supervisor's umask keeps its files private; the jail's directories must be searchable by the VMM.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
    // Nothing done here may reach the host's mounts.
    mount_change("/", MountPropagationFlags::PRIVATE | MountPropagationFlags::REC)
        .map_err(io("make the mounts private"))?;
    mount_bind(root, root).map_err(io("make the jail a mount point"))
}

/// The host files bound into a jail, each once.
pub(crate) struct JailFiles<'a> {
    root: &'a Path,
    bound: HashSet<PathBuf>,
}

impl<'a> JailFiles<'a> {
    pub(crate) fn new(root: &'a Path) -> Self {
        Self { root, bound: HashSet::new() }
    }

    /// Binds `program` and every object the loader will open to run it.
    pub(crate) fn program(&mut self, program: &Path) -> Result<(), JailError> {
        for object in crate::closure::closure(program)? {
            self.bind_resolved(&object)?;
        }
        Ok(())
    }

    /// Binds the files QEMU opens beside its binary: the TCG accelerator's module (with its own closure)
    /// when it runs without KVM, and the `microvm` firmware.
    fn qemu_data(&mut self, qemu: &Path, kvm: bool) -> Result<(), JailError> {
        let Some(prefix) = qemu.parent().and_then(Path::parent) else { return Ok(()) };
        let target = qemu.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("qemu-system-"));
        if let (false, Some(target)) = (kvm, target) {
            let module = format!("accel-tcg-{target}.so");
            let found = MODULE_DIRS.iter().map(|dir| prefix.join(dir).join(&module)).find(|p| p.is_file());
            if let Some(module) = found {
                self.program(&module)?;
            }
        }
        for firmware in MICROVM_FIRMWARE {
            let path = prefix.join("share/qemu").join(firmware);
            if path.exists() {
                self.bind_resolved(&path)?;
            }
        }
        Ok(())
    }

    /// Makes `path` resolve inside the jail as it does on the host: each symlink on the way recreated as
    /// it is, each directory made, and the file it ends at bound read-only. Only host paths without a
    /// symlink are ever joined to the jail's root, so no mount lands through a link.
    fn bind_resolved(&mut self, path: &Path) -> Result<(), JailError> {
        let mut pending: VecDeque<OsString> = parts(path);
        let mut at = PathBuf::from("/");
        let mut links = 0;
        while let Some(part) = pending.pop_front() {
            if part == ".." {
                at.pop();
                continue;
            }
            let host = at.join(&part);
            let meta = fs::symlink_metadata(&host).map_err(JailError::step("find a file QEMU loads"))?;
            if meta.file_type().is_symlink() {
                links += 1;
                if links > MAX_LINKS {
                    return Err(JailError::Step("follow a file's links", std::io::ErrorKind::InvalidInput.into()));
                }
                let target = fs::read_link(&host).map_err(JailError::step("read a system symlink"))?;
                copy_symlink(&host, self.root)?;
                if target.is_absolute() {
                    at = PathBuf::from("/");
                }
                for part in parts(&target).into_iter().rev() {
                    pending.push_front(part);
                }
            } else if pending.is_empty() && !meta.is_dir() {
                if self.bound.insert(host.clone()) {
                    bind_read_only(&host, &inside(self.root, &host), false)?;
                }
            } else {
                fs::create_dir_all(inside(self.root, &host)).map_err(JailError::step("make a directory"))?;
                at = host;
            }
        }
        Ok(())
    }
}

/// A path's parts as the kernel walks them: names and `..`, the root and `.` dropped.
fn parts(path: &Path) -> VecDeque<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(name) => Some(name.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect()
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
