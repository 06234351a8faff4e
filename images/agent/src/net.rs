//! Network streams in the guest ([`vm_protocol::net`]): the loopback proxy listeners and port forwards.
//!
//! The agent never parses what it carries. A connection accepted on a listener becomes a stream announced
//! with `Opened`; its bytes go to the host, which reads the proxy request itself and answers on the stream. A
//! `Connect` from the host dials the guest's `127.0.0.1:port`. Each stream has a pump (socket to host, within
//! the host's credit) and a writer (host to socket, which returns credit once bytes are written), so neither
//! side buffers past the windows.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::link::ToHost;
use vm_protocol::net::{
    Listener, NetToGuest, NetToHost, StreamFrame, StreamId, EGRESS_DOWNLOAD_WINDOW_BYTES, HOST_OPENED, NET_WINDOW_BYTES,
};
use vm_protocol::Window;

use crate::credit::Credit;
use crate::link::{LinkError, Shared};

/// Most streams at once in the guest: the host's policy caps connections far lower; this only keeps a
/// runaway workload from exhausting the agent's threads.
const MAX_STREAMS: usize = 1024;
/// How long a port forward's dial of the guest's loopback may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest chunk a pump reads from a socket (one frame's data at most).
const CHUNK_BYTES: usize = 256 * 1024;

enum ToSocket {
    Data(Vec<u8>),
    Eof,
    /// The host closed the stream: what was queued before is written first.
    Close,
}

struct Entry {
    /// What the host may still send; consumed on data, returned by the writer once written.
    recv: Arc<Mutex<Window>>,
    /// Host bytes for the writer; `None` before the stream is open for them, or after the host's `Eof`.
    writer: Option<Sender<ToSocket>>,
    /// The host's window for our bytes, handed to the pump when it comes (`Accept`).
    accept: Option<Sender<Arc<Credit>>>,
    credit: Option<Arc<Credit>>,
    socket: TcpStream,
    /// Set once the host closed the stream: the pump sends nothing more.
    closed: Arc<AtomicBool>,
    /// Our direction ended in order (`Eof` sent), and the host's (its `Eof` written).
    sent_eof: bool,
    got_eof: bool,
    /// The host's `Eof` came: its writer ends the socket's write side once its queue is written.
    host_eof: bool,
}

/// The streams of one link, and the listeners.
#[derive(Default)]
pub(crate) struct Streams {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    live: HashMap<StreamId, Entry>,
    next_guest: u32,
    highest_host: Option<StreamId>,
    /// Port forwards being dialed: a `Close` meanwhile cancels the dial.
    connecting: std::collections::HashSet<StreamId>,
    listeners: Vec<(Listener, Arc<AtomicBool>)>,
}

impl Streams {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens or closes the loopback proxy listeners. A listener that cannot bind is logged and skipped: the
    /// workload then finds no proxy, which is what a policy without egress gives it too.
    pub(crate) fn set_listening(shared: &Arc<Shared>, listen: bool) {
        let mut state = shared.net.state();
        if !listen {
            for (listener, stop) in state.listeners.drain(..) {
                stop.store(true, Ordering::Release);
                // Wakes the blocked accept, which then sees the flag.
                let _ = TcpStream::connect((Ipv4Addr::LOCALHOST, listener.port()));
            }
            return;
        }
        if !state.listeners.is_empty() {
            return;
        }
        for listener in [Listener::Http, Listener::Socks] {
            match bind(listener) {
                Ok(socket) => {
                    let stop = Arc::new(AtomicBool::new(false));
                    let (shared, flag) = (Arc::clone(shared), Arc::clone(&stop));
                    let started = thread::Builder::new()
                        .name("vm-agent-listen".into())
                        .spawn(move || accept_loop(&shared, listener, &socket, &flag));
                    if started.is_ok() {
                        state.listeners.push((listener, stop));
                    }
                }
                Err(_) => shared.log("cannot bind a loopback proxy listener"),
            }
        }
    }

    /// Closes every stream: the link is ending.
    pub(crate) fn close_all(&self) {
        let mut state = self.state();
        for (_, entry) in state.live.drain() {
            entry.closed.store(true, Ordering::Release);
            let _ = entry.socket.shutdown(Shutdown::Both);
            if let Some(credit) = entry.credit {
                credit.close();
            }
        }
    }
}

