//! Why a sandbox stops, what the supervisor's exit status says about it, and what asks for a stop from
//! outside (signals; the liveness pipe is [`liveness`]).

pub mod kill_switch;
pub mod liveness;
use std::fmt;
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use vm_contract::exit::SupervisorExit;

use crate::boot::lease::LeaseFailure;
use crate::boundary::GuestViolation;
use crate::inbox::Senders;

/// How a supervised VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// SIGTERM (or SIGINT/SIGHUP): an orderly stop.
    Terminated,
    /// The liveness pipe closed: the VM was killed at once.
    DriverGone,
    /// The watchdog stopped answering: the VM was killed at once.
    LeaseLost(LeaseFailure),
    /// QEMU exited without being asked (guest crash or power-off), with this status when it could be read.
    VmmExited(Option<std::process::ExitStatus>),
    /// The guest broke the protocol; the VM was stopped.
    GuestViolation(GuestViolation),
    /// The guest channel closed while QEMU kept running; the VM was stopped.
    ChannelClosed,
    /// The driver refused this supervisor's session; the VM was stopped.
    SessionRefused,
}

impl StopReason {
    /// The supervisor's exit status for this ending.
    pub fn exit(&self) -> SupervisorExit {
        match self {
            Self::Terminated => SupervisorExit::Stopped,
            Self::VmmExited(_) | Self::GuestViolation(_) | Self::ChannelClosed => SupervisorExit::VmEnded,
            Self::DriverGone => SupervisorExit::DriverGone,
            Self::LeaseLost(_) => SupervisorExit::LeaseLost,
            Self::SessionRefused => SupervisorExit::SessionRefused,
        }
    }

    /// How long the OTLP flush may take after this ending. When the driver is gone, an unsupervised process
    /// holding collector credentials must not linger: what a slow collector has not taken by then is dropped
    /// (and counted).
    pub fn flush_budget(&self) -> Duration {
        match self {
            Self::DriverGone => DRIVER_GONE_FLUSH,
            _ => FLUSH_BUDGET,
        }
    }
}

/// The flush budget at an orderly stop: the stop budget's last phase.
pub const FLUSH_BUDGET: Duration = vm_contract::stop::FLUSH;

/// The OTLP flush budget when the driver is gone.
pub const DRIVER_GONE_FLUSH: Duration = Duration::from_millis(250);

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Terminated => f.write_str("stopped on request"),
            Self::DriverGone => f.write_str("the driver is gone; the VM was killed"),
            Self::LeaseLost(why) => write!(f, "the lease with the watchdog was lost ({why}); the VM was killed"),
            Self::VmmExited(Some(status)) => write!(f, "the VMM exited on its own ({status})"),
            Self::VmmExited(None) => f.write_str("the VMM exited on its own"),
            Self::GuestViolation(what) => {
                write!(f, "the guest broke the boundary protocol ({what}); the VM was stopped")
            }
            Self::ChannelClosed => f.write_str("the guest closed the boundary channel; the VM was stopped"),
            Self::SessionRefused => f.write_str("the driver refused this supervisor's session; the VM was stopped"),
        }
    }
}

/// Turns SIGTERM, SIGINT and SIGHUP into a stop request, on a thread of its own.
pub fn watch_signals(senders: Senders) {
    match Signals::new([SIGTERM, SIGINT, SIGHUP]) {
        Ok(mut signals) => {
            let spawned = std::thread::Builder::new().name("signals".into()).spawn(move || {
                for _ in signals.forever() {
                    senders.terminate();
                }
            });
            if spawned.is_err() {
                tracing::error!("cannot start the signal thread; SIGTERM will kill without an orderly stop");
            }
        }
        Err(_) => tracing::error!("cannot register signal handlers; SIGTERM will kill without an orderly stop"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ending_has_its_documented_exit() {
        assert_eq!(StopReason::Terminated.exit().code(), 0);
        assert_eq!(StopReason::ChannelClosed.exit().code(), 3);
        assert_eq!(StopReason::DriverGone.exit().code(), 4);
        assert_eq!(StopReason::LeaseLost(LeaseFailure::EchoLate).exit().code(), 5);
        assert_eq!(StopReason::SessionRefused.exit().code(), 6);
        assert_eq!(StopReason::DriverGone.flush_budget(), DRIVER_GONE_FLUSH);
    }
}
