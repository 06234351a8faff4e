//! Host directories the host shares (`vm.mounts=` on the kernel command line, [`vm_protocol::mounts`]): one
//! virtiofs device each, mounted where the host asks, without set-id programs or device nodes. The host
//! enforces read-only itself; the `ro` here only spares the workload writes that would fail anyway.
//!
//! And memory file systems of the guest's own (`vm.tmpfs=`, [`vm_protocol::tmpfs`]), mounted after them.

use std::fs;

use nix::mount::{mount, MsFlags};
use vm_protocol::mounts::{self, GuestMount};
use vm_protocol::tmpfs::{self, GuestTmpfs};

/// The modules virtiofs needs (FUSE, virtiofs), in load order. Written by the image builder.
pub const MODULE_LIST: &str = "/etc/vm-agent/modules-mount";

/// Why a host directory could not be mounted.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// `/proc/cmdline` could not be read.
    #[error("cannot read the kernel command line")]
    Cmdline(#[source] std::io::Error),
    /// The argument is there but malformed.
    #[error("the host's vm.mounts argument is malformed")]
    Malformed,
    /// The tmpfs argument is there but malformed.
    #[error("the host's vm.tmpfs argument is malformed")]
    MalformedTmpfs,
    /// The mount point could not be made.
    #[error("cannot make the mount point {0}")]
    MountPoint(String, #[source] std::io::Error),
    /// The mount failed.
    #[error("cannot mount at {0}")]
    Mount(String, #[source] nix::errno::Errno),
}

/// The mounts the host asks for (none without the argument).
///
/// # Errors
/// [`MountError::Cmdline`] or [`MountError::Malformed`].
pub fn asked() -> Result<Vec<GuestMount>, MountError> {
    let cmdline = fs::read_to_string("/proc/cmdline").map_err(MountError::Cmdline)?;
    if !cmdline.split_whitespace().any(|a| a.starts_with(mounts::KERNEL_ARG_PREFIX)) {
        return Ok(Vec::new());
    }
    mounts::parse_cmdline(&cmdline).ok_or(MountError::Malformed)
}

/// The tmpfs mounts the host asks for (none without the argument).
///
/// # Errors
/// [`MountError::Cmdline`] or [`MountError::MalformedTmpfs`].
pub fn asked_tmpfs() -> Result<Vec<GuestTmpfs>, MountError> {
    let cmdline = fs::read_to_string("/proc/cmdline").map_err(MountError::Cmdline)?;
    tmpfs::parse_cmdline(&cmdline).ok_or(MountError::MalformedTmpfs)
}

/// Mounts each of `asked` in the root the workload runs in, `nosuid` and `nodev`.
///
/// # Errors
/// The first mount that failed.
pub fn mount_tmpfs(asked: &[GuestTmpfs]) -> Result<(), MountError> {
    for t in asked {
        fs::create_dir_all(&t.target).map_err(|e| MountError::MountPoint(t.target.clone(), e))?;
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if t.readonly {
            flags |= MsFlags::MS_RDONLY;
        }
        if t.noexec {
            flags |= MsFlags::MS_NOEXEC;
        }
        let data = match t.size {
            Some(size) => format!("mode={:o},size={size}", t.mode),
            None => format!("mode={:o}", t.mode),
        };
        mount(Some("tmpfs"), t.target.as_str(), Some("tmpfs"), flags, Some(data.as_str()))
            .map_err(|e| MountError::Mount(t.target.clone(), e))?;
    }
    Ok(())
}

/// Mounts each of `asked` (their modules loaded) in the root the workload runs in.
///
/// # Errors
/// The first mount that failed.
pub fn mount_all(asked: &[GuestMount]) -> Result<(), MountError> {
    for m in asked {
        fs::create_dir_all(&m.target).map_err(|e| MountError::MountPoint(m.target.clone(), e))?;
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if m.readonly {
            flags |= MsFlags::MS_RDONLY;
        }
        mount(Some(mounts::tag(m.index).as_str()), m.target.as_str(), Some("virtiofs"), flags, None::<&str>)
            .map_err(|e| MountError::Mount(m.target.clone(), e))?;
    }
    Ok(())
}
