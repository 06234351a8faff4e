//! The process router: many attach clients' processes, one guest link.
//!
//! Each client numbers its own processes; the router gives each one a guest-wide id and routes every
//! process message both ways, after the boundary ([`super::Boundary`]) prepared and admitted it. It is the one
//! place that enforces the protocol's process rules on both sides (`docs/protocol.md`), so neither a client
//! nor the guest can make the supervisor hold more than the windows that were granted:
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
//! The clients' half is here, the guest's in `guest.rs`. This is pure state: it returns [`Action`]s and never
//! does I/O, so it is tested without a VM.

mod guest;
mod open;
mod route;

use std::collections::HashMap;

use vm_protocol::attach::{ProcessSummary, SupervisorReply, SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::files::{FileOp, TarRefusal};
use vm_protocol::link::ToGuest;
use vm_protocol::message::Refusal;
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, SignalName};

pub use self::route::MAX_KEPT_ARGV_BYTES;
use self::route::{Phase, Route};
use super::violation::ClientViolation;
use super::ClientId;

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

/// What the caller must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send to the guest.
    ToGuest(ToGuest),
    /// Send to a client.
    ToClient(ClientId, ToClient),
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
    /// A file operation ended (for a File System Activity event).
    FileDone {
        /// What it was.
        op: FileOp,
        /// Bytes in on stdin and out on stdout.
        bytes: u64,
        /// How it ended: 0 is success.
        status: ExitStatus,
    },
    /// The client's hardened extractor refused a `CopyOut`'s tar (for a finding).
    TarRefused {
        /// The guest path copied out.
        path: String,
        /// Why.
        reason: TarRefusal,
    },
}

#[derive(Debug, Default)]
struct Client {
    highest: Option<ProcId>,
    procs: HashMap<ProcId, ProcId>,
}

/// Routing state for one VM's processes.
#[derive(Debug)]
pub struct ProcessRouter {
    next_guest_id: u32,
    routes: HashMap<ProcId, Route>,
    clients: HashMap<ClientId, Client>,
    accepting: bool,
    /// When off (the `no-guest-invariants` control), the guest's messages are only routed, not checked.
    enforce: bool,
}

impl Default for ProcessRouter {
    fn default() -> Self {
        Self::new(true)
    }
}

impl ProcessRouter {
    /// A router that enforces the guest's rules, or (`enforce` off, controls only) merely routes.
    pub fn new(enforce: bool) -> Self {
        Self { next_guest_id: 1, routes: HashMap::new(), clients: HashMap::new(), accepting: true, enforce }
    }

    /// The sandbox's processes that are asked for or running (not those that exited).
    pub fn running(&self) -> usize {
        self.routes.values().filter(|r| !matches!(r.phase, Phase::Exited(_))).count()
    }

    /// Registers a new client.
    pub fn add_client(&mut self, client: ClientId) {
        self.clients.insert(client, Client::default());
    }

