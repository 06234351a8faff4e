//! The boundary core: the one place that decides every message of a running sandbox, with no I/O.
//!
//! ```text
//! Input: client | guest | egress report | collector rotated | stop | tick          (with the time)
//!   client  --> prepare (image defaults, network variables) --> policy gate (admit) --+
//!   guest   ------------------------------------------------------------------------+
//!               --> process router  (spawns, stdio, credit, exits, re-attach)       |
//!               --> stream router   (egress and port forwards, credit, tombstones)  |
//!               --> control         (pings, policy updates, credential rotations)   |
//! Output: what to send (to the guest, a client, an egress task) + notes (for the reporter)
//!         + the guest's violation, if it broke the protocol (the sandbox stops)
//! ```
//!
//! The event loop (`crate::serve`) only moves bytes: it hands every message here and carries out the
//! [`Output`]; the reporter (`crate::report`) turns the [`Note`]s into OCSF events. Time comes in with each
//! input, so the core runs in tests without a VM or a clock ([`tests`], and `tests/boundary_props.rs`).
//!
//! The core bounds what the guest can make the host do: each process and stream is held to its windows by its
//! router, and refused egress connections take tokens from one bucket ([`REFUSALS_PER_SEC`]); when it is
//! empty the loop stops reading the guest's link until a tick finds tokens again, which passes the cost of a
//! guest that opens streams without end back to its own vCPU.

mod admit;
mod control;
pub mod note;
pub mod prepare;
pub mod process;
pub mod stream;
#[cfg(test)]
mod tests;
pub mod violation;

use std::sync::Arc;
use std::time::Instant;

use vm_contract::root::RunConfig;
use vm_protocol::attach::{SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};
use vm_protocol::link::{ToGuest, ToHost, VmRequest};
use vm_protocol::net::{Listener, StreamId};
use vm_protocol::policy::{PolicyUpdate, SandboxPolicy};

pub use self::note::Note;
use self::prepare::Prepare;
use self::process::{Action, ProcessRouter};
use self::stream::{Out, StreamRouter};
pub use self::violation::{ClientViolation, GuestViolation};
use crate::bucket::TokenBucket;
use crate::network::egress::Report;
use crate::network::intercept::secrets::Secrets;
use crate::network::pipe::{End, Pipe};
use crate::policy::{Gate, NetView};
use crate::telemetry::spans::{dispatched_spawn, spawn_answer};

/// Refused egress connections a second, sustained and in a burst, before the loop stops reading the guest's
/// link until the next tick that finds a token. Refusing costs the host CPU, and a guest can open streams as
/// fast as its vCPU runs. A workload that retries at its connection cap is slowed, never stopped.
pub const REFUSALS_PER_SEC: u32 = 512;

/// One attach connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientId(pub u64);

/// The rules the core enforces; each is on but in a causal test's control ([`crate::safeguards`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// The guest's messages are checked, not only routed (off: `no-guest-invariants`).
    pub guest_invariants: bool,
    /// A policy update is applied in order with dispatch before it is acknowledged (off: `unserialized-policy`).
    pub serialized_policy: bool,
    /// Egress follows policy updates (off: `egress-ignores-updates`: the rules approved at create stay).
    pub egress_follows_updates: bool,
}

impl Default for Rules {
    fn default() -> Self {
        Self { guest_invariants: true, serialized_policy: true, egress_follows_updates: true }
    }
}

/// What a sandbox's boundary starts with.
#[derive(Debug, Default)]
pub struct BoundaryConfig {
    /// The policy approved at create.
    pub policy: SandboxPolicy,
    /// How the image root asks processes be run (nothing for the built-in root).
    pub run: RunConfig,
    /// The sandbox's credentials (their placeholders go to every process; rotations swap them).
    pub secrets: Secrets,
    /// The sandbox CA's certificate (PEM), when the supervisor intercepts TLS: the guest trusts it before
    /// its listeners open.
    pub trust: Option<String>,
    /// On stop: time between SIGTERM and SIGKILL for workload processes.
    pub stop_grace_ms: u32,
    /// The rules, all on but in a control.
    pub rules: Rules,
}

