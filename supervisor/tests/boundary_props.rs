//! Stateful property test of the boundary core: random interleavings of every client and guest message,
//! process and stream alike, egress tasks ending, clients coming and going, time passing, the sandbox
//! starting to stop. Whatever arrives, nothing panics, what each client is sent follows the protocol, what
//! the guest is sent follows it too, no stream carries a byte past the credit its receiver granted, a
//! well-behaved guest is never called a violator, and the state stays within its bounds. Frames of the other
//! channel (the guest link's from a client, the attach socket's from the guest) go through the decoder first,
//! as they would on the sockets: only what means the same on both gets through.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use vm_protocol::attach::{SupervisorReply, ToClient, ToSupervisor};
use vm_protocol::link::{ToGuest, ToHost};
use vm_protocol::message::Refusal;
use vm_protocol::net::{ForwardEvent, Listener, NetToGuest, NetToHost, StreamFrame, StreamId, NET_WINDOW_BYTES};
use vm_protocol::policy::SandboxPolicy;
use vm_protocol::{arbitrary, frame, ProcId, ProcessEvent, ProcessRequest};
use vm_supervisor::boundary::process::{MAX_FINISHED_DETACHED, MAX_PROCESSES, OUTPUT_BUDGET_BYTES};
use vm_supervisor::boundary::{Boundary, BoundaryConfig, ClientId, Input, Note, Outgoing, Output};
use vm_supervisor::network::egress::Report;

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
    /// A well-behaved guest's next step for the `n`th stream open on the link: an egress stream it opens, or
    /// one the supervisor asked it to connect (a port forward).
    PoliteStream(prop::sample::Index, u16),
    /// A well-behaved client's next step for its `n`th port forward: open one, send within the guest's
    /// grant, credit what it was sent, end it.
    PoliteForward(u64, prop::sample::Index, u16),
    /// A well-behaved client starts a process.
    PoliteSpawn(u64, bool),
    /// The egress task of the `n`th accepted stream ends.
    EgressGone(prop::sample::Index),
    /// Time passes, and the loop ticks.
    Tick(u16),
    Stop,
}

/// Every kind of step: `hostile` weighs the random messages (a random guest mostly breaks a rule at once,
/// which ends the run), `polite` the well-behaved peers' steps (which take runs into deep states).
fn op(hostile: u32, polite: u32) -> impl Strategy<Value = Op> {
    let commands = vec![vec!["true".to_owned()], vec!["cat".to_owned()], vec![]];
    prop_oneof![
        2 => (1..=CLIENTS).prop_map(Op::Connect),
        1 => (1..=CLIENTS).prop_map(Op::Disconnect),
        3 * hostile => ((1..=CLIENTS), arbitrary::attach_to_supervisor(IDS, commands.clone())).prop_map(|(c, m)| Op::FromClient(c, m)),
        hostile => arbitrary::link_to_host(IDS).prop_map(Op::FromGuest),
        hostile => ((1..=CLIENTS), arbitrary::link_to_guest(IDS, commands)).prop_map(|(c, m)| Op::LinkFrameFromClient(c, m)),
        hostile => arbitrary::attach_to_client(IDS).prop_map(Op::AttachFrameFromGuest),
        2 * polite => ((1..=CLIENTS), any::<bool>()).prop_map(|(c, cat)| Op::PoliteSpawn(c, cat)),
        3 * polite => (any::<prop::sample::Index>(), 1..2048u16).prop_map(|(i, n)| Op::Polite(i, n)),
        3 * polite => (any::<prop::sample::Index>(), 0..4096u16).prop_map(|(i, n)| Op::PoliteStream(i, n)),
        3 * polite => ((1..=CLIENTS), any::<prop::sample::Index>(), 1..4096u16).prop_map(|(c, i, n)| Op::PoliteForward(c, i, n)),
        1 => any::<prop::sample::Index>().prop_map(Op::EgressGone),
        1 => (0..2000u16).prop_map(Op::Tick),
        1 => Just(Op::Stop),
    ]
}

/// Where one process stands, as one client has been told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Started,
    Ended,
}

/// Checks what the boundary sends against the protocol's rules, as the receiving peers would.
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
    /// Port forwards on the link: the guest's grants and what it was sent ([`Credit`]).
    to_guest: HashMap<StreamId, Credit>,
    /// Port forwards as each client has them: its grants and what it was sent.
    to_client: HashMap<(ClientId, StreamId), Credit>,
    /// The polite guest's streams.
    streams: Vec<PoliteStream>,
    /// The highest stream id the guest opened that the boundary took.
    highest_opened: u32,
    /// Egress streams whose task runs (their ids).
    tasks: Vec<StreamId>,
    /// The polite clients' port forwards.
    forwards: Vec<ClientForward>,
    /// The highest forward id each client used.
    forward_ids: HashMap<ClientId, u32>,
}

