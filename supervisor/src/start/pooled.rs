//! A pooled VM (`--pooled`): booted with no identity, idle until `vm-driver serve` claims it for a sandbox
//! ([`vm_contract::claim`]), then admitted and served as that sandbox; or, with `--save-snapshot`, saved
//! and stopped ([`crate::boot::snapshot`]).
//!
//! ```text
//! enter the sandbox directory -> leash (signals, the liveness pipe with its claim line) -> boot
//!   -> save, stop                                                                (--save-snapshot)
//!   -> report pooled -> wait for the claim -> admit under the claimed identity -> serve until stopped
//! ```
//!
//! Before the claim nothing is served and no telemetry exists: no event can leave under an identity that
//! is not the sandbox's, and the boot's events are emitted after the claim, under the claimed one. The
//! waiting VM is leashed like any other: the liveness pipe (EOF kills it), the lease with the watchdog, stop
//! signals, and its own exit. A pooled VM serves one sandbox: there is no way back into the pool.

use std::path::Path;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use vm_contract::args::SupervisorArgs;
use vm_contract::root::RootImage;
use vm_contract::status::SupervisorStatus;
use vm_ocsf::{AppInfo, Lifecycle, Status};

use super::admission::{self, SettingsFrom};
use super::claim::{self, Unclaimed};
use super::fail::{fail, Outlet};
use super::StartError;
use crate::boot::snapshot::SaveLine;
use crate::boot::Booted;
use crate::inbox::Inbox;
use crate::safeguards::Safeguards;
use crate::status;
use crate::stop::StopReason;
use crate::telemetry::console::Console;
use crate::telemetry::settings::TelemetrySettings;
use crate::telemetry::Telemetry;

/// Boots the pooled VM, then saves it, or waits for its claim and runs the claimed sandbox.
///
/// # Errors
/// A [`StartError`] if the VM never became ready, its save or its claim failed, or the claimed sandbox was
/// not admitted.
pub async fn run(args: SupervisorArgs, safeguards: &Safeguards, console: Console) -> Result<StopReason, StartError> {
    if let Err(e) = super::enter(&args.vm) {
        return fail(Outlet::Console(console), e).await;
    }
    let (claim_tx, claim_rx) = oneshot::channel();
    let (senders, mut inbox) = match super::leash(true, Some(claim_tx)) {
        Ok(leash) => leash,
        Err(e) => return fail(Outlet::Console(console), e).await,
    };
    // A pool of an image root boots on it: the driver wrote the slot's root file.
    let root = match RootImage::read(Path::new(".")) {
        Ok(root) => root,
        Err(e) => return fail(Outlet::Console(console), StartError::Root(e)).await,
    };
    let mut booted = match crate::boot::boot(&args.vm, root.as_ref(), safeguards, &senders, &mut inbox.stop).await {
        Ok(booted) => booted,
        Err(e) => return fail(Outlet::Console(console), e.into()).await,
    };
    if let (Some(dir), Some(line)) = (args.vm.save_snapshot.clone(), booted.save.take()) {
        let cap = safeguards.stream_cap_bytes(args.vm.shape);
        return save_and_stop(booted, line, inbox, (&dir, root.is_some()), cap, console).await;
    }
    let agent = booted.link.hello.software_label();
    status::report(&SupervisorStatus::Pooled { vmm_pid: booted.vm.vmm_record.pid.unsigned_abs(), agent });
    tracing::info!(slot = %args.identity.sandbox_id, "pooled VM ready; waiting for a claim");
    // Control: the naive pool, whose VM reports its boot under the slot's id before any claim.
    let _early = (!safeguards.identity_at_claim).then(|| boot_event(&args, safeguards, &console)).flatten();
    let vm = &mut booted.vm;
    let claim = match claim::wait(&mut vm.vmm, &mut vm.lease, &mut inbox, claim_rx).await {
        Ok(claim) => claim,
        Err(unclaimed) => {
            let _ = booted.shut_down().await;
            return match unclaimed {
                Unclaimed::Stopped(reason) => {
                    tracing::info!(reason = %reason, "pooled VM stopped before a claim");
                    Ok(end_unclaimed(reason, console))
                }
                Unclaimed::BadClaim(e) => fail(Outlet::Console(console), StartError::Claim(e)).await,
            };
        }
    };
    // The sandbox's identity from now on; the VM's arguments are the slot's, unchanged.
    let args = SupervisorArgs { identity: claim.identity(), vm: args.vm };
    tracing::info!(sandbox = %args.identity.sandbox_id, "claimed");
    let mut admitted = match admission::admit(&args, safeguards, console, SettingsFrom::Claim(&claim)) {
        Ok(admitted) => admitted,
        Err(failure) => {
            let _ = booted.shut_down().await;
            return failure.fail().await;
        }
    };
    // The claimed sandbox's root is the one this VM booted (the driver claims only such a VM).
    if admitted.root.as_ref().map(|r| &r.manifest) != root.as_ref().map(|r| &r.manifest) {
        let _ = booted.shut_down().await;
        return fail(Outlet::Sandbox(Box::new(admitted.sandbox)), StartError::RootMismatch).await;
    }
    admitted.sandbox.telemetry().spans().boot_origin(claim.origin.as_str());
    Ok(admitted.serve(&args, safeguards, booted, senders, inbox).await)
}

