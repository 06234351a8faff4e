//! The lease watchdog: a tiny process that kills the VMM unless the supervisor keeps proving it is alive.
//!
//! ```text
//! supervisor --pulse 'P' every 250 ms--> watchdog --SIGKILL via pidfd--> VMM
//!            <--------- echo 'P' -------
//! ```
//!
//! The watchdog runs in its own session, so a signal to the supervisor's process group or terminal does
//! not reach it. It holds the VMM's pidfd (so a recycled pid can never be hit), its stdin (pulses) and
//! stdout (echoes), and nothing else: no workload data, no credentials.
//!
//! It kills the VMM on EOF (the supervisor died), a wrong byte, or [`SILENCE_MS`] without a pulse (the
//! supervisor hangs or is stopped), then confirms the exit through the pidfd and retries up to
//! [`KILL_ATTEMPTS`] times. When the VMM exits on its own (the supervisor stopped the VM) it exits 0.
//!
//! [`decide`] is the whole policy, as a pure function; `main.rs` does the I/O.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The byte the supervisor sends and the watchdog echoes.
pub const PULSE: u8 = b'P';
/// The byte the watchdog writes once it holds the pidfd.
pub const READY: u8 = b'R';
/// The byte the watchdog writes just before it kills the VMM, so a supervisor that is only slow learns why
/// its VM is gone.
pub const KILLING: u8 = b'K';
/// Longest silence tolerated before the VMM is killed.
pub const SILENCE_MS: u64 = 2_000;
/// A wait that overruns by more than this means the waiting side itself was not running (the watchdog here,
/// the supervisor in its lease); the overrun is not counted as the peer's silence.
pub const OWN_GAP_TOLERANCE_MS: u64 = 250;

/// The part of a wait for `asked` that took `took` which was this process's own gap, not the peer's silence:
/// the overrun, when it passes [`OWN_GAP_TOLERANCE_MS`].
pub fn own_gap(asked: std::time::Duration, took: std::time::Duration) -> Option<std::time::Duration> {
    let overran = took.saturating_sub(asked);
    (overran > std::time::Duration::from_millis(OWN_GAP_TOLERANCE_MS)).then_some(overran)
}
/// How long to wait for the pidfd to report the exit after each SIGKILL.
pub const KILL_CONFIRM_MS: u64 = 500;
/// SIGKILL attempts before giving up (and exiting non-zero).
pub const KILL_ATTEMPTS: u32 = 3;

/// What the watchdog observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A byte on the pulse pipe.
    Byte(u8),
    /// The pulse pipe closed (or failed).
    Eof,
    /// [`SILENCE_MS`] passed without a pulse.
    Silence,
    /// The VMM exited.
    VmmExited,
}

/// Why the VMM is being killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillReason {
    /// The supervisor's end of the pulse pipe closed.
    SupervisorGone,
    /// A byte other than [`PULSE`].
    WrongByte(u8),
    /// No pulse for [`SILENCE_MS`].
    Silence,
}

/// What to do about an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Echo the pulse and keep watching.
    Echo,
    /// Kill the VMM.
    Kill(KillReason),
    /// The VMM is gone: exit 0.
    Exit,
}

/// Which failures the watchdog reacts to. Test builds can narrow it for the causal tests' controls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// React to silence (off only in the "reacts only to EOF" control).
    pub silence_kills: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self { silence_kills: true }
    }
}

/// The watchdog's policy.
pub fn decide(input: Input, policy: Policy) -> Option<Action> {
    match input {
        Input::Byte(PULSE) => Some(Action::Echo),
        Input::Byte(other) => Some(Action::Kill(KillReason::WrongByte(other))),
        Input::Eof => Some(Action::Kill(KillReason::SupervisorGone)),
        Input::Silence if policy.silence_kills => Some(Action::Kill(KillReason::Silence)),
        Input::Silence => None,
        Input::VmmExited => Some(Action::Exit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_overrun_past_the_tolerance_is_this_sides_gap() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        // A wait that ended on time, or a little late (timer slack), is the peer's silence.
        assert_eq!(own_gap(ms(2_000), ms(2_000)), None);
        assert_eq!(own_gap(ms(2_000), ms(2_250)), None);
        // A wait that returned far too late: this process was not scheduled, and that is not the peer's.
        assert_eq!(own_gap(ms(2_000), ms(3_500)), Some(ms(1_500)));
        // An early return (a byte arrived) is never a gap.
        assert_eq!(own_gap(ms(2_000), ms(10)), None);
    }

    #[test]
    fn pulses_are_echoed_and_anything_else_kills() {
        let p = Policy::default();
        assert_eq!(decide(Input::Byte(PULSE), p), Some(Action::Echo));
        assert_eq!(decide(Input::Byte(b'x'), p), Some(Action::Kill(KillReason::WrongByte(b'x'))));
        assert_eq!(decide(Input::Eof, p), Some(Action::Kill(KillReason::SupervisorGone)));
        assert_eq!(decide(Input::Silence, p), Some(Action::Kill(KillReason::Silence)));
        assert_eq!(decide(Input::VmmExited, p), Some(Action::Exit));
    }

    #[test]
    fn the_eof_only_control_ignores_silence() {
        let p = Policy { silence_kills: false };
        assert_eq!(decide(Input::Silence, p), None);
        assert_eq!(decide(Input::Eof, p), Some(Action::Kill(KillReason::SupervisorGone)));
    }
}