/// One input of the core.
#[derive(Debug)]
pub enum Input {
    /// The boundary is attached and confirmed: the guest may open its listeners.
    Attached,
    /// An attach client finished its handshake.
    Connected(ClientId),
    /// A client's message.
    Client(ClientId, ToSupervisor),
    /// A client went away (or stopped reading its frames).
    ClientGone(ClientId),
    /// A guest message.
    Guest(ToHost),
    /// An egress task's report.
    Egress(Report),
    /// The collector's part of a rotation ([`Outgoing::RotateCollector`]) ended with `outcome`.
    CollectorRotated {
        /// Who asked.
        client: ClientId,
        /// What it asked.
        rotation: CredentialRotation,
        /// What became of the collector's part.
        outcome: RotationOutcome,
    },
    /// The sandbox stops: nothing new opens; the guest is asked to shut down.
    Stop,
    /// About once a second.
    Tick,
}

/// What the caller does next, in order.
#[derive(Debug)]
pub enum Outgoing {
    /// Send to the guest, in order behind whatever waits for room.
    ToGuest(ToGuest),
    /// Send to the guest ahead of whatever waits (the shutdown; if there is no room, the stop deadline covers it).
    ToGuestFirst(ToGuest),
    /// Send to a client.
    ToClient(ClientId, ToClient),
    /// Close a client's connection (it broke the protocol; its state here is gone already).
    Disconnect(ClientId),
    /// Start the egress task of a stream the guest opened.
    StartEgress(StreamId, Listener, Arc<Pipe>),
    /// The network rules egress follows from now on.
    PublishRules(NetView),
    /// Swap the collector's credentials for the rotation's, then hand back the outcome
    /// ([`Input::CollectorRotated`]).
    RotateCollector(ClientId, CredentialRotation),
}

/// The core's answer to one input.
#[derive(Debug, Default)]
#[must_use = "an output carries sends and notes the caller must carry out"]
pub struct Output {
    /// What to send, in order.
    pub sends: Vec<Outgoing>,
    /// What the record must say.
    pub notes: Vec<Note>,
    /// The guest broke the protocol: the sandbox stops in order.
    pub violation: Option<GuestViolation>,
}

/// The boundary of one running sandbox.
#[derive(Debug)]
pub struct Boundary {
    rules: Rules,
    /// What clients may do.
    gate: Gate,
    /// `unserialized-policy` control only: an update acknowledged but not yet applied.
    late_update: Option<PolicyUpdate>,
    prepare: Prepare,
    processes: ProcessRouter,
    streams: StreamRouter,
    secrets: Secrets,
    /// The rules egress follows, as last published.
    published: NetView,
    /// Whether the agent was told to listen.
    listening: bool,
    /// The sandbox CA's certificate, until the agent was told to trust it.
    trust: Option<String>,
    refusals: TokenBucket,
    reading_guest: bool,
    stopping: bool,
    stop_grace_ms: u32,
}

impl Boundary {
    /// The boundary of a sandbox started with `config`, at `now`.
    pub fn new(config: BoundaryConfig, now: Instant) -> Self {
        let egress_env = prepare::egress_env(&config.secrets, config.trust.is_some());
        let gate = Gate::new(config.policy, vm_protocol::identity::WORKLOAD);
        Self {
            rules: config.rules,
            published: gate.network(),
            gate,
            late_update: None,
            prepare: Prepare { run: config.run, egress_env },
            processes: ProcessRouter::new(config.rules.guest_invariants),
            streams: StreamRouter::default(),
            secrets: config.secrets,
            listening: false,
            trust: config.trust,
            refusals: TokenBucket::new(REFUSALS_PER_SEC, REFUSALS_PER_SEC, now),
            reading_guest: true,
            stopping: false,
            stop_grace_ms: config.stop_grace_ms,
        }
    }

