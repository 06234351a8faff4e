//! Exit statuses: the supervisor's (which the driver reads and explains), the watchdog's, and the driver's
//! own when the workload gave it none.

/// How `vm-supervisor` ended. In every case the VMM has exited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SupervisorExit {
    /// 0: an orderly stop (SIGTERM).
    Stopped,
    /// 1: the VM never became ready.
    StartFailed,
    /// 2: a bad command line.
    Usage,
    /// 3: the VM ended on its own, or was stopped because the guest broke the protocol.
    VmEnded,
    /// 4: the driver went away (liveness EOF); the VM was killed.
    DriverGone,
    /// 5: the lease with the watchdog was lost; the VM was killed.
    LeaseLost,
    /// 6: the driver refused this supervisor's session; the VM was stopped.
    SessionRefused,
}

impl SupervisorExit {
    const ALL: [Self; 7] = [
        Self::Stopped,
        Self::StartFailed,
        Self::Usage,
        Self::VmEnded,
        Self::DriverGone,
        Self::LeaseLost,
        Self::SessionRefused,
    ];

    /// The process exit status.
    pub const fn code(self) -> u8 {
        match self {
            Self::Stopped => 0,
            Self::StartFailed => 1,
            Self::Usage => 2,
            Self::VmEnded => 3,
            Self::DriverGone => 4,
            Self::LeaseLost => 5,
            Self::SessionRefused => 6,
        }
    }

    /// The exit a status means, if it is one of ours.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|e| i32::from(e.code()) == code)
    }

    /// What it means, in words.
    pub const fn meaning(self) -> &'static str {
        match self {
            Self::Stopped => "stopped in order",
            Self::StartFailed => "the VM never became ready",
            Self::Usage => "bad command line",
            Self::VmEnded => "the VM ended on its own or broke the protocol",
            Self::DriverGone => "the driver went away; the VM was killed",
            Self::LeaseLost => "the lease with the watchdog was lost; the VM was killed",
            Self::SessionRefused => "the driver refused its session; the VM was stopped",
        }
    }
}

/// How `vm-watchdog` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WatchdogExit {
    /// 0: the VMM is gone (stopped by the supervisor, or killed here and confirmed).
    VmmGone,
    /// 1: the kill could not be confirmed, or the VMM could not be watched.
    Unconfirmed,
    /// 2: bad arguments.
    Usage,
}

impl WatchdogExit {
    /// The process exit status.
    pub const fn code(self) -> u8 {
        match self {
            Self::VmmGone => 0,
            Self::Unconfirmed => 1,
            Self::Usage => 2,
        }
    }
}

/// `vm-jailer`'s status when it could not confine itself (QEMU never ran); its reason is on QEMU's stderr.
/// Clear of QEMU's own statuses (0 and 1) and of clap's usage error (2).
pub const JAILER_FAILED: u8 = 71;

/// `vm-driver`'s own exit statuses (`launch` and `exec` otherwise exit with the workload's: its code, or 128
/// + the signal that killed it).
pub mod driver {
    /// A bad command line.
    pub const USAGE: u8 = 2;
    /// `--timeout` expired (as `timeout(1)`).
    pub const TIMEOUT: u8 = 124;
    /// The driver failed before the workload had a status (as `docker run`).
    pub const DRIVER_ERROR: u8 = 125;
    /// Stopped because the driver got SIGHUP.
    pub const HANGUP: u8 = 129;
    /// Stopped by three Ctrl-Cs (SIGINT).
    pub const INTERRUPTED: u8 = 130;
    /// Stopped because the driver got SIGTERM.
    pub const TERMINATED: u8 = 143;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for e in SupervisorExit::ALL {
            assert_eq!(SupervisorExit::from_code(i32::from(e.code())), Some(e));
        }
        assert_eq!(SupervisorExit::from_code(101), None);
    }
}
