//! Process-level types shared by every hop: ids, streams, exit statuses, named signals, terminal sizes.

use serde::{Deserialize, Serialize};

/// A process on one connection, chosen by the side that sends `Spawn`.
///
/// Ids on one connection strictly increase, so a late message for a process that already exited (a benign
/// race) can be told apart from a message for an id that never existed (a protocol violation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProcId(pub u32);

impl std::fmt::Display for ProcId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Which output stream a chunk belongs to. With a PTY, everything arrives as `Stdout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stream {
    /// Standard output (or the PTY).
    Stdout,
    /// Standard error.
    Stderr,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    /// It exited with this code.
    Code(i32),
    /// A signal with this number killed it.
    Signaled(i32),
}

/// Highest signal number on Linux (`SIGRTMAX`).
pub const MAX_SIGNAL: i32 = 64;

impl ExitStatus {
    /// Whether a Linux process can end this way: a code of 0 to 255, or a signal of 1 to [`MAX_SIGNAL`]. A
    /// status from the guest that is not plausible is a protocol violation.
    pub fn is_plausible(self) -> bool {
        match self {
            Self::Code(code) => (0..=255).contains(&code),
            Self::Signaled(signal) => (1..=MAX_SIGNAL).contains(&signal),
        }
    }

    /// The status a shell would report: the code, or 128 + the signal number. Saturating, so an implausible
    /// status can never overflow (callers check [`ExitStatus::is_plausible`] first).
    pub fn shell_code(self) -> i32 {
        match self {
            Self::Code(code) => code,
            Self::Signaled(signal) => signal.saturating_add(128),
        }
    }

    /// The status as a process's 8-bit exit code, as a shell reports it: the code, or 128 + signal, modulo 256.
    pub fn exit_code(self) -> u8 {
        u8::try_from(self.shell_code().rem_euclid(256)).unwrap_or(u8::MAX)
    }
}

/// The signals a host may send to a workload. A named set, never raw numbers, so a peer cannot ask for a
/// signal the product has not decided to allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SignalName {
    /// SIGHUP
    Hup,
    /// SIGINT (Ctrl-C)
    Int,
    /// SIGQUIT
    Quit,
    /// SIGKILL
    Kill,
    /// SIGUSR1
    Usr1,
    /// SIGUSR2
    Usr2,
    /// SIGPIPE
    Pipe,
    /// SIGALRM
    Alrm,
    /// SIGTERM
    Term,
    /// SIGCONT
    Cont,
    /// SIGSTOP
    Stop,
    /// SIGTSTP (Ctrl-Z)
    Tstp,
    /// SIGWINCH
    Winch,
}

impl SignalName {
    /// Every named signal, for parsers and tests.
    pub const ALL: [Self; 13] = [
        Self::Hup,
        Self::Int,
        Self::Quit,
        Self::Kill,
        Self::Usr1,
        Self::Usr2,
        Self::Pipe,
        Self::Alrm,
        Self::Term,
        Self::Cont,
        Self::Stop,
        Self::Tstp,
        Self::Winch,
    ];

    /// The signal's number on Linux x86-64 (the only guest architecture).
    pub fn number(self) -> i32 {
        match self {
            Self::Hup => 1,
            Self::Int => 2,
            Self::Quit => 3,
            Self::Kill => 9,
            Self::Usr1 => 10,
            Self::Usr2 => 12,
            Self::Pipe => 13,
            Self::Alrm => 14,
            Self::Term => 15,
            Self::Cont => 18,
            Self::Stop => 19,
            Self::Tstp => 20,
            Self::Winch => 28,
        }
    }

    /// The conventional name without the `SIG` prefix, e.g. `INT`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hup => "HUP",
            Self::Int => "INT",
            Self::Quit => "QUIT",
            Self::Kill => "KILL",
            Self::Usr1 => "USR1",
            Self::Usr2 => "USR2",
            Self::Pipe => "PIPE",
            Self::Alrm => "ALRM",
            Self::Term => "TERM",
            Self::Cont => "CONT",
            Self::Stop => "STOP",
            Self::Tstp => "TSTP",
            Self::Winch => "WINCH",
        }
    }

    /// Parses `INT`, `SIGINT` or `int`.
    pub fn parse(text: &str) -> Option<Self> {
        let upper = text.to_ascii_uppercase();
        let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
        Self::ALL.into_iter().find(|s| s.name() == bare)
    }

    /// Parses a name as [`SignalName::parse`] does, or a number (an image config's `StopSignal` may be
    /// either).
    pub fn parse_name_or_number(text: &str) -> Option<Self> {
        match text.parse::<i32>() {
            Ok(n) => Self::ALL.into_iter().find(|s| s.number() == n),
            Err(_) => Self::parse(text),
        }
    }
}

/// A terminal size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

impl PtySize {
    /// A terminal's size as a client reports it: a zero (no size known) is the classic 24x80's, a size past
    /// what a terminal can have is the largest one.
    pub fn from_client(rows: u32, cols: u32) -> Self {
        let clamp = |n: u32, unknown: u16| if n == 0 { unknown } else { u16::try_from(n).unwrap_or(u16::MAX) };
        Self { rows: clamp(rows, 24), cols: clamp(cols, 80) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell_and_terminal_sizes_are_clamped() {
        assert_eq!(ExitStatus::Code(7).exit_code(), 7);
        assert_eq!(ExitStatus::Signaled(9).exit_code(), 137);
        assert_eq!(ExitStatus::Code(256 + 3).exit_code(), 3);
        assert_eq!(ExitStatus::Code(-1).exit_code(), 255);
        assert_eq!(PtySize::from_client(0, 0), PtySize { rows: 24, cols: 80 });
        assert_eq!(PtySize::from_client(40, 1 << 20), PtySize { rows: 40, cols: u16::MAX });
    }

    #[test]
    fn shell_code_adds_128_to_signals() {
        assert_eq!(ExitStatus::Code(7).shell_code(), 7);
        assert_eq!(ExitStatus::Signaled(9).shell_code(), 137);
        assert_eq!(ExitStatus::Signaled(i32::MAX).shell_code(), i32::MAX, "no overflow");
        for bad in [
            ExitStatus::Signaled(i32::MAX),
            ExitStatus::Signaled(-128),
            ExitStatus::Signaled(0),
            ExitStatus::Code(-1),
            ExitStatus::Code(256),
        ] {
            assert!(!bad.is_plausible(), "{bad:?}");
        }
        assert!(ExitStatus::Code(255).is_plausible() && ExitStatus::Signaled(64).is_plausible());
    }

    #[test]
    fn signal_names_round_trip() {
        for s in SignalName::ALL {
            assert_eq!(SignalName::parse(s.name()), Some(s));
            assert_eq!(SignalName::parse(&format!("sig{}", s.name().to_lowercase())), Some(s));
        }
        assert_eq!(SignalName::parse("SIGBOGUS"), None);
    }
}