/// A port forward a polite client opened, as it sees it.
#[derive(Debug, Clone, Copy)]
struct ClientForward {
    client: ClientId,
    id: StreamId,
    connected: bool,
    may_send: u64,
    /// Received and not credited yet.
    unacked: u64,
    eof: bool,
}

/// A receiver's grants on one stream, and what it was sent: never more than granted.
#[derive(Debug, Default, Clone, Copy)]
struct Credit {
    granted: u64,
    sent: u64,
}

/// A stream the polite guest takes part in, with what it may still send on it.
#[derive(Debug, Clone, Copy)]
struct PoliteStream {
    id: StreamId,
    /// A port forward the supervisor asked for (not yet `Connected` while `connected` is false).
    forward: bool,
    connected: bool,
    may_send: u64,
    eof: bool,
}

/// One attach client's port forward Connect, to learn its link id from the answer.
type Connecting = Option<(ClientId, StreamId, u32)>;

impl Peers {
    fn check(&mut self, out: &Output, connecting: Connecting) -> Result<(), TestCaseError> {
        for send in &out.sends {
            match send {
                Outgoing::ToGuest(msg) | Outgoing::ToGuestFirst(msg) => self.sent_to_guest(msg, connecting)?,
                Outgoing::ToClient(client, msg) => self.sent_to_client(*client, msg)?,
                Outgoing::StartEgress(id, ..) => self.tasks.push(*id),
                Outgoing::Disconnect(_) | Outgoing::PublishRules(_) | Outgoing::RotateCollector(..) => {}
            }
        }
        for note in &out.notes {
            if let Note::Exited { status, .. } = note {
                prop_assert!(status.is_plausible());
            }
        }
        Ok(())
    }

    fn sent_to_guest(&mut self, msg: &ToGuest, connecting: Connecting) -> Result<(), TestCaseError> {
        match msg {
            ToGuest::Process(ProcessRequest::Spawn(s)) => {
                prop_assert!(s.id.0 > self.highest_spawn, "guest ids must increase: {:?}", s.id);
                prop_assert!(!s.argv.is_empty());
                self.highest_spawn = s.id.0;
                self.spawned.push((s.id, s.output_window, false));
            }
            ToGuest::Process(ProcessRequest::Credit { bytes, .. }) => {
                prop_assert!(*bytes > 0, "zero credit to the guest")
            }
            ToGuest::Process(ProcessRequest::Stdin { data, .. }) => prop_assert!(!data.is_empty(), "empty stdin"),
            ToGuest::Process(_) => {}
            ToGuest::Net(NetToGuest::Connect { id, window, .. }) => {
                prop_assert!(id.host_opened() && *window > 0 && *window <= NET_WINDOW_BYTES);
                let (client, client_id, granted) = connecting.expect("a Connect answers a client's Connect");
                prop_assert_eq!(granted, *window, "the client's window, unchanged");
                self.to_guest.insert(*id, Credit::default());
                self.to_client.insert((client, client_id), Credit { granted: u64::from(*window), sent: 0 });
                self.streams.push(PoliteStream {
                    id: *id,
                    forward: true,
                    connected: false,
                    may_send: u64::from(*window),
                    eof: false,
                });
            }
            ToGuest::Net(NetToGuest::Accept { window, .. }) => prop_assert!(*window > 0 && *window <= NET_WINDOW_BYTES),
            ToGuest::Net(NetToGuest::Stream(frame)) => match frame {
                StreamFrame::Data { id, data } => {
                    prop_assert!(!data.is_empty(), "empty data to the guest");
                    let credit = self.to_guest.get_mut(id);
                    prop_assert!(
                        credit.is_some(),
                        "data on {id:?}, which is no port forward: egress data is its task's"
                    );
                    let credit = credit.unwrap();
                    credit.sent += data.len() as u64;
                    prop_assert!(credit.sent <= credit.granted, "past the guest's grant on {id:?}: {credit:?}");
                }
                StreamFrame::Credit { id, bytes } => {
                    prop_assert!(*bytes > 0, "zero stream credit to the guest");
                    if let Some(s) = self.streams.iter_mut().find(|s| s.id == *id) {
                        s.may_send += u64::from(*bytes);
                    }
                }
                StreamFrame::Close { id } => self.streams.retain(|s| s.id != *id),
                StreamFrame::Eof { .. } => {}
            },
            // The handshake and pings are the link's own, never the boundary's.
            ToGuest::Hello(_) | ToGuest::Ping { .. } => prop_assert!(false, "not from the boundary: {msg:?}"),
            ToGuest::Vm(_) => {}
            ToGuest::Reserved(never) | ToGuest::AttachOnly(never) => match *never {},
        }
        Ok(())
    }

