//! The process-access multiplexer: many attach clients, one guest link.
//!
//! Each client numbers its own processes; the multiplexer gives each one a guest-wide id and routes every
//! message both ways. It is the one place that enforces the protocol's rules on both sides
//! (`docs/protocol.md`), so neither a client nor the guest can make the supervisor hold more than the windows
//! that were granted:
//!
//! - output: the client grants a window at `Spawn` and credits what it received; guest output beyond it is a
//!   guest violation, and what was sent stays retained here until credited ([`route`]);
//! - stdin: the guest grants a window at `Started` and credits what it wrote; client stdin beyond it is a
//!   client violation;
//! - every process gets exactly one `Started`, before any output; no empty data or credit message; exit
//!   statuses a Linux process can have; known ids only.
//!
//! A client that disconnects leaves its processes running, detached: their retained output (everything the
//! client never credited) and what they write meanwhile, up to the window, wait for the client that
//! re-attaches with `Reattach { pid }`, and so does the exit of one that ends meanwhile (the most recent
//! [`MAX_FINISHED_DETACHED`] such are kept).
//!
//! This is pure state: it returns [`Action`]s and never does I/O, so it is tested without a VM.

mod route;
mod violation;

use std::collections::HashMap;

use vm_protocol::flow::MAX_WINDOW_BYTES;
use vm_protocol::message::{ProcessSummary, Refusal, MAX_FAILURE_MESSAGE_BYTES};
use vm_protocol::{ExitStatus, ProcId, ToGuest, ToHost};

pub use self::route::MAX_KEPT_ARGV_BYTES;
use self::route::{Phase, Route};
pub use self::violation::{ClientViolation, GuestViolation};
use crate::policy::{Denial, Gate};
use vm_contract::test_control::TestControl;
use vm_protocol::policy::{Operation, SandboxPolicy, UpdateOutcome};

/// The policy operation a client message is, if it is one (credit, pings and policy updates are not).
fn operation(msg: &ToGuest) -> Option<Operation> {
    Some(match msg {
        ToGuest::Spawn(_) => Operation::Exec,
        ToGuest::Stdin { .. } | ToGuest::StdinEof { .. } => Operation::Stdin,
        ToGuest::Signal { .. } => Operation::Signal,
        ToGuest::Resize { .. } => Operation::Resize,
        ToGuest::Reattach { .. } => Operation::Reattach,
        ToGuest::ListProcesses => Operation::ListProcesses,
        _ => return None,
    })
}

/// Processes that ended while detached and still wait for someone to collect their output and status.
pub const MAX_FINISHED_DETACHED: usize = 64;

/// Processes alive at once in one sandbox: also the highest process cap a policy may set.
pub const MAX_PROCESSES: usize = vm_protocol::policy::MAX_PROCESSES_CAP as usize;

/// Output windows of all live processes together. Past it a new process gets a smaller window, never less
/// than [`MIN_WINDOW_BYTES`]: the guest output the supervisor can ever hold is at most this budget plus
/// [`MAX_PROCESSES`] minimal windows.
pub const OUTPUT_BUDGET_BYTES: u64 = 64 * 1024 * 1024;

/// The smallest output window a process is given when the budget is spent.
pub const MIN_WINDOW_BYTES: u32 = 64 * 1024;

/// One attach connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientId(pub u64);

/// What the caller must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send to the guest.
    ToGuest(ToGuest),
    /// Send to a client.
    ToClient(ClientId, ToHost),
    /// A workload process started (for telemetry).
    Started {
        /// The guest-wide id.
        guest_id: ProcId,
        /// Its pid inside the guest.
        pid: u32,
        /// Its argv (bounded to [`MAX_KEPT_ARGV_BYTES`]).
        argv: Vec<String>,
    },
    /// A workload process ended, or never started (for telemetry).
    Exited {
        /// The guest-wide id.
        guest_id: ProcId,
        /// Its pid inside the guest, if it started.
        pid: Option<u32>,
        /// Its argv (bounded).
        argv: Vec<String>,
        /// How it ended (a plausible status).
        status: ExitStatus,
    },
    /// The policy denied a client's operation (for a finding).
    Denied {
        /// What was asked.
        op: Operation,
        /// The revision in force.
        revision: u64,
        /// Why.
        denial: Denial,
    },
    /// A policy update was applied or refused (for a configuration event).
    PolicyUpdated {
        /// Its revision.
        revision: u64,
        /// What became of it.
        outcome: UpdateOutcome,
        /// The operations allowed now.
        allowed: String,
    },
    /// A client asked to rotate the OTLP credentials: the telemetry swaps them and the client gets a
    /// `CredentialsAck`.
    RotateCredentials(ClientId, vm_protocol::credentials::CredentialRotation),
}

