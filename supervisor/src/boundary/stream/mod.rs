//! The stream router: the link's network streams, egress and port forwards alike, and the one place their
//! rules are enforced on the supervisor's side.
//!
//! Egress streams (opened by the guest) each get a [`Pipe`] and a task ([`crate::network::egress`]); port forwards
//! (opened by a client) are routed between the client and the guest under ids of the link's own, the way the
//! multiplexer routes processes. Rules: ids increase per opener; no data before a stream is open, after its
//! sender's `Eof`, or past the receiver's window; no zero credit or credit past a window. A message for a
//! stream that ended is a benign race, within what its sender could still have had in flight (a tombstone
//! per ended stream, the newest [`MAX_TOMBSTONES`]).
//!
//! Pure state, no I/O: it returns what to send, and the caller spawns the tasks.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use vm_protocol::message::Refusal;
use vm_protocol::net::{
    ForwardEvent, ForwardRequest, Listener, NetToGuest, NetToHost, StreamFrame, StreamId, EGRESS_DOWNLOAD_WINDOW_BYTES,
    HOST_OPENED, NET_WINDOW_BYTES,
};
use vm_protocol::Window;

use super::violation::{ClientViolation, GuestViolation};
use super::ClientId;
use crate::network::pipe::{End, Pipe};

/// Ended streams remembered, so late messages for them are told from forged ones.
pub const MAX_TOMBSTONES: usize = 1024;

/// What the caller does next.
#[derive(Debug)]
pub enum Out {
    /// Send to the guest.
    Guest(NetToGuest),
    /// Send to a client.
    Client(ClientId, ForwardEvent),
    /// Start the egress task of a stream the guest opened.
    Egress(StreamId, Listener, Arc<Pipe>),
    /// A stream was refused before it opened (for the event and the finding).
    Refused(Refused),
    /// A port forward opened (guest side connected) or ended.
    Forward(ForwardNote),
}

/// A refusal to report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// The stream.
    pub id: StreamId,
    /// The listener (egress) or `None` for a port forward.
    pub listener: Option<Listener>,
    /// The guest port of a port forward.
    pub port: Option<u16>,
    /// Why (fixed text).
    pub reason: &'static str,
}

/// What became of a port forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardNote {
    /// The guest's port accepted.
    Opened {
        /// The link's id.
        id: StreamId,
        /// The guest port.
        port: u16,
    },
    /// It ended, with the bytes each way.
    Closed {
        /// The link's id.
        id: StreamId,
        /// The guest port.
        port: u16,
        /// Bytes from the client to the guest.
        to_guest: u64,
        /// Bytes from the guest to the client.
        from_guest: u64,
    },
}

#[derive(Debug)]
enum Stream {
    Egress(Arc<Pipe>),
    Forward(Forward),
}

#[derive(Debug)]
struct Forward {
    client: ClientId,
    client_id: StreamId,
    port: u16,
    connected: bool,
    /// What the client may send towards the guest (the guest's window).
    client_send: Window,
    /// What the guest may send towards the client (the client's window).
    guest_send: Window,
    client_eof: bool,
    guest_eof: bool,
    to_guest: u64,
    from_guest: u64,
}

/// All network streams of one link.
#[derive(Debug, Default)]
pub struct StreamRouter {
    live: HashMap<StreamId, Stream>,
    highest_guest: Option<StreamId>,
    next_host: u32,
    /// Ended streams and the bytes their guest side may still have in flight.
    tombs: VecDeque<(StreamId, u64)>,
    /// Each client's forwards: its id to the link's.
    clients: HashMap<ClientId, ClientForwards>,
    stopping: bool,
}

#[derive(Debug, Default)]
struct ClientForwards {
    highest: Option<StreamId>,
    links: HashMap<StreamId, StreamId>,
}

fn guest(id: StreamId, what: &'static str) -> GuestViolation {
    GuestViolation::Stream(id, what)
}

fn client(id: StreamId, what: &'static str) -> ClientViolation {
    ClientViolation::Stream(id, what)
}

/// A window a peer grants: at most `most`. A forward's (either peer's) is at most what the supervisor grants
/// itself, as it queues a client's bytes within it; an egress stream's at most
/// [`EGRESS_DOWNLOAD_WINDOW_BYTES`], as its task holds no more than the download budget.
fn window_ok(window: u32, most: u32) -> bool {
    window > 0 && window <= most
}

impl StreamRouter {
    /// Streams open now (egress and forwards).
    pub fn open(&self) -> usize {
        self.live.len()
    }