/// Binds a listener's port. Right after a close its old accept thread may still hold the socket for a
/// moment (it wakes, sees its flag, and drops it): a restore then retries briefly rather than fail.
fn bind(listener: Listener) -> std::io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind((Ipv4Addr::LOCALHOST, listener.port())) {
            Err(e) if e.kind() == ErrorKind::AddrInUse && tries < 50 => {
                tries += 1;
                thread::sleep(Duration::from_millis(20));
            }
            bound => return bound,
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: Listener, socket: &TcpListener, stop: &AtomicBool) {
    for conn in socket.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(conn) = conn else { continue };
        let mut state = shared.net.state();
        if state.live.len() >= MAX_STREAMS || state.next_guest >= HOST_OPENED - 1 {
            continue;
        }
        state.next_guest += 1;
        let id = StreamId(state.next_guest);
        let (accept_tx, accept_rx) = mpsc::channel();
        let Some(entry) = entry(conn, Some(accept_tx), EGRESS_DOWNLOAD_WINDOW_BYTES) else { continue };
        let Ok(reader) = entry.socket.try_clone() else { continue };
        let closed = Arc::clone(&entry.closed);
        state.live.insert(id, entry);
        drop(state);
        shared.send(NetToHost::Opened { id, listener, window: EGRESS_DOWNLOAD_WINDOW_BYTES });
        start_pump(shared, id, reader, closed, accept_rx);
    }
}

/// A stream's entry, granting the host `window`.
fn entry(socket: TcpStream, accept: Option<Sender<Arc<Credit>>>, window: u32) -> Option<Entry> {
    let _ = socket.set_nodelay(true);
    Some(Entry {
        recv: Arc::new(Mutex::new(Window::new(window))),
        writer: None,
        accept,
        credit: None,
        socket,
        closed: Arc::new(AtomicBool::new(false)),
        sent_eof: false,
        got_eof: false,
        host_eof: false,
    })
}

/// Handles one network message from the host.
///
/// # Errors
/// A violation: an unknown id, data past the window, zero credit, a second accept.
pub(crate) fn handle(shared: &Arc<Shared>, msg: NetToGuest) -> Result<(), LinkError> {
    match msg {
        NetToGuest::Connect { id, port, window } => connect(shared, id, port, window),
        NetToGuest::Accept { id, window } => {
            let mut state = shared.net.state();
            let Some(entry) = known(&mut state, id)? else { return Ok(()) };
            let accept = entry.accept.take().ok_or_else(|| violation(id, "accept of a stream not waiting for one"))?;
            let credit = window_credit(id, window)?;
            entry.credit = Some(Arc::clone(&credit));
            let writer = start_writer(shared, id, entry)?;
            entry.writer = Some(writer);
            // A pump that already ended (the connection closed) no longer listens.
            let _ = accept.send(credit);
            Ok(())
        }
        NetToGuest::Stream(frame) => stream_frame(shared, frame),
    }
}

fn window_credit(id: StreamId, window: u32) -> Result<Arc<Credit>, LinkError> {
    if window == 0 || window > vm_protocol::flow::MAX_WINDOW_BYTES {
        return Err(violation(id, "window out of range"));
    }
    Ok(Arc::new(Credit::new(window)))
}

