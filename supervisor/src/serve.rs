//! The event loop of a running sandbox, and how it stops.
//!
//! ```text
//! loop { VMM exit | kill deadline | lease step | event (guest, client, signal, liveness) }
//! ```
//!
//! Three ways to stop:
//! - **Orderly** (SIGTERM, or a guest violation): refuse new processes, `Shutdown{grace}` to the agent
//!   (SIGTERM to the workload, SIGKILL after the grace, power off), forward the last output and `Exited`
//!   frames, wait for QEMU to exit (SIGKILL after grace + [`STOP_MARGIN_MS`]).
//! - **Driver gone** (liveness EOF): nobody is left to hand the workload's output to and the VM holds its
//!   plaintext, so the VMM is killed at once; output still inside the guest is dropped.
//! - **Lease lost** (the watchdog stopped echoing or died): the supervisor cannot vouch for the VM any more
//!   and kills the VMM at once.

use std::collections::HashMap;
use std::time::Duration;

use tokio::process::Child;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio::time::Instant;
use vm_protocol::ToGuest;

use vm_contract::args::SupervisorArgs;
use vm_ocsf::{Finding, ProcessActivity, ProcessInfo};

use crate::attach_server::ClientHandle;
use crate::lease::{Lease, LeaseFailure};
use crate::mux::{Action, ClientId, GuestViolation, Mux};
use crate::stop::StopReason;
use crate::telemetry::Telemetry;
use crate::Event;

/// After the agent's grace period, how long QEMU gets to exit on its own before SIGKILL.
const STOP_MARGIN_MS: u64 = 5_000;

/// How long client writers get to deliver their last frames after the VM is gone.
const CLIENT_DRAIN_MS: u64 = 2_000;

struct Serving<'a> {
    args: &'a SupervisorArgs,
    vmm: &'a mut Child,
    telemetry: &'a mut Telemetry,
    mux: Mux,
    guest: UnboundedSender<ToGuest>,
    clients: HashMap<ClientId, ClientHandle>,
    /// Why we are stopping, and when QEMU gets SIGKILL if it has not exited.
    stopping: Option<(StopReason, Instant)>,
    /// The session with `vm-driver serve`, if any: ended as soon as stopping begins, which closes the
    /// readiness listener, so a stopping sandbox never looks ready.
    session: Option<tokio::task::AbortHandle>,
}