    /// Whether `client` is connected (its late messages after it was removed go nowhere).
    pub fn has_client(&self, client: ClientId) -> bool {
        self.clients.contains_key(&client)
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

    /// Handles one process message from a client, already prepared and admitted: a [`ToSupervisor::Process`]
    /// or one of the requests about processes (`Reattach`, `ListProcesses`, `Detach`, `TarRefused`).
    ///
    /// # Errors
    /// A [`ClientViolation`]; the caller disconnects the client (and calls [`ProcessRouter::remove_client`]).
    pub fn from_client(&mut self, client: ClientId, msg: ToSupervisor) -> Result<Vec<Action>, ClientViolation> {
        // A removed (or never added) client's late messages go nowhere.
        if !self.clients.contains_key(&client) {
            return Ok(Vec::new());
        }
        match msg {
            ToSupervisor::Process(req) => self.process_request(client, req),
            ToSupervisor::Supervisor(req) => self.session(client, req),
            _ => Err(ClientViolation::Unexpected("a message for no process")),
        }
    }

    /// A client's request about one of its processes, forwarded under the guest-wide id.
    fn process_request(&mut self, client: ClientId, req: ProcessRequest) -> Result<Vec<Action>, ClientViolation> {
        let forward = |m: ProcessRequest| Ok(vec![Action::ToGuest(ToGuest::Process(m))]);
        match req {
            ProcessRequest::Spawn(spawn) => Ok(self.spawn(client, spawn)),
            ProcessRequest::Files(files) => Ok(self.files(client, files)),
            ProcessRequest::Stdin { id, data } => match self.client_route(client, id)? {
                _ if data.is_empty() => Err(ClientViolation::Empty(id)),
                Some((_, route)) if route.stdin_closed => Err(ClientViolation::Unexpected("stdin after EOF")),
                Some((guest_id, route)) => {
                    route.stdin(data.len()).map_err(|source| ClientViolation::Credit { id, source })?;
                    forward(ProcessRequest::Stdin { id: guest_id, data })
                }
                None => Ok(Vec::new()),
            },
            ProcessRequest::StdinEof { id } => match self.client_route(client, id)? {
                Some((guest_id, route)) if !route.stdin_closed => {
                    route.stdin_closed = true;
                    forward(ProcessRequest::StdinEof { id: guest_id })
                }
                // Already closed (by the client before a re-attach): EOF twice is still EOF.
                Some(_) | None => Ok(Vec::new()),
            },
            ProcessRequest::Credit { id, bytes } => self.credit(client, id, bytes),
            ProcessRequest::Signal { id, signal } => match self.client_route(client, id)? {
                Some((guest_id, _)) => forward(ProcessRequest::Signal { id: guest_id, signal }),
                None => Ok(Vec::new()),
            },
            // Only a terminal has a size; a resize of anything else is dropped here.
            ProcessRequest::Resize { id, size } => match self.client_route(client, id)? {
                Some((guest_id, route)) if route.tty => forward(ProcessRequest::Resize { id: guest_id, size }),
                Some(_) | None => Ok(Vec::new()),
            },
        }
    }

    /// A client's request that the supervisor answers itself.
    fn session(&mut self, client: ClientId, req: SupervisorRequest) -> Result<Vec<Action>, ClientViolation> {
        let reply = |m: SupervisorReply| Ok(vec![Action::ToClient(client, ToClient::Supervisor(m))]);
        match req {
            SupervisorRequest::Reattach { id, pid } => Ok(self.reattach(client, id, pid)),
            SupervisorRequest::ListProcesses => {
                let list = self
                    .routes
                    .values()
                    .filter(|r| r.phase == Phase::Running)
                    .filter_map(|r| {
                        Some(ProcessSummary { pid: r.pid?, argv: r.argv.clone(), attached: !r.detached, tty: r.tty })
                    })
                    .collect();
                reply(SupervisorReply::Processes { list })
            }
            SupervisorRequest::UpdatePolicy(_) | SupervisorRequest::RotateCredentials(_) => {
                Err(ClientViolation::Unexpected("a control request as a process request"))
            }
            SupervisorRequest::Detach { id } => self.detach(client, id),
            SupervisorRequest::TarRefused { id, path, reason } => self.tar_refused(client, id, path, reason),
        }
    }

    /// The client's extractor refused what a `CopyOut` sent: a finding, and the operation killed if it still
    /// runs (a refusal often comes after the operation ended: its whole tar was sent).
    fn tar_refused(
        &mut self,
        client: ClientId,
        id: ProcId,
        path: String,
        reason: TarRefusal,
    ) -> Result<Vec<Action>, ClientViolation> {
        if path.len() > vm_protocol::files::MAX_PATH_BYTES {
            return Err(ClientViolation::Unexpected("a refused tar's path past the path limit"));
        }
        let mut actions = vec![Action::TarRefused { path, reason }];
        if let Some((guest_id, route)) = self.client_route(client, id)? {
            if !matches!(route.phase, Phase::Exited(_)) {
                actions.push(Action::ToGuest(ProcessRequest::Signal { id: guest_id, signal: SignalName::Kill }.into()));
            }
        }
        Ok(actions)
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
            _ => vec![Action::ToGuest(ProcessRequest::Credit { id: guest_id, bytes }.into())],
        })
    }

    /// Moves a detached process to `client` as `id` and replays what it retained.
    fn reattach(&mut self, client: ClientId, id: ProcId, pid: u32) -> Vec<Action> {
        let refuse = |reason| vec![Action::ToClient(client, ProcessEvent::Refused { id, reason }.into())];
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
        let started = ProcessEvent::Started { id, pid, stdin_window, output_window };
        let mut actions = vec![Action::ToClient(client, started.into())];
        actions.extend(route.replay(id).map(|m| Action::ToClient(client, m)));
        if let Phase::Exited(status) = route.phase {
            actions.push(Action::ToClient(client, ProcessEvent::Exited { id, status }.into()));
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