fn stream_frame(shared: &Arc<Shared>, frame: StreamFrame) -> Result<(), LinkError> {
    let id = frame.id();
    let mut state = shared.net.state();
    if state.connecting.contains(&id) {
        return match frame {
            StreamFrame::Close { .. } => {
                state.connecting.remove(&id);
                Ok(())
            }
            _ => Err(violation(id, "a message before Connected")),
        };
    }
    let Some(entry) = known(&mut state, id)? else { return Ok(()) };
    match frame {
        StreamFrame::Data { data, .. } if data.is_empty() => return Err(violation(id, "empty data")),
        StreamFrame::Data { data, .. } => {
            let writer = entry.writer.as_ref().ok_or_else(|| violation(id, "data before open or after eof"))?;
            let mut recv = entry.recv.lock().unwrap_or_else(PoisonError::into_inner);
            recv.consume(data.len()).map_err(|e| violation(id, &e.to_string()))?;
            drop(recv);
            let _ = writer.send(ToSocket::Data(data.into_vec()));
        }
        StreamFrame::Eof { .. } => {
            let writer = entry.writer.take().ok_or_else(|| violation(id, "eof before open or twice"))?;
            entry.host_eof = true;
            let _ = writer.send(ToSocket::Eof);
        }
        StreamFrame::Credit { bytes: 0, .. } => return Err(violation(id, "zero credit")),
        StreamFrame::Credit { bytes, .. } => {
            let credit = entry.credit.as_ref().ok_or_else(|| violation(id, "credit before open"))?;
            credit.grant(bytes).map_err(|e| violation(id, &e.to_string()))?;
        }
        StreamFrame::Close { .. } => {
            if let Some(mut entry) = state.live.remove(&id) {
                entry.closed.store(true, Ordering::Release);
                // The workload's direction ends at once. What the host sent before its Close still reaches
                // the workload, in order, before the socket closes (an HTTP server's last answer, a 431, then
                // its close): the writer closes it after its queue; without a writer it closes here.
                let _ = entry.socket.shutdown(Shutdown::Read);
                let queued =
                    entry.host_eof || entry.writer.take().is_some_and(|writer| writer.send(ToSocket::Close).is_ok());
                if !queued {
                    let _ = entry.socket.shutdown(Shutdown::Both);
                }
                if let Some(credit) = entry.credit {
                    credit.close();
                }
            }
        }
    }
    Ok(())
}

/// The live entry for `id`; `None` for a stream that already ended (a benign race); a violation for an id
/// that never existed.
fn known(state: &mut State, id: StreamId) -> Result<Option<&mut Entry>, LinkError> {
    let existed = if id.host_opened() { state.highest_host.is_some_and(|h| id <= h) } else { id.0 <= state.next_guest };
    match state.live.get_mut(&id) {
        Some(entry) => Ok(Some(entry)),
        None if existed => Ok(None),
        None => Err(violation(id, "message for a stream that was never opened")),
    }
}

fn connect(shared: &Arc<Shared>, id: StreamId, port: u16, window: u32) -> Result<(), LinkError> {
    let mut state = shared.net.state();
    if !id.host_opened() || state.highest_host.is_some_and(|h| id <= h) {
        return Err(violation(id, "connect id not increasing in the host's range"));
    }
    state.highest_host = Some(id);
    let credit = window_credit(id, window)?;
    if state.live.len() + state.connecting.len() >= MAX_STREAMS {
        drop(state);
        shared.send(NetToHost::Stream(StreamFrame::Close { id }));
        return Ok(());
    }
    state.connecting.insert(id);
    drop(state);
    let shared = Arc::clone(shared);
    let dial = move || {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let dialed =
            TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).ok().and_then(|s| entry(s, None, NET_WINDOW_BYTES));
        let mut state = shared.net.state();
        if !state.connecting.remove(&id) {
            return; // The host closed it meanwhile.
        }
        let opened = dialed.and_then(|mut entry| {
            let reader = entry.socket.try_clone().ok()?;
            entry.credit = Some(Arc::clone(&credit));
            entry.writer = Some(start_writer(&shared, id, &entry).ok()?);
            Some((entry, reader))
        });
        let Some((entry, reader)) = opened else {
            drop(state);
            shared.send(NetToHost::Stream(StreamFrame::Close { id }));
            return;
        };
        let closed = Arc::clone(&entry.closed);
        let (accept_tx, accept_rx) = mpsc::channel();
        let _ = accept_tx.send(credit);
        state.live.insert(id, entry);
        // Sent under the lock, so no host message for the stream can be judged before it is in the table.
        shared.send(NetToHost::Connected { id, window: NET_WINDOW_BYTES });
        drop(state);
        pump(&shared, id, reader, &closed, &accept_rx);
    };
    thread::Builder::new()
        .name("vm-agent-dial".into())
        .spawn(dial)
        .map(drop)
        .map_err(|_| violation(id, "cannot start a thread for the stream"))
}

fn start_pump(
    shared: &Arc<Shared>,
    id: StreamId,
    reader: TcpStream,
    closed: Arc<AtomicBool>,
    accept: Receiver<Arc<Credit>>,
) {
    let shared2 = Arc::clone(shared);
    let started =
        thread::Builder::new().name("vm-agent-pump".into()).spawn(move || pump(&shared2, id, reader, &closed, &accept));
    if started.is_err() {
        shared.send(NetToHost::Stream(StreamFrame::Close { id }));
    }
}