/// Runs the sandbox until the VMM has exited; returns why it stopped.
pub(crate) async fn serve(
    args: &SupervisorArgs,
    vmm: &mut Child,
    lease: &mut Lease,
    guest: UnboundedSender<ToGuest>,
    rx: &mut UnboundedReceiver<Event>,
    telemetry: &mut Telemetry,
    session: Option<tokio::task::AbortHandle>,
) -> StopReason {
    let mut state =
        Serving { args, vmm, telemetry, mux: Mux::default(), guest, clients: HashMap::new(), stopping: None, session };
    let mut lease_ok = true;
    let reason = loop {
        let kill_at = state.stopping.as_ref().map(|(_, at)| *at);
        tokio::select! {
            exit = state.vmm.wait() => {
                let status = exit.ok();
                state.end_session();
                break match state.stopping.take() {
                    None | Some((StopReason::ChannelClosed, _)) => StopReason::VmmExited(status),
                    Some((reason, _)) => reason,
                };
            }
            () = sleep_until_some(kill_at) => {
                tracing::warn!("the VM did not power off in time; killing the VMM");
                state.kill_vmm();
            }
            step = lease.step(), if lease_ok => {
                if let Err(e) = step {
                    lease_ok = false;
                    // The watchdog exits when the VMM does: after the VM is gone that is the normal close.
                    if matches!(state.vmm.try_wait(), Ok(Some(_))) {
                        continue;
                    }
                    tracing::error!(error = %e, "lease lost; stopping the VM");
                    let finding = if e == LeaseFailure::WatchdogKilling { Finding::WatchdogAction } else { Finding::LeaseLost };
                    state.finding(finding, &e.to_string());
                    state.stop_now(StopReason::LeaseLost(e));
                }
            }
            event = rx.recv() => state.handle(event),
        }
    };
    // Closing each client's queue lets its writer deliver what is queued (the last `Exited` frames), then end.
    let writers: Vec<_> = state.clients.into_values().map(|c| c.writer).collect();
    let _ = tokio::time::timeout(Duration::from_millis(CLIENT_DRAIN_MS), futures_util::future::join_all(writers)).await;
    reason
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Serving<'_> {
    fn handle(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Guest(msg)) => match self.mux.from_guest(msg) {
                Ok(actions) => self.apply(actions),
                Err(violation) => self.guest_violation(violation),
            },
            Some(Event::Client(id, msg)) => match self.mux.from_client(id, msg) {
                Ok(actions) => self.apply(actions),
                Err(violation) => {
                    tracing::warn!(error = %violation, "protocol violation by an attach client; disconnected");
                    self.drop_client(id);
                }
            },
            Some(Event::ClientConnected(id, handle)) => {
                self.mux.add_client(id);
                self.clients.insert(id, handle);
            }
            Some(Event::ClientClosed(id)) => self.drop_client(id),
            Some(Event::GuestClosed(_)) if self.stopping.is_some() => {}
            Some(Event::GuestClosed(Some(error))) if error.violation().is_some() => {
                if let Some(violation) = error.violation() {
                    self.guest_violation(violation.into());
                }
            }
            Some(Event::GuestClosed(_)) => {
                // The agent never closes the channel first: the VM is broken or stopping on its own. If QEMU
                // exits meanwhile, its exit is reported as the cause.
                tracing::warn!("the guest channel closed unexpectedly; stopping the VM");
                self.stop(StopReason::ChannelClosed);
            }
            Some(Event::AdmissionRefused(what)) => self.finding(Finding::AdmissionRefused, what),
            Some(Event::SessionUp(readiness)) => {
                tracing::info!(readiness = %readiness, "session accepted; readiness open")
            }
            Some(Event::SessionDown) => tracing::warn!("session with the driver lost; readiness closed; reconnecting"),
            Some(Event::SessionRefused) => {
                self.finding(Finding::AdmissionRefused, "the driver refused this supervisor's session");
                self.stop(StopReason::SessionRefused);
            }
            Some(Event::Terminate) => self.stop(StopReason::Terminated),
            Some(Event::DriverGone) => {
                tracing::warn!("the driver is gone (liveness pipe closed); killing the VM");
                self.finding(Finding::LivenessLost, "the parent-liveness pipe closed");
                self.stop_now(StopReason::DriverGone);
            }
            // Senders live as long as the loop; unreachable, but never spin on a closed queue.
            None => self.stop_now(StopReason::DriverGone),
        }
    }

    /// The guest broke the protocol: a finding, then the orderly stop.
    fn guest_violation(&mut self, violation: GuestViolation) {
        tracing::error!(error = %violation, "protocol violation by the guest");
        self.finding(Finding::GuestProtocolViolation, &violation.to_string());
        self.stop(StopReason::GuestViolation(violation));
    }

    /// Begins the orderly stop once; later requests only keep the first reason.
    fn stop(&mut self, reason: StopReason) {
        if self.stopping.is_some() {
            return;
        }
        tracing::info!(?reason, "stopping the sandbox");
        self.end_session();
        self.mux.stop_accepting();
        let grace = self.args.stop_grace_ms;
        let _ = self.guest.send(ToGuest::Shutdown { grace_ms: grace });
        let kill_at = Instant::now() + Duration::from_millis(u64::from(grace) + STOP_MARGIN_MS);
        self.stopping = Some((reason, kill_at));
    }

    /// Kills the VMM now. The reason wins over an orderly stop already under way.
    fn stop_now(&mut self, reason: StopReason) {
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
        let _ = self.vmm.start_kill();
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
        let actions = self.mux.remove_client(id);
        self.apply(actions);
    }

    fn apply(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::ToGuest(msg) => {
                    let _ = self.guest.send(msg);
                }
                Action::ToClient(id, msg) => {
                    if let Some(client) = self.clients.get(&id) {
                        let _ = client.tx.send(msg);
                    }
                }
                Action::Started { guest_id, pid, argv } => {
                    let info =
                        ProcessInfo::new(self.args.sandbox_id.as_str(), guest_id.0, i32::try_from(pid).ok(), &argv);
                    let event = self.telemetry.source().process(ProcessActivity::Launch, info, None);
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
}