    /// From now on nothing new opens.
    pub fn stop_accepting(&mut self) {
        self.stopping = true;
    }

    /// The egress pipes, for a policy update's re-check.
    pub fn egress(&self) -> impl Iterator<Item = (StreamId, &Arc<Pipe>)> {
        self.live.iter().filter_map(|(id, s)| match s {
            Stream::Egress(pipe) => Some((*id, pipe)),
            Stream::Forward(_) => None,
        })
    }

    fn bury(&mut self, id: StreamId, allowance: u64) {
        if self.tombs.len() == MAX_TOMBSTONES {
            self.tombs.pop_front();
        }
        self.tombs.push_back((id, allowance));
    }

    /// An egress task ended: the stream is gone.
    pub fn egress_ended(&mut self, id: StreamId) {
        if let Some(Stream::Egress(pipe)) = self.live.remove(&id) {
            self.bury(id, pipe.guest_allowance());
        }
    }

    /// Whether `id` was ever opened on the link.
    fn existed(&self, id: StreamId) -> bool {
        if id.host_opened() {
            id.0 >= HOST_OPENED && id.0 - HOST_OPENED < self.next_host
        } else {
            self.highest_guest.is_some_and(|h| id <= h)
        }
    }

    /// A late message for an ended stream: data within what could be in flight is dropped; anything for a
    /// stream that never existed, or data past that, is a violation.
    fn late(&mut self, frame: &StreamFrame) -> Result<Vec<Out>, GuestViolation> {
        let id = frame.id();
        if !self.existed(id) {
            return Err(guest(id, "a message for a stream that was never opened"));
        }
        if let StreamFrame::Data { data, .. } = frame {
            let tomb = self.tombs.iter_mut().find(|(t, _)| *t == id).ok_or(guest(id, "data on a closed stream"))?;
            let len = data.len() as u64;
            if len > tomb.1 {
                return Err(guest(id, "data on a closed stream past its window"));
            }
            tomb.1 -= len;
        }
        Ok(Vec::new())
    }

    /// One network message from the guest. `cap` is the policy's connection cap, `egress` whether any rule
    /// allows egress now.
    ///
    /// # Errors
    /// A [`GuestViolation`]: the caller stops the VM.
    pub fn from_guest(&mut self, msg: NetToHost, cap: usize, egress: bool) -> Result<Vec<Out>, GuestViolation> {
        match msg {
            NetToHost::Opened { id, listener, window } => {
                if id.host_opened() || self.highest_guest.is_some_and(|h| id <= h) {
                    return Err(guest(id, "an opened id not increasing in the guest's range"));
                }
                if !window_ok(window, EGRESS_DOWNLOAD_WINDOW_BYTES) {
                    return Err(guest(id, "a window out of range"));
                }
                self.highest_guest = Some(id);
                let reason = if self.stopping {
                    Some("the sandbox is stopping")
                } else if !egress {
                    Some("the policy allows no egress")
                } else if self.live.len() >= cap {
                    Some("the policy's max_connections are open")
                } else {
                    None
                };
                if let Some(reason) = reason {
                    self.bury(id, 0);
                    let refused = Refused { id, listener: Some(listener), port: None, reason };
                    return Ok(vec![Out::Guest(NetToGuest::Stream(StreamFrame::Close { id })), Out::Refused(refused)]);
                }
                let pipe = Arc::new(Pipe::new(NET_WINDOW_BYTES, window));
                self.live.insert(id, Stream::Egress(Arc::clone(&pipe)));
                Ok(vec![
                    Out::Guest(NetToGuest::Accept { id, window: NET_WINDOW_BYTES }),
                    Out::Egress(id, listener, pipe),
                ])
            }
            NetToHost::Connected { id, window } => {
                // A forward whose client went away while the guest dialed: the Close sent then ends it there.
                if id.host_opened() && !self.live.contains_key(&id) && self.existed(id) {
                    return Ok(Vec::new());
                }
                let Some(Stream::Forward(fwd)) = self.live.get_mut(&id) else {
                    return Err(guest(id, "Connected for no port forward being dialed"));
                };
                if fwd.connected || !window_ok(window, NET_WINDOW_BYTES) {
                    return Err(guest(id, "a second Connected, or a window out of range"));
                }
                fwd.connected = true;
                fwd.client_send = Window::new(window);
                let opened = Out::Forward(ForwardNote::Opened { id, port: fwd.port });
                let event = ForwardEvent::Connected { id: fwd.client_id, window };
                Ok(vec![Out::Client(fwd.client, event), opened])
            }
            NetToHost::Stream(frame) => self.guest_frame(frame),
        }
    }

