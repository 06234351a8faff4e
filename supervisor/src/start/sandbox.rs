//! An admitted sandbox: its telemetry under its own identity from admission to the final report, and its
//! serving, from ready to stop, with the lifecycle events around it.

use std::path::PathBuf;

use vm_contract::args::SupervisorArgs;
use vm_contract::jail::Confinement;
use vm_contract::status::SupervisorStatus;
use vm_ocsf::{AppInfo, Finding, Lifecycle, Status};

use super::admission::Admitted;
use crate::boot::{BootError, Booted};
use crate::boundary::{Boundary, BoundaryConfig, Rules};
use crate::diagnostics::chain;
use crate::inbox::{Inbox, Senders};
use crate::network::egress::EgressSettings;
use crate::network::resolve::Resolver;
use crate::network::upstream::Upstream;
use crate::safeguards::Safeguards;
use crate::status;
use crate::stop::StopReason;
use crate::telemetry::console::Console;
use crate::telemetry::Telemetry;

/// The sandbox as the lifecycle events name it.
pub(crate) fn app() -> AppInfo {
    AppInfo { name: "sandbox".into(), version: env!("CARGO_PKG_VERSION").into() }
}

/// An admitted sandbox's telemetry, and the console it ends at its flush.
pub(crate) struct Sandbox {
    telemetry: Telemetry,
    console: Console,
    /// The VMM's cgroups, whose limits explain a VMM that exited.
    vmm_cgroups: Vec<PathBuf>,
}

impl Sandbox {
    /// Takes over the sandbox's sinks and says how its VMM is confined (`none` loudly), and, in a build with
    /// test controls, that it has them.
    pub(crate) fn open(telemetry: Telemetry, console: Console, args: &SupervisorArgs) -> Self {
        let mut sandbox = Self { telemetry, console, vmm_cgroups: args.vm.vmm_cgroups.clone() };
        #[cfg(feature = "test-controls")]
        sandbox.config_change(&vm_contract::test_control::announcement("vm-supervisor"));
        let confinement = match args.vm.confinement {
            Confinement::None => {
                "VMM confinement: none (UNCONFINED: no jail, no separate uid, no namespaces)".to_owned()
            }
            mode => format!("VMM confinement: {mode}"),
        };
        sandbox.config_change(&confinement);
        sandbox
    }

    pub(crate) fn telemetry(&mut self) -> &mut Telemetry {
        &mut self.telemetry
    }

    /// A configuration event.
    pub(crate) fn config_change(&mut self, what: &str) {
        let event = self.telemetry.source().config_change(what);
        self.telemetry.emit(event);
    }

    fn finding(&mut self, finding: Finding, detail: &str) {
        let event = self.telemetry.source().finding(finding, detail);
        self.telemetry.emit(event);
    }

    fn lifecycle(&mut self, activity: Lifecycle, app: &AppInfo, status: Status, detail: Option<String>) {
        let event = self.telemetry.source().lifecycle(activity, app, status, detail);
        self.telemetry.emit(event);
    }

    /// Reports a failed boot: its findings (the VMM's limits, a bad handshake) and the failed start. Returns
    /// what the status line adds after the logs: the limits the VMM hit.
    pub(crate) fn boot_failed(&mut self, e: &BootError) -> String {
        self.telemetry.spans().boot_ended(false);
        let mut notes = String::new();
        if matches!(e, BootError::VmmExitedDuringBoot { .. }) {
            for hit in crate::boot::vmm_limits::hits(&self.vmm_cgroups) {
                notes.push_str(&format!("; {}", hit.describe()));
                self.finding(Finding::VmmLimit, hit.describe());
            }
        }
        if e.is_bad_handshake() {
            self.finding(Finding::GuestProtocolViolation, "the guest agent's handshake failed");
        }
        self.lifecycle(Lifecycle::Start, &app(), Status::Failure, Some(chain(e)));
        notes
    }

