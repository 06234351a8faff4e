//! Bringing the guest up as PID 1: the kernel filesystems, the workload user's home, the modules the
//! channel needs and, when the host asks, the image root ([`crate::root`]).

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::kmod::{finit_module, ModuleInitFlags};
use nix::mount::{mount, MsFlags};
use vm_protocol::identity::{WorkloadIdentity, WORKLOAD};

/// Lists the modules to load, one absolute path per line, in dependency order. Written by the image builder.
pub const MODULE_LIST: &str = "/etc/vm-agent/modules";

/// Why the guest could not be brought up.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A kernel filesystem did not mount.
    #[error("cannot mount {fstype} on {target}")]
    Mount {
        /// Filesystem type.
        fstype: &'static str,
        /// Mount point.
        target: &'static str,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// The module list could not be read.
    #[error("cannot read the module list {MODULE_LIST}")]
    ModuleList(#[source] std::io::Error),
    /// The workload user's home or console access could not be set up.
    #[error("cannot prepare the workload user's home and console")]
    WorkloadUser(#[source] std::io::Error),
    /// A host directory or a tmpfs could not be mounted.
    #[error("cannot mount the host's directories or the tmpfs mounts")]
    Mounts(#[from] crate::mounts::MountError),
    /// The image root could not be entered.
    #[error("cannot enter the image root")]
    Root(#[from] crate::root::RootError),
    /// A module did not load.
    #[error("cannot load module {path}")]
    LoadModule {
        /// The module file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Mounts `/proc`, `/sys`, `/dev`, `/dev/pts` and `/run`, then loads the listed modules; with an image
/// root, loads its modules too and moves into it.
///
/// # Errors
/// The first mount or module that failed.
pub fn boot() -> Result<(), InitError> {
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount_fs("proc", "/proc", nosuid_nodev | MsFlags::MS_NOEXEC)?;
    mount_fs("sysfs", "/sys", nosuid_nodev | MsFlags::MS_NOEXEC)?;
    mount_fs("devtmpfs", "/dev", MsFlags::MS_NOSUID)?;
    mount_fs("devpts", "/dev/pts", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC)?;
    mount_fs("tmpfs", "/run", nosuid_nodev)?;
    if let Ok(name) = fs::read_to_string("/etc/hostname") {
        // Cosmetic: a failure leaves the kernel's "(none)".
        let _ = nix::unistd::sethostname(name.trim());
    }
    prepare_for(&WORKLOAD)?;
    // Without it no proxy listener or port forward works; everything else does.
    if crate::loopback::up().is_err() {
        eprintln!("vm-agent: cannot bring up the loopback interface");
    }
    load_modules(Path::new(MODULE_LIST))?;
    // Read and loaded from the initramfs, before an image root hides it.
    let shared = crate::mounts::asked()?;
    let tmpfs = crate::mounts::asked_tmpfs()?;
    if !shared.is_empty() {
        load_modules(Path::new(crate::mounts::MODULE_LIST))?;
    }
    if crate::root::asked()? {
        load_modules(Path::new(crate::root::MODULE_LIST))?;
        crate::root::enter(&WORKLOAD)?;
    }
    crate::mounts::mount_all(&shared)?;
    crate::mounts::mount_tmpfs(&tmpfs)?;
    Ok(())
}

/// What the workload user needs: its own home, 0700 (the initramfs holds files owned by root only), and, as
/// a terminal's group would, write access to the console (0620), which the host already treats as untrusted
/// and caps.
fn prepare_for(who: &WorkloadIdentity) -> Result<(), InitError> {
    use std::os::unix::fs::{chown, PermissionsExt};
    let mode = |path: &str, bits: u32| fs::set_permissions(path, fs::Permissions::from_mode(bits));
    let made = fs::create_dir_all(who.home)
        .and_then(|()| chown(who.home, Some(who.uid), Some(who.gid)))
        .and_then(|()| mode(who.home, 0o700))
        .and_then(|()| chown("/dev/console", Some(0), Some(who.gid)))
        .and_then(|()| mode("/dev/console", 0o620));
    made.map_err(InitError::WorkloadUser)
}

fn mount_fs(fstype: &'static str, target: &'static str, flags: MsFlags) -> Result<(), InitError> {
    // The mount point may be missing from a user's own image.
    let _ = fs::create_dir_all(target);
    match mount(Some(fstype), target, Some(fstype), flags, None::<&str>) {
        Ok(()) | Err(Errno::EBUSY) => Ok(()),
        Err(source) => Err(InitError::Mount { fstype, target, source }),
    }
}

fn load_modules(list: &Path) -> Result<(), InitError> {
    let text = match fs::read_to_string(list) {
        Ok(text) => text,
        // An image with the drivers built in needs no list.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(InitError::ModuleList(e)),
    };
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let path = PathBuf::from(line);
        let file = File::open(&path).map_err(|source| InitError::LoadModule { path: path.clone(), source })?;
        match finit_module(&file, c"", ModuleInitFlags::empty()) {
            // Already loaded or built in.
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(InitError::LoadModule { path, source: e.into() }),
        }
    }
    Ok(())
}
