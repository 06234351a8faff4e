//! Stateful property test of the multiplexer: random sequences of every client and guest message, clients
//! coming and going, the sandbox starting to stop. Whatever arrives, nothing panics, what each client is
//! sent follows the protocol, what the guest is sent follows it too, and the state stays within its bounds.
//! Frames of the other channel (the guest link's from a client, the attach socket's from the guest) go
//! through the decoder first, as they would on the sockets: only what means the same on both gets through.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::collections::HashMap;

use proptest::prelude::*;
use vm_protocol::attach::{SupervisorReply, ToClient, ToSupervisor};
use vm_protocol::link::{ToGuest, ToHost};
use vm_protocol::message::Refusal;
use vm_protocol::{arbitrary, frame, ProcId, ProcessEvent, ProcessRequest};
use vm_supervisor::mux::{Action, ClientId, Mux, MAX_FINISHED_DETACHED, MAX_PROCESSES, OUTPUT_BUDGET_BYTES};

/// Few ids and clients, so messages hit live processes.
const IDS: std::ops::Range<u32> = 1..6;
const CLIENTS: u64 = 3;

#[derive(Debug, Clone)]
enum Op {
    Connect(u64),
    Disconnect(u64),
    FromClient(u64, ToSupervisor),
    FromGuest(ToHost),
    /// A frame of the guest link's type, from a client.
    LinkFrameFromClient(u64, ToGuest),
    /// A frame of the attach socket's type, from the guest.
    AttachFrameFromGuest(ToClient),
    /// A well-behaved guest's next step for the `n`th process it was asked to spawn (so sequences reach
    /// deep states, not only the first violation).
    Polite(prop::sample::Index, u16),
    StopAccepting,
}

fn op() -> impl Strategy<Value = Op> {
    let commands = vec![vec!["true".to_owned()], vec!["cat".to_owned()], vec![]];
    prop_oneof![
        1 => (1..=CLIENTS).prop_map(Op::Connect),
        1 => (1..=CLIENTS).prop_map(Op::Disconnect),
        6 => ((1..=CLIENTS), arbitrary::attach_to_supervisor(IDS, commands.clone())).prop_map(|(c, m)| Op::FromClient(c, m)),
        3 => arbitrary::link_to_host(IDS).prop_map(Op::FromGuest),
        1 => ((1..=CLIENTS), arbitrary::link_to_guest(IDS, commands)).prop_map(|(c, m)| Op::LinkFrameFromClient(c, m)),
        1 => arbitrary::attach_to_client(IDS).prop_map(Op::AttachFrameFromGuest),
        6 => (any::<prop::sample::Index>(), 1..2048u16).prop_map(|(i, n)| Op::Polite(i, n)),
        1 => Just(Op::StopAccepting),
    ]
}

/// Where one process stands, as one client has been told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Started,
    Ended,
}

/// Checks what the mux sends against the protocol's rules, as the receiving peers would.
#[derive(Debug, Default)]
struct Peers {
    /// Per client and client-side id.
    clients: HashMap<(ClientId, ProcId), Seen>,
    /// The highest guest id spawned.
    highest_spawn: u32,
    /// Ids a client spawned more than once.
    reused: std::collections::HashSet<(ClientId, ProcId)>,
    spawned_by_clients: std::collections::HashSet<(ClientId, ProcId)>,
    /// What the guest was asked to spawn: its id, output window, and whether it started.
    spawned: Vec<(ProcId, u32, bool)>,
}

impl Peers {
    fn check(&mut self, actions: &[Action]) -> Result<(), TestCaseError> {
        for action in actions {
            match action {
                Action::ToGuest(ToGuest::Process(ProcessRequest::Spawn(s))) => {
                    prop_assert!(s.id.0 > self.highest_spawn, "guest ids must increase: {:?}", s.id);
                    prop_assert!(!s.argv.is_empty());
                    self.highest_spawn = s.id.0;
                    self.spawned.push((s.id, s.output_window, false));
                }
                Action::ToGuest(ToGuest::Process(ProcessRequest::Credit { bytes, .. })) => {
                    prop_assert!(*bytes > 0, "zero credit to the guest");
                }
                Action::ToGuest(ToGuest::Process(ProcessRequest::Stdin { data, .. })) => {
                    prop_assert!(!data.is_empty(), "empty stdin");
                }
                Action::ToGuest(ToGuest::Hello(_) | ToGuest::Vm(_) | ToGuest::Net(_)) => {
                    prop_assert!(false, "not for the guest: {action:?}");
                }
                Action::ToClient(client, msg) => self.sent_to_client(*client, msg)?,
                Action::Exited { status, .. } => prop_assert!(status.is_plausible()),
                _ => {}
            }
        }
        Ok(())
    }

