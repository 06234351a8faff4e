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
//! A client that disconnects has its processes killed; their remaining output is credited back to the
//! guest and dropped, so they can finish and be reported.
//!
//! This is pure state: it returns [`Action`]s and never does I/O, so it is tested without a VM.

use std::collections::HashMap;

use vm_protocol::flow::MAX_WINDOW_BYTES;
use vm_protocol::message::Refusal;
use vm_protocol::{CreditError, ExitStatus, ProcId, SignalName, ToGuest, ToHost, Window};

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
}

#[derive(Debug)]
struct Route {
    client: ClientId,
    client_id: ProcId,
    argv: Vec<String>,
    /// The guest pid, once started.
    pid: Option<u32>,
    output: Window,
    stdin: Window,
    /// The client is gone: output is credited back and dropped.
    detached: bool,
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
        Self {
            next_guest_id: 1,
            routes: HashMap::new(),
            clients: HashMap::new(),
            accepting: true,
        }
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
    pub fn live_processes(&self) -> usize {
        self.routes.len()
    }

    /// Forgets a client and kills its processes.
    pub fn remove_client(&mut self, client: ClientId) -> Vec<Action> {
        let Some(state) = self.clients.remove(&client) else {
            return Vec::new();
        };
        state
            .procs
            .into_values()
            .filter_map(|guest_id| {
                let route = self.routes.get_mut(&guest_id)?;
                route.detached = true;
                Some(Action::ToGuest(ToGuest::Signal {
                    id: guest_id,
                    signal: SignalName::Kill,
                }))
            })
            .collect()
    }

    /// Handles one message from a client.
    ///
    /// # Errors
    /// A [`ClientViolation`]; the caller disconnects the client (and calls [`Mux::remove_client`]).
    pub fn from_client(&mut self, client: ClientId, msg: ToGuest) -> Result<Vec<Action>, ClientViolation> {
        let reply = |m: ToHost| Ok(vec![Action::ToClient(client, m)]);
        let forward = |m: ToGuest| Ok(vec![Action::ToGuest(m)]);
        match msg {
            ToGuest::Spawn(mut spawn) => {
                let state = self.clients.entry(client).or_default();
                let id = spawn.id;
                if !self.accepting {
                    return reply(ToHost::Refused {
                        id,
                        reason: Refusal::ShuttingDown,
                    });
                }
                if state.highest.is_some_and(|h| id <= h) {
                    return reply(ToHost::Refused {
                        id,
                        reason: Refusal::IdNotIncreasing,
                    });
                }
                state.highest = Some(id);
                if u64::from(spawn.output_window) > MAX_WINDOW_BYTES || spawn.argv.is_empty() {
                    return reply(ToHost::Refused {
                        id,
                        reason: Refusal::Invalid,
                    });
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
                        output: Window::new(spawn.output_window),
                        stdin: Window::new(0),
                        detached: false,
                    },
                );
                spawn.id = guest_id;
                forward(ToGuest::Spawn(spawn))
            }
            ToGuest::Stdin { id, data } => match self.client_route(client, id)? {
                Some((guest_id, route)) => {
                    route
                        .stdin
                        .consume(data.len())
                        .map_err(|source| ClientViolation::Credit { id, source })?;
                    forward(ToGuest::Stdin { id: guest_id, data })
                }
                None => Ok(Vec::new()),
            },
            ToGuest::Credit { id, bytes } => match self.client_route(client, id)? {
                Some((guest_id, route)) => {
                    route
                        .output
                        .grant(bytes)
                        .map_err(|source| ClientViolation::Credit { id, source })?;
                    forward(ToGuest::Credit { id: guest_id, bytes })
                }
                None => Ok(Vec::new()),
            },
            ToGuest::StdinEof { id } => self.map_forward(client, id, |id| ToGuest::StdinEof { id }),
            ToGuest::Signal { id, signal } => self.map_forward(client, id, |id| ToGuest::Signal { id, signal }),
            ToGuest::Resize { id, size } => self.map_forward(client, id, |id| ToGuest::Resize { id, size }),
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
                let mut actions = vec![Action::Started {
                    guest_id: id,
                    pid,
                    argv: route.argv.clone(),
                }];
                if !route.detached {
                    let msg = ToHost::Started {
                        id: route.client_id,
                        pid,
                        stdin_window,
                    };
                    actions.push(Action::ToClient(route.client, msg));
                }
                Ok(actions)
            }
            ToHost::Output { id, stream, data } => {
                let route = self.routes.get_mut(&id).ok_or(GuestViolation::UnknownProcess(id))?;
                route
                    .output
                    .consume(data.len())
                    .map_err(|source| GuestViolation::Credit { id, source })?;
                if route.detached {
                    // Nobody reads it: hand the credit straight back so the process can finish.
                    let bytes = u32::try_from(data.len()).unwrap_or(u32::MAX);
                    route
                        .output
                        .grant(bytes)
                        .map_err(|source| GuestViolation::Credit { id, source })?;
                    return Ok(vec![Action::ToGuest(ToGuest::Credit { id, bytes })]);
                }
                Ok(vec![Action::ToClient(
                    route.client,
                    ToHost::Output {
                        id: route.client_id,
                        stream,
                        data,
                    },
                )])
            }
            ToHost::StdinCredit { id, bytes } => match self.routes.get_mut(&id) {
                Some(route) => {
                    route
                        .stdin
                        .grant(bytes)
                        .map_err(|source| GuestViolation::Credit { id, source })?;
                    if route.detached {
                        return Ok(Vec::new());
                    }
                    Ok(vec![Action::ToClient(
                        route.client,
                        ToHost::StdinCredit {
                            id: route.client_id,
                            bytes,
                        },
                    )])
                }
                // The agent credits stdin it wrote just before the process exited: a benign race.
                None if id.0 < self.next_guest_id => Ok(Vec::new()),
                None => Err(GuestViolation::UnknownProcess(id)),
            },
            ToHost::Exited { id, status } => {
                let route = self.end_route(id)?;
                let mut actions = vec![Action::Exited {
                    guest_id: id,
                    pid: route.pid,
                    argv: route.argv,
                    status,
                }];
                if !route.detached {
                    actions.push(Action::ToClient(
                        route.client,
                        ToHost::Exited {
                            id: route.client_id,
                            status,
                        },
                    ));
                }
                Ok(actions)
            }
            ToHost::Refused { id, reason } => {
                let route = self.end_route(id)?;
                Ok(if route.detached {
                    Vec::new()
                } else {
                    vec![Action::ToClient(
                        route.client,
                        ToHost::Refused {
                            id: route.client_id,
                            reason,
                        },
                    )]
                })
            }
            ToHost::Pong { .. } => Err(GuestViolation::Unexpected("an unsolicited Pong")),
            ToHost::Hello(_) => Err(GuestViolation::Unexpected("a second Hello")),
            ToHost::Reserved => Err(GuestViolation::Unexpected("the reserved message")),
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
                let route = self
                    .routes
                    .get_mut(&guest_id)
                    .ok_or(ClientViolation::UnknownProcess(id))?;
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
mod tests {
    use super::*;
    use vm_protocol::{Spawn, Stream};

