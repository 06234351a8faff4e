//! The event loop of a running sandbox, and how it stops.
//!
//! ```text
//! loop { stop requests | VMM exit | lease step | kill deadline  (in this order, always first)
//!        then, fairly: notices | guest | clients | telemetry tick }
//! ```
//!
//! Stop requests, the VMM's exit and the lease come first: no guest or client traffic, however much, can make
//! them wait (the queues they would wait behind are bounded and separate, `crate::inbox`).
//!
//! Three ways to stop:
//! - **Orderly** (SIGTERM, or a guest violation): refuse new processes, `Shutdown{grace}` to the agent (SIGTERM
//!   to the workload, SIGKILL after the grace, power off), forward the last output and `Exited` frames, wait for
//!   QEMU to exit; SIGKILL it after the grace plus `vm_contract::stop::POWER_OFF`.
//! - **Driver gone** (liveness EOF): nobody is left to hand the workload's output to and the VM holds its
//!   plaintext, so the VMM is killed at once; output still inside the guest is dropped.
//! - **Lease lost** (the watchdog stopped echoing or died): the supervisor cannot vouch for the VM any more
//!   and kills the VMM at once.

pub mod attach_server;
pub(crate) mod network;
pub mod session;
use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use vm_contract::args::SupervisorArgs;
use vm_contract::layout::SandboxFile;
use vm_ocsf::{FileActivity, Finding, ProcessActivity, ProcessInfo, Status};
use vm_protocol::attach::{SupervisorReply, SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};
use vm_protocol::files::FileOp;
use vm_protocol::link::{ToGuest, VmRequest};
use vm_protocol::policy::UpdateOutcome;

use self::attach_server::ClientHandle;
use crate::boot::lease::{Lease, LeaseFailure};
use crate::inbox::{FromClient, FromGuest, Inbox, Notice};
use crate::mux::{Action, ClientId, ClientViolation, GuestViolation, Mux};
use crate::stop::StopReason;
use crate::telemetry::spans::ExecOutcome;
use crate::telemetry::Telemetry;

/// How often the loop lets telemetry report what it had to drop.
const TICK: Duration = Duration::from_secs(1);

struct Serving<'a> {
    args: &'a SupervisorArgs,
    vmm: &'a mut crate::boot::vmm_process::VmmProcess,
    telemetry: &'a mut Telemetry,
    mux: Mux,
    guest: mpsc::Sender<ToGuest>,
    clients: HashMap<ClientId, ClientHandle>,
    /// Why we are stopping, and when QEMU gets SIGKILL if it has not exited.
    stopping: Option<(StopReason, Instant)>,
    /// The session with `vm-driver serve`, if any: ended as soon as stopping begins, which closes the
    /// readiness listener, so a stopping sandbox never looks ready.
    session: Option<tokio::task::AbortHandle>,
    /// This loop sent QEMU its SIGKILL: the watchdog, which exits with the VMM, may now close its pipe
    /// before QEMU is reaped.
    vmm_killed: bool,
    /// Network streams.
    net: network::Network,
}

/// The guest's side of the boundary: where admitted operations go, and the multiplexer (with the policy
/// approved at create) that admits them.
pub(crate) struct Boundary {
    /// The guest link's queue.
    pub(crate) guest: mpsc::Sender<ToGuest>,
    /// The routing state, with the policy gate.
    pub(crate) mux: Mux,
    /// How egress resolves, leaves and checks.
    pub(crate) egress: network::EgressSettings,
}

