//! Start-up: the two orders in which a sandbox gets its VM, each a straight script over the phases.
//!
//! ```text
//! cold:    enter -> admit -> leash -> boot -> serve
//! pooled:  enter -> leash -> boot -> save, stop                          (--save-snapshot)
//!                                 -> wait for the claim -> admit -> serve
//! admit:   descriptor -> auth bundle and telemetry -> session -> policy
//! ```
//!
//! - [`cold`] and [`pooled`] are the scripts; neither calls the other.
//! - [`admission`]: what a sandbox must pass before it is served; `claim`: a pooled VM's wait for its claim.
//! - `sandbox`: an admitted sandbox's telemetry, from its admission to its final report, and its serving.
//! - `fail`: the one way a start that failed ends, whatever the phase.

pub mod admission;
mod claim;
pub mod cold;
mod fail;
pub mod pooled;
mod sandbox;

use std::path::PathBuf;

use vm_contract::args::VmArgs;
use vm_contract::claim::ClaimError;
use vm_contract::layout::SandboxFile;

pub use self::admission::AdmitError;
use crate::boot::snapshot::SaveError;
use crate::boot::BootError;
use crate::inbox::{Inbox, Senders};
use crate::stop::liveness::ClaimSender;
use crate::stop::StopReason;

/// Why a start failed, by phase. Nothing is left running when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The sandbox directory is unusable.
    #[error("cannot enter the sandbox directory {}", .0.display())]
    SandboxDir(PathBuf, #[source] std::io::Error),
    /// The parent-liveness reader could not be started; without it the VM could outlive the driver.
    #[error("cannot start the parent-liveness reader")]
    Liveness(#[source] std::io::Error),
    /// The sandbox was not admitted.
    #[error(transparent)]
    Admission(#[from] AdmitError),
    /// The VM did not boot.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// `--save-snapshot`: the save failed.
    #[error("cannot save the VM")]
    Save(#[source] SaveError),
    /// `--save-snapshot`: the VM stopped before it was saved.
    #[error("the VM stopped before it was saved ({0})")]
    StoppedBeforeSave(StopReason),
    /// A pooled VM's claim line could not be used.
    #[error("the claim was refused")]
    Claim(#[source] ClaimError),
    /// A pooled VM's image root (the slot's root file) cannot be read.
    #[error("cannot read the pooled VM's image root")]
    Root(#[source] vm_contract::root::RootFileError),
    /// A pooled VM was claimed for a sandbox of another root than it booted.
    #[error("the pooled VM booted another root than the sandbox asks for")]
    RootMismatch,
    /// `--save-snapshot`: the image root's writable layer could not be kept with the snapshot.
    #[error("cannot keep the writable layer with the snapshot")]
    SaveDisk(#[source] crate::boot::disks::DiskError),
}

impl StartError {
    /// The logs whose last lines explain this failure on the status line: QEMU's and the guest's when the
    /// guest did not come up, QEMU's when a save failed (QEMU says why a migration failed on its stderr).
    fn explained_by(&self) -> &'static [SandboxFile] {
        match self {
            Self::Boot(e) if e.concerns_the_guest() => &[SandboxFile::VmmLog, SandboxFile::Console],
            Self::Save(_) | Self::StoppedBeforeSave(_) => &[SandboxFile::VmmLog],
            _ => &[],
        }
    }

    /// Whether a restore failed on its saved state itself (the driver then makes the template again), not
    /// on the host (a timeout under load).
    fn saved_state_refused(&self) -> bool {
        match self {
            Self::Boot(BootError::Restore(e)) => e.is_refusal(),
            Self::Boot(BootError::Snapshot(_)) => true,
            _ => false,
        }
    }
}

/// Enters the sandbox directory: every relative path from here on is the sandbox's.
fn enter(vm: &VmArgs) -> Result<(), StartError> {
    std::env::set_current_dir(&vm.sandbox_dir).map_err(|e| StartError::SandboxDir(vm.sandbox_dir.clone(), e))
}

/// The leash before anything boots: the loop's queues, stop signals, and (with `liveness`) the liveness
/// pipe, whose reader first hands a pooled VM's claim to `claim`.
fn leash(liveness: bool, claim: Option<ClaimSender>) -> Result<(Senders, Inbox), StartError> {
    let (senders, inbox) = crate::inbox::new();
    crate::stop::watch_signals(senders.clone());
    if liveness {
        // Without the liveness thread the VM could outlive the driver; refuse to run.
        crate::stop::liveness::watch_stdin(senders.clone(), claim).map_err(StartError::Liveness)?;
    }
    Ok((senders, inbox))
}