    const A: ClientId = ClientId(1);
    const B: ClientId = ClientId(2);

    fn spawn(id: u32, window: u32) -> ToGuest {
        ToGuest::Spawn(Spawn {
            id: ProcId(id),
            argv: vec!["true".into()],
            env: vec![],
            cwd: None,
            pty: None,
            output_window: window,
        })
    }

    fn mux_with(clients: &[ClientId]) -> Mux {
        let mut mux = Mux::default();
        for c in clients {
            mux.add_client(*c);
        }
        mux
    }

    #[test]
    fn two_clients_may_use_the_same_ids() {
        let mut mux = mux_with(&[A, B]);
        let a = mux.from_client(A, spawn(1, 10)).unwrap();
        let b = mux.from_client(B, spawn(1, 10)).unwrap();
        assert!(matches!(&a[..], [Action::ToGuest(ToGuest::Spawn(s))] if s.id == ProcId(1)));
        assert!(matches!(&b[..], [Action::ToGuest(ToGuest::Spawn(s))] if s.id == ProcId(2)));
        let out = mux
            .from_guest(ToHost::Output {
                id: ProcId(2),
                stream: Stream::Stdout,
                data: b"hi".to_vec().into(),
            })
            .unwrap();
        assert!(matches!(&out[..], [Action::ToClient(c, ToHost::Output { id, .. })] if *c == B && *id == ProcId(1)));
    }

    #[test]
    fn guest_output_beyond_the_window_is_a_violation() {
        let mut mux = mux_with(&[A]);
        mux.from_client(A, spawn(1, 4)).unwrap();
        let out = |n: usize| ToHost::Output {
            id: ProcId(1),
            stream: Stream::Stdout,
            data: vec![0; n].into(),
        };
        mux.from_guest(out(4)).unwrap();
        assert!(matches!(mux.from_guest(out(1)), Err(GuestViolation::Credit { .. })));
        mux.from_client(
            A,
            ToGuest::Credit {
                id: ProcId(1),
                bytes: 1,
            },
        )
        .unwrap();
        mux.from_guest(out(1)).unwrap();
    }

