//! The event loop of a running sandbox, and how it stops. It only moves bytes: every message goes to the
//! boundary core (`crate::boundary`), which decides it; the loop carries out what it answers, and hands its
//! notes to the reporter (`crate::report`), which alone makes events of them.
//!
//! ```text
//! loop { stop requests | VMM exit | lease step | kill deadline  (in this order, always first)
//!        then, fairly: notices | guest | clients | telemetry tick }
//! ```
//!
//! The guest is read only while the boundary allows it and the telemetry keeps up: while the queue to the
//! audit chain is backlogged (a host whose disk is slower than the workload's events), its messages wait in
//! their bounded queue, and the guest with them, rather than have their events dropped.
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
mod guest_queue;
pub mod session;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use vm_contract::args::SupervisorArgs;

use self::attach_server::ClientHandle;
use self::guest_queue::GuestQueue;
use crate::boot::guest_link::Queued;
use crate::boot::lease::Lease;
use crate::boundary::{Boundary, ClientId, ClientViolation, GuestViolation, Input, Note, Outgoing};
use crate::inbox::{FromClient, FromGuest, Inbox, Notice};
use crate::network::egress::{self, EgressSettings, Report};
use crate::policy::NetView;
use crate::report::Reporter;
use crate::stop::StopReason;
use crate::telemetry::Telemetry;

/// How often the loop ticks: the boundary's rate limits and the reporter's summaries follow it.
const TICK: Duration = Duration::from_secs(1);

struct Serving<'a, 'r> {
    args: &'a SupervisorArgs,
    vmm: &'a mut crate::boot::vmm_process::VmmProcess,
    reporter: Reporter<'r>,
    boundary: Boundary,
    guest: GuestQueue,
    clients: HashMap<ClientId, ClientHandle>,
    /// What the egress tasks share, and the rules they follow.
    egress: Arc<egress::Context>,
    rules: watch::Sender<NetView>,
    /// Why we are stopping, and when QEMU gets SIGKILL if it has not exited.
    stopping: Option<(StopReason, Instant)>,
    /// The sessions with `vm-driver serve` and with an OpenShell gateway, if any: ended as soon as stopping
    /// begins, which closes the readiness listener and the gateway's session, so a stopping sandbox never
    /// looks ready.
    sessions: Vec<tokio::task::AbortHandle>,
    /// This loop sent QEMU its SIGKILL: the watchdog, which exits with the VMM, may now close its pipe
    /// before QEMU is reaped.
    vmm_killed: bool,
}

/// What a booted sandbox serves with: the guest link's queue, its boundary, and how its egress leaves.
pub(crate) struct Attached {
    /// The guest link's queue.
    pub(crate) guest: mpsc::Sender<Queued>,
    /// The boundary core, with the policy approved at create.
    pub(crate) boundary: Boundary,
    /// How egress resolves, leaves and checks.
    pub(crate) egress: EgressSettings,
}