#[derive(Debug, Default)]
struct Client {
    highest: Option<ProcId>,
    procs: HashMap<ProcId, ProcId>,
}

/// Routing state for one VM.
#[derive(Debug)]
pub struct Mux {
    next_guest_id: u32,
    routes: HashMap<ProcId, Route>,
    clients: HashMap<ClientId, Client>,
    accepting: bool,
    /// When off (the `no-guest-invariants` control), the guest's messages are only routed, not checked.
    enforce: bool,
    /// What clients may do.
    gate: Gate,
    /// `unserialized-policy` control only: an update acknowledged but not yet applied.
    late_update: Option<vm_protocol::policy::PolicyUpdate>,
}

impl Default for Mux {
    fn default() -> Self {
        Self::new(true)
    }
}

impl Mux {
    /// A multiplexer that enforces the guest's rules, or (`enforce` off, controls only) merely routes.
    pub fn new(enforce: bool) -> Self {
        Self {
            next_guest_id: 1,
            routes: HashMap::new(),
            clients: HashMap::new(),
            accepting: true,
            enforce,
            gate: Gate::default(),
            late_update: None,
        }
    }

    /// The same, under `policy` (approved at create) instead of the allow-everything default.
    pub fn with_policy(mut self, policy: SandboxPolicy) -> Self {
        self.gate = Gate::new(policy, vm_protocol::identity::WORKLOAD);
        self
    }

    /// The sandbox's processes that are asked for or running (not those that exited).
    fn running(&self) -> usize {
        self.routes.values().filter(|r| !matches!(r.phase, Phase::Exited(_))).count()
    }

    /// Registers a new client.
    pub fn add_client(&mut self, client: ClientId) {
        self.clients.insert(client, Client::default());
    }

    /// From now on every spawn is refused (the sandbox is stopping).
    pub fn stop_accepting(&mut self) {
        self.accepting = false;
    }

    /// Processes still known (running, or waiting to be collected).
    pub fn known_processes(&self) -> usize {
        self.routes.len()
    }

    /// Output held in all: sent towards clients and not credited, or waiting for a re-attach.
    pub fn retained_bytes(&self) -> u64 {
        self.routes.values().map(Route::retained).sum()
    }

    /// What the guest may send plus what is retained, over all processes: at most [`OUTPUT_BUDGET_BYTES`].
    fn output_in_use(&self) -> u64 {
        let held = |r: &Route| if matches!(r.phase, Phase::Exited(_)) { r.retained() } else { r.window() };
        self.routes.values().map(held).sum()
    }

    /// Forgets a client; its processes keep running, detached, with everything it never credited.
    pub fn remove_client(&mut self, client: ClientId) {
        let Some(state) = self.clients.remove(&client) else { return };
        for guest_id in state.procs.into_values() {
            self.detach_route(guest_id);
        }
        self.forget_old_finished();
    }

    /// `Detach`: the client lets go of one process, as if it had disconnected (it keeps its other ones).
    fn detach(&mut self, client: ClientId, id: ProcId) -> Result<Vec<Action>, ClientViolation> {
        let Some((guest_id, _)) = self.client_route(client, id)? else { return Ok(Vec::new()) };
        if let Some(state) = self.clients.get_mut(&client) {
            state.procs.remove(&id);
        }
        self.detach_route(guest_id);
        self.forget_old_finished();
        Ok(Vec::new())
    }

    /// Leaves a process without a client; one whose output and exit were all delivered is forgotten.
    fn detach_route(&mut self, guest_id: ProcId) {
        let delivered = match self.routes.get_mut(&guest_id) {
            Some(route) => {
                route.detached = true;
                route.delivered()
            }
            None => false,
        };
        if delivered {
            self.routes.remove(&guest_id);
        }
    }

