//! A pooled VM (`--pooled`): booted with no identity, idle until `vm-driver serve` claims it for a sandbox
//! ([`vm_contract::claim`]), then the same sandbox as a cold start from the admission of its descriptor on
//! ([`crate::run`]).
//!
//! Before the claim nothing is served and no telemetry exists: no event can leave under an identity that
//! is not the sandbox's, and the boot's events are emitted after the claim, under the claimed one. The
//! waiting VM is leashed like any other: the liveness pipe (EOF kills it), the lease with the watchdog, stop
//! signals, and its own exit. A pooled VM serves one sandbox: there is no way back into the pool.

use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};
use vm_contract::args::SupervisorArgs;
use vm_contract::claim::{Claim, ClaimError};
use vm_contract::layout::SandboxFile;
use vm_contract::status::SupervisorStatus;
use vm_contract::test_control::TestControl;
use vm_ocsf::{AppInfo, Lifecycle, Status};

use crate::boot::{self, Booted, StartError};
use crate::diagnostics::{chain, tails};
use crate::inbox::{Inbox, StopRequests};
use crate::lease::Lease;
use crate::run::{Claimed, Start};
use crate::snapshot::SaveLine;
use crate::status;
use crate::stop::{self, StopReason};
use crate::telemetry::console::Console;
use crate::telemetry::settings::TelemetrySettings;
use crate::telemetry::{Telemetry, TelemetryControls};
use crate::vmm_process::VmmProcess;

/// How the wait for a claim ended without one.
enum Unclaimed {
    /// Stopped (signal, driver gone, lease lost, VMM exit).
    Stopped(StopReason),
    /// The driver wrote something that is not a claim.
    BadClaim(ClaimError),
}

/// Boots the pooled VM, waits for its claim, and then runs the claimed sandbox.
///
/// # Errors
/// A [`StartError`] if the VM never became ready, or its claim or the claimed sandbox's start failed.
pub async fn run(mut args: SupervisorArgs, console: Console) -> Result<StopReason, StartError> {
    if let Err(e) = std::env::set_current_dir(&args.sandbox_dir) {
        return failed(StartError::SandboxDir(args.sandbox_dir.clone(), e), console);
    }
    let (senders, mut inbox) = crate::inbox::new();
    stop::watch_signals(senders.clone());
    let (claim_tx, claim_rx) = oneshot::channel();
    if let Err(e) = crate::liveness::watch_stdin(senders.clone(), Some(claim_tx)) {
        return failed(StartError::Liveness(e), console);
    }
    let mut booted = match boot::boot(&args, &senders, &mut inbox.stop).await {
        Ok(booted) => booted,
        Err(e) => {
            let mut error = chain(&e);
            if e.concerns_the_guest() {
                error.push_str(&tails(&[SandboxFile::VmmLog.name(), SandboxFile::Console.name()]));
            }
            status::report(&SupervisorStatus::Failed { error });
            console.shutdown(Instant::now() + Duration::from_secs(1));
            return Err(e);
        }
    };
    if let (Some(dir), Some(line)) = (args.save_snapshot.clone(), booted.save.take()) {
        return save_and_stop(booted, line, inbox, &dir, &args, console).await;
    }
    let agent = booted.link.hello.software_label();
    status::report(&SupervisorStatus::Pooled { vmm_pid: booted.vmm_record.pid.unsigned_abs(), agent });
    tracing::info!(slot = %args.sandbox_id, "pooled VM ready; waiting for a claim");
    // Control: the naive pool, whose VM reports its boot under the slot's id before any claim.
    let _early = crate::control(TestControl::PoolIdentityAtBoot).then(|| boot_event(&args, &console)).flatten();
    let unclaimed = match wait_for_claim(&mut booted, &mut inbox, claim_rx).await {
        Ok(claim) => {
            args.sandbox_id = claim.sandbox_id.clone();
            args.session_id = Some(claim.session_id.clone());
            args.generation = claim.generation;
            args.session_socket = Some(claim.session_socket.clone());
            tracing::info!(sandbox = %args.sandbox_id, "claimed");
            let claimed = Claimed { booted, senders, inbox, claim };
            return crate::run::admit_and_serve(&args, console, Start::Claimed(Box::new(claimed))).await;
        }
        Err(unclaimed) => unclaimed,
    };
    let Booted { mut vmm, lease, .. } = booted;
    vmm.kill().await;
    let _ = lease.close().await;
    match unclaimed {
        Unclaimed::Stopped(reason) => {
            tracing::info!(reason = %reason, "pooled VM stopped before a claim");
            status::report(&stopped_unclaimed());
            console.shutdown(Instant::now() + Duration::from_secs(1));
            Ok(reason)
        }
        Unclaimed::BadClaim(e) => failed(StartError::Claim(e), console),
    }
}

