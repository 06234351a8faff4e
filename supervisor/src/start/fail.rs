//! The one way a failed start ends: the failure on the status line, through whichever sinks were up.

use std::time::{Duration, Instant};

use vm_contract::status::SupervisorStatus;
use vm_ocsf::{Finding, Lifecycle, Status};

use super::admission::AdmitError;
use super::sandbox::{self, Sandbox};
use super::StartError;
use crate::diagnostics::{chain, tails};
use crate::status;
use crate::stop::{self, StopReason};
use crate::telemetry::console::Console;
use crate::telemetry::settings::{SettingsError, TelemetrySettings};
use crate::telemetry::{Telemetry, TelemetryControls};

/// How long the console may take to drain after a failure with no telemetry.
const CONSOLE_DRAIN: Duration = Duration::from_secs(1);

/// Where a failure is reported, besides the status line: the sinks that were up when the start stopped.
pub(crate) enum Outlet {
    /// No telemetry yet: the console (`supervisor.log`) alone.
    Console(Console),
    /// Refused at its launch descriptor: the finding goes to the sinks that need no credential (console and
    /// JSONL), since the auth bundle is never read; the driver takes the bundle back.
    Refused {
        console: Console,
        /// The settings, or why there are none.
        settings: Box<Result<TelemetrySettings, SettingsError>>,
        /// The id the refused sandbox claimed.
        sandbox_id: String,
        /// What the sinks are told.
        controls: TelemetryControls,
    },
    /// An admitted sandbox, whose telemetry ends the console at its flush.
    Sandbox(Box<Sandbox>),
}

/// A failed phase and the sinks to report it through (boxed: it travels as an `Err`).
pub(crate) struct Failure(Box<(Outlet, StartError)>);

impl Failure {
    pub(crate) fn new(error: impl Into<StartError>, outlet: Outlet) -> Self {
        Self(Box::new((outlet, error.into())))
    }

    /// Reports it: see [`fail`].
    pub(crate) async fn fail(self) -> Result<StopReason, StartError> {
        let (outlet, error) = *self.0;
        fail(outlet, error).await
    }
}

/// Ends a start that failed with `error`: the `failed` status line (the error's chain and the logs that
/// explain it), the sinks of `outlet` told and flushed, and the error returned.
///
/// A refused descriptor is reported last (the driver ends the supervisor on it, and no signal handler is
/// installed yet); otherwise the status line comes first and an admitted sandbox still sends its final counts.
pub(crate) async fn fail(outlet: Outlet, error: StartError) -> Result<StopReason, StartError> {
    let files: Vec<&str> = error.explained_by().iter().map(|f| f.name()).collect();
    let saved_state_refused = error.saved_state_refused();
    let mut line = format!("{}{}", chain(&error), tails(&files));
    match outlet {
        Outlet::Console(console) => {
            status::report(&SupervisorStatus::Failed { error: line, saved_state_refused });
            console.shutdown(Instant::now() + CONSOLE_DRAIN);
        }
        Outlet::Refused { console, settings, sandbox_id, controls } => {
            refuse(&error, console, *settings, &sandbox_id, controls).await;
            status::report(&SupervisorStatus::Failed { error: line, saved_state_refused });
        }
        Outlet::Sandbox(mut sandbox) => {
            if let StartError::Boot(boot) = &error {
                line.push_str(&sandbox.boot_failed(boot));
            }
            status::report(&SupervisorStatus::Failed { error: line, saved_state_refused });
            // Logged here, while the console still runs.
            tracing::error!(error = %chain(&error), "start-up failed");
            sandbox.end(stop::FLUSH_BUDGET).await;
        }
    }
    Err(error)
}

/// The refusal's finding and failed start, on the sinks that need no credential, then the console ended.
async fn refuse(
    error: &StartError,
    console: Console,
    settings: Result<TelemetrySettings, SettingsError>,
    sandbox_id: &str,
    controls: TelemetryControls,
) {
    tracing::error!(error = %chain(error), "start-up refused");
    let settings = settings.map(|s| TelemetrySettings { otlp: None, ..s });
    let telemetry = settings.ok().and_then(|s| Telemetry::start(console.handle(), sandbox_id, &s, controls).ok());
    let Some(mut telemetry) = telemetry else {
        console.shutdown(Instant::now() + CONSOLE_DRAIN);
        return;
    };
    if let StartError::Admission(AdmitError::Descriptor(mismatch)) = error {
        let event = telemetry.source().finding(Finding::DescriptorMismatch, &mismatch.to_string());
        telemetry.emit(event);
    }
    let app = sandbox::app();
    let event = telemetry.source().lifecycle(Lifecycle::Start, &app, Status::Failure, Some(chain(error)));
    telemetry.emit(event);
    telemetry.shutdown(stop::FLUSH_BUDGET, console).await;
}