    /// Handles one message from a client.
    ///
    /// # Errors
    /// A [`ClientViolation`]; the caller disconnects the client (and calls [`Mux::remove_client`]).
    pub fn from_client(&mut self, client: ClientId, msg: ToGuest) -> Result<Vec<Action>, ClientViolation> {
        // The control's broken design: an update applied only once the message queued behind it was handled.
        let late = self.late_update.take();
        let handled = self.handle_client(client, msg);
        if let Some(update) = late {
            self.gate.update(&update);
        }
        handled
    }

    fn handle_client(&mut self, client: ClientId, msg: ToGuest) -> Result<Vec<Action>, ClientViolation> {
        // A removed (or never added) client's late messages go nowhere.
        if !self.clients.contains_key(&client) {
            return Ok(Vec::new());
        }
        if let Some(op) = operation(&msg) {
            let admitted = match &msg {
                ToGuest::Spawn(spawn) => self.gate.admit_spawn(spawn, self.running()),
                _ => self.gate.admit(op, None),
            };
            if let Err(denial) = admitted {
                return Ok(self.deny(client, &msg, op, denial));
            }
        }
        let reply = |m: ToHost| Ok(vec![Action::ToClient(client, m)]);
        let forward = |m: ToGuest| Ok(vec![Action::ToGuest(m)]);
        match msg {
            ToGuest::Spawn(spawn) => Ok(self.spawn(client, spawn)),
            ToGuest::Stdin { id, data } => match self.client_route(client, id)? {
                _ if data.is_empty() => Err(ClientViolation::Empty(id)),
                Some((_, route)) if route.stdin_closed => Err(ClientViolation::Unexpected("stdin after EOF")),
                Some((guest_id, route)) => {
                    route.stdin(data.len()).map_err(|source| ClientViolation::Credit { id, source })?;
                    forward(ToGuest::Stdin { id: guest_id, data })
                }
                None => Ok(Vec::new()),
            },
            ToGuest::StdinEof { id } => match self.client_route(client, id)? {
                Some((guest_id, route)) if !route.stdin_closed => {
                    route.stdin_closed = true;
                    forward(ToGuest::StdinEof { id: guest_id })
                }
                // Already closed (by the client before a re-attach): EOF twice is still EOF.
                Some(_) | None => Ok(Vec::new()),
            },
            ToGuest::Credit { id, bytes } => self.credit(client, id, bytes),
            ToGuest::Signal { id, signal } => match self.client_route(client, id)? {
                Some((guest_id, _)) => forward(ToGuest::Signal { id: guest_id, signal }),
                None => Ok(Vec::new()),
            },
            // Only a terminal has a size; a resize of anything else is dropped here.
            ToGuest::Resize { id, size } => match self.client_route(client, id)? {
                Some((guest_id, route)) if route.tty => forward(ToGuest::Resize { id: guest_id, size }),
                Some(_) | None => Ok(Vec::new()),
            },
            ToGuest::Reattach { id, pid } => Ok(self.reattach(client, id, pid)),
            ToGuest::ListProcesses => {
                let list = self
                    .routes
                    .values()
                    .filter(|r| r.phase == Phase::Running)
                    .filter_map(|r| {
                        Some(ProcessSummary { pid: r.pid?, argv: r.argv.clone(), attached: !r.detached, tty: r.tty })
                    })
                    .collect();
                reply(ToHost::Processes { list })
            }
            ToGuest::Ping { nonce } => reply(ToHost::Pong { nonce }),
            // Every operation handled before this one is already dispatched: the acknowledgment is sent after it.
            ToGuest::UpdatePolicy(update) if crate::control(TestControl::UnserializedPolicy) => {
                let (revision, outcome) = (update.revision, UpdateOutcome::Applied);
                self.late_update = Some(update);
                Ok(vec![
                    Action::PolicyUpdated { revision, outcome, allowed: self.gate.allowed() },
                    Action::ToClient(client, ToHost::PolicyAck { revision, outcome }),
                ])
            }
            ToGuest::UpdatePolicy(update) => {
                let outcome = self.gate.update(&update);
                let revision = update.revision;
                Ok(vec![
                    Action::PolicyUpdated { revision, outcome, allowed: self.gate.allowed() },
                    Action::ToClient(client, ToHost::PolicyAck { revision, outcome }),
                ])
            }
            // Kept by the supervisor: credentials never reach the guest.
            ToGuest::RotateCredentials(rotation) => Ok(vec![Action::RotateCredentials(client, rotation)]),
            ToGuest::Detach { id } => self.detach(client, id),
            ToGuest::Shutdown { .. } => Err(ClientViolation::Unexpected("Shutdown")),
            ToGuest::Reseed { .. } => Err(ClientViolation::Unexpected("Reseed")),
            ToGuest::Hello(_) => Err(ClientViolation::Unexpected("a second Hello")),
            ToGuest::Reserved => Err(ClientViolation::Unexpected("the reserved message")),
        }
    }

