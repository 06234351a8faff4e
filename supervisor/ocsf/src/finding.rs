//! The security findings a supervisor reports, as Detection Findings (2004).

use crate::event::Severity;

/// The security findings a supervisor reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finding {
    /// The driver's liveness pipe closed: the VM was killed.
    LivenessLost,
    /// The lease with the watchdog failed: the VM was killed.
    LeaseLost,
    /// The watchdog killed the VMM.
    WatchdogAction,
    /// A request to use the sandbox was refused (wrong peer, bad input).
    AdmissionRefused,
    /// The guest broke the boundary protocol.
    GuestProtocolViolation,
    /// Events over the sandbox's rate or size limits were dropped (and counted).
    TelemetryDropped,
    /// A log the guest writes (console, VMM) reached its cap; the rest is dropped and counted.
    LogCapped,
    /// The VMM ran into a limit of its jail's cgroup (memory: killed; pids: refused).
    VmmLimit,
    /// The sandbox's policy denied a client's operation (the detail names it and the revision).
    PolicyDenied,
    /// The launch descriptor did not match the trusted arguments: the start was stopped.
    DescriptorMismatch,
    /// The host's hardened extractor refused a tar the guest sent back (the detail says why).
    TarRefused,
}

impl Finding {
    /// Every finding.
    pub const ALL: &'static [Self] = &[
        Self::LivenessLost,
        Self::LeaseLost,
        Self::WatchdogAction,
        Self::AdmissionRefused,
        Self::GuestProtocolViolation,
        Self::TelemetryDropped,
        Self::LogCapped,
        Self::VmmLimit,
        Self::PolicyDenied,
        Self::DescriptorMismatch,
        Self::TarRefused,
    ];

    /// The finding's title (`finding_info.title`, and the event's message).
    pub fn title(self) -> &'static str {
        match self {
            Self::LivenessLost => "Parent liveness lost; VM killed",
            Self::LeaseLost => "Watchdog lease lost; VM killed",
            Self::WatchdogAction => "Watchdog killed the VMM",
            Self::AdmissionRefused => "Admission refused",
            Self::GuestProtocolViolation => "Guest violated the boundary protocol",
            Self::TelemetryDropped => "Telemetry over its limits was dropped",
            Self::LogCapped => "A guest log reached its cap",
            Self::VmmLimit => "The VMM hit a limit of its jail",
            Self::PolicyDenied => "The sandbox policy denied an operation",
            Self::DescriptorMismatch => "The launch descriptor did not match; start stopped",
            Self::TarRefused => "The host refused a tar the guest sent",
        }
    }

    /// Its stable kind, for filtering (`finding_info.types`).
    pub fn kind(self) -> &'static str {
        match self {
            Self::LivenessLost => "liveness_lost",
            Self::LeaseLost => "lease_lost",
            Self::WatchdogAction => "watchdog_action",
            Self::AdmissionRefused => "admission_refused",
            Self::GuestProtocolViolation => "guest_protocol_violation",
            Self::TelemetryDropped => "telemetry_dropped",
            Self::LogCapped => "log_capped",
            Self::VmmLimit => "vmm_limit",
            Self::PolicyDenied => "policy_denied",
            Self::DescriptorMismatch => "descriptor_mismatch",
            Self::TarRefused => "tar_refused",
        }
    }

    /// How severe it is.
    pub fn severity(self) -> Severity {
        match self {
            Self::AdmissionRefused | Self::TelemetryDropped | Self::LogCapped | Self::PolicyDenied => Severity::Medium,
            Self::LivenessLost
            | Self::LeaseLost
            | Self::WatchdogAction
            | Self::GuestProtocolViolation
            | Self::VmmLimit
            | Self::DescriptorMismatch
            | Self::TarRefused => Severity::High,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Its place in [`Finding::ALL`]: a finding added to the enum fails to compile here until it is listed.
    fn index(finding: Finding) -> usize {
        match finding {
            Finding::LivenessLost => 0,
            Finding::LeaseLost => 1,
            Finding::WatchdogAction => 2,
            Finding::AdmissionRefused => 3,
            Finding::GuestProtocolViolation => 4,
            Finding::TelemetryDropped => 5,
            Finding::LogCapped => 6,
            Finding::VmmLimit => 7,
            Finding::PolicyDenied => 8,
            Finding::DescriptorMismatch => 9,
            Finding::TarRefused => 10,
        }
    }

    #[test]
    fn all_lists_every_finding_once() {
        for (i, finding) in Finding::ALL.iter().enumerate() {
            assert_eq!(index(*finding), i, "{finding:?}");
        }
        let kinds: std::collections::HashSet<_> = Finding::ALL.iter().map(|f| f.kind()).collect();
        assert_eq!(kinds.len(), Finding::ALL.len(), "kinds are unique");
    }
}
