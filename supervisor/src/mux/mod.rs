//! The process-access multiplexer: many attach clients, one guest channel.
//!
//! Each client numbers its own processes; the multiplexer gives each one a guest-wide id and routes every
//! message both ways. It is the one place that enforces the credit rules on both sides, so neither a client
//! nor the guest can make the supervisor buffer more than the windows they were granted:
//!
//! - output: the client grants credit (`Spawn::output_window`, then `Credit`), which is forwarded to the
//!   guest; guest output beyond it is a guest violation;
//! - stdin: the guest grants credit (`Started::stdin_window`, then `StdinCredit`), which is forwarded to
//!   the client; client stdin beyond it is a client violation.
//!
//! A client that disconnects leaves its processes running, detached: their output is held (never more than
//! the credit the guest already had, so the hold is bounded) and replayed to the client that re-attaches
//! with `Reattach { pid }`. A detached process that exits keeps its output and exit status for a later
//! attach; the most recent [`MAX_FINISHED_DETACHED`] such are kept.
//!
//! This is pure state: it returns [`Action`]s and never does I/O, so it is tested without a VM.

use std::collections::HashMap;

use vm_protocol::flow::MAX_WINDOW_BYTES;
use vm_protocol::message::{ProcessSummary, Refusal};
use vm_protocol::{CreditError, ExitStatus, FrameViolation, ProcId, ToGuest, ToHost, Window};

/// Detached processes that exited and still wait for someone to collect their output and status.
pub const MAX_FINISHED_DETACHED: usize = 64;

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
        /// Its argv.
        argv: Vec<String>,
    },
    /// A workload process ended (for telemetry).
    Exited {
        /// The guest-wide id.
        guest_id: ProcId,
        /// Its pid inside the guest, if it started.
        pid: Option<u32>,
        /// Its argv.
        argv: Vec<String>,
        /// How it ended.
        status: ExitStatus,
    },
}

/// A client broke the protocol; it is disconnected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientViolation {
    /// A message for an id it never spawned.
    #[error("message for unknown process {0}")]
    UnknownProcess(ProcId),
    /// Stdin beyond the credit, or credit beyond the window limit.
    #[error("credit rules broken for process {id}")]
    Credit {
        /// The process.
        id: ProcId,
        /// What broke.
        #[source]
        source: CreditError,
    },
    /// A message clients may not send.
    #[error("clients may not send {0}")]
    Unexpected(&'static str),
}