/// Runs the sandbox until the VMM has exited; returns why it stopped.
pub(crate) async fn serve(
    args: &SupervisorArgs,
    vmm: &mut crate::boot::vmm_process::VmmProcess,
    lease: &mut Lease,
    Attached { guest, boundary, egress }: Attached,
    inbox: &mut Inbox,
    telemetry: &mut Telemetry,
    sessions: Vec<tokio::task::AbortHandle>,
) -> StopReason {
    // The rules are published at `Attached`, before any stream can open.
    let (egress, mut reports, rules) = egress::Context::new(egress, guest.clone(), NetView::default());
    // Waits for room in the guest's queue for the backlog (a permit borrows its sender).
    let room = guest.clone();
    let events = telemetry.backlog();
    let mut state = Serving {
        args,
        vmm,
        reporter: Reporter::new(telemetry, args.identity.sandbox_id.as_str(), std::time::Instant::now()),
        boundary,
        guest: GuestQueue::new(guest),
        clients: HashMap::new(),
        egress,
        rules,
        stopping: None,
        sessions,
        vmm_killed: false,
    };
    // The boundary is attached and confirmed: the listeners may open.
    state.input(Input::Attached);
    let mut lease_ok = true;
    let mut tick = tokio::time::interval(TICK);
    let reason = loop {
        let kill_at = state.stopping.as_ref().map(|(_, at)| *at);
        let backlogged = events.backlogged();
        let reading_guest = state.boundary.reading_guest() && !backlogged;
        tokio::select! {
            biased;
            Ok(()) = inbox.stop.changed() => {
                let requests = *inbox.stop.borrow_and_update();
                if requests.driver_gone {
                    state.note(Note::DriverGone);
                    state.stop_now(StopReason::DriverGone);
                } else if requests.terminate {
                    state.stop(StopReason::Terminated);
                }
            }
            exit = state.vmm.wait() => {
                let status = exit.ok();
                for hit in crate::boot::vmm_limits::hits(&state.args.vm.vmm_cgroups) {
                    state.note(Note::VmmLimit(hit.describe()));
                }
                // The driver, which watches the VMM too, now gives this process the time to flush.
                crate::status::report(&vm_contract::status::SupervisorStatus::Stopping);
                state.end_session();
                let reason = match state.stopping.take() {
                    None | Some((StopReason::ChannelClosed, _)) => StopReason::VmmExited(status),
                    Some((reason, _)) => reason,
                };
                state.note(Note::VmmExited(reason.clone()));
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
                    state.note(Note::LeaseLost(e));
                    state.stop_now(StopReason::LeaseLost(e));
                }
            }
            () = sleep_until_some(kill_at) => {
                tracing::warn!("the VM did not power off in time; killing the VMM");
                state.kill_vmm();
            }
            traffic = next_traffic(&mut inbox.notices, (&mut inbox.guest, reading_guest), &mut inbox.clients, &mut reports, &mut tick) => {
                state.handle(traffic);
            }
            Ok(permit) = room.reserve(), if state.guest.waiting() => state.guest.flush(permit),
            // Wakes the loop to read the guest again; `backlogged` is checked anew each time round.
            () = events.drained(), if backlogged => {}
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
    Egress(Report),
    Tick,
}

/// The next notice, guest message or client traffic, or the tick: fair between them, so a guest that floods
/// its queue cannot starve the clients whose credit it waits for.
async fn next_traffic(
    notices: &mut mpsc::Receiver<Notice>,
    (guest, guest_open): (&mut mpsc::Receiver<FromGuest>, bool),
    clients: &mut mpsc::Receiver<FromClient>,
    reports: &mut mpsc::Receiver<Report>,
    tick: &mut tokio::time::Interval,
) -> Traffic {
    tokio::select! {
        Some(n) = notices.recv() => Traffic::Notice(n),
        Some(g) = guest.recv(), if guest_open => Traffic::Guest(g),
        Some(c) = clients.recv() => Traffic::Client(c),
        Some(r) = reports.recv() => Traffic::Egress(r),
        _ = tick.tick() => Traffic::Tick,
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Serving<'_, '_> {
    fn handle(&mut self, traffic: Traffic) {
        match traffic {
            Traffic::Notice(n) => self.notice(n),
            // The permit returns its bytes to the guest's queue once the message is handled.
            Traffic::Guest(FromGuest::Message(msg, _permit)) => self.input(Input::Guest(msg)),
            Traffic::Guest(FromGuest::Closed(_)) if self.stopping.is_some() => {}
            Traffic::Guest(FromGuest::Closed(Some(error))) if error.violation().is_some() => {
                if let Some(violation) = error.violation() {
                    self.guest_violation(violation.into());
                }
            }
            Traffic::Guest(FromGuest::Closed(_)) => {
                // The agent never closes the channel first: the VM is broken or stopping on its own. If QEMU
                // exits meanwhile, its exit is reported as the cause.
                tracing::warn!("the guest channel closed unexpectedly; stopping the VM");
                self.stop(StopReason::ChannelClosed);
            }
            Traffic::Client(FromClient::Message(id, msg, _permit)) => self.input(Input::Client(id, msg)),
            Traffic::Client(FromClient::Connected(id, handle)) => {
                self.clients.insert(id, handle);
                self.input(Input::Connected(id));
            }
            Traffic::Client(FromClient::Closed(id)) => {
                self.close_client(id);
                self.input(Input::ClientGone(id));
            }
            Traffic::Egress(report) => self.input(Input::Egress(report)),
            Traffic::Tick => {
                self.input(Input::Tick);
                self.reporter.tick(std::time::Instant::now());
            }
        }
    }

    /// Hands `first` to the boundary and carries out what it answers (which may hand it more: a client that
    /// stopped reading, a rotation's collector part).
    fn input(&mut self, first: Input) {
        let mut inputs = VecDeque::from([first]);
        while let Some(input) = inputs.pop_front() {
            let now = std::time::Instant::now();
            let out = self.boundary.handle(input, now);
            self.reporter.notes(out.notes, now);
            for send in out.sends {
                match send {
                    Outgoing::ToGuest(msg) => {
                        if let Some(dropped) = self.guest.push(msg) {
                            self.reporter.undelivered(&dropped, now);
                        }
                    }
                    Outgoing::ToGuestFirst(msg) => self.guest.push_first(msg),
                    Outgoing::ToClient(id, msg) => {
                        let Some(client) = self.clients.get(&id) else { continue };
                        if client.tx.push(msg).is_err() {
                            self.note(Note::ClientViolation(id, ClientViolation::NotReading));
                            self.close_client(id);
                            inputs.push_back(Input::ClientGone(id));
                        }
                    }
                    Outgoing::Disconnect(id) => self.close_client(id),
                    Outgoing::StartEgress(id, listener, pipe) => {
                        tokio::spawn(egress::run(Arc::clone(&self.egress), id, listener, pipe));
                    }
                    Outgoing::PublishRules(view) => {
                        self.rules.send_replace(view);
                    }
                    Outgoing::RotateCollector(client, rotation) => {
                        let outcome = self.reporter.rotate_collector(&rotation);
                        inputs.push_back(Input::CollectorRotated { client, rotation, outcome });
                    }
                }
            }
            if let Some(violation) = out.violation {
                self.guest_violation(violation);
            }
        }
    }

    fn note(&mut self, note: Note) {
        self.reporter.note(note, std::time::Instant::now());
    }

    fn notice(&mut self, notice: Notice) {
        match notice {
            Notice::AdmissionRefused(what) => self.note(Note::AdmissionRefused(what)),
            Notice::SessionUp(readiness) => tracing::info!(readiness = %readiness, "session accepted; readiness open"),
            Notice::SessionDown => tracing::warn!("session with the driver lost; readiness closed; reconnecting"),
            Notice::LogCapped(log) => self.note(Note::LogCapped(log)),
            Notice::Gateway(event) => self.note(Note::Gateway(event)),
            Notice::SessionRefused => {
                self.note(Note::SessionRefused);
                self.stop(StopReason::SessionRefused);
            }
        }
    }

    /// The guest broke the protocol: a finding, then the orderly stop.
    fn guest_violation(&mut self, violation: GuestViolation) {
        if self.stopping.is_some() {
            return;
        }
        self.note(Note::GuestViolation(violation.clone()));
        self.stop(StopReason::GuestViolation(violation));
    }

    /// Begins the orderly stop once; later requests only keep the first reason.
    fn stop(&mut self, reason: StopReason) {
        if self.stopping.is_some() {
            return;
        }
        tracing::info!(reason = %reason, "stopping the sandbox");
        let grace = Duration::from_millis(u64::from(self.args.vm.stop_grace_ms));
        self.stopping = Some((reason, Instant::now() + grace + vm_contract::stop::POWER_OFF));
        self.note(Note::StopDecided);
        self.end_session();
        self.input(Input::Stop);
    }

    /// Kills the VMM now. The reason wins over an orderly stop already under way.
    fn stop_now(&mut self, reason: StopReason) {
        self.stopping = Some((reason, Instant::now()));
        self.note(Note::StopDecided);
        self.end_session();
        self.input(Input::Stop);
        self.kill_vmm();
    }

    fn end_session(&mut self) {
        for session in self.sessions.drain(..) {
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

    /// Ends a client's connection: its writer ends once `tx` is gone; with the reader aborted too, the
    /// connection closes.
    fn close_client(&mut self, id: ClientId) {
        if let Some(client) = self.clients.remove(&id) {
            client.reader.abort();
        }
    }
}
