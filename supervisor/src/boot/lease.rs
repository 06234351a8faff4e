//! The supervisor's side of the lease with the watchdog (`vm-watchdog`).
//!
//! Every [`PULSE_INTERVAL_MS`] the event loop writes a pulse byte and the watchdog echoes it. A write that
//! succeeds proves nothing (the pipe buffers), so the supervisor demands each echo within
//! [`ACK_TIMEOUT_MS`]; when one is late, or the watchdog's pipe closes, the supervisor stops the VM itself.
//! The pulses are a branch of the loop that drives the VM and the boundary: if that loop hangs, the pulses
//! stop and the watchdog kills the VMM.
//!
//! A deadline measures the peer's silence, not the observer's own scheduling gap: on a busy host the
//! supervisor itself may run late, and an echo that waited in the pipe meanwhile is not late. So echoes are
//! read before pulses are judged, and when a pulse tick fires more than [`vm_watchdog::OWN_GAP_TOLERANCE_MS`] after it was
//! due, the time this side was not running is not counted against the watchdog.

use std::collections::VecDeque;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::time::{Instant, Interval, MissedTickBehavior};
use vm_contract::args::WatchdogArgs;
use vm_contract::pids::ProcessRecord;

/// Time between pulses.
pub const PULSE_INTERVAL_MS: u64 = 250;
/// Longest wait for a pulse's echo.
pub const ACK_TIMEOUT_MS: u64 = 1_000;
/// Longest wait for the watchdog's ready byte.
pub const READY_TIMEOUT_MS: u64 = 5_000;

use vm_watchdog::{KILLING, PULSE, READY};

/// Why the lease could not be established; the VM is refused.
#[derive(Debug, thiserror::Error)]
pub enum LeaseStartError {
    /// The watchdog binary could not be started.
    #[error("cannot start the lease watchdog")]
    Spawn(#[source] std::io::Error),
    /// No ready byte in time.
    #[error("the lease watchdog was not ready within {READY_TIMEOUT_MS} ms")]
    NotReady,
}

/// Why a running lease failed. Each one means the VM must stop now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LeaseFailure {
    /// An echo is overdue.
    #[error("the lease watchdog did not echo a pulse within {ACK_TIMEOUT_MS} ms")]
    EchoLate,
    /// The watchdog's pipes closed: it is gone.
    #[error("the lease watchdog is gone")]
    WatchdogGone,
    /// An echo that matches no pulse, or a wrong byte.
    #[error("the lease watchdog sent an unexpected byte")]
    Unexpected,
    /// The watchdog announced it is killing the VMM (it thinks this supervisor is hung).
    #[error("the lease watchdog is killing the VMM")]
    WatchdogKilling,
}

/// Pulses sent and not yet echoed. Pure bookkeeping, tested with made-up instants.
#[derive(Debug)]
pub struct Ledger {
    unechoed: VecDeque<Instant>,
    /// Off only in the "write success is enough" control.
    require_echo: bool,
}

impl Ledger {
    /// A ledger that demands echoes (or not, for the control).
    pub fn new(require_echo: bool) -> Self {
        Self { unechoed: VecDeque::new(), require_echo }
    }

    /// A pulse went out at `now`.
    pub fn sent(&mut self, now: Instant) {
        self.unechoed.push_back(now);
    }

    /// An echo came back.
    ///
    /// # Errors
    /// [`LeaseFailure::Unexpected`] when no pulse is outstanding.
    pub fn echoed(&mut self) -> Result<(), LeaseFailure> {
        self.unechoed.pop_front().map(drop).ok_or(LeaseFailure::Unexpected)
    }

    /// A pulse tick due at `due` fired at `now`: if this side was not running for a while, the outstanding
    /// pulses' clocks stop for that while.
    pub fn ticked(&mut self, due: Instant, now: Instant) {
        if let Some(gap) = vm_watchdog::own_gap(Duration::ZERO, now.saturating_duration_since(due)) {
            for sent in &mut self.unechoed {
                *sent += gap;
            }
        }
    }

    /// Whether every pulse older than the ack timeout has been echoed.
    ///
    /// # Errors
    /// [`LeaseFailure::EchoLate`].
    pub fn check(&self, now: Instant) -> Result<(), LeaseFailure> {
        match self.unechoed.front() {
            Some(sent) if self.require_echo && now.duration_since(*sent) > Duration::from_millis(ACK_TIMEOUT_MS) => {
                Err(LeaseFailure::EchoLate)
            }
            _ => Ok(()),
        }
    }
}

/// A running watchdog and its two pipes.
#[derive(Debug)]
pub struct Lease {
    child: Child,
    pulses: ChildStdin,
    echoes: ChildStdout,
    ledger: Ledger,
    interval: Interval,
    /// The watchdog, for the pids file.
    pub record: Option<ProcessRecord>,
}