    fn guest_frame(&mut self, frame: StreamFrame) -> Result<Vec<Out>, GuestViolation> {
        let id = frame.id();
        match self.live.get_mut(&id) {
            None => self.late(&frame),
            Some(Stream::Egress(pipe)) => {
                match frame {
                    StreamFrame::Data { data, .. } if data.is_empty() => return Err(guest(id, "empty data")),
                    StreamFrame::Data { .. } if pipe.guest_done() => return Err(guest(id, "data after eof")),
                    StreamFrame::Data { data, .. } => {
                        pipe.push(&data).map_err(|_| guest(id, "data past the window"))?
                    }
                    StreamFrame::Eof { .. } if !pipe.guest_eof() => return Err(guest(id, "a second eof")),
                    StreamFrame::Eof { .. } => {}
                    StreamFrame::Credit { bytes: 0, .. } => return Err(guest(id, "zero credit")),
                    StreamFrame::Credit { bytes, .. } => {
                        pipe.grant(bytes).map_err(|_| guest(id, "credit past the window"))?;
                    }
                    StreamFrame::Close { .. } => {
                        pipe.end(End::GuestClosed);
                        self.live.remove(&id);
                        self.bury(id, 0);
                    }
                }
                Ok(Vec::new())
            }
            Some(Stream::Forward(fwd)) => {
                if !fwd.connected && !matches!(frame, StreamFrame::Close { .. }) {
                    return Err(guest(id, "a message before Connected"));
                }
                let (who, client_id) = (fwd.client, fwd.client_id);
                let to_client = move |frame| Out::Client(who, ForwardEvent::Stream(frame));
                let out = match frame {
                    StreamFrame::Data { data, .. } if data.is_empty() => return Err(guest(id, "empty data")),
                    StreamFrame::Data { .. } if fwd.guest_eof => return Err(guest(id, "data after eof")),
                    StreamFrame::Data { data, .. } => {
                        fwd.guest_send.consume(data.len()).map_err(|_| guest(id, "data past the window"))?;
                        fwd.from_guest += data.len() as u64;
                        vec![to_client(StreamFrame::Data { id: client_id, data })]
                    }
                    StreamFrame::Eof { .. } if fwd.guest_eof => return Err(guest(id, "a second eof")),
                    StreamFrame::Eof { .. } => {
                        fwd.guest_eof = true;
                        vec![to_client(StreamFrame::Eof { id: client_id })]
                    }
                    StreamFrame::Credit { bytes: 0, .. } => return Err(guest(id, "zero credit")),
                    StreamFrame::Credit { bytes, .. } => {
                        fwd.client_send.grant(bytes).map_err(|_| guest(id, "credit past the window"))?;
                        vec![to_client(StreamFrame::Credit { id: client_id, bytes })]
                    }
                    StreamFrame::Close { .. } => {
                        let mut out = vec![to_client(StreamFrame::Close { id: client_id })];
                        out.extend(self.end_forward(id, 0));
                        return Ok(out);
                    }
                };
                Ok(self.maybe_done(id, out))
            }
        }
    }

    /// A forward whose two directions both ended in order is gone.
    fn maybe_done(&mut self, id: StreamId, mut out: Vec<Out>) -> Vec<Out> {
        if let Some(Stream::Forward(fwd)) = self.live.get(&id) {
            if fwd.client_eof && fwd.guest_eof {
                let allowance = fwd.guest_send.available();
                out.extend(self.end_forward(id, allowance));
            }
        }
        out
    }

    fn end_forward(&mut self, id: StreamId, allowance: u64) -> Vec<Out> {
        let Some(Stream::Forward(fwd)) = self.live.remove(&id) else { return Vec::new() };
        if let Some(state) = self.clients.get_mut(&fwd.client) {
            state.links.remove(&fwd.client_id);
        }
        self.bury(id, allowance);
        if !fwd.connected {
            return Vec::new();
        }
        let note = ForwardNote::Closed { id, port: fwd.port, to_guest: fwd.to_guest, from_guest: fwd.from_guest };
        vec![Out::Forward(note)]
    }

