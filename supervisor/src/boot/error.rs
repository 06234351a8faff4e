//! Why a boot failed: one variant per step, from the host's checks to the agent's answer.

use std::path::PathBuf;

use vm_contract::layout::SandboxFile;

use super::accel::KvmUnusable;
use super::guest_link::LinkError;
use super::lease::{LeaseFailure, LeaseStartError};

/// Why the boot failed. Nothing it started is left running when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// `--accel kvm` on a host where KVM cannot boot the guest.
    #[error("--accel kvm: KVM cannot be used here")]
    Kvm(#[source] KvmUnusable),
    /// No QEMU.
    #[error("qemu-system-x86_64 not found on PATH; install Debian's qemu-system-x86 package")]
    NoQemu,
    /// A kernel or initramfs is missing.
    #[error("guest {what} {} does not exist", path.display())]
    MissingImage {
        /// `kernel` or `initramfs`.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// An image root's disks are not ready.
    #[error("the image root's disks are not ready")]
    Disks(#[source] super::disks::DiskError),
    /// No watchdog or jailer binary next to the supervisor.
    #[error("{} not found (it is installed next to vm-supervisor)", .0.display())]
    NoSibling(PathBuf),
    /// `jail` confinement without an id for the VMM.
    #[error("jail confinement needs --jail-id")]
    NoJailId,
    /// A socket (or the VMM's directory) could not be made.
    #[error("cannot bind {}", .0.name())]
    Bind(SandboxFile, #[source] std::io::Error),
    /// The snapshot to restore from is unreadable.
    #[error("cannot read the snapshot to restore")]
    Snapshot(#[source] std::io::Error),
    /// A template's clone was not restored.
    #[error("the VM was not restored from its template")]
    Restore(#[source] super::snapshot::RestoreError),
    /// The guest RAM memfd was refused, or given to a VM that neither saves nor restores.
    #[error("the guest's RAM memfd cannot be used")]
    GuestRam(#[source] Option<vm_contract::guest_ram::RamError>),
    /// A host directory's file server could not be started.
    #[error("cannot share a host directory")]
    Shares(#[source] super::shares::ShareError),
    /// QEMU could not be started.
    #[error("cannot start the VMM")]
    SpawnVmm(#[source] std::io::Error),
    /// A guest log could not be set up.
    #[error("cannot set up {}", .0.name())]
    Log(SandboxFile, #[source] std::io::Error),
    /// QEMU did not connect its monitor (a VM to be saved needs it).
    #[error("the VMM did not connect its monitor")]
    Monitor(#[source] std::io::Error),
    /// The jailer did not report a pid that names its QEMU.
    #[error("the jailer did not report QEMU's pid")]
    NoVmmPid,
    /// The pids file could not be written; without it the reaper could not find an orphaned VM.
    #[error("cannot record the sandbox's pids")]
    Pids(#[source] std::io::Error),
    /// The lease could not be established.
    #[error("the VM was refused: no lease")]
    Lease(#[source] LeaseStartError),
    /// The lease failed during boot.
    #[error("the VM was refused: the lease failed during boot")]
    LeaseLost(#[source] LeaseFailure),
    /// QEMU exited before the agent answered.
    #[error("the VMM exited during boot ({status})")]
    VmmExitedDuringBoot {
        /// QEMU's exit status.
        status: String,
    },
    /// The agent did not come up.
    #[error("the VM did not boot")]
    Link(#[source] LinkError),
    /// Told to stop before the VM was ready.
    #[error("stopped during boot")]
    StoppedDuringBoot,
}

impl BootError {
    /// Whether the guest's handshake was wrong (as opposed to missing): a protocol violation to report.
    pub fn is_bad_handshake(&self) -> bool {
        matches!(self, Self::Link(LinkError::Handshake(_)))
    }

    /// Whether QEMU's and the guest's logs explain it.
    pub fn concerns_the_guest(&self) -> bool {
        matches!(self, Self::Link(_) | Self::VmmExitedDuringBoot { .. })
    }
}
