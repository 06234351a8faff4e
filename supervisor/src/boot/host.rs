//! The host's side of a boot, before QEMU starts: the sibling binaries, the VMM's directory, the sockets.

use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use vm_contract::args::VmArgs;
use vm_contract::guest_ram::{reopen_from_parent, RamUse};
use vm_contract::jail::{Confinement, JailIds};
use vm_contract::layout::SandboxFile;
use vm_contract::root::RootImage;
use vm_contract::snapshot::SnapshotFile;
use vm_contract::status::SupervisorStatus;
use vm_protocol::Hello;

use super::accel;
use super::vmm::{self, VmmConfig};
use super::BootError;
use crate::status;

/// What a boot needs before QEMU starts, checked and made.
pub(super) struct Prepared {
    /// QEMU's command line and confinement.
    pub(super) config: VmmConfig,
    /// The watchdog binary.
    pub(super) watchdog: PathBuf,
    /// The guest link's socket.
    pub(super) channel: UnixListener,
    /// The console's socket.
    pub(super) console: UnixListener,
    /// `--save-snapshot`, or a template's clone: the monitor's socket.
    pub(super) monitor: Option<UnixListener>,
    /// `--save-snapshot`: the migration stream's socket.
    pub(super) migration: Option<UnixListener>,
    /// `--restore-snapshot`: the agent's saved hello, already checked.
    pub(super) restored: Option<Hello>,
    /// A template's clone: the saved state its monitor hands over.
    pub(super) deferred: Option<PathBuf>,
}

/// Joins the cgroup, checks the image, the binaries and the accelerator (reporting it), makes an image
/// root's writable layer, and binds the sockets QEMU connects to.
pub(super) fn prepare(vm: &VmArgs, root: Option<&RootImage>) -> Result<Prepared, BootError> {
    if let Some(cgroup) = &vm.cgroup {
        // Before anything is started, so QEMU and the watchdog inherit it. Not fatal: it is the last sweep,
        // not the first line of defence.
        if std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string()).is_err() {
            tracing::warn!(cgroup = %cgroup.display(), "cannot join the sandbox's cgroup");
        }
    }
    for (what, path) in [("kernel", &vm.kernel), ("initramfs", &vm.initrd)] {
        if !path.is_file() {
            return Err(BootError::MissingImage { what, path: path.clone() });
        }
    }
    let watchdog = sibling_binary("vm-watchdog")?;
    let (accel, fallback) = accel::Host::default().choose(vm.accel).map_err(BootError::Kvm)?;
    if let Some(why) = &fallback {
        tracing::warn!(reason = %why, "KVM unusable; using TCG software emulation");
    }
    status::report(&SupervisorStatus::Accelerator { accel, fallback: fallback.map(|w| w.to_string()) });
    let qemu = match &vm.qemu {
        Some(q) => std::path::absolute(q).map_err(|_| BootError::NoQemu)?,
        None => vmm::find_on_path("qemu-system-x86_64").ok_or(BootError::NoQemu)?,
    };
    let ids = vm.jail_id.map(|id| JailIds { uid: id, gid: id });
    if vm.confinement == Confinement::Jail && ids.is_none() {
        return Err(BootError::NoJailId);
    }
    let restored = vm.restore_snapshot.as_deref();
    let disks = root.map(|r| super::disks::prepare(r, ids, restored)).transpose().map_err(BootError::Disks)?;
    let root = vmm_root(&vm.sandbox_dir)?;
    let channel = bind(SandboxFile::Channel, ids)?;
    let console = bind(SandboxFile::ConsoleSocket, ids)?;
    let saving = vm.save_snapshot.is_some();
    let ram = guest_ram(vm)?;
    // A template's clone: its state comes through the monitor (`x-ignore-shared` first).
    let deferred = match (&ram, &vm.restore_snapshot) {
        (Some(_), Some(dir)) => Some(SnapshotFile::State.path(dir)),
        _ => None,
    };
    let monitor = if saving || deferred.is_some() { Some(bind(SandboxFile::Monitor, ids)?) } else { None };
    let migration = if saving { Some(bind(SandboxFile::Migration, ids)?) } else { None };
    let restored = match &vm.restore_snapshot {
        Some(dir) => Some(super::snapshot::saved_hello(dir).map_err(BootError::Snapshot)?),
        None => None,
    };
    let config = VmmConfig {
        qemu,
        jailer: sibling_binary("vm-jailer")?,
        confinement: vm.confinement,
        ids,
        root,
        cgroups: vm.vmm_cgroups.clone(),
        kernel: vm.kernel.clone(),
        initrd: vm.initrd.clone(),
        shape: vm.shape,
        accel,
        monitor: monitor.is_some(),
        incoming: vm
            .restore_snapshot
            .as_deref()
            .filter(|_| deferred.is_none())
            .map(|dir| SnapshotFile::State.path(dir)),
        defer_incoming: deferred.is_some(),
        tsc_khz: vm.tsc_khz,
        disks,
        mounts: super::shares::guest_view(&vm.mounts),
        tmpfs: vm.tmpfs.clone(),
        ram,
    };
    Ok(Prepared { config, watchdog, channel, console, monitor, migration, restored, deferred })
}

