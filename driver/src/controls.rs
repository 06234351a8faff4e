//! The test controls the driver's core takes as input: plain values, read once at the binary's edge
//! (`src/bin/vm-driver`, through `vm_contract::test_controls!`) and handed down. Every one is off by
//! default, and always in a build without the `test-controls` feature (`vm_contract::test_control`).

use vm_contract::test_control::TestControl;

/// Every control the driver knows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Controls {
    /// The sandbox lifecycle's.
    pub lifecycle: Lifecycle,
    /// The reaper's.
    pub reaper: Reaper,
    /// `serve`'s.
    pub service: Service,
    /// Copies in and out (`vm-driver cp`, `launch --copy-out`).
    pub files: Files,
}

/// Controls of copies ([`crate::files`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Files {
    /// `unchecked-extract`: the hardened extractor's path checks are off.
    pub unchecked_extract: bool,
}

/// Controls of the sandbox lifecycle ([`crate::sandbox`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lifecycle {
    /// `leak-liveness-write-end`: the supervisor inherits the liveness pipe's write end.
    pub leak_liveness_write_end: bool,
    /// `close-liveness-first`: a stop closes the liveness pipe before SIGTERM.
    pub close_liveness_first: bool,
    /// `descriptor-wrong-sandbox`: the launch descriptor names another sandbox.
    pub descriptor_wrong_sandbox: bool,
    /// `descriptor-wrong-session`: the launch descriptor names another session.
    pub descriptor_wrong_session: bool,
    /// `descriptor-wrong-generation`: the launch descriptor names another generation.
    pub descriptor_wrong_generation: bool,
    /// `pool-identity-at-boot`: a pooled VM gets the telemetry settings at spawn.
    pub pool_identity_at_boot: bool,
    /// `no-vmm-watch`: the VMM's exit is not watched.
    pub no_vmm_watch: bool,
}

/// Controls of what is cleaned up after a supervisor ([`crate::reap`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reaper {
    /// `no-reaper`: the orphan reaper does nothing.
    pub no_reaper: bool,
    /// `no-cgroup-sweep`: the cgroup sweep does nothing.
    pub no_cgroup_sweep: bool,
    /// `keep-credentials`: an ended generation keeps its unread auth bundle.
    pub keep_credentials: bool,
}

/// Controls of `vm-driver serve` ([`crate::service`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Service {
    /// `api-no-peer-check`: the API socket serves any peer.
    pub api_no_peer_check: bool,
    /// `api-socket-world-reachable`: the API socket and its directory are reachable by all users.
    pub api_socket_world_reachable: bool,
    /// `session-gate-signals`: SIGUSR1 drops every supervisor session and holds new ones, SIGUSR2 lets
    /// them in.
    pub session_gate_signals: bool,
    /// `exec-mux-head-of-line`: the shared attach connection's reader waits on each process's queue.
    pub exec_mux_head_of_line: bool,
}

impl Controls {
    /// The controls `on` says are switched on (the binary passes its `control`).
    pub fn from_switches(on: impl Fn(TestControl) -> bool) -> Self {
        Self {
            lifecycle: Lifecycle {
                leak_liveness_write_end: on(TestControl::LeakLivenessWriteEnd),
                close_liveness_first: on(TestControl::CloseLivenessFirst),
                descriptor_wrong_sandbox: on(TestControl::DescriptorWrongSandbox),
                descriptor_wrong_session: on(TestControl::DescriptorWrongSession),
                descriptor_wrong_generation: on(TestControl::DescriptorWrongGeneration),
                pool_identity_at_boot: on(TestControl::PoolIdentityAtBoot),
                no_vmm_watch: on(TestControl::NoVmmWatch),
            },
            reaper: Reaper {
                no_reaper: on(TestControl::NoReaper),
                no_cgroup_sweep: on(TestControl::NoCgroupSweep),
                keep_credentials: on(TestControl::KeepCredentials),
            },
            service: Service {
                api_no_peer_check: on(TestControl::ApiNoPeerCheck),
                api_socket_world_reachable: on(TestControl::ApiSocketWorldReachable),
                session_gate_signals: on(TestControl::SessionGateSignals),
                exec_mux_head_of_line: on(TestControl::ExecMuxHeadOfLine),
            },
            files: Files { unchecked_extract: on(TestControl::UncheckedExtract) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_switch_sets_only_its_own_value() {
        assert_eq!(Controls::from_switches(|_| false), Controls::default());
        let only = |c: TestControl| Controls::from_switches(move |x| x == c);
        assert!(only(TestControl::NoReaper).reaper.no_reaper);
        assert_eq!(only(TestControl::NoReaper).lifecycle, Lifecycle::default());
        assert!(only(TestControl::ExecMuxHeadOfLine).service.exec_mux_head_of_line);
        assert!(only(TestControl::NoVmmWatch).lifecycle.no_vmm_watch);
        assert!(!only(TestControl::PulseWriteOnly).reaper.no_reaper);
    }
}