/// The guest broke the protocol; the VM is stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuestViolation {
    /// A message for an id we never assigned, or output after exit.
    #[error("message for unknown process {0}")]
    UnknownProcess(ProcId),
    /// Output beyond the credit, or credit beyond the window limit.
    #[error("credit rules broken for process {id}")]
    Credit {
        /// The process.
        id: ProcId,
        /// What broke.
        #[source]
        source: CreditError,
    },
    /// A message the guest may not send after the handshake.
    #[error("the guest may not send {0} after the handshake")]
    Unexpected(&'static str),
    /// Bytes that are not a frame.
    #[error(transparent)]
    Frame(#[from] FrameViolation),
}

#[derive(Debug)]
struct Route {
    client: ClientId,
    client_id: ProcId,
    argv: Vec<String>,
    /// The guest pid, once started.
    pid: Option<u32>,
    /// The output window granted at spawn.
    window: u32,
    output: Window,
    stdin: Window,
    tty: bool,
    /// Stdin EOF reached the guest; a re-attached client's EOF is then a no-op, its data a violation.
    stdin_closed: bool,
    /// No client: output (and the exit) is held for the next one.
    detached: bool,
    /// What arrived while detached, with guest ids.
    held: Vec<ToHost>,
    /// It exited while detached; the route only waits to be collected.
    finished: bool,
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
}

impl Default for Mux {
    fn default() -> Self {
        Self { next_guest_id: 1, routes: HashMap::new(), clients: HashMap::new(), accepting: true }
    }
}

impl Mux {
    /// Registers a new client.
    pub fn add_client(&mut self, client: ClientId) {
        self.clients.insert(client, Client::default());
    }

    /// From now on every spawn is refused (the sandbox is stopping).
    pub fn stop_accepting(&mut self) {
        self.accepting = false;
    }

    /// Processes still known to the guest.
    #[cfg(test)]
    pub fn live_processes(&self) -> usize {
        self.routes.len()
    }

    /// Forgets a client; its processes keep running, detached.
    ///
    /// Output the departed client received but never credited is credited back to the guest here, so every
    /// detach restores the process's whole window for the hold (and for the next client) instead of
    /// shrinking it.
    #[must_use]
    pub fn remove_client(&mut self, client: ClientId) -> Vec<Action> {
        let Some(state) = self.clients.remove(&client) else { return Vec::new() };
        let mut actions = Vec::new();
        for guest_id in state.procs.into_values() {
            let Some(route) = self.routes.get_mut(&guest_id) else { continue };
            route.detached = true;
            let uncredited = u64::from(route.window).saturating_sub(route.output.available());
            if let Ok(bytes) = u32::try_from(uncredited) {
                if bytes > 0 && route.output.grant(bytes).is_ok() {
                    actions.push(Action::ToGuest(ToGuest::Credit { id: guest_id, bytes }));
                }
            }
        }
        actions
    }

    /// Handles one message from a client.
    ///
    /// # Errors
    /// A [`ClientViolation`]; the caller disconnects the client (and calls [`Mux::remove_client`]).
    pub fn from_client(&mut self, client: ClientId, msg: ToGuest) -> Result<Vec<Action>, ClientViolation> {
        // A removed (or never added) client's late messages go nowhere.
        if !self.clients.contains_key(&client) {
            return Ok(Vec::new());
        }
        let reply = |m: ToHost| Ok(vec![Action::ToClient(client, m)]);
        let forward = |m: ToGuest| Ok(vec![Action::ToGuest(m)]);
        match msg {
            ToGuest::Spawn(mut spawn) => {
                let state = self.clients.entry(client).or_default();
                let id = spawn.id;
                if !self.accepting {
                    return reply(ToHost::Refused { id, reason: Refusal::ShuttingDown });
                }
                if state.highest.is_some_and(|h| id <= h) {
                    return reply(ToHost::Refused { id, reason: Refusal::IdNotIncreasing });
                }
                state.highest = Some(id);
                if u64::from(spawn.output_window) > MAX_WINDOW_BYTES || spawn.argv.is_empty() {
                    return reply(ToHost::Refused { id, reason: Refusal::Invalid });
                }
                let guest_id = ProcId(self.next_guest_id);
                self.next_guest_id += 1;
                state.procs.insert(id, guest_id);
                self.routes.insert(
                    guest_id,
                    Route {
                        client,
                        client_id: id,
                        argv: spawn.argv.clone(),
                        pid: None,
                        window: spawn.output_window,
                        output: Window::new(spawn.output_window),
                        stdin: Window::new(0),
                        tty: spawn.pty.is_some(),
                        stdin_closed: false,
                        detached: false,
                        held: Vec::new(),
                        finished: false,
                    },
                );
                spawn.id = guest_id;
                forward(ToGuest::Spawn(spawn))
            }
            ToGuest::Stdin { id, data } => match self.client_route(client, id)? {
                Some((_, route)) if route.stdin_closed => Err(ClientViolation::Unexpected("stdin after EOF")),
                Some((guest_id, route)) => {
                    route.stdin.consume(data.len()).map_err(|source| ClientViolation::Credit { id, source })?;
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
            ToGuest::Credit { id, bytes } => match self.client_route(client, id)? {
                Some((guest_id, route)) => {
                    route.output.grant(bytes).map_err(|source| ClientViolation::Credit { id, source })?;
                    forward(ToGuest::Credit { id: guest_id, bytes })
                }
                None => Ok(Vec::new()),
            },
            ToGuest::Signal { id, signal } => self.map_forward(client, id, |id| ToGuest::Signal { id, signal }),
            // Only a terminal has a size; a resize of anything else is dropped here.
            ToGuest::Resize { id, size } => match self.client_route(client, id)? {
                Some((guest_id, route)) if route.tty => forward(ToGuest::Resize { id: guest_id, size }),
                Some(_) | None => Ok(Vec::new()),
            },
            ToGuest::Reattach { id, pid } => Ok(self.attach(client, id, pid)),
            ToGuest::ListProcesses => {
                let list = self
                    .routes
                    .values()
                    .filter(|r| !r.finished)
                    .filter_map(|r| {
                        Some(ProcessSummary { pid: r.pid?, argv: r.argv.clone(), attached: !r.detached, tty: r.tty })
                    })
                    .collect();
                reply(ToHost::Processes { list })
            }
            ToGuest::Ping { nonce } => reply(ToHost::Pong { nonce }),
            ToGuest::Shutdown { .. } => Err(ClientViolation::Unexpected("Shutdown")),
            ToGuest::Hello(_) => Err(ClientViolation::Unexpected("a second Hello")),
            ToGuest::Reserved => Err(ClientViolation::Unexpected("the reserved message")),
        }
    }

    /// Handles one message from the guest.
    ///
    /// # Errors
    /// A [`GuestViolation`]; the caller stops the VM.
    pub fn from_guest(&mut self, msg: ToHost) -> Result<Vec<Action>, GuestViolation> {
        match msg {
            ToHost::Started { id, pid, stdin_window } => {
                let route = self.routes.get_mut(&id).ok_or(GuestViolation::UnknownProcess(id))?;
                route.stdin = Window::new(stdin_window);
                route.pid = Some(pid);
                let mut actions = vec![Action::Started { guest_id: id, pid, argv: route.argv.clone() }];
                if !route.detached {
                    let msg = ToHost::Started { id: route.client_id, pid, stdin_window };
                    actions.push(Action::ToClient(route.client, msg));
                }
                Ok(actions)
            }
            ToHost::Output { id, stream, data } => {
                let route =
                    self.routes.get_mut(&id).filter(|r| !r.finished).ok_or(GuestViolation::UnknownProcess(id))?;
                route.output.consume(data.len()).map_err(|source| GuestViolation::Credit { id, source })?;
                if route.detached {
                    // Held, not credited: the guest stops once its window is used, which bounds the hold.
                    route.held.push(ToHost::Output { id, stream, data });
                    return Ok(Vec::new());
                }
                Ok(vec![Action::ToClient(route.client, ToHost::Output { id: route.client_id, stream, data })])
            }
            ToHost::StdinCredit { id, bytes } => match self.routes.get_mut(&id).filter(|r| !r.finished) {
                Some(route) => {
                    route.stdin.grant(bytes).map_err(|source| GuestViolation::Credit { id, source })?;
                    if route.detached {
                        return Ok(Vec::new());
                    }
                    Ok(vec![Action::ToClient(route.client, ToHost::StdinCredit { id: route.client_id, bytes })])
                }
                // The agent credits stdin it wrote just before the process exited: a benign race.
                None if id.0 < self.next_guest_id => Ok(Vec::new()),
                None => Err(GuestViolation::UnknownProcess(id)),
            },
            ToHost::Exited { id, status } => {
                let route =
                    self.routes.get_mut(&id).filter(|r| !r.finished).ok_or(GuestViolation::UnknownProcess(id))?;
                let event = Action::Exited { guest_id: id, pid: route.pid, argv: route.argv.clone(), status };
                if route.detached {
                    route.held.push(ToHost::Exited { id, status });
                    route.finished = true;
                    self.forget_old_finished();
                    return Ok(vec![event]);
                }
                let route = self.end_route(id)?;
                Ok(vec![event, Action::ToClient(route.client, ToHost::Exited { id: route.client_id, status })])
            }
            ToHost::Refused { id, reason } => {
                let route = self.end_route(id)?;
                Ok(if route.detached {
                    Vec::new()
                } else {
                    vec![Action::ToClient(route.client, ToHost::Refused { id: route.client_id, reason })]
                })
            }
            ToHost::Pong { .. } => Err(GuestViolation::Unexpected("an unsolicited Pong")),
            ToHost::Processes { .. } => Err(GuestViolation::Unexpected("a process list")),
            ToHost::Hello(_) => Err(GuestViolation::Unexpected("a second Hello")),
            ToHost::Reserved => Err(GuestViolation::Unexpected("the reserved message")),
        }
    }

    /// Moves a detached process to `client` as `id` and replays what it held.
    fn attach(&mut self, client: ClientId, id: ProcId, pid: u32) -> Vec<Action> {
        let refuse = |reason| vec![Action::ToClient(client, ToHost::Refused { id, reason })];
        let state = self.clients.entry(client).or_default();
        if state.highest.is_some_and(|h| id <= h) {
            return refuse(Refusal::IdNotIncreasing);
        }
        state.highest = Some(id);
        let Some((&guest_id, route)) = self.routes.iter_mut().find(|(_, r)| r.detached && r.pid == Some(pid)) else {
            return refuse(Refusal::NoSuchProcess);
        };
        route.client = client;
        route.client_id = id;
        route.detached = false;
        let stdin_window =
            if route.stdin_closed { 0 } else { u32::try_from(route.stdin.available()).unwrap_or(u32::MAX) };
        let mut actions = vec![Action::ToClient(client, ToHost::Started { id, pid, stdin_window })];
        for held in route.held.drain(..) {
            let msg = match held {
                ToHost::Output { stream, data, .. } => ToHost::Output { id, stream, data },
                ToHost::Exited { status, .. } => ToHost::Exited { id, status },
                other => other,
            };
            actions.push(Action::ToClient(client, msg));
        }
        if route.finished {
            self.routes.remove(&guest_id);
        } else if let Some(state) = self.clients.get_mut(&client) {
            state.procs.insert(id, guest_id);
        }
        actions
    }

    /// Bounds the processes kept only for their output and status.
    fn forget_old_finished(&mut self) {
        let mut finished: Vec<ProcId> = self.routes.iter().filter(|(_, r)| r.finished).map(|(id, _)| *id).collect();
        if finished.len() > MAX_FINISHED_DETACHED {
            finished.sort_unstable();
            for id in &finished[..finished.len() - MAX_FINISHED_DETACHED] {
                self.routes.remove(id);
            }
        }
    }

    fn end_route(&mut self, id: ProcId) -> Result<Route, GuestViolation> {
        let route = self.routes.remove(&id).ok_or(GuestViolation::UnknownProcess(id))?;
        if let Some(client) = self.clients.get_mut(&route.client) {
            client.procs.remove(&route.client_id);
        }
        Ok(route)
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

    fn map_forward(
        &mut self,
        client: ClientId,
        id: ProcId,
        make: impl FnOnce(ProcId) -> ToGuest,
    ) -> Result<Vec<Action>, ClientViolation> {
        Ok(match self.client_route(client, id)? {
            Some((guest_id, _)) => vec![Action::ToGuest(make(guest_id))],
            None => Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests;