/// The driver's guest RAM memfd (`--guest-ram-fd`), reopened and checked: written through by a VM being
/// saved, a sealed template mapped private by one restored.
fn guest_ram(vm: &VmArgs) -> Result<Option<vmm::GuestRam>, BootError> {
    let Some(fd) = vm.guest_ram_fd else { return Ok(None) };
    let usage = match (&vm.save_snapshot, &vm.restore_snapshot) {
        (Some(_), None) => RamUse::Shared,
        (None, Some(_)) => RamUse::Private,
        _ => return Err(BootError::GuestRam(None)),
    };
    let bytes = u64::from(vm.shape.memory_mib()) << 20;
    let file = reopen_from_parent(fd, bytes, usage).map_err(|e| BootError::GuestRam(Some(e)))?;
    Ok(Some(vmm::GuestRam { file: std::sync::Arc::new(file), usage }))
}

/// `name` (`vm-watchdog`, `vm-jailer`), next to this binary.
pub(super) fn sibling_binary(name: &str) -> Result<PathBuf, BootError> {
    let path = std::env::current_exe().map_or_else(|_| PathBuf::from(name), |exe| exe.with_file_name(name));
    if path.is_file() {
        Ok(path)
    } else {
        Err(BootError::NoSibling(path))
    }
}

/// The VMM directory, made (0755: a jailed QEMU must traverse its own root, never write it) if missing.
pub(super) fn vmm_root(sandbox_dir: &Path) -> Result<PathBuf, BootError> {
    use std::os::unix::fs::PermissionsExt;
    let root = std::path::absolute(sandbox_dir.join(SandboxFile::VmmRoot.name()))
        .map_err(|e| BootError::Bind(SandboxFile::VmmRoot, e))?;
    match std::fs::DirBuilder::new().create(&root) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(BootError::Bind(SandboxFile::VmmRoot, e)),
        // Set, not asked of mkdir: the supervisor's umask would take the search bits away.
        _ => std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))
            .map(|()| root)
            .map_err(|e| BootError::Bind(SandboxFile::VmmRoot, e)),
    }
}

/// Binds one of the sandbox's sockets, replacing one a previous start left behind. A socket QEMU connects
/// to is given to the jail's ids, 0600: only that VMM (and root) may connect.
pub(super) fn bind(file: SandboxFile, ids: Option<JailIds>) -> Result<UnixListener, BootError> {
    use std::os::unix::fs::PermissionsExt;
    let path = file.relative();
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| BootError::Bind(file, e))?;
    if file.in_vmm_root() {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| BootError::Bind(file, e))?;
        if let Some(ids) = ids {
            std::os::unix::fs::chown(&path, Some(ids.uid), Some(ids.gid)).map_err(|e| BootError::Bind(file, e))?;
        }
    }
    Ok(listener)
}
