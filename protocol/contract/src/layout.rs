//! A sandbox directory, `<state>/sandboxes/<id>/` (0700): every file in it, named once.
//!
//! The supervisor and QEMU run inside it and use the bare names (short socket paths whatever the state
//! directory); the driver reaches them through [`SandboxLayout`].

use std::path::{Path, PathBuf};

/// Every file of a sandbox directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SandboxFile {
    /// The VMM's directory: its working directory, and its whole root when jailed. Holds QEMU's sockets
    /// (see [`SandboxFile::in_vmm_root`]).
    VmmRoot,
    /// The jailed VMM's uid, claimed for this sandbox and released when it ends.
    JailId,
    /// The boundary channel's socket: the supervisor listens, QEMU's virtio-serial port connects.
    Channel,
    /// QEMU's monitor (QMP), connected to the supervisor only in a VM that is to be saved.
    Monitor,
    /// A saved VM's migration stream: QEMU connects here to send it, the supervisor writes it to the snapshot.
    Migration,
    /// The supervisor's attach socket (0600): the driver runs processes through it.
    Attach,
    /// The guest's serial console: QEMU connects its serial port here; the supervisor writes it to
    /// [`SandboxFile::Console`] with a cap.
    ConsoleSocket,
    /// The guest's serial console, as written (capped).
    Console,
    /// QEMU's own stderr.
    VmmLog,
    /// The supervisor's stderr: its diagnostics and the watchdog's.
    SupervisorLog,
    /// Pid and start time of the supervisor, the VMM and the watchdog, for the reaper.
    Pids,
    /// The sandbox's cgroup v2 path, for the final sweep.
    Cgroup,
    /// The VMM's own cgroups (its limits), one path a line.
    VmmCgroups,
    /// How the last supervisor ended (the tombstone).
    Tombstone,
    /// The supervisor's secrets (0600), read once and removed.
    AuthBundle,
    /// OCSF events, one per line (0600).
    Events,
    /// The audit chain of every event (SQLite, 0600; `vm-audit`), with its `-wal` and `-shm` beside it.
    Audit,
    /// The policy approved at create (JSON, written by the driver at every start, read by the supervisor).
    Policy,
    /// The launch descriptor (0600, written by the driver at every start, admitted by the supervisor first).
    Descriptor,
    /// `serve`: the accepted spec.
    Spec,
    /// `serve`: the last start's generation.
    Generation,
    /// `serve`: present while the sandbox is stopped on purpose.
    Stopped,
    /// The image root ([`crate::root::RootImage`], 0600, written by the driver at every start of a sandbox
    /// with an image); absent for the built-in root.
    Root,
    /// The sandbox's writable layer (a sparse ext4 disk, made by the supervisor at the first boot and kept
    /// across restarts).
    WritableDisk,
    /// The host-directory mounts' file servers: `shares/N/`, each one's jail root (empty on the host).
    Shares,
    /// `serve`: the binding to the OpenShell gateway that created the sandbox ([`crate::gateway`], 0600,
    /// written by the driver at every start, read by the supervisor).
    Gateway,
    /// `serve`: the sandbox token the gateway minted (0600), kept by the driver for every start; it reaches
    /// the supervisor only in the auth bundle.
    GatewayToken,
}

impl SandboxFile {
    /// Every file, for listings and tests.
    pub const ALL: [Self; 26] = [
        Self::VmmRoot,
        Self::JailId,
        Self::Channel,
        Self::ConsoleSocket,
        Self::Monitor,
        Self::Migration,
        Self::Attach,
        Self::Console,
        Self::VmmLog,
        Self::SupervisorLog,
        Self::Pids,
        Self::Cgroup,
        Self::VmmCgroups,
        Self::Tombstone,
        Self::AuthBundle,
        Self::Events,
        Self::Policy,
        Self::Descriptor,
        Self::Spec,
        Self::Generation,
        Self::Stopped,
        Self::Root,
        Self::WritableDisk,
        Self::Shares,
        Self::Gateway,
        Self::GatewayToken,
    ];

    /// The file's name inside the sandbox directory.
    pub const fn name(self) -> &'static str {
        match self {
            Self::VmmRoot => "vmm",
            Self::JailId => "jail-id",
            Self::Channel => "chan.sock",
            Self::Monitor => "qmp.sock",
            Self::Migration => "migrate.sock",
            Self::Attach => "attach.sock",
            Self::ConsoleSocket => "console.sock",
            Self::Console => "console.log",
            Self::VmmLog => "vmm.log",
            Self::SupervisorLog => "supervisor.log",
            Self::Pids => "pids.json",
            Self::Cgroup => "cgroup",
            Self::VmmCgroups => "vmm-cgroups",
            Self::Tombstone => "terminated.json",
            Self::AuthBundle => "auth.json",
            Self::Events => "events.jsonl",
            Self::Audit => "audit.db",
            Self::Policy => "policy.json",
            Self::Descriptor => "descriptor.json",
            Self::Spec => "spec.json",
            Self::Generation => "generation",
            Self::Stopped => "stopped",
            Self::Root => "root.json",
            Self::WritableDisk => "disk.ext4",
            Self::Shares => "shares",
            Self::Gateway => "gateway.json",
            Self::GatewayToken => "gateway-token",
        }
    }

    /// Whether the file lives in [`SandboxFile::VmmRoot`] (QEMU's sockets), not in the sandbox directory.
    pub const fn in_vmm_root(self) -> bool {
        matches!(self, Self::Channel | Self::ConsoleSocket | Self::Monitor | Self::Migration)
    }

    /// Its path relative to the sandbox directory.
    pub fn relative(self) -> PathBuf {
        if self.in_vmm_root() {
            Path::new(Self::VmmRoot.name()).join(self.name())
        } else {
            PathBuf::from(self.name())
        }
    }
}

impl AsRef<Path> for SandboxFile {
    fn as_ref(&self) -> &Path {
        Path::new(self.name())
    }
}

/// One sandbox directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxLayout {
    dir: PathBuf,
}

impl SandboxLayout {
    /// The layout of `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of `file`.
    pub fn path(&self, file: SandboxFile) -> PathBuf {
        self.dir.join(file.relative())
    }

    /// The sandbox id: the directory's name.
    pub fn id(&self) -> String {
        self.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_single_components() {
        let mut names: Vec<&str> = SandboxFile::ALL.iter().map(|f| f.name()).collect();
        assert!(names.iter().all(|n| !n.contains('/') && !n.is_empty()));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SandboxFile::ALL.len());
        assert_eq!(SandboxLayout::new("/s/box").path(SandboxFile::Attach), Path::new("/s/box/attach.sock"));
    }
}
