//! A cold start: the sandbox's VM is booted for it, after its admission.
//!
//! ```text
//! enter the sandbox directory -> admit (descriptor, telemetry, session, policy)
//!   -> leash (signals, liveness pipe) -> boot -> serve until stopped
//! ```

use vm_contract::args::SupervisorArgs;

use super::admission::{self, SettingsFrom};
use super::fail::{fail, Outlet};
use super::StartError;
use crate::safeguards::Safeguards;
use crate::stop::StopReason;
use crate::telemetry::console::Console;

/// Runs one sandbox from its admission to its stop, reporting to `console` and the telemetry sinks.
///
/// # Errors
/// A [`StartError`] if the VM never became ready; the failure is also reported as a status line and (from
/// admission on) as OCSF events.
pub async fn run(args: SupervisorArgs, safeguards: &Safeguards, console: Console) -> Result<StopReason, StartError> {
    if let Err(e) = super::enter(&args.vm) {
        return fail(Outlet::Console(console), e).await;
    }
    let admitted = match admission::admit(&args, safeguards, console, SettingsFrom::Environment) {
        Ok(admitted) => admitted,
        Err(failure) => return failure.fail().await,
    };
    let (senders, mut inbox) = match super::leash(args.vm.parent_liveness_stdin, None) {
        Ok(leash) => leash,
        Err(e) => return fail(Outlet::Sandbox(Box::new(admitted.sandbox)), e).await,
    };
    let booted = match crate::boot::boot(&args.vm, admitted.root.as_ref(), safeguards, &senders, &mut inbox.stop).await
    {
        Ok(booted) => booted,
        Err(e) => return fail(Outlet::Sandbox(Box::new(admitted.sandbox)), e.into()).await,
    };
    Ok(admitted.serve(&args, safeguards, booted, senders, inbox).await)
}