    #[test]
    fn client_stdin_beyond_the_guest_window_is_a_violation() {
        let mut mux = mux_with(&[A]);
        mux.from_client(A, spawn(1, 4)).unwrap();
        let stdin = |n: usize| ToGuest::Stdin {
            id: ProcId(1),
            data: vec![0; n].into(),
        };
        assert!(
            matches!(mux.from_client(A, stdin(1)), Err(ClientViolation::Credit { .. })),
            "before Started"
        );
        mux.from_guest(ToHost::Started {
            id: ProcId(1),
            pid: 10,
            stdin_window: 3,
        })
        .unwrap();
        mux.from_client(A, stdin(3)).unwrap();
        assert!(matches!(
            mux.from_client(A, stdin(1)),
            Err(ClientViolation::Credit { .. })
        ));
    }

    #[test]
    fn a_departed_client_has_its_processes_killed_and_drained() {
        let mut mux = mux_with(&[A]);
        mux.from_client(A, spawn(1, 4)).unwrap();
        let killed = mux.remove_client(A);
        assert_eq!(
            killed,
            [Action::ToGuest(ToGuest::Signal {
                id: ProcId(1),
                signal: SignalName::Kill
            })]
        );
        let out = mux
            .from_guest(ToHost::Output {
                id: ProcId(1),
                stream: Stream::Stdout,
                data: vec![0; 4].into(),
            })
            .unwrap();
        assert_eq!(
            out,
            [Action::ToGuest(ToGuest::Credit {
                id: ProcId(1),
                bytes: 4
            })]
        );
        let exited = mux
            .from_guest(ToHost::Exited {
                id: ProcId(1),
                status: ExitStatus::Signaled(9),
            })
            .unwrap();
        assert!(
            matches!(&exited[..], [Action::Exited { .. }]),
            "reported, but to nobody"
        );
        assert_eq!(mux.live_processes(), 0);
    }

    #[test]
    fn late_and_unknown_ids_are_told_apart() {
        let mut mux = mux_with(&[A]);
        mux.from_client(A, spawn(1, 4)).unwrap();
        mux.from_guest(ToHost::Exited {
            id: ProcId(1),
            status: ExitStatus::Code(0),
        })
        .unwrap();
        assert_eq!(mux.from_client(A, ToGuest::StdinEof { id: ProcId(1) }).unwrap(), []);
        assert_eq!(
            mux.from_guest(ToHost::StdinCredit {
                id: ProcId(1),
                bytes: 1
            })
            .unwrap(),
            []
        );
        assert!(matches!(
            mux.from_client(A, ToGuest::StdinEof { id: ProcId(2) }),
            Err(ClientViolation::UnknownProcess(_))
        ));
        assert!(matches!(
            mux.from_guest(ToHost::Output {
                id: ProcId(1),
                stream: Stream::Stdout,
                data: vec![].into()
            }),
            Err(GuestViolation::UnknownProcess(_))
        ));
        assert!(matches!(
            mux.from_guest(ToHost::StdinCredit {
                id: ProcId(9),
                bytes: 1
            }),
            Err(GuestViolation::UnknownProcess(_))
        ));
    }

    #[test]
    fn refuses_spawns_when_stopping_or_out_of_order() {
        let mut mux = mux_with(&[A]);
        mux.from_client(A, spawn(5, 4)).unwrap();
        assert_eq!(
            mux.from_client(A, spawn(5, 4)).unwrap(),
            [Action::ToClient(
                A,
                ToHost::Refused {
                    id: ProcId(5),
                    reason: Refusal::IdNotIncreasing
                }
            )]
        );
        mux.stop_accepting();
        assert_eq!(
            mux.from_client(A, spawn(6, 4)).unwrap(),
            [Action::ToClient(
                A,
                ToHost::Refused {
                    id: ProcId(6),
                    reason: Refusal::ShuttingDown
                }
            )]
        );
    }

    #[test]
    fn clients_may_not_shut_the_vm_down() {
        let mut mux = mux_with(&[A]);
        assert!(matches!(
            mux.from_client(A, ToGuest::Shutdown { grace_ms: 0 }),
            Err(ClientViolation::Unexpected(_))
        ));
    }
}
