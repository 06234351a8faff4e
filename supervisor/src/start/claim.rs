//! A pooled VM's wait: its lease kept stepping, until its claim arrives or it must stop.

use tokio::sync::{oneshot, watch};
use vm_contract::claim::{Claim, ClaimError};

use crate::boot::lease::Lease;
use crate::boot::vmm_process::VmmProcess;
use crate::inbox::{Inbox, StopRequests};
use crate::stop::StopReason;

/// How the wait for a claim ended without one.
pub(super) enum Unclaimed {
    /// Stopped (signal, driver gone, lease lost, VMM exit).
    Stopped(StopReason),
    /// The driver wrote something that is not a claim.
    BadClaim(ClaimError),
}

/// Waits for the claim, keeping the lease, until a stop, the VMM's exit or a lease failure.
pub(super) async fn wait(
    vmm: &mut VmmProcess,
    lease: &mut Lease,
    inbox: &mut Inbox,
    claim: oneshot::Receiver<Result<Claim, ClaimError>>,
) -> Result<Claim, Unclaimed> {
    let claim = async {
        match claim.await {
            Ok(Ok(claim)) => Ok(claim),
            Ok(Err(e)) => Err(Unclaimed::BadClaim(e)),
            // Closed when the reader thread saw EOF first: its "driver gone" follows on the stop requests.
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        reason = until_stopped(vmm, lease, &mut inbox.stop) => Err(Unclaimed::Stopped(reason)),
        claim = claim => claim,
    }
}

/// Keeps an idle VM's lease stepping until it must stop: a stop request, the VMM's exit or a lease failure.
pub(super) async fn until_stopped(
    vmm: &mut VmmProcess,
    lease: &mut Lease,
    stop: &mut watch::Receiver<StopRequests>,
) -> StopReason {
    loop {
        tokio::select! {
            biased;
            Ok(()) = stop.changed() => {
                let requests = *stop.borrow_and_update();
                if requests.driver_gone {
                    return StopReason::DriverGone;
                }
                if requests.terminate {
                    return StopReason::Terminated;
                }
            }
            exit = vmm.wait() => return StopReason::VmmExited(exit.ok()),
            step = lease.step() => {
                if let Err(e) = step {
                    tracing::error!(error = %e, "lease lost while pooled; stopping the VM");
                    return StopReason::LeaseLost(e);
                }
            }
        }
    }
}