/// `--save-snapshot`: saves the booted VM, keeping its lease meanwhile, then stops it. Saved or not, the VM
/// serves nothing and the supervisor exits.
async fn save_and_stop(
    mut booted: Booted,
    line: SaveLine,
    mut inbox: Inbox,
    dir: &std::path::Path,
    args: &SupervisorArgs,
    console: Console,
) -> Result<StopReason, StartError> {
    let saved = tokio::select! {
        biased;
        reason = until_stopped(&mut booted.vmm, &mut booted.lease, &mut inbox.stop) => {
            Err(StartError::StoppedBeforeSave(reason))
        }
        saved = crate::snapshot::save(line, &booted.link, dir, args.shape) => saved.map_err(StartError::Save),
    };
    let Booted { mut vmm, lease, .. } = booted;
    vmm.kill().await;
    let _ = lease.close().await;
    match saved {
        Ok(bytes) => {
            tracing::info!(bytes, "VM saved");
            status::report(&SupervisorStatus::Saved { bytes });
            status::report(&stopped_unclaimed());
            console.shutdown(Instant::now() + Duration::from_secs(1));
            Ok(StopReason::Terminated)
        }
        Err(e) => {
            // QEMU says why a migration failed on its stderr.
            let error = format!("{}{}", chain(&e), tails(&[SandboxFile::VmmLog.name()]));
            status::report(&SupervisorStatus::Failed { error });
            console.shutdown(Instant::now() + Duration::from_secs(1));
            Err(e)
        }
    }
}

/// The final report of a VM that served nothing.
fn stopped_unclaimed() -> SupervisorStatus {
    SupervisorStatus::Stopped {
        events: 0,
        otlp_exported: 0,
        otlp_dropped: 0,
        limited: 0,
        jsonl_dropped: 0,
        console_dropped: 0,
    }
}

/// Reports a failed start and ends the console.
fn failed(e: StartError, console: Console) -> Result<StopReason, StartError> {
    status::report(&SupervisorStatus::Failed { error: chain(&e) });
    console.shutdown(Instant::now() + Duration::from_secs(1));
    Err(e)
}

/// The `pool-identity-at-boot` control's telemetry: started at boot from the environment, under the slot's id.
fn boot_event(args: &SupervisorArgs, console: &Console) -> Option<Telemetry> {
    let settings = TelemetrySettings::load(Vec::new()).ok()?;
    let mut telemetry =
        Telemetry::start(console.handle(), args.sandbox_id.as_str(), &settings, TelemetryControls::at_start()).ok()?;
    let vm = AppInfo { name: "microvm".into(), version: env!("CARGO_PKG_VERSION").into() };
    let event = telemetry.source().lifecycle(Lifecycle::Start, &vm, Status::Success, None);
    telemetry.emit(event);
    Some(telemetry)
}

/// Waits for the claim, keeping the lease, until a stop, the VMM's exit or a lease failure.
async fn wait_for_claim(
    booted: &mut Booted,
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
        reason = until_stopped(&mut booted.vmm, &mut booted.lease, &mut inbox.stop) => Err(Unclaimed::Stopped(reason)),
        claim = claim => claim,
    }
}

/// Keeps an idle VM's lease stepping until it must stop: a stop request, the VMM's exit or a lease failure.
async fn until_stopped(
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