    /// Flushes the sinks within `budget`, ends the console, and reports the final counts.
    pub(crate) async fn end(self, budget: std::time::Duration) {
        let report = self.telemetry.shutdown(budget, self.console).await;
        status::report(&SupervisorStatus::Stopped {
            events: report.events,
            otlp_exported: report.otlp.exported,
            otlp_dropped: report.otlp.dropped,
            limited: report.limited,
            jsonl_dropped: report.jsonl.dropped,
            console_dropped: report.console_dropped,
            audit: report.audit,
        });
    }
}

impl Admitted {
    /// Serves the sandbox on `booted` until it stops, then ends the VM and the sinks; returns why it stopped.
    pub(crate) async fn serve(
        self,
        args: &SupervisorArgs,
        safeguards: &Safeguards,
        booted: Booted,
        senders: Senders,
        mut inbox: Inbox,
    ) -> StopReason {
        let Self { mut sandbox, session, policy, root, egress, gateway, origin } = self;
        let Booted { mut vm, link, attach, .. } = booted;
        sandbox.telemetry.spans().boot_ended(true);
        let microvm = AppInfo { name: "microvm".into(), version: link.hello.software_label() };
        let apps = [microvm, app()];
        let connector = crate::serve::attach_server::serve(attach, link.hello.capabilities, senders.clone());
        // The VM's start says where it came from (booted, a pool's, a template's).
        sandbox.lifecycle(Lifecycle::Start, &apps[0], Status::Success, Some(format!("origin: {}", origin.as_str())));
        sandbox.lifecycle(Lifecycle::Start, &apps[1], Status::Success, None);
        let agent = apps[0].version.clone();
        status::report(&SupervisorStatus::Ready { vmm_pid: vm.vmm_record.pid.unsigned_abs(), agent });
        tracing::info!(sandbox = %args.identity.sandbox_id, agent = %apps[0].version, "sandbox ready");
        let mut sessions: Vec<_> = session
            .map(|s| tokio::spawn(crate::serve::session::run(s, senders.clone())).abort_handle())
            .into_iter()
            .collect();
        if let Some(gateway) = gateway {
            sessions.push(gateway.start(args.identity.sandbox_id.to_string(), connector, senders.clone()));
        }
        let config = BoundaryConfig {
            policy,
            run: root.map(|r| r.run).unwrap_or_default(),
            secrets: egress.secrets.clone(),
            trust: egress.intercept.as_ref().map(|i| i.ca.pem().to_owned()),
            stop_grace_ms: args.vm.stop_grace_ms,
            rules: Rules {
                guest_invariants: safeguards.guest_invariants,
                serialized_policy: safeguards.serialized_policy,
                egress_follows_updates: safeguards.egress_updates,
            },
        };
        let egress = EgressSettings {
            resolver: args.vm.egress_resolver.map_or(Resolver::System, Resolver::Dns),
            upstream: args
                .vm
                .egress_proxy
                .clone()
                .map(|address| Upstream { address, authorization: egress.proxy_authorization }),
            check_addresses: safeguards.address_check,
            download_budget: safeguards.download_budget,
            secrets: egress.secrets,
            intercept: egress.intercept,
        };
        let boundary = Boundary::new(config, std::time::Instant::now());
        let attached = crate::serve::Attached { guest: link.tx, boundary, egress };
        let telemetry = &mut sandbox.telemetry;
        let reason =
            crate::serve::serve(args, &mut vm.vmm, &mut vm.lease, attached, &mut inbox, telemetry, sessions).await;
        let logs = vm.logs.clone();
        if vm.shut_down().await.is_none() {
            tracing::warn!("the lease watchdog did not exit after the VM stopped; killed it");
        }
        let (console, vmm_log) = (logs.console.get(), logs.vmm.get());
        if console > 0 || vmm_log > 0 {
            tracing::warn!(console_bytes = console, vmm_bytes = vmm_log, "guest logs dropped bytes past their caps");
        }
        let (status, detail) = match &reason {
            StopReason::Terminated => (Status::Success, None),
            other => (Status::Failure, Some(other.to_string())),
        };
        for app in &apps {
            sandbox.lifecycle(Lifecycle::Stop, app, status, detail.clone());
        }
        sandbox.end(reason.flush_budget()).await;
        reason
    }
}