/// Socket to host: waits for the host's window, then sends what the socket yields within the credit, and
/// `Eof` (or `Close` on an error) at the end.
fn pump(
    shared: &Arc<Shared>,
    id: StreamId,
    mut socket: TcpStream,
    closed: &AtomicBool,
    accept: &Receiver<Arc<Credit>>,
) {
    let Ok(credit) = accept.recv() else { return };
    let mut buf = vec![0u8; CHUNK_BYTES.min(MAX_DATA_BYTES)];
    let mut scratch = Vec::new();
    let end = loop {
        let Some(n) = credit.reserve(buf.len()) else { return };
        match socket.read(&mut buf[..n]) {
            Ok(0) => break StreamFrame::Eof { id },
            Ok(read) => {
                credit.give_back(n - read);
                if closed.load(Ordering::Acquire) {
                    return;
                }
                let data = buf[..read].to_vec().into();
                let msg = ToHost::Net(NetToHost::Stream(StreamFrame::Data { id, data }));
                if shared.outbox.send_with(&msg, &mut scratch).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => credit.give_back(n),
            Err(_) => break StreamFrame::Close { id },
        }
    };
    if !closed.load(Ordering::Acquire) {
        shared.send(NetToHost::Stream(end.clone()));
    }
    if matches!(end, StreamFrame::Close { .. }) {
        shared.net.state().live.remove(&id);
    } else {
        finish_direction(shared, id, true);
    }
}

fn start_writer(shared: &Arc<Shared>, id: StreamId, entry: &Entry) -> Result<Sender<ToSocket>, LinkError> {
    let socket = entry.socket.try_clone().map_err(|_| violation(id, "cannot clone the stream's socket"))?;
    let (tx, rx) = mpsc::channel();
    let (shared, recv, closed) = (Arc::clone(shared), Arc::clone(&entry.recv), Arc::clone(&entry.closed));
    thread::Builder::new()
        .name("vm-agent-netw".into())
        .spawn(move || write_loop(&shared, id, socket, &rx, &recv, &closed))
        .map_err(|_| violation(id, "cannot start a thread for the stream"))?;
    Ok(tx)
}

/// Host to socket: writes each chunk, then returns its credit; `Eof` half-closes the socket.
fn write_loop(
    shared: &Arc<Shared>,
    id: StreamId,
    mut socket: TcpStream,
    rx: &Receiver<ToSocket>,
    recv: &Mutex<Window>,
    closed: &AtomicBool,
) {
    while let Ok(cmd) = rx.recv() {
        match cmd {
            ToSocket::Data(data) => {
                if socket.write_all(&data).is_err() {
                    if !closed.swap(true, Ordering::AcqRel) {
                        shared.send(NetToHost::Stream(StreamFrame::Close { id }));
                    }
                    let _ = socket.shutdown(Shutdown::Both);
                    shared.net.state().live.remove(&id);
                    return;
                }
                let bytes = u32::try_from(data.len()).unwrap_or(u32::MAX);
                // Within what was consumed, so within the capacity.
                let _ = recv.lock().unwrap_or_else(PoisonError::into_inner).grant(bytes);
                if !closed.load(Ordering::Acquire) {
                    shared.send(NetToHost::Stream(StreamFrame::Credit { id, bytes }));
                }
            }
            ToSocket::Eof => {
                let _ = socket.shutdown(Shutdown::Write);
                finish_direction(shared, id, false);
                return;
            }
            ToSocket::Close => {
                let _ = socket.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}

/// One direction of `id` ended in order; the stream leaves the table when both have.
fn finish_direction(shared: &Shared, id: StreamId, ours: bool) {
    let mut state = shared.net.state();
    let Some(entry) = state.live.get_mut(&id) else { return };
    if ours {
        entry.sent_eof = true;
    } else {
        entry.got_eof = true;
    }
    if entry.sent_eof && entry.got_eof {
        state.live.remove(&id);
    }
}

fn violation(id: StreamId, what: &str) -> LinkError {
    LinkError::Violation { what: format!("stream {id}: {what}") }
}
