//! What an actor's commands and starts fail with.

use std::path::PathBuf;

use crate::sandbox;
use crate::service::admission::Refused;

/// Why a stop request was refused.
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// The `stopped` marker could not be written, so a restarted driver would bring the sandbox back: it was
    /// not stopped.
    #[error("cannot record the stop ({}); the sandbox was not stopped", .0.display())]
    Marker(PathBuf, #[source] std::io::Error),
}

/// Why a start request was refused.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The last generation's VM is gone but not cleaned up yet.
    #[error("the sandbox's last VM is still being cleaned up; try again")]
    CleaningUp,
    /// It no longer fits.
    #[error(transparent)]
    Refused(#[from] Refused),
    /// The `stopped` marker could not be removed, so a restarted driver would keep the sandbox stopped.
    #[error("cannot clear the stop ({}); the sandbox was not started", .0.display())]
    Marker(PathBuf, #[source] std::io::Error),
}

/// Why a generation could not begin; its record then says `cannot start: ...`.
#[derive(Debug, thiserror::Error)]
pub(super) enum BeginError {
    /// The generation could not be recorded.
    #[error("cannot record the generation")]
    Generation(#[source] std::io::Error),
    /// No randomness for the session's credentials.
    #[error("cannot make the session's credentials")]
    Random(#[source] std::io::Error),
    /// The image is gone.
    #[error(transparent)]
    Image(#[from] crate::image::NamedImageError),
    /// The lifecycle could not start it.
    #[error(transparent)]
    Start(#[from] sandbox::StartError),
    /// The blocking start ended abnormally.
    #[error("the start task ended abnormally")]
    Task,
    /// An OpenShell gateway created the sandbox, and this `serve` has no endpoint to reach one.
    #[error("an OpenShell gateway created this sandbox, and vm-driver serve was started without --openshell-endpoint")]
    NoGateway,
    /// An OpenShell gateway created the sandbox, and the token it minted is gone from the sandbox directory.
    #[error("the sandbox token its OpenShell gateway minted is missing")]
    NoGatewayToken,
}
