//! The safety mechanisms a test build's controls switch off, as plain values the core takes as input.
//!
//! `main` reads the switches once ([`vm_contract::test_control`], only in a build with the `test-controls`
//! feature) into a [`Safeguards`]; no other module of the supervisor asks for a switch. A release build
//! runs with [`Safeguards::default`]: every mechanism on, no switch handed on to the children.

use vm_contract::shape::SandboxShape;
use vm_contract::snapshot::max_state_bytes;
use vm_contract::test_control::{TestControl, VAR};

use crate::telemetry::TelemetryControls;

/// The migration stream's cap under the `snapshot-stream-cap` fault injection: far below any guest's memory.
const INJECTED_STREAM_CAP_BYTES: u64 = 1024 * 1024;

/// Which safety mechanisms are on. Each field names its control; [`Default`] has every one on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Safeguards {
    /// The launch descriptor is admitted against the arguments (off: `descriptor-unchecked`).
    pub admit_descriptor: bool,
    /// A pooled VM reports nothing before its claim gives it an identity (off: `pool-identity-at-boot`).
    pub identity_at_claim: bool,
    /// The lease demands each pulse's echo, not only its write (off: `pulse-write-only`).
    pub require_echo: bool,
    /// The guest's messages are checked, not only routed (off: `no-guest-invariants`).
    pub guest_invariants: bool,
    /// A policy update is applied in order with dispatch before it is acknowledged (off: `unserialized-policy`).
    pub serialized_policy: bool,
    /// A VM restored from a snapshot is reseeded (off: `no-reseed-at-restore`).
    pub reseed_restored: bool,
    /// `console.log` and `vmm.log` stop at their caps (off: `no-log-caps`).
    pub log_caps: bool,
    /// A saved VM's migration stream may be as large as its guest can make it (off, as fault injection:
    /// `snapshot-stream-cap`, 1 MiB).
    pub full_stream_cap: bool,
    /// Egress checks every resolved address against the address rules (off: `no-address-check`).
    pub address_check: bool,
    /// Intercepted requests get their placeholders swapped, refused or injected (off: `pass-placeholders`).
    pub swap_placeholders: bool,
    /// Egress downloads together stay within the download budget (off: `no-download-budget`).
    pub download_budget: bool,
    /// Egress follows policy updates (off: `egress-ignores-updates`).
    pub egress_updates: bool,
    /// Failures are logged in fixed text and library logs are silenced (off: `verbose-failure-logs`).
    pub quiet_failures: bool,
    /// What the telemetry sinks are told (`jsonl-sink-fails`, `no-telemetry-limits`, `verbose-failure-logs`,
    /// `no-audit-chain`, `audit-stall`, `no-telemetry-backpressure`).
    pub telemetry: TelemetryControls,
    /// The environment of the supervisor's children (the jailer, the watchdog): the switches that are on, so
    /// that theirs reach them too; empty in a release build.
    pub child_env: Vec<(&'static str, String)>,
}

impl Default for Safeguards {
    fn default() -> Self {
        Self::from_controls(&[])
    }
}

impl Safeguards {
    /// The safeguards with the switches in `active` off (the rest of `active` is for the children).
    pub fn from_controls(active: &[TestControl]) -> Self {
        let on = |c: TestControl| !active.contains(&c);
        let names: Vec<&str> = active.iter().map(|c| c.name()).collect();
        Self {
            admit_descriptor: on(TestControl::DescriptorUnchecked),
            identity_at_claim: on(TestControl::PoolIdentityAtBoot),
            require_echo: on(TestControl::PulseWriteOnly),
            guest_invariants: on(TestControl::NoGuestInvariants),
            serialized_policy: on(TestControl::UnserializedPolicy),
            reseed_restored: on(TestControl::NoReseedAtRestore),
            log_caps: on(TestControl::NoLogCaps),
            full_stream_cap: on(TestControl::SnapshotStreamCap),
            quiet_failures: on(TestControl::VerboseFailureLogs),
            address_check: on(TestControl::NoAddressCheck),
            swap_placeholders: on(TestControl::PassPlaceholders),
            download_budget: on(TestControl::NoDownloadBudget),
            egress_updates: on(TestControl::EgressIgnoresUpdates),
            telemetry: TelemetryControls {
                jsonl_fails: !on(TestControl::JsonlSinkFails),
                no_limits: !on(TestControl::NoTelemetryLimits),
                no_audit_chain: !on(TestControl::NoAuditChain),
                verbose_failures: !on(TestControl::VerboseFailureLogs),
                audit_stall: !on(TestControl::AuditStall),
                no_backpressure: !on(TestControl::NoTelemetryBackpressure),
            },
            child_env: if names.is_empty() { Vec::new() } else { vec![(VAR, names.join(","))] },
        }
    }

    /// The most bytes a saved VM of `shape` may send as its migration stream.
    pub fn stream_cap_bytes(&self, shape: SandboxShape) -> u64 {
        if self.full_stream_cap {
            max_state_bytes(shape)
        } else {
            INJECTED_STREAM_CAP_BYTES
        }
    }

    /// A log's cap of `bytes`, or none.
    pub fn log_cap(&self, bytes: u64) -> u64 {
        if self.log_caps {
            bytes
        } else {
            u64::MAX
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_build_has_every_safeguard_on_and_hands_nothing_on() {
        let all = Safeguards::default();
        assert!(all.admit_descriptor && all.identity_at_claim && all.require_echo && all.guest_invariants);
        assert!(all.serialized_policy && all.reseed_restored && all.log_caps && all.full_stream_cap);
        assert!(all.quiet_failures && all.child_env.is_empty());
        assert_eq!(all.telemetry, TelemetryControls::default());
        assert_eq!(all.log_cap(10), 10);
        assert_eq!(all.stream_cap_bytes(SandboxShape::default()), max_state_bytes(SandboxShape::default()));
    }

    #[test]
    fn each_control_turns_off_its_own_safeguard_only() {
        let all = Safeguards::default();
        let fields = |s: &Safeguards| {
            [
                s.admit_descriptor,
                s.identity_at_claim,
                s.require_echo,
                s.guest_invariants,
                s.serialized_policy,
                s.reseed_restored,
                s.log_caps,
                s.full_stream_cap,
                s.quiet_failures,
            ]
        };
        let mut turned_off = 0;
        for control in TestControl::ALL {
            let one = Safeguards::from_controls(&[*control]);
            let off = fields(&one).iter().filter(|on| !**on).count();
            assert!(off <= 1, "{control} turns off {off} safeguards");
            turned_off += off;
            assert_eq!(one.child_env, vec![(VAR, control.name().to_owned())], "{control} reaches the children");
        }
        assert_eq!(turned_off, fields(&all).len(), "every safeguard has its control");
        let off = Safeguards::from_controls(&[TestControl::NoLogCaps, TestControl::SnapshotStreamCap]);
        assert_eq!(off.log_cap(10), u64::MAX);
        assert_eq!(off.stream_cap_bytes(SandboxShape::default()), INJECTED_STREAM_CAP_BYTES);
        assert_eq!(off.child_env, vec![(VAR, "no-log-caps,snapshot-stream-cap".to_owned())]);
        let sinks = Safeguards::from_controls(&[TestControl::JsonlSinkFails, TestControl::NoTelemetryLimits]).telemetry;
        assert!(sinks.jsonl_fails && sinks.no_limits && !sinks.verbose_failures);
        let verbose = Safeguards::from_controls(&[TestControl::VerboseFailureLogs]);
        assert!(verbose.telemetry.verbose_failures && !verbose.quiet_failures);
    }
}