impl Lease {
    /// Starts the watchdog on `vmm`, with the environment `env`, and waits for its ready byte. Without
    /// `require_echo` (the `pulse-write-only` control) a pulse that was written counts.
    ///
    /// # Errors
    /// [`LeaseStartError`]; the VM must then be refused.
    pub async fn start(
        binary: &Path,
        vmm: ProcessRecord,
        env: &[(&str, String)],
        require_echo: bool,
    ) -> Result<Self, LeaseStartError> {
        let mut child = Command::new(binary)
            .args(WatchdogArgs { vmm }.to_argv())
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(LeaseStartError::Spawn)?;
        let (Some(pulses), Some(mut echoes)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(LeaseStartError::Spawn(std::io::ErrorKind::BrokenPipe.into()));
        };
        let mut ready = [0u8];
        match tokio::time::timeout(Duration::from_millis(READY_TIMEOUT_MS), echoes.read_exact(&mut ready)).await {
            Ok(Ok(_)) if ready[0] == READY => {}
            _ => return Err(LeaseStartError::NotReady),
        }
        let record = child.id().and_then(|pid| ProcessRecord::read(i32::try_from(pid).ok()?));
        let mut interval = tokio::time::interval(Duration::from_millis(PULSE_INTERVAL_MS));
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ok(Self { child, pulses, echoes, ledger: Ledger::new(require_echo), interval, record })
    }

    /// One step of the lease: a pulse when one is due (after checking the echoes), or an echo. A select
    /// branch of the event loop; cancelling it between steps loses nothing.
    ///
    /// # Errors
    /// Any [`LeaseFailure`]: stop the VM.
    pub async fn step(&mut self) -> Result<(), LeaseFailure> {
        let mut echo = [0u8];
        tokio::select! {
            // Echoes first: one that is waiting is never judged late.
            biased;
            read = self.echoes.read(&mut echo) => match read {
                Ok(1) if echo[0] == PULSE => self.ledger.echoed(),
                Ok(1) if echo[0] == KILLING => Err(LeaseFailure::WatchdogKilling),
                Ok(0) | Err(_) => Err(LeaseFailure::WatchdogGone),
                Ok(_) => Err(LeaseFailure::Unexpected),
            },
            due = self.interval.tick() => {
                let now = Instant::now();
                self.ledger.ticked(due, now);
                self.ledger.check(now)?;
                self.pulses.write_all(&[PULSE]).await.map_err(|_| LeaseFailure::WatchdogGone)?;
                self.ledger.sent(Instant::now());
                Ok(())
            }
        }
    }

    /// Normal close, after the VM stopped: EOF on the pulses, then the watchdog confirms the VMM is gone and
    /// exits. Returns its exit status, or `None` if it had to be killed.
    pub async fn close(mut self) -> Option<std::process::ExitStatus> {
        drop(self.pulses);
        match tokio::time::timeout(vm_contract::stop::WATCHDOG_CLOSE, self.child.wait()).await {
            Ok(Ok(status)) => Some(status),
            _ => {
                let _ = self.child.start_kill();
                let _ = self.child.wait().await;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_echo_fails_the_lease() {
        let t0 = Instant::now();
        let mut ledger = Ledger::new(true);
        ledger.sent(t0);
        assert!(ledger.check(t0 + Duration::from_millis(900)).is_ok());
        assert_eq!(ledger.check(t0 + Duration::from_millis(1001)), Err(LeaseFailure::EchoLate));
        ledger.echoed().unwrap();
        assert!(ledger.check(t0 + Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn this_sides_own_gap_is_not_the_watchdogs_silence() {
        let t0 = Instant::now();
        let mut ledger = Ledger::new(true);
        ledger.sent(t0);
        // This side slept 3 s past a tick: the pulse's clock stopped meanwhile.
        let due = t0 + Duration::from_millis(PULSE_INTERVAL_MS);
        ledger.ticked(due, due + Duration::from_secs(3));
        assert!(ledger.check(due + Duration::from_secs(3)).is_ok());
        assert_eq!(ledger.check(due + Duration::from_secs(4) + Duration::from_millis(1)), Err(LeaseFailure::EchoLate));
        // A tick on time stops nothing.
        let mut ledger = Ledger::new(true);
        ledger.sent(t0);
        ledger.ticked(due, due + Duration::from_millis(10));
        assert_eq!(ledger.check(t0 + Duration::from_millis(1001)), Err(LeaseFailure::EchoLate));
    }

    #[test]
    fn echoes_without_pulses_are_refused() {
        let mut ledger = Ledger::new(true);
        assert_eq!(ledger.echoed(), Err(LeaseFailure::Unexpected));
    }

    #[test]
    fn the_write_only_control_never_notices() {
        let t0 = Instant::now();
        let mut ledger = Ledger::new(false);
        ledger.sent(t0);
        assert!(ledger.check(t0 + Duration::from_secs(60)).is_ok());
    }
}