/// Runs the sandbox until the VMM has exited; returns why it stopped.
pub(crate) async fn serve(
    args: &SupervisorArgs,
    vmm: &mut crate::boot::vmm_process::VmmProcess,
    lease: &mut Lease,
    Boundary { guest, mux, egress }: Boundary,
    inbox: &mut Inbox,
    telemetry: &mut Telemetry,
    session: Option<tokio::task::AbortHandle>,
) -> StopReason {
    let (net, mut reports) = network::Network::new(egress, guest.clone(), mux.gate().network());
    // Waits for room in the guest's queue for the network backlog (a permit borrows its sender).
    let room = guest.clone();
    let mut state = Serving {
        args,
        vmm,
        telemetry,
        mux,
        guest,
        clients: HashMap::new(),
        stopping: None,
        session,
        vmm_killed: false,
        net,
    };
    // The boundary is attached and confirmed: the listeners may open.
    state.publish_network();
    let mut lease_ok = true;
    let mut tick = tokio::time::interval(TICK);
    let reason = loop {
        let kill_at = state.stopping.as_ref().map(|(_, at)| *at);
        let guest_paused = state.guest_paused_until();
        tokio::select! {
            biased;
            Ok(()) = inbox.stop.changed() => {
                let requests = *inbox.stop.borrow_and_update();
                if requests.driver_gone {
                    tracing::warn!("the driver is gone (liveness pipe closed); killing the VM");
                    state.finding(Finding::LivenessLost, "the parent-liveness pipe closed");
                    state.stop_now(StopReason::DriverGone);
                } else if requests.terminate {
                    state.stop(StopReason::Terminated);
                }
            }
            exit = state.vmm.wait() => {
                let status = exit.ok();
                for hit in crate::boot::vmm_limits::hits(&state.args.vmm_cgroups) {
                    state.finding(Finding::VmmLimit, hit.describe());
                }
                // The driver, which watches the VMM too, now gives this process the time to flush.
                crate::status::report(&vm_contract::status::SupervisorStatus::Stopping);
                state.end_session();
                let reason = match state.stopping.take() {
                    None | Some((StopReason::ChannelClosed, _)) => StopReason::VmmExited(status),
                    Some((reason, _)) => reason,
                };
                state.telemetry.spans().vmm_exited(&reason);
                break reason;
            }
            step = lease.step(), if lease_ok => {
                if let Err(e) = step {
                    lease_ok = false;
                    // The watchdog exits when the VMM does: after the VM is gone, or once this loop killed it
                    // (QEMU may not be reaped yet), that is the normal close, not a lost lease.
                    if state.vmm_killed || state.vmm.has_exited() {
                        continue;
                    }
                    tracing::error!(error = %e, "lease lost; stopping the VM");
                    let finding = if e == LeaseFailure::WatchdogKilling { Finding::WatchdogAction } else { Finding::LeaseLost };
                    state.finding(finding, &e.to_string());
                    state.stop_now(StopReason::LeaseLost(e));
                }
            }
            () = sleep_until_some(kill_at) => {
                tracing::warn!("the VM did not power off in time; killing the VMM");
                state.kill_vmm();
            }
            traffic = next_traffic(&mut inbox.notices, (&mut inbox.guest, guest_paused.is_none()), &mut inbox.clients, &mut reports, &mut tick) => {
                state.handle(traffic);
            }
            // The pause ends: the next turn reads the guest again.
            () = sleep_until_some(guest_paused) => {}
            Ok(permit) = room.reserve(), if state.net_waiting() => state.net_flush(permit),
        }
    };
    // Closing each client's queue lets its writer deliver what is queued (the last `Exited` frames), then end.
    let writers: Vec<_> = state.clients.into_values().map(|c| c.writer).collect();
    let drain = vm_contract::stop::VMM_EXIT;
    let _ = tokio::time::timeout(drain, futures_util::future::join_all(writers)).await;
    reason
}

/// What the loop handles after stop requests, the VMM and the lease.
enum Traffic {
    Notice(Notice),
    Guest(FromGuest),
    Client(FromClient),
    Net(crate::network::egress::Report),
    Tick,
}