/// `--save-snapshot`: saves the booted VM into `dir`, keeping its lease meanwhile, then stops it; with an
/// image root (`with_disk`), its writable layer as the saved guest left it is kept beside the stream. Saved
/// or not, the VM serves nothing and the supervisor exits.
async fn save_and_stop(
    mut booted: Booted,
    line: SaveLine,
    mut inbox: Inbox,
    (dir, with_disk): (&Path, bool),
    cap: u64,
    console: Console,
) -> Result<StopReason, StartError> {
    let vm = &mut booted.vm;
    let saved = tokio::select! {
        biased;
        reason = claim::until_stopped(&mut vm.vmm, &mut vm.lease, &mut inbox.stop) => {
            Err(StartError::StoppedBeforeSave(reason))
        }
        saved = crate::boot::snapshot::save(line, &booted.link, dir, cap) => saved.map_err(StartError::Save),
    };
    // The saved guest is stopped: its layer no longer changes, and QEMU flushed it at the end of the save.
    let saved = saved.and_then(|bytes| {
        if with_disk {
            crate::boot::disks::save(dir).map_err(StartError::SaveDisk)?;
        }
        Ok(bytes)
    });
    let _ = booted.shut_down().await;
    match saved {
        Ok(bytes) => {
            tracing::info!(bytes, "VM saved");
            status::report(&SupervisorStatus::Saved { bytes });
            Ok(end_unclaimed(StopReason::Terminated, console))
        }
        Err(e) => fail(Outlet::Console(console), e).await,
    }
}

/// The end of a VM that served nothing: its final report (nothing sent), and the console ended.
fn end_unclaimed(reason: StopReason, console: Console) -> StopReason {
    status::report(&SupervisorStatus::Stopped {
        events: 0,
        otlp_exported: 0,
        otlp_dropped: 0,
        limited: 0,
        jsonl_dropped: 0,
        console_dropped: 0,
        audit: None,
    });
    console.shutdown(Instant::now() + Duration::from_secs(1));
    reason
}

/// The `pool-identity-at-boot` control's telemetry: started at boot from the environment, under the slot's id.
fn boot_event(args: &SupervisorArgs, safeguards: &Safeguards, console: &Console) -> Option<Telemetry> {
    let settings = TelemetrySettings::load(Vec::new()).ok()?;
    let sandbox_id = args.identity.sandbox_id.as_str();
    let mut telemetry = Telemetry::start(console.handle(), sandbox_id, &settings, safeguards.telemetry).ok()?;
    let vm = AppInfo { name: "microvm".into(), version: env!("CARGO_PKG_VERSION").into() };
    let event = telemetry.source().lifecycle(Lifecycle::Start, &vm, Status::Success, None);
    telemetry.emit(event);
    Some(telemetry)
}