    fn sent_to_client(&mut self, client: ClientId, msg: &ToClient) -> Result<(), TestCaseError> {
        match msg {
            ToClient::Process(event) => self.event_to_client(client, event)?,
            ToClient::Supervisor(SupervisorReply::Processes { list }) => prop_assert!(list.len() <= MAX_PROCESSES),
            // The notice of a disconnection comes from a client's writer, never from the multiplexer.
            ToClient::Hello(_) | ToClient::Supervisor(SupervisorReply::Disconnected { .. }) => {
                prop_assert!(false, "not for a client: {msg:?}");
            }
            // The supervisor answers a client's Ping itself.
            ToClient::Pong { .. } | ToClient::Supervisor(_) => {}
            // A denied port forward's answer; the streams themselves are routed outside the multiplexer.
            ToClient::Forward(vm_protocol::net::ForwardEvent::Refused { .. }) => {}
            ToClient::Forward(_) => prop_assert!(false, "a stream from the multiplexer: {msg:?}"),
            ToClient::Reserved(never) | ToClient::LinkOnly(never) => match *never {},
        }
        Ok(())
    }

    fn event_to_client(&mut self, client: ClientId, msg: &ProcessEvent) -> Result<(), TestCaseError> {
        let state = self.clients.get(&(client, msg.id())).copied();
        match msg {
            ProcessEvent::Started { id, .. } => {
                prop_assert_eq!(state, None, "a second Started");
                self.clients.insert((client, *id), Seen::Started);
            }
            ProcessEvent::Output { data, .. } => {
                prop_assert_eq!(state, Some(Seen::Started), "output outside Started..Exited");
                prop_assert!(!data.is_empty(), "empty output to a client");
            }
            ProcessEvent::Exited { id, status } => {
                prop_assert_eq!(state, Some(Seen::Started), "Exited without Started, or twice");
                prop_assert!(status.is_plausible());
                self.clients.insert((client, *id), Seen::Ended);
            }
            ProcessEvent::SpawnFailed { id, status, .. } => {
                prop_assert_eq!(state, None, "SpawnFailed after Started");
                prop_assert!(status.is_plausible());
                self.clients.insert((client, *id), Seen::Ended);
            }
            // A spawn reusing an id is refused, whatever that id's process is doing: the client's own doing.
            ProcessEvent::Refused { reason: Refusal::IdNotIncreasing, .. } => {}
            ProcessEvent::Refused { id, .. } if self.reused.contains(&(client, *id)) => {}
            ProcessEvent::Refused { .. } => prop_assert!(state != Some(Seen::Started), "a running process refused"),
            ProcessEvent::StdinCredit { bytes, .. } => prop_assert!(*bytes > 0, "zero stdin credit to a client"),
        }
        Ok(())
    }
}

impl Peers {
    /// Keeps the polite guest's view in step with an accepted message of the random one.
    fn guest_sent(&mut self, msg: &ToHost) {
        let ToHost::Process(msg) = msg else { return };
        let id = msg.id();
        let Some(i) = self.spawned.iter().position(|(p, ..)| *p == id) else { return };
        match msg {
            ProcessEvent::Started { .. } => self.spawned[i].2 = true,
            ProcessEvent::Output { data, .. } => {
                let used = u32::try_from(data.len()).unwrap_or(u32::MAX);
                self.spawned[i].1 = self.spawned[i].1.saturating_sub(used);
            }
            ProcessEvent::Exited { .. } | ProcessEvent::SpawnFailed { .. } | ProcessEvent::Refused { .. } => {
                self.spawned.swap_remove(i);
            }
            ProcessEvent::StdinCredit { .. } => {}
        }
    }

    /// The polite guest's next message for the `at`th spawned process: `Started`, then output of `len` bytes
    /// while the window lasts, then `Exited`.
    fn polite(&mut self, at: prop::sample::Index, len: u16) -> Option<ToHost> {
        if self.spawned.is_empty() {
            return None;
        }
        let i = at.index(self.spawned.len());
        let (id, window, started) = &mut self.spawned[i];
        let id = *id;
        if !*started {
            *started = true;
            return Some(ToHost::Process(ProcessEvent::Started {
                id,
                pid: 1000 + id.0,
                stdin_window: 4096,
                output_window: *window,
            }));
        }
        if u32::from(len) <= *window && !len.is_multiple_of(8) {
            *window -= u32::from(len);
            let data = vec![b'x'; usize::from(len)];
            return Some(ToHost::Process(ProcessEvent::Output {
                id,
                stream: vm_protocol::Stream::Stdout,
                data: data.into(),
            }));
        }
        self.spawned.swap_remove(i);
        Some(ToHost::Process(ProcessEvent::Exited { id, status: vm_protocol::ExitStatus::Code(0) }))
    }
}