    /// A port forward's message from a client, already admitted by the policy gate.
    ///
    /// # Errors
    /// A [`ClientViolation`]: the caller disconnects the client.
    pub fn from_client(&mut self, who: ClientId, msg: ForwardRequest, cap: usize) -> Result<Vec<Out>, ClientViolation> {
        match msg {
            ForwardRequest::Connect { id, port, window } => {
                let state = self.clients.entry(who).or_default();
                let refuse = |reason| Ok(vec![Out::Client(who, ForwardEvent::Refused { id, reason })]);
                if state.highest.is_some_and(|h| id <= h) {
                    return refuse(Refusal::IdNotIncreasing);
                }
                state.highest = Some(id);
                if !window_ok(window, NET_WINDOW_BYTES) || port == 0 {
                    return refuse(Refusal::Invalid);
                }
                let reason = if self.stopping {
                    Some((Refusal::ShuttingDown, "the sandbox is stopping"))
                } else if self.live.len() >= cap || self.next_host >= HOST_OPENED - 1 {
                    Some((Refusal::TooManyProcesses, "the policy's max_connections are open"))
                } else {
                    None
                };
                if let Some((refusal, reason)) = reason {
                    let link = StreamId(HOST_OPENED);
                    let refused = Refused { id: link, listener: None, port: Some(port), reason };
                    return Ok(vec![
                        Out::Client(who, ForwardEvent::Refused { id, reason: refusal }),
                        Out::Refused(refused),
                    ]);
                }
                let link = StreamId(HOST_OPENED + self.next_host);
                self.next_host += 1;
                state.links.insert(id, link);
                let fwd = Forward {
                    client: who,
                    client_id: id,
                    port,
                    connected: false,
                    client_send: Window::new(0),
                    guest_send: Window::new(window),
                    client_eof: false,
                    guest_eof: false,
                    to_guest: 0,
                    from_guest: 0,
                };
                self.live.insert(link, Stream::Forward(fwd));
                Ok(vec![Out::Guest(NetToGuest::Connect { id: link, port, window })])
            }
            ForwardRequest::Stream(frame) => self.client_frame(who, frame),
        }
    }

    fn client_frame(&mut self, who: ClientId, frame: StreamFrame) -> Result<Vec<Out>, ClientViolation> {
        let id = frame.id();
        let state = self.clients.get(&who);
        let Some(&link) = state.and_then(|s| s.links.get(&id)) else {
            // Ended (benign), or never opened on this connection.
            return match state.and_then(|s| s.highest) {
                Some(h) if id <= h => Ok(Vec::new()),
                _ => Err(client(id, "a message for a stream never opened")),
            };
        };
        let Some(Stream::Forward(fwd)) = self.live.get_mut(&link) else { return Ok(Vec::new()) };
        if !fwd.connected && !matches!(frame, StreamFrame::Close { .. }) {
            return Err(client(id, "a message before Connected"));
        }
        let to_guest = |frame| Out::Guest(NetToGuest::Stream(frame));
        let out = match frame {
            StreamFrame::Data { data, .. } if data.is_empty() => return Err(client(id, "empty data")),
            StreamFrame::Data { .. } if fwd.client_eof => return Err(client(id, "data after eof")),
            StreamFrame::Data { data, .. } => {
                fwd.client_send.consume(data.len()).map_err(|_| client(id, "data past the window"))?;
                fwd.to_guest += data.len() as u64;
                vec![to_guest(StreamFrame::Data { id: link, data })]
            }
            StreamFrame::Eof { .. } if fwd.client_eof => return Err(client(id, "a second eof")),
            StreamFrame::Eof { .. } => {
                fwd.client_eof = true;
                vec![to_guest(StreamFrame::Eof { id: link })]
            }
            StreamFrame::Credit { bytes: 0, .. } => return Err(client(id, "zero credit")),
            StreamFrame::Credit { bytes, .. } => {
                fwd.guest_send.grant(bytes).map_err(|_| client(id, "credit past the window"))?;
                vec![to_guest(StreamFrame::Credit { id: link, bytes })]
            }
            StreamFrame::Close { .. } => {
                let allowance = fwd.guest_send.available();
                let mut out = vec![to_guest(StreamFrame::Close { id: link })];
                out.extend(self.end_forward(link, allowance));
                return Ok(out);
            }
        };
        Ok(self.maybe_done(link, out))
    }

    /// A client went away: its forwards are closed.
    pub fn remove_client(&mut self, who: ClientId) -> Vec<Out> {
        let Some(state) = self.clients.remove(&who) else { return Vec::new() };
        let mut out = Vec::new();
        for link in state.links.into_values() {
            let allowance = match self.live.get(&link) {
                Some(Stream::Forward(fwd)) => fwd.guest_send.available(),
                _ => 0,
            };
            out.push(Out::Guest(NetToGuest::Stream(StreamFrame::Close { id: link })));
            out.extend(self.end_forward(link, allowance));
        }
        out
    }
}

#[cfg(test)]
mod tests;
