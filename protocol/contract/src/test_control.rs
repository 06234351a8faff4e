//! Switches that turn one safety mechanism off, for the causal tests' controls.
//!
//! Every binary reads them only when built with its `test-controls` feature, which a release build refuses
//! (`compile_error!`); a build that has them says so on stderr at every start, and the supervisor also
//! reports it as an OCSF configuration event. The names travel in [`VAR`], comma-separated.

use std::fmt;

/// The environment variable that carries the switches, comma-separated.
pub const VAR: &str = "VM_TEST_CONTROL";

macro_rules! controls {
    ($($variant:ident = $name:literal: $doc:literal,)+) => {
        /// One switch.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum TestControl {
            $(#[doc = $doc] $variant,)+
        }

        impl TestControl {
            /// Every switch.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)+];

            /// Its name in [`VAR`].
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }
        }
    };
}

controls! {
    LeakLivenessWriteEnd = "leak-liveness-write-end": "driver: the liveness pipe's write end is inherited by the supervisor (and the watchdog; the jailer closes it for QEMU).",
    CloseLivenessFirst = "close-liveness-first": "driver: a stop closes the liveness pipe before SIGTERM (the wrong order).",
    DescriptorWrongSandbox = "descriptor-wrong-sandbox": "driver: fault injection, the launch descriptor names another sandbox.",
    DescriptorWrongSession = "descriptor-wrong-session": "driver: fault injection, the launch descriptor names another session.",
    DescriptorWrongGeneration = "descriptor-wrong-generation": "driver: fault injection, the launch descriptor names another generation.",
    NoReaper = "no-reaper": "driver: the orphan reaper does nothing.",
    NoCgroupSweep = "no-cgroup-sweep": "driver: the cgroup sweep after a stop does nothing.",
    KeepCredentials = "keep-credentials": "driver: a failed start leaves the auth bundle in place.",
    ApiNoPeerCheck = "api-no-peer-check": "driver: the API socket serves any peer.",
    ApiSocketWorldReachable = "api-socket-world-reachable": "driver: fault injection, the API socket and its directory reachable by all users.",
    ExecMuxHeadOfLine = "exec-mux-head-of-line": "driver: the shared attach connection's reader waits on each process's queue, cut to one frame (no per-process buffering), so one stream whose client does not read stalls every stream of its sandbox.",
    UncheckedExtract = "unchecked-extract": "driver: the hardened extractor's path checks are off (lookups follow symlinks, symlink targets unchecked), so a guest's tar can write through a symlink out of the destination.",
    NoVmmWatch = "no-vmm-watch": "driver: the VMM's exit is not watched, so a hung supervisor keeps its sandbox ready.",
    SessionGateSignals = "session-gate-signals": "driver: fault injection, SIGUSR1 drops every supervisor session and holds new ones, SIGUSR2 lets them in.",
    PoolIdentityAtBoot = "pool-identity-at-boot": "driver and supervisor: a pooled VM gets the telemetry settings at spawn and reports its boot under its slot's id, before any claim (identity at claim dropped).",
    PulseWriteOnly = "pulse-write-only": "supervisor: a pulse that was written counts, echoed or not.",
    UnserializedPolicy = "unserialized-policy": "supervisor: a policy update is acknowledged on receipt and applied only after the next client message (the serialization with dispatch dropped).",
    DescriptorUnchecked = "descriptor-unchecked": "supervisor: the launch descriptor is not admitted (any sandbox, session or generation starts).",
    NoGuestInvariants = "no-guest-invariants": "supervisor: the guest's messages are routed but not checked (one Started, no empty data, plausible statuses).",
    JsonlSinkFails = "jsonl-sink-fails": "supervisor: fault injection, every write to events.jsonl fails (ENOSPC).",
    NoAuditChain = "no-audit-chain": "supervisor: events reach the sinks without the audit chain (none is written).",
    NoTelemetryLimits = "no-telemetry-limits": "supervisor: no rate limit on events and no cap on events.jsonl.",
    AuditStall = "audit-stall": "supervisor: fault injection, the audit chain appends nothing while a file named audit-stall is in the sandbox directory (a disk that stopped answering).",
    NoTelemetryBackpressure = "no-telemetry-backpressure": "supervisor: the guest is read however far the audit chain is behind, so a full queue to the chain drops events.",
    NoLogCaps = "no-log-caps": "supervisor: console.log and vmm.log grow without a cap.",
    VerboseFailureLogs = "verbose-failure-logs": "supervisor: failures are logged with their error text and library logs are not silenced.",
    SupervisorExitsAtStart = "supervisor-exits-at-start": "supervisor: fault injection, exit before reading the auth bundle.",
    NoReseedAtRestore = "no-reseed-at-restore": "supervisor: a VM restored from a snapshot is not reseeded (the saved VM still was), so its clones keep the RNG state and clock they were saved with.",
    SnapshotStreamCap = "snapshot-stream-cap": "supervisor: fault injection, a saved VM's migration stream may hold 1 MiB at most, so every save is refused as too large (as for a QEMU that sends more than its guest's memory).",
    NoAddressCheck = "no-address-check": "supervisor: egress dials every resolved address unchecked (loopback, private, metadata).",
    PassPlaceholders = "pass-placeholders": "supervisor: intercepted requests go out as the workload wrote them (no placeholder swapped or refused, nothing injected).",
    NoDownloadBudget = "no-download-budget": "supervisor: egress downloads are held by the guest's windows alone, with no budget for all of them together.",
    EgressIgnoresUpdates = "egress-ignores-updates": "supervisor: egress keeps deciding by the network rules approved at create; policy updates do not reach it.",
    WatchdogEofOnly = "watchdog-eof-only": "watchdog: silence does not kill, only EOF does.",
    WatchdogNeverReady = "watchdog-never-ready": "watchdog: fault injection, never send the ready byte.",
    JailerNoDeathSignal = "jailer-no-death-signal": "jailer: QEMU is not armed to die with the jailer (its parent-death SIGKILL dropped).",
    JailProcShowsAll = "jail-proc-shows-all": "vm-jailer: the /proc of a template clone's jail is mounted without hidepid=invisible and subset=pid, so QEMU sees every process of the host.",
    JailChrootSharedMounts = "jail-chroot-shared-mounts": "vm-jailer: in a chroot, the mounts are not made private before the chroot is bound onto itself, so the bind propagates to the chroot's host.",
    ShareNoDeathSignal = "share-no-death-signal": "jailer share: a file server's jailer is not armed to die with the supervisor.",
    ShareAllowsSetId = "share-allows-setid": "jailer share: a file server may set set-uid and set-gid bits (its set-id filter is not installed).",
}