/// The next notice, guest message or client traffic, or the telemetry tick: fair between them, so a
/// guest that floods its queue cannot starve the clients whose credit it waits for.
async fn next_traffic(
    notices: &mut mpsc::Receiver<Notice>,
    (guest, guest_open): (&mut mpsc::Receiver<FromGuest>, bool),
    clients: &mut mpsc::Receiver<FromClient>,
    reports: &mut mpsc::Receiver<crate::network::egress::Report>,
    tick: &mut tokio::time::Interval,
) -> Traffic {
    tokio::select! {
        Some(n) = notices.recv() => Traffic::Notice(n),
        Some(g) = guest.recv(), if guest_open => Traffic::Guest(g),
        Some(c) = clients.recv() => Traffic::Client(c),
        Some(r) = reports.recv() => Traffic::Net(r),
        _ = tick.tick() => Traffic::Tick,
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Serving<'_> {
    fn handle(&mut self, traffic: Traffic) {
        match traffic {
            Traffic::Notice(n) => self.notice(n),
            Traffic::Guest(g) => self.on_guest(g),
            Traffic::Client(c) => self.on_client(c),
            Traffic::Net(r) => self.net_report(r),
            Traffic::Tick => self.telemetry.tick(),
        }
    }

    fn on_guest(&mut self, from: FromGuest) {
        match from {
            // The permit returns its bytes to the guest's queue once the message is handled.
            FromGuest::Message(vm_protocol::link::ToHost::Net(msg), _permit) => self.net_from_guest(msg),
            FromGuest::Message(msg, _permit) => {
                let answer = crate::telemetry::spans::spawn_answer(&msg);
                match self.mux.from_guest(msg) {
                    Ok(actions) => {
                        if let Some((id, outcome)) = answer {
                            self.telemetry.spans().exec_answered(id, outcome);
                        }
                        self.apply(actions);
                    }
                    Err(violation) => self.guest_violation(violation),
                }
            }
            FromGuest::Closed(_) if self.stopping.is_some() => {}
            FromGuest::Closed(Some(error)) if error.violation().is_some() => {
                if let Some(violation) = error.violation() {
                    self.guest_violation(violation.into());
                }
            }
            FromGuest::Closed(_) => {
                // The agent never closes the channel first: the VM is broken or stopping on its own. If QEMU
                // exits meanwhile, its exit is reported as the cause.
                tracing::warn!("the guest channel closed unexpectedly; stopping the VM");
                self.stop(StopReason::ChannelClosed);
            }
        }
    }

    fn on_client(&mut self, from: FromClient) {
        match from {
            FromClient::Message(id, msg, _permit) => {
                if matches!(msg, ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(_))) {
                    self.telemetry.spans().policy_update_received();
                }
                match self.mux.from_client(id, msg) {
                    Ok(actions) => self.apply(actions),
                    Err(violation) => self.client_violation(id, &violation),
                }
            }
            FromClient::Connected(id, handle) => {
                self.mux.add_client(id);
                self.clients.insert(id, handle);
            }
            FromClient::Closed(id) => self.drop_client(id),
        }
    }

    fn notice(&mut self, notice: Notice) {
        match notice {
            Notice::AdmissionRefused(what) => self.finding(Finding::AdmissionRefused, what),
            Notice::SessionUp(readiness) => tracing::info!(readiness = %readiness, "session accepted; readiness open"),
            Notice::SessionDown => tracing::warn!("session with the driver lost; readiness closed; reconnecting"),
            Notice::LogCapped(log) => {
                let detail = format!("{log} reached its cap; the rest is dropped and counted");
                self.finding(Finding::LogCapped, &detail);
            }
            Notice::SessionRefused => {
                self.finding(Finding::AdmissionRefused, "the driver refused this supervisor's session");
                self.stop(StopReason::SessionRefused);
            }
        }
    }

    /// The guest broke the protocol: a finding, then the orderly stop.
    fn guest_violation(&mut self, violation: GuestViolation) {
        if self.stopping.is_some() {
            return;
        }
        tracing::error!(error = %violation, "protocol violation by the guest");
        self.finding(Finding::GuestProtocolViolation, &violation.to_string());
        self.stop(StopReason::GuestViolation(violation));
    }

    fn client_violation(&mut self, id: ClientId, violation: &ClientViolation) {
        tracing::warn!(error = %violation, "protocol violation by an attach client; disconnected");
        self.drop_client(id);
    }

    /// Begins the orderly stop once; later requests only keep the first reason.
    fn stop(&mut self, reason: StopReason) {
        if self.stopping.is_some() {
            return;
        }
        tracing::info!(reason = %reason, "stopping the sandbox");
        self.telemetry.spans().stop_decided();
        self.end_session();
        self.mux.stop_accepting();
        self.net_stop();
        let grace = self.args.stop_grace_ms;
        // A guest that does not read its channel cannot take the shutdown; the deadline covers it.
        let signal = self.mux.stop_signal();
        let _ = self.guest.try_send(VmRequest::Shutdown { grace_ms: grace, signal }.into());
        let kill_at = Instant::now() + Duration::from_millis(u64::from(grace)) + vm_contract::stop::POWER_OFF;
        self.stopping = Some((reason, kill_at));
    }

    /// Kills the VMM now. The reason wins over an orderly stop already under way.
    fn stop_now(&mut self, reason: StopReason) {
        self.telemetry.spans().stop_decided();
        self.end_session();
        self.mux.stop_accepting();
        self.stopping = Some((reason, Instant::now()));
        self.kill_vmm();
    }

    fn end_session(&mut self) {
        if let Some(session) = self.session.take() {
            session.abort();
        }
    }

    /// SIGKILLs QEMU. Its exit then arrives through `vmm.wait()`, so the kill deadline is spent: moving it
    /// out keeps the loop from waking (and killing, and logging) again and again until QEMU is reaped.
    fn kill_vmm(&mut self) {
        self.vmm.start_kill();
        self.vmm_killed = true;
        if let Some((_, at)) = self.stopping.as_mut() {
            *at = Instant::now() + Duration::from_secs(3600);
        }
    }

    /// Reports a finding. `detail` is fixed text plus ids.
    fn finding(&mut self, finding: Finding, detail: &str) {
        let event = self.telemetry.source().finding(finding, detail);
        self.telemetry.emit(event);
    }

    fn drop_client(&mut self, id: ClientId) {
        if let Some(client) = self.clients.remove(&id) {
            // Its writer ends once `tx` is gone; with the reader aborted too, the connection closes.
            client.reader.abort();
        }
        self.mux.remove_client(id);
        self.net_drop_client(id);
    }

    fn apply(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::ToGuest(msg) => {
                    let spawn = crate::telemetry::spans::dispatched_spawn(&msg);
                    if let Some(id) = spawn {
                        self.telemetry.spans().exec_dispatched(id);
                    }
                    if self.guest.try_send(msg).is_err() {
                        if let Some(id) = spawn {
                            self.telemetry.spans().exec_answered(id, ExecOutcome::NotDispatched);
                        }
                        // The guest is not taking what clients send it; what it does take is credit-bound, so
                        // this is a client flooding with signals or resizes.
                        tracing::warn!("the guest's queue is full; a client message was dropped");
                    }
                }
                Action::ToClient(id, msg) => self.send_to_client(id, msg),
                Action::Forward(client, msg) => self.net_from_client(client, msg),
                Action::Started { guest_id, pid, argv } => {
                    let info =
                        ProcessInfo::new(self.args.sandbox_id.as_str(), guest_id.0, i32::try_from(pid).ok(), &argv);
                    let event = self.telemetry.source().process(ProcessActivity::Launch, info, None);
                    self.telemetry.emit(event);
                }
                Action::Denied { op, revision, denial } => {
                    let detail = format!("{op} denied at policy revision {revision}: {}", denial.describe());
                    self.finding(Finding::PolicyDenied, &detail);
                }
                Action::TarRefused { path, reason } => {
                    let detail = format!("copy_out {path:?} refused by the host's extractor: {}", reason.describe());
                    self.finding(Finding::TarRefused, &detail);
                }
                Action::PolicyUpdated { revision, outcome, allowed } => {
                    self.publish_network();
                    self.telemetry.spans().policy_updated(revision, outcome);
                    let applied = outcome == UpdateOutcome::Applied;
                    self.api_call("UpdatePolicy", applied, &format!("revision {revision} {}", outcome.describe()));
                    let what = format!("policy revision {revision} {}; allowed: {allowed}", outcome.describe());
                    let event = self.telemetry.source().config_change(&what);
                    self.telemetry.emit(event);
                }
                Action::RotateCredentials(client, rotation) => {
                    let outcome = self.rotate(&rotation);
                    self.api_call("RotateCredentials", outcome == RotationOutcome::Applied, outcome.describe());
                    self.send_to_client(client, SupervisorReply::CredentialsAck { outcome }.into());
                }
                Action::FileDone { op, bytes, status } => {
                    let paths = op.paths();
                    let done =
                        if status == vm_protocol::ExitStatus::Code(0) { Status::Success } else { Status::Failure };
                    let event =
                        self.telemetry.source().file(file_activity(&op), paths[0], paths.get(1).copied(), bytes, done);
                    self.telemetry.emit(event);
                }
                Action::Exited { guest_id, pid, argv, status } => {
                    let pid = pid.and_then(|p| i32::try_from(p).ok());
                    let info = ProcessInfo::new(self.args.sandbox_id.as_str(), guest_id.0, pid, &argv);
                    let event =
                        self.telemetry.source().process(ProcessActivity::Terminate, info, Some(status.shell_code()));
                    self.telemetry.emit(event);
                }
            }
        }
    }

    /// A rotation: the collector's part and the credentials, each all or nothing; the credentials' names are
    /// checked before the collector's part is swapped, so an unknown name changes nothing.
    fn rotate(&mut self, rotation: &CredentialRotation) -> RotationOutcome {
        let secrets = rotation.secrets.as_deref();
        if secrets.is_some_and(|s| !self.secrets().holds(s)) {
            return RotationOutcome::UnknownSecret;
        }
        if rotation.headers.is_some() || rotation.ca_path.is_some() || secrets.is_none() {
            let outcome = self.telemetry.rotate(rotation);
            if outcome != RotationOutcome::Applied {
                return outcome;
            }
        }
        let Some(secrets) = secrets else { return RotationOutcome::Applied };
        let outcome = self.secrets().rotate(secrets);
        let names: Vec<&str> = secrets.iter().map(|c| c.name.as_str()).collect();
        let event =
            self.telemetry.source().config_change(&format!("credentials {}: {}", outcome.describe(), names.join(", ")));
        self.telemetry.emit(event);
        outcome
    }

    /// Records a control-plane call that came through the attach socket (API Activity); `outcome` is fixed text.
    fn api_call(&mut self, operation: &str, applied: bool, outcome: &str) {
        let status = if applied { Status::Success } else { Status::Failure };
        let event = self.telemetry.source().api_update(operation, SandboxFile::Attach.name(), status, outcome);
        self.telemetry.emit(event);
    }

    fn send_to_client(&mut self, id: ClientId, msg: ToClient) {
        let Some(client) = self.clients.get(&id) else { return };
        if client.tx.push(msg).is_err() {
            self.client_violation(id, &ClientViolation::NotReading);
        }
    }
}

/// The OCSF activity of a file operation.
fn file_activity(op: &FileOp) -> FileActivity {
    match op {
        FileOp::Read { .. } | FileOp::CopyOut { .. } => FileActivity::Read,
        FileOp::Write { .. } => FileActivity::Update,
        FileOp::List { .. } | FileOp::Stat { .. } => FileActivity::GetAttributes,
        FileOp::MakeDir { .. } | FileOp::CopyIn { .. } => FileActivity::Create,
        FileOp::Remove { .. } => FileActivity::Delete,
        FileOp::Rename { .. } => FileActivity::Rename,
    }
}