    /// A denied operation: a finding, and for a request that expects an answer, a refusal. Stdin, signals and
    /// resizes are dropped (the client sees no effect).
    fn deny(&self, client: ClientId, msg: &ToGuest, op: Operation, denial: Denial) -> Vec<Action> {
        let mut actions = vec![Action::Denied { op, revision: self.gate.revision(), denial }];
        let refused = |id| Action::ToClient(client, ToHost::Refused { id, reason: Refusal::Denied });
        match msg {
            ToGuest::Spawn(spawn) => actions.push(refused(spawn.id)),
            ToGuest::Reattach { id, .. } => actions.push(refused(*id)),
            ToGuest::ListProcesses => actions.push(refused(ProcId(0))),
            _ => {}
        }
        actions
    }

    fn spawn(&mut self, client: ClientId, mut spawn: vm_protocol::Spawn) -> Vec<Action> {
        let id = spawn.id;
        let refuse = |reason| vec![Action::ToClient(client, ToHost::Refused { id, reason })];
        let left = OUTPUT_BUDGET_BYTES.saturating_sub(self.output_in_use()).max(u64::from(MIN_WINDOW_BYTES));
        let state = self.clients.entry(client).or_default();
        if !self.accepting {
            return refuse(Refusal::ShuttingDown);
        }
        if state.highest.is_some_and(|h| id <= h) {
            return refuse(Refusal::IdNotIncreasing);
        }
        state.highest = Some(id);
        if spawn.output_window > MAX_WINDOW_BYTES || spawn.argv.is_empty() {
            return refuse(Refusal::Invalid);
        }
        if self.routes.len() >= MAX_PROCESSES {
            return refuse(Refusal::TooManyProcesses);
        }
        // Within the budget: the window shrinks (the client credits only what it gets, so it need not know).
        spawn.output_window = u32::try_from(u64::from(spawn.output_window).min(left)).unwrap_or(MIN_WINDOW_BYTES);
        let guest_id = ProcId(self.next_guest_id);
        self.next_guest_id = self.next_guest_id.saturating_add(1);
        state.procs.insert(id, guest_id);
        self.routes.insert(guest_id, Route::new(client, id, &spawn.argv, spawn.output_window, spawn.pty.is_some()));
        spawn.id = guest_id;
        vec![Action::ToGuest(ToGuest::Spawn(spawn))]
    }

    fn credit(&mut self, client: ClientId, id: ProcId, bytes: u32) -> Result<Vec<Action>, ClientViolation> {
        if bytes == 0 {
            return Err(ClientViolation::Empty(id));
        }
        let Some((guest_id, route)) = self.client_route(client, id)? else { return Ok(Vec::new()) };
        route.acked(bytes).map_err(|source| ClientViolation::Credit { id, source })?;
        if route.delivered() {
            self.end_route(guest_id);
            return Ok(Vec::new());
        }
        Ok(match route.phase {
            // A finished process needs no more credit.
            Phase::Exited(_) => Vec::new(),
            _ => vec![Action::ToGuest(ToGuest::Credit { id: guest_id, bytes })],
        })
    }