impl TestControl {
    /// Parses one name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.name() == name)
    }

    /// The switches set in `value` (the contents of [`VAR`]); unknown names are ignored.
    pub fn list(value: &str) -> Vec<Self> {
        value.split(',').filter_map(|n| Self::parse(n.trim())).collect()
    }

    /// The switches set in this process's environment.
    pub fn active() -> Vec<Self> {
        std::env::var(VAR).map(|v| Self::list(&v)).unwrap_or_default()
    }

    /// Whether this switch is set in this process's environment.
    pub fn is_on(self) -> bool {
        Self::active().contains(&self)
    }
}

impl fmt::Display for TestControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Declares, in the calling crate, `control(TestControl) -> bool`: whether a switch is on. Only a build with
/// that crate's `test-controls` feature reads the switches; elsewhere it is `false` and the control's code is
/// dead. It also makes a release build with the feature fail to compile.
#[macro_export]
macro_rules! test_controls {
    () => {
        #[cfg(all(feature = "test-controls", not(debug_assertions)))]
        compile_error!("test controls switch safety mechanisms off: they are for debug test builds, never a release");

        /// Whether test control `c` is switched on: never in a release build (see `vm_contract::test_control`).
        #[allow(dead_code, reason = "not every binary of the crate reads a switch")]
        pub(crate) fn control(c: $crate::test_control::TestControl) -> bool {
            #[cfg(feature = "test-controls")]
            return c.is_on();
            #[cfg(not(feature = "test-controls"))]
            {
                let _ = c;
                false
            }
        }
    };
}

/// The line a binary built with test controls prints on stderr at every start.
pub fn announcement(binary: &str) -> String {
    let active: Vec<&str> = TestControl::active().iter().map(|c| c.name()).collect();
    format!(
        "{binary}: WARNING: built with test controls: safety mechanisms can be switched off through {VAR}; \
         never ship this build (active: {})",
        if active.is_empty() { "none".to_owned() } else { active.join(",") }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_distinct() {
        for c in TestControl::ALL {
            assert_eq!(TestControl::parse(c.name()), Some(*c));
        }
        let mut names: Vec<&str> = TestControl::ALL.iter().map(|c| c.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), TestControl::ALL.len());
        assert_eq!(
            TestControl::list("no-reaper, bogus,pulse-write-only"),
            [TestControl::NoReaper, TestControl::PulseWriteOnly]
        );
    }
}