    fn sent_to_client(&mut self, client: ClientId, msg: &ToClient) -> Result<(), TestCaseError> {
        match msg {
            ToClient::Process(event) => self.event_to_client(client, event)?,
            ToClient::Supervisor(SupervisorReply::Processes { list }) => prop_assert!(list.len() <= MAX_PROCESSES),
            // The notice of a disconnection comes from a client's writer, never from the boundary.
            ToClient::Hello(_) | ToClient::Supervisor(SupervisorReply::Disconnected { .. }) => {
                prop_assert!(false, "not for a client: {msg:?}");
            }
            ToClient::Pong { .. } | ToClient::Supervisor(_) => {}
            ToClient::Forward(ForwardEvent::Stream(StreamFrame::Data { id, data })) => {
                prop_assert!(!data.is_empty(), "empty data to a client");
                if let Some(f) = self.forward(client, *id) {
                    f.unacked += data.len() as u64;
                }
                let credit = self.to_client.get_mut(&(client, *id));
                prop_assert!(credit.is_some(), "data on a forward the client never opened: {id:?}");
                let credit = credit.unwrap();
                credit.sent += data.len() as u64;
                prop_assert!(credit.sent <= credit.granted, "past the client's grant: {credit:?}");
            }
            ToClient::Forward(ForwardEvent::Stream(StreamFrame::Credit { id, bytes })) => {
                prop_assert!(*bytes > 0);
                if let Some(f) = self.forward(client, *id) {
                    f.may_send += u64::from(*bytes);
                }
            }
            ToClient::Forward(ForwardEvent::Connected { id, window }) => {
                prop_assert!(*window > 0 && *window <= NET_WINDOW_BYTES);
                if let Some(f) = self.forward(client, *id) {
                    (f.connected, f.may_send) = (true, u64::from(*window));
                }
            }
            ToClient::Forward(ForwardEvent::Refused { id, .. } | ForwardEvent::Stream(StreamFrame::Close { id })) => {
                self.forwards.retain(|f| (f.client, f.id) != (client, *id));
            }
            ToClient::Forward(ForwardEvent::Stream(StreamFrame::Eof { .. })) => {}
            ToClient::Forward(ForwardEvent::LinkOnly(never)) => match *never {},
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

    fn forward(&mut self, client: ClientId, id: StreamId) -> Option<&mut ClientForward> {
        self.forwards.iter_mut().find(|f| (f.client, f.id) == (client, id))
    }

    /// A client's stream message the boundary took: its credit grows what it may be sent; its own stream
    /// frames use up what it may send.
    fn client_sent(&mut self, client: ClientId, msg: &ToSupervisor) {
        let ToSupervisor::Forward(req) = msg else { return };
        match req {
            vm_protocol::net::ForwardRequest::Connect { id, .. } => {
                let highest = self.forward_ids.entry(client).or_default();
                *highest = (*highest).max(id.0);
            }
            vm_protocol::net::ForwardRequest::Stream(frame) => {
                let id = frame.id();
                if let StreamFrame::Credit { bytes, .. } = frame {
                    if let Some(credit) = self.to_client.get_mut(&(client, id)) {
                        credit.granted += u64::from(*bytes);
                    }
                }
                let Some(f) = self.forward(client, id) else { return };
                match frame {
                    StreamFrame::Data { data, .. } => f.may_send = f.may_send.saturating_sub(data.len() as u64),
                    StreamFrame::Credit { bytes, .. } => f.unacked = f.unacked.saturating_sub(u64::from(*bytes)),
                    StreamFrame::Eof { .. } => f.eof = true,
                    StreamFrame::Close { .. } => self.forwards.retain(|f| (f.client, f.id) != (client, id)),
                }
            }
        }
    }

    /// The polite client's next message for its `at`th forward: past the last, a new one; then, once
    /// connected, credit for what it received, data of `len` bytes within the guest's grant, `Eof`, `Close`.
    fn polite_forward(&mut self, client: ClientId, at: prop::sample::Index, len: u16) -> Option<ToSupervisor> {
        use vm_protocol::net::ForwardRequest;
        let mine: Vec<usize> = (0..self.forwards.len()).filter(|i| self.forwards[*i].client == client).collect();
        let i = at.index(mine.len() + 1);
        let Some(&index) = mine.get(i) else {
            let id = StreamId(self.forward_ids.get(&client).copied().unwrap_or(0).max(100) + 1);
            let f = ClientForward { client, id, connected: false, may_send: 0, unacked: 0, eof: false };
            self.forwards.push(f);
            return Some(ToSupervisor::Forward(ForwardRequest::Connect { id, port: 8080, window: 8192 }));
        };
        let f = self.forwards[index];
        let frame = if !f.connected {
            // It waits for the guest to connect.
            return None;
        } else if f.unacked > 0 {
            StreamFrame::Credit { id: f.id, bytes: u32::try_from(f.unacked).unwrap() }
        } else if !f.eof && u64::from(len) <= f.may_send {
            StreamFrame::Data { id: f.id, data: vec![b'z'; usize::from(len)].into() }
        } else if !f.eof {
            StreamFrame::Eof { id: f.id }
        } else {
            StreamFrame::Close { id: f.id }
        };
        Some(ToSupervisor::Forward(ForwardRequest::Stream(frame)))
    }

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

    /// Keeps the polite guest's streams and the guest's grants in step with a network message the boundary
    /// took (from the random guest or the polite one).
    fn guest_sent_net(&mut self, msg: &ToHost, out: &Output) {
        let ToHost::Net(msg) = msg else { return };
        match msg {
            NetToHost::Opened { id, .. } => {
                self.highest_opened = self.highest_opened.max(id.0);
                let accepted =
                    out.sends.iter().any(|s| matches!(s, Outgoing::ToGuest(ToGuest::Net(NetToGuest::Accept { .. }))));
                if accepted {
                    let window = u64::from(NET_WINDOW_BYTES);
                    self.streams.push(PoliteStream {
                        id: *id,
                        forward: false,
                        connected: true,
                        may_send: window,
                        eof: false,
                    });
                }
            }
            NetToHost::Connected { id, window } => {
                if let Some(credit) = self.to_guest.get_mut(id) {
                    credit.granted += u64::from(*window);
                }
                if let Some(s) = self.streams.iter_mut().find(|s| s.id == *id) {
                    s.connected = true;
                }
            }
            NetToHost::Stream(frame) => {
                let id = frame.id();
                match frame {
                    StreamFrame::Credit { bytes, .. } => {
                        if let Some(credit) = self.to_guest.get_mut(&id) {
                            credit.granted += u64::from(*bytes);
                        }
                    }
                    StreamFrame::Data { data, .. } => {
                        if let Some(s) = self.streams.iter_mut().find(|s| s.id == id) {
                            s.may_send = s.may_send.saturating_sub(data.len() as u64);
                        }
                    }
                    StreamFrame::Eof { .. } => {
                        if let Some(s) = self.streams.iter_mut().find(|s| s.id == id) {
                            s.eof = true;
                        }
                    }
                    StreamFrame::Close { .. } => self.streams.retain(|s| s.id != id),
                }
            }
        }
    }

    /// The polite guest's next network message: for the `at`th stream, `Connected` to a forward asked for,
    /// then data of `len` bytes while its window lasts, then `Eof`, then `Close`; or (past the last stream)
    /// a new egress stream.
    fn polite_stream(&mut self, at: prop::sample::Index, len: u16) -> ToHost {
        // Few egress streams of its own at once, so port forwards find room under the cap too.
        let egress = self.streams.iter().filter(|s| !s.forward).count();
        let i = at.index(self.streams.len() + usize::from(egress < 3));
        let Some(stream) = self.streams.get_mut(i) else {
            let id = StreamId(self.highest_opened.max(1000) + 1);
            return ToHost::Net(NetToHost::Opened { id, listener: Listener::Http, window: 65536 });
        };
        let id = stream.id;
        if stream.forward && !stream.connected {
            return ToHost::Net(NetToHost::Connected { id, window: 4096 });
        }
        let len = u64::from(len);
        if !stream.eof && len > 0 && len <= stream.may_send {
            let data = vec![b'y'; usize::try_from(len).unwrap()];
            return ToHost::Net(NetToHost::Stream(StreamFrame::Data { id, data: data.into() }));
        }
        if !stream.eof {
            return ToHost::Net(NetToHost::Stream(StreamFrame::Eof { id }));
        }
        ToHost::Net(NetToHost::Stream(StreamFrame::Close { id }))
    }
}

/// `msg` encoded as a frame and decoded as an `M`, as a socket of the other channel would read it.
fn decode<M: serde::de::DeserializeOwned>(msg: &impl serde::Serialize) -> Option<M> {
    let mut wire = Vec::new();
    frame::encode(msg, &mut wire).unwrap();
    frame::decode::<M>(&wire).ok().flatten().map(|(m, _)| m)
}

/// A sandbox whose policy allows every operation and egress to one rule, at most [`MAX_STREAMS`] at once.
fn boundary(now: Instant) -> Boundary {
    let network =
        serde_json::json!({"allow": [{"host": "example.com", "ports": [443]}], "max_connections": MAX_STREAMS});
    let policy = SandboxPolicy { network: Some(serde_json::from_value(network).unwrap()), ..SandboxPolicy::default() };
    let mut b = Boundary::new(BoundaryConfig { policy, stop_grace_ms: 10, ..BoundaryConfig::default() }, now);
    let _ = b.handle(Input::Attached, now);
    b
}

/// The connection cap of the sandbox under test.
const MAX_STREAMS: usize = 8;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn any_interleaving_keeps_the_rules_the_credits_and_the_bounds(ops in prop::collection::vec(op(3, 1), 1..80)) {
        run(ops)?;
    }

    #[test]
    fn a_mostly_polite_interleaving_reaches_deep_states_and_keeps_every_credit(ops in prop::collection::vec(op(1, 6), 1..160)) {
        run(ops)?;
    }
}

/// Runs one sequence of steps, checking after each.
fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    {
        let mut now = Instant::now();
        let mut b = boundary(now);
        let mut peers = Peers::default();
        // A reconnecting client is a new connection, with ids of its own.
        let mut current: HashMap<u64, ClientId> = HashMap::new();
        let mut next = 0u64;
        for op in ops {
            match op {
                Op::Connect(c) => {
                    if let Some(old) = current.remove(&c) {
                        peers.check(&b.handle(Input::ClientGone(old), now), None)?;
                    }
                    next += 1;
                    current.insert(c, ClientId(next));
                    peers.check(&b.handle(Input::Connected(ClientId(next)), now), None)?;
                }
                Op::Disconnect(c) => {
                    if let Some(old) = current.remove(&c) {
                        peers.check(&b.handle(Input::ClientGone(old), now), None)?;
                    }
                }
                Op::FromClient(c, msg) => {
                    // Messages of a client that is not connected never reach the boundary.
                    let Some(client) = current.get(&c).copied() else { continue };
                    let _ = from_client(&mut b, &mut peers, &mut current, (c, client), msg, now)?;
                }
                Op::LinkFrameFromClient(c, msg) => {
                    // The attach server decodes a client's frames as the socket's type; a frame that does not
                    // decode disconnects the client.
                    let Some(client) = current.get(&c).copied() else { continue };
                    let decoded = decode::<ToSupervisor>(&msg);
                    let link_only = matches!(msg, ToGuest::Vm(_));
                    prop_assert!(!(link_only && decoded.is_some()), "{msg:?} decoded on the attach socket");
                    match decoded {
                        Some(msg) => {
                            let _ = from_client(&mut b, &mut peers, &mut current, (c, client), msg, now)?;
                        }
                        None => {
                            current.remove(&c);
                            peers.check(&b.handle(Input::ClientGone(client), now), None)?;
                        }
                    }
                }
                Op::FromGuest(msg) => {
                    if !from_guest(&mut b, &mut peers, msg, now)? {
                        break;
                    }
                }
                Op::AttachFrameFromGuest(msg) => {
                    // The guest link decodes the guest's frames as the link's type; one that does not decode
                    // stops the sandbox.
                    let decoded = decode::<ToHost>(&msg);
                    let socket_only = matches!(msg, ToClient::Supervisor(_));
                    prop_assert!(!(socket_only && decoded.is_some()), "{msg:?} decoded on the guest link");
                    let Some(msg) = decoded else { break };
                    if !from_guest(&mut b, &mut peers, msg, now)? {
                        break;
                    }
                }
                Op::Polite(at, len) => {
                    let Some(msg) = peers.polite(at, len) else { continue };
                    let out = b.handle(Input::Guest(msg.clone()), now);
                    prop_assert!(out.violation.is_none(), "a polite guest's {msg:?} was refused: {:?}", out.violation);
                    peers.check(&out, None)?;
                }
                Op::PoliteStream(at, len) => {
                    let msg = peers.polite_stream(at, len);
                    let out = b.handle(Input::Guest(msg.clone()), now);
                    prop_assert!(out.violation.is_none(), "a polite guest's {msg:?} was refused: {:?}", out.violation);
                    peers.guest_sent_net(&msg, &out);
                    peers.check(&out, None)?;
                }
                Op::PoliteSpawn(c, cat) => {
                    let Some(client) = current.get(&c).copied() else { continue };
                    let id = peers
                        .spawned_by_clients
                        .iter()
                        .filter(|(k, _)| *k == client)
                        .map(|(_, p)| p.0)
                        .max()
                        .unwrap_or(0)
                        .max(100)
                        + 1;
                    let argv = vec![if cat { "cat" } else { "true" }.to_owned()];
                    let spawn = vm_protocol::Spawn {
                        id: ProcId(id),
                        argv,
                        env: vec![],
                        cwd: None,
                        pty: None,
                        output_window: 4096,
                        rlimits: Vec::new(),
                        root: None,
                    };
                    let msg = ToSupervisor::Process(ProcessRequest::Spawn(spawn));
                    let gone = from_client(&mut b, &mut peers, &mut current, (c, client), msg, now)?;
                    prop_assert!(!gone, "a polite spawn cut its client off");
                }
                Op::PoliteForward(c, at, len) => {
                    let Some(client) = current.get(&c).copied() else { continue };
                    let Some(msg) = peers.polite_forward(client, at, len) else { continue };
                    let gone = from_client(&mut b, &mut peers, &mut current, (c, client), msg.clone(), now)?;
                    prop_assert!(!gone, "a polite client's {msg:?} cut it off");
                }
                Op::EgressGone(at) => {
                    if peers.tasks.is_empty() {
                        continue;
                    }
                    let id = peers.tasks.swap_remove(at.index(peers.tasks.len()));
                    // The task sent the guest its Close: the polite guest stops using the stream.
                    peers.streams.retain(|s| s.id != id);
                    peers.check(&b.handle(Input::Egress(Report::Gone(id)), now), None)?;
                }
                Op::Tick(ms) => {
                    now += Duration::from_millis(u64::from(ms));
                    peers.check(&b.handle(Input::Tick, now), None)?;
                }
                Op::Stop => peers.check(&b.handle(Input::Stop, now), None)?,
            }
            prop_assert!(b.retained_bytes() <= OUTPUT_BUDGET_BYTES);
            prop_assert!(b.known_processes() <= MAX_PROCESSES + MAX_FINISHED_DETACHED);
            prop_assert!(b.open_streams() <= MAX_STREAMS, "{} streams open", b.open_streams());
        }
    }
    Ok(())
}