    /// Handles one message from the guest.
    ///
    /// # Errors
    /// A [`GuestViolation`]; the caller stops the VM.
    pub fn from_guest(&mut self, msg: ToHost) -> Result<Vec<Action>, GuestViolation> {
        let enforce = self.enforce;
        match msg {
            ToHost::Started { id, pid, stdin_window, output_window } => {
                let route = self.live_route(id)?;
                if enforce && route.phase != Phase::Spawned {
                    return Err(GuestViolation::StartedTwice(id));
                }
                if enforce && (stdin_window > MAX_WINDOW_BYTES || output_window != route.output_window()) {
                    return Err(GuestViolation::WindowTooLarge(id));
                }
                let output_window = route.output_window();
                route.started(pid, stdin_window);
                let mut actions = vec![Action::Started { guest_id: id, pid, argv: route.argv.clone() }];
                if !route.detached {
                    let msg = ToHost::Started { id: route.client_id, pid, stdin_window, output_window };
                    actions.push(Action::ToClient(route.client, msg));
                }
                Ok(actions)
            }
            ToHost::Output { id, stream, data } => {
                let route = self.live_route(id)?;
                if enforce && data.is_empty() {
                    return Err(GuestViolation::Empty(id));
                }
                if enforce && route.phase != Phase::Running {
                    return Err(GuestViolation::OutOfOrder(id));
                }
                route.output(stream, data.clone()).map_err(|source| GuestViolation::Credit { id, source })?;
                if route.detached {
                    return Ok(Vec::new());
                }
                Ok(vec![Action::ToClient(route.client, ToHost::Output { id: route.client_id, stream, data })])
            }
            ToHost::StdinCredit { id, bytes } => {
                if enforce && bytes == 0 {
                    return Err(GuestViolation::Empty(id));
                }
                match self.routes.get_mut(&id).filter(|r| r.phase == Phase::Running) {
                    Some(route) => {
                        let passed =
                            route.stdin_credit(bytes).map_err(|source| GuestViolation::Credit { id, source })?;
                        if route.detached || passed == 0 {
                            return Ok(Vec::new());
                        }
                        let msg = ToHost::StdinCredit { id: route.client_id, bytes: passed };
                        Ok(vec![Action::ToClient(route.client, msg)])
                    }
                    // The agent credits stdin it wrote just before the process exited: a benign race.
                    None if id.0 < self.next_guest_id => Ok(Vec::new()),
                    None => Err(GuestViolation::UnknownProcess(id)),
                }
            }
            ToHost::Exited { id, status } => {
                let route = self.live_route(id)?;
                if enforce && route.phase != Phase::Running {
                    return Err(GuestViolation::OutOfOrder(id));
                }
                if enforce && !status.is_plausible() {
                    return Err(GuestViolation::ImplausibleStatus(id));
                }
                route.phase = Phase::Exited(status);
                let mut actions =
                    vec![Action::Exited { guest_id: id, pid: route.pid, argv: route.argv.clone(), status }];
                if !route.detached {
                    actions.push(Action::ToClient(route.client, ToHost::Exited { id: route.client_id, status }));
                    if route.delivered() {
                        self.end_route(id);
                    }
                } else {
                    self.forget_old_finished();
                }
                Ok(actions)
            }
            ToHost::SpawnFailed { id, status, message } => {
                let route = self.live_route(id)?;
                if enforce && route.phase != Phase::Spawned {
                    return Err(GuestViolation::OutOfOrder(id));
                }
                if enforce && !status.is_plausible() {
                    return Err(GuestViolation::ImplausibleStatus(id));
                }
                if enforce && message.len() > MAX_FAILURE_MESSAGE_BYTES {
                    return Err(GuestViolation::MessageTooLong(id));
                }
                let (client, client_id, detached, argv) =
                    (route.client, route.client_id, route.detached, route.argv.clone());
                self.end_route(id);
                let mut actions = vec![Action::Exited { guest_id: id, pid: None, argv, status }];
                if !detached {
                    actions.push(Action::ToClient(client, ToHost::SpawnFailed { id: client_id, status, message }));
                }
                Ok(actions)
            }
            ToHost::Refused { id, reason } => {
                let route = self.live_route(id)?;
                if enforce && route.phase != Phase::Spawned {
                    return Err(GuestViolation::OutOfOrder(id));
                }
                let (client, client_id, detached) = (route.client, route.client_id, route.detached);
                self.end_route(id);
                Ok(if detached {
                    Vec::new()
                } else {
                    vec![Action::ToClient(client, ToHost::Refused { id: client_id, reason })]
                })
            }
            ToHost::Pong { .. } => Err(GuestViolation::Unexpected("an unsolicited Pong")),
            ToHost::Processes { .. } => Err(GuestViolation::Unexpected("a process list")),
            ToHost::PolicyAck { .. } => Err(GuestViolation::Unexpected("a policy acknowledgment")),
            ToHost::CredentialsAck { .. } => Err(GuestViolation::Unexpected("a credentials acknowledgment")),
            ToHost::Disconnected { .. } => Err(GuestViolation::Unexpected("a disconnection notice")),
            ToHost::Hello(_) => Err(GuestViolation::Unexpected("a second Hello")),
            ToHost::Reserved => Err(GuestViolation::Unexpected("the reserved message")),
        }
    }