/// `msg` encoded as a frame and decoded as an `M`, as a socket of the other channel would read it.
fn decode<M: serde::de::DeserializeOwned>(msg: &impl serde::Serialize) -> Option<M> {
    let mut wire = Vec::new();
    frame::encode(msg, &mut wire).unwrap();
    frame::decode::<M>(&wire).ok().flatten().map(|(m, _)| m)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn any_sequence_keeps_the_rules_and_the_bounds(ops in prop::collection::vec(op(), 1..80)) {
        let mut mux = Mux::default();
        let mut peers = Peers::default();
        // A reconnecting client is a new connection, with ids of its own.
        let mut current: HashMap<u64, ClientId> = HashMap::new();
        let mut next = 0u64;
        for op in ops {
            match op {
                Op::Connect(c) => {
                    if let Some(old) = current.remove(&c) {
                        mux.remove_client(old);
                    }
                    next += 1;
                    current.insert(c, ClientId(next));
                    mux.add_client(ClientId(next));
                }
                Op::Disconnect(c) => {
                    if let Some(old) = current.remove(&c) {
                        mux.remove_client(old);
                    }
                }
                Op::FromClient(c, msg) => {
                    // Messages of a client that is not connected never reach the mux.
                    let Some(client) = current.get(&c).copied() else { continue };
                    if let ToSupervisor::Process(ProcessRequest::Spawn(spawn)) = &msg {
                        if !peers.spawned_by_clients.insert((client, spawn.id)) {
                            peers.reused.insert((client, spawn.id));
                        }
                    }
                    match mux.from_client(client, msg) {
                        Ok(actions) => peers.check(&actions)?,
                        Err(_) => {
                            mux.remove_client(client);
                            current.remove(&c);
                        }
                    }
                }
                Op::FromGuest(msg) => match mux.from_guest(msg.clone()) {
                    Ok(actions) => {
                        peers.guest_sent(&msg);
                        peers.check(&actions)?;
                    }
                    // The sandbox stops here: nothing after a violation is routed.
                    Err(_) => break,
                },
                Op::Polite(at, len) => {
                    let Some(msg) = peers.polite(at, len) else { continue };
                    let actions = mux.from_guest(msg.clone());
                    prop_assert!(actions.is_ok(), "a polite guest's {msg:?} was refused: {actions:?}");
                    peers.check(&actions.unwrap_or_default())?;
                }
                Op::LinkFrameFromClient(c, msg) => {
                    // The attach server decodes a client's frames as the socket's type; a frame that does not
                    // decode disconnects the client.
                    let Some(client) = current.get(&c).copied() else { continue };
                    let decoded = decode::<ToSupervisor>(&msg);
                    let link_only = matches!(msg, ToGuest::Vm(_));
                    prop_assert!(!(link_only && decoded.is_some()), "{msg:?} decoded on the attach socket");
                    match decoded.map(|m| mux.from_client(client, m)) {
                        Some(Ok(actions)) => peers.check(&actions)?,
                        Some(Err(_)) | None => {
                            mux.remove_client(client);
                            current.remove(&c);
                        }
                    }
                }
                Op::AttachFrameFromGuest(msg) => {
                    // The guest link decodes the guest's frames as the link's type; one that does not decode
                    // stops the sandbox.
                    let decoded = decode::<ToHost>(&msg);
                    let socket_only = matches!(msg, ToClient::Supervisor(_));
                    prop_assert!(!(socket_only && decoded.is_some()), "{msg:?} decoded on the guest link");
                    let Some(msg) = decoded else { break };
                    match mux.from_guest(msg.clone()) {
                        Ok(actions) => {
                            peers.guest_sent(&msg);
                            peers.check(&actions)?;
                        }
                        Err(_) => break,
                    }
                }
                Op::StopAccepting => mux.stop_accepting(),
            }
            prop_assert!(mux.retained_bytes() <= OUTPUT_BUDGET_BYTES);
            prop_assert!(mux.known_processes() <= MAX_PROCESSES + MAX_FINISHED_DETACHED);
        }
    }
}