/// One client message through the boundary; a client it disconnects is gone from `current`.
fn from_client(
    b: &mut Boundary,
    peers: &mut Peers,
    current: &mut HashMap<u64, ClientId>,
    (c, client): (u64, ClientId),
    msg: ToSupervisor,
    now: Instant,
) -> Result<bool, TestCaseError> {
    if let ToSupervisor::Process(ProcessRequest::Spawn(spawn)) = &msg {
        if !peers.spawned_by_clients.insert((client, spawn.id)) {
            peers.reused.insert((client, spawn.id));
        }
    }
    let connecting = match &msg {
        ToSupervisor::Forward(vm_protocol::net::ForwardRequest::Connect { id, window, .. }) => {
            Some((client, *id, *window))
        }
        _ => None,
    };
    let out = b.handle(Input::Client(client, msg.clone()), now);
    let disconnected = out.sends.iter().any(|s| matches!(s, Outgoing::Disconnect(d) if *d == client));
    peers.check(&out, connecting)?;
    if disconnected {
        current.remove(&c);
    } else {
        peers.client_sent(client, &msg);
    }
    Ok(disconnected)
}

/// One guest message through the boundary; `false` once the guest broke the rules (the sandbox stops there:
/// nothing after a violation is routed).
fn from_guest(b: &mut Boundary, peers: &mut Peers, msg: ToHost, now: Instant) -> Result<bool, TestCaseError> {
    let out = b.handle(Input::Guest(msg.clone()), now);
    if out.violation.is_some() {
        return Ok(false);
    }
    peers.guest_sent(&msg);
    peers.guest_sent_net(&msg, &out);
    peers.check(&out, None)?;
    Ok(true)
}