    /// The route of a process that has not exited.
    fn live_route(&mut self, id: ProcId) -> Result<&mut Route, GuestViolation> {
        self.routes
            .get_mut(&id)
            .filter(|r| !matches!(r.phase, Phase::Exited(_)))
            .ok_or(GuestViolation::UnknownProcess(id))
    }

    /// Moves a detached process to `client` as `id` and replays what it retained.
    fn reattach(&mut self, client: ClientId, id: ProcId, pid: u32) -> Vec<Action> {
        let refuse = |reason| vec![Action::ToClient(client, ToHost::Refused { id, reason })];
        let state = self.clients.entry(client).or_default();
        if state.highest.is_some_and(|h| id <= h) {
            return refuse(Refusal::IdNotIncreasing);
        }
        state.highest = Some(id);
        let Some((&guest_id, route)) = self.routes.iter_mut().find(|(_, r)| r.detached && r.pid == Some(pid)) else {
            return refuse(Refusal::NoSuchProcess);
        };
        let stdin_window = route.reattach(client, id);
        let output_window = route.output_window();
        let mut actions = vec![Action::ToClient(client, ToHost::Started { id, pid, stdin_window, output_window })];
        actions.extend(route.replay(id).map(|m| Action::ToClient(client, m)));
        if let Phase::Exited(status) = route.phase {
            actions.push(Action::ToClient(client, ToHost::Exited { id, status }));
        }
        if route.delivered() {
            self.routes.remove(&guest_id);
        } else if let Some(state) = self.clients.get_mut(&client) {
            state.procs.insert(id, guest_id);
        }
        actions
    }

    /// Bounds the processes kept only for their output and status.
    fn forget_old_finished(&mut self) {
        let mut finished: Vec<ProcId> = self
            .routes
            .iter()
            .filter(|(_, r)| r.detached && matches!(r.phase, Phase::Exited(_)))
            .map(|(id, _)| *id)
            .collect();
        if finished.len() > MAX_FINISHED_DETACHED {
            finished.sort_unstable();
            for id in &finished[..finished.len() - MAX_FINISHED_DETACHED] {
                self.routes.remove(id);
            }
        }
    }

    fn end_route(&mut self, id: ProcId) {
        if let Some(route) = self.routes.remove(&id) {
            if let Some(client) = self.clients.get_mut(&route.client) {
                client.procs.remove(&route.client_id);
            }
        }
    }

    /// The route of a client's process. `Ok(None)`: it already ended (a late message, benign).
    fn client_route(&mut self, client: ClientId, id: ProcId) -> Result<Option<(ProcId, &mut Route)>, ClientViolation> {
        let state = self.clients.get(&client).ok_or(ClientViolation::UnknownProcess(id))?;
        match state.procs.get(&id) {
            Some(guest_id) => {
                let guest_id = *guest_id;
                let route = self.routes.get_mut(&guest_id).ok_or(ClientViolation::UnknownProcess(id))?;
                Ok(Some((guest_id, route)))
            }
            None if state.highest.is_some_and(|h| id <= h) => Ok(None),
            None => Err(ClientViolation::UnknownProcess(id)),
        }
    }
}

#[cfg(test)]
mod tests;