    /// Decides one input at `now`.
    pub fn handle(&mut self, input: Input, now: Instant) -> Output {
        let mut out = Output::default();
        match input {
            Input::Attached => self.publish_rules(&mut out),
            Input::Connected(client) => self.processes.add_client(client),
            Input::Client(client, msg) => {
                // The control's broken design: an update applied only once the message behind it was handled.
                let late = self.late_update.take();
                self.client_message(client, msg, now, &mut out);
                if let Some(update) = late {
                    self.gate.update(&update);
                }
            }
            Input::ClientGone(client) => self.client_gone(client, now, &mut out),
            Input::Guest(msg) => self.guest_message(msg, now, &mut out),
            Input::Egress(Report::Gone(id)) => self.streams.egress_ended(id),
            Input::Egress(report) => {
                if matches!(report, Report::Refused { .. }) {
                    self.count_refusal(now);
                }
                out.notes.push(Note::Egress(report));
            }
            Input::CollectorRotated { client, rotation, outcome } => {
                self.collector_rotated(client, &rotation, outcome, &mut out);
            }
            Input::Stop => self.stop(&mut out),
            Input::Tick => {
                if !self.reading_guest && self.refusals.ready(now) {
                    self.reading_guest = true;
                }
            }
        }
        out
    }

    /// Whether the loop reads the guest's link now (not while refusals are over their rate).
    pub fn reading_guest(&self) -> bool {
        self.reading_guest
    }

    /// Processes still known (running, or waiting to be collected).
    pub fn known_processes(&self) -> usize {
        self.processes.known_processes()
    }

    /// Output held in all: sent towards clients and not credited, or waiting for a re-attach.
    pub fn retained_bytes(&self) -> u64 {
        self.processes.retained_bytes()
    }

    /// Network streams open now (egress and port forwards).
    pub fn open_streams(&self) -> usize {
        self.streams.open()
    }

    fn client_message(&mut self, client: ClientId, mut msg: ToSupervisor, now: Instant, out: &mut Output) {
        // A removed (or never added) client's late messages go nowhere.
        if !self.processes.has_client(client) {
            return;
        }
        // Before the gate: the policy judges the program that will run, the image's entrypoint included.
        if let ToSupervisor::Process(vm_protocol::ProcessRequest::Spawn(spawn)) = &mut msg {
            self.prepare.spawn(spawn, self.gate.has_network());
        }
        if matches!(msg, ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(_))) {
            out.notes.push(Note::PolicyUpdateReceived);
        }
        if !admit::admit(&self.gate, self.processes.running(), client, &msg, out) {
            return;
        }
        let routed = match msg {
            ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(update)) => {
                self.update_policy(client, update, out);
                Ok(())
            }
            ToSupervisor::Supervisor(SupervisorRequest::RotateCredentials(rotation)) => {
                self.rotate(client, rotation, out);
                Ok(())
            }
            ToSupervisor::Ping { nonce } => {
                Self::ping(client, nonce, out);
                Ok(())
            }
            ToSupervisor::Hello(_) => Err(ClientViolation::Unexpected("a second Hello")),
            ToSupervisor::Forward(req) => {
                let cap = usize::try_from(self.published.max_connections).unwrap_or(usize::MAX);
                self.streams.from_client(client, req, cap).map(|streamed| self.streamed(streamed, now, out))
            }
            msg @ (ToSupervisor::Process(_) | ToSupervisor::Supervisor(_)) => {
                self.processes.from_client(client, msg).map(|actions| Self::routed(actions, out))
            }
        };
        if let Err(violation) = routed {
            out.notes.push(Note::ClientViolation(client, violation));
            self.client_gone(client, now, out);
            out.sends.push(Outgoing::Disconnect(client));
        }
    }

    /// A client is gone: its processes keep running, detached; its port forwards close.
    fn client_gone(&mut self, client: ClientId, now: Instant, out: &mut Output) {
        self.processes.remove_client(client);
        let closed = self.streams.remove_client(client);
        self.streamed(closed, now, out);
    }

    fn guest_message(&mut self, msg: ToHost, now: Instant, out: &mut Output) {
        let routed = match msg {
            ToHost::Net(msg) => {
                let cap = usize::try_from(self.published.max_connections).unwrap_or(usize::MAX);
                let egress = !self.published.rules.is_empty();
                self.streams.from_guest(msg, cap, egress).map(|streamed| self.streamed(streamed, now, out))
            }
            msg => {
                let answer = spawn_answer(&msg);
                self.processes.from_guest(msg).map(|actions| {
                    if let Some((id, outcome)) = answer {
                        out.notes.push(Note::ExecAnswered(id, outcome));
                    }
                    Self::routed(actions, out);
                })
            }
        };
        if let Err(violation) = routed {
            out.violation = Some(violation);
        }
    }

    /// The process router's actions as sends and notes.
    fn routed(actions: Vec<Action>, out: &mut Output) {
        for action in actions {
            match action {
                Action::ToGuest(msg) => {
                    if let Some(id) = dispatched_spawn(&msg) {
                        out.notes.push(Note::ExecDispatched(id));
                    }
                    out.sends.push(Outgoing::ToGuest(msg));
                }
                Action::ToClient(client, msg) => out.sends.push(Outgoing::ToClient(client, msg)),
                Action::Started { guest_id, pid, argv } => out.notes.push(Note::Started { guest_id, pid, argv }),
                Action::Exited { guest_id, pid, argv, status } => {
                    out.notes.push(Note::Exited { guest_id, pid, argv, status });
                }
                Action::FileDone { op, bytes, status } => out.notes.push(Note::FileDone { op, bytes, status }),
                Action::TarRefused { path, reason } => out.notes.push(Note::TarRefused { path, reason }),
            }
        }
    }

    /// The stream router's output as sends and notes; an egress refusal takes a token.
    fn streamed(&mut self, streamed: Vec<Out>, now: Instant, out: &mut Output) {
        for item in streamed {
            match item {
                Out::Guest(msg) => out.sends.push(Outgoing::ToGuest(msg.into())),
                Out::Client(client, event) => out.sends.push(Outgoing::ToClient(client, event.into())),
                Out::Egress(id, listener, pipe) => out.sends.push(Outgoing::StartEgress(id, listener, pipe)),
                Out::Refused(refused) => {
                    if refused.listener.is_some() {
                        self.count_refusal(now);
                    }
                    out.notes.push(Note::StreamRefused(refused));
                }
                Out::Forward(note) => out.notes.push(Note::Forward(note)),
            }
        }
    }

    /// One refused egress connection: past the rate, the guest's link is not read until a tick finds tokens.
    fn count_refusal(&mut self, now: Instant) {
        if !self.refusals.take(now) {
            self.reading_guest = false;
        }
    }

    /// Tells the agent to trust the sandbox CA (once, before any listener), and to open its listeners when
    /// some rule allows egress and close them when none does; egress follows the rules now in force, and
    /// what they no longer allow is closed.
    fn publish_rules(&mut self, out: &mut Output) {
        if let Some(ca_pem) = self.trust.take() {
            out.sends.push(Outgoing::ToGuest(VmRequest::Trust { ca_pem }.into()));
        }
        if self.listening && !self.rules.egress_follows_updates {
            return;
        }
        let view = self.gate.network();
        let listen = !view.rules.is_empty();
        if listen != self.listening {
            self.listening = listen;
            out.sends.push(Outgoing::ToGuest(VmRequest::Egress { listen }.into()));
        }
        for (_, pipe) in self.streams.egress() {
            if pipe.ended().is_none() && !crate::network::dial::still_allowed(pipe, &view) {
                pipe.end(End::Aborted("a policy update no longer allows the destination"));
            }
        }
        self.published = view.clone();
        out.sends.push(Outgoing::PublishRules(view));
    }

    /// Nothing new opens, every egress stream ends, and the agent is asked to shut down: SIGTERM (or the
    /// image's stop signal) to the workload, SIGKILL after the grace, power off.
    fn stop(&mut self, out: &mut Output) {
        if self.stopping {
            return;
        }
        self.stopping = true;
        self.processes.stop_accepting();
        self.streams.stop_accepting();
        for (_, pipe) in self.streams.egress() {
            pipe.end(End::Aborted("the sandbox is stopping"));
        }
        let shutdown = VmRequest::Shutdown { grace_ms: self.stop_grace_ms, signal: self.prepare.stop_signal() };
        out.sends.push(Outgoing::ToGuestFirst(shutdown.into()));
    }
}
