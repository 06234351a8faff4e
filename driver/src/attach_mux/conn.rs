//! One shared attach connection: its reader and writer tasks, and the processes open on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures_util::{SinkExt, StreamExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use vm_protocol::attach::{SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::codec::FrameCodec;
use vm_protocol::{Capabilities, ProcId, ProcessEvent};

use super::{STREAM_FRAMES, WRITE_QUEUE};

pub use crate::process::Lost;

const OPEN: u8 = 0;
const CONNECTION_LOST: u8 = 1;
const OVERFLOWED: u8 = 2;

/// What the reader and a process share.
#[derive(Debug)]
struct RouteState {
    /// Output bytes queued for the process and not taken yet.
    queued: AtomicU64,
    /// The most that may be queued: the process's output window.
    limit: u64,
    /// Why the stream ended (`OPEN` while it has not).
    ended: AtomicU8,
}

#[derive(Debug)]
struct Route {
    tx: mpsc::Sender<ProcessEvent>,
    state: Arc<RouteState>,
}

#[derive(Debug, Default)]
struct Routes {
    /// The id the next process gets on this connection.
    next: u32,
    live: HashMap<ProcId, Route>,
    closed: bool,
}

type OnClose = Box<dyn FnOnce() + Send>;

struct Shared {
    routes: Mutex<Routes>,
    writes: mpsc::Sender<ToSupervisor>,
    closed: CancellationToken,
    on_close: Mutex<Option<OnClose>>,
    capabilities: Capabilities,
    /// The head-of-line control: the reader waits on each process's one-frame queue.
    head_of_line: bool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("capabilities", &self.capabilities).finish_non_exhaustive()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends every stream on the connection, once.
    fn close(&self) {
        let ended: Vec<Route> = {
            let mut routes = self.lock();
            routes.closed = true;
            routes.live.drain().map(|(_, r)| r).collect()
        };
        for route in ended {
            route.state.ended.store(CONNECTION_LOST, Ordering::Release);
        }
        self.closed.cancel();
        let on_close = self.on_close.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(f) = on_close {
            f();
        }
    }

    /// Hands one frame to its process, never waiting on it (but under the head-of-line control). What is not
    /// about a process (acknowledgments, pongs, lists) answers the short control connections: ignored here.
    async fn route(&self, msg: ToClient) {
        let ToClient::Process(msg) = msg else { return };
        if let Some((tx, msg)) = self.try_route(msg) {
            let _ = tx.send(msg).await;
        }
    }

    /// Queues `msg` for its process; under the head-of-line control, returns the queue to wait on instead.
    fn try_route(&self, msg: ProcessEvent) -> Option<(mpsc::Sender<ProcessEvent>, ProcessEvent)> {
        let id = msg.id();
        let bytes = match &msg {
            ProcessEvent::Output { data, .. } => data.len() as u64,
            _ => 0,
        };
        let mut routes = self.lock();
        // A stream already gone: the supervisor holds its output for a re-attach.
        let route = routes.live.get(&id)?;
        // Counted before the stream can take it (it subtracts what it takes).
        let before = route.state.queued.fetch_add(bytes, Ordering::AcqRel);
        if self.head_of_line {
            return Some((route.tx.clone(), msg));
        }
        let full = if before + bytes > route.state.limit {
            true
        } else {
            match route.tx.try_send(msg) {
                Ok(()) => return None,
                Err(mpsc::error::TrySendError::Full(_)) => true,
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        };
        route.state.queued.fetch_sub(bytes, Ordering::AcqRel);
        if let Some(route) = routes.live.remove(&id) {
            if full {
                route.state.ended.store(OVERFLOWED, Ordering::Release);
            }
        }
        None
    }
}

/// A handshaken attach connection shared by many processes.
#[derive(Debug, Clone)]
pub struct Conn {
    shared: Arc<Shared>,
}

impl Conn {
    /// Starts the reader and writer on a handshaken connection; `on_close` runs once when it breaks.
    /// `head_of_line` is the `exec-mux-head-of-line` control (off but in its causal test).
    pub fn start(
        stream: UnixStream,
        capabilities: Capabilities,
        head_of_line: bool,
        on_close: impl FnOnce() + Send + 'static,
    ) -> Self {
        let (read, write) = stream.into_split();
        let (writes, queued) = mpsc::channel(WRITE_QUEUE);
        let shared = Arc::new(Shared {
            routes: Mutex::new(Routes { next: 1, ..Routes::default() }),
            writes,
            closed: CancellationToken::new(),
            on_close: Mutex::new(Some(Box::new(on_close))),
            capabilities,
            head_of_line,
        });
        tokio::spawn(read_frames(read, Arc::clone(&shared)));
        tokio::spawn(write_frames(write, queued, Arc::clone(&shared)));
        Self { shared }
    }

    /// The sandbox's capabilities, from the handshake.
    pub fn capabilities(&self) -> Capabilities {
        self.shared.capabilities
    }

    /// Whether the connection broke (or its ids ran out): the next open needs a new one.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// Processes open on the connection.
    pub fn open_processes(&self) -> usize {
        self.shared.lock().live.len()
    }

    /// Opens a process: gives it the next id and queues `opening(id)` (its `Spawn` or `Reattach`).
    /// `output_window` bounds the output bytes queued for it.
    ///
    /// # Errors
    /// [`Lost::Connection`] when the connection is closed.
    pub async fn open(
        &self,
        output_window: u32,
        opening: impl FnOnce(ProcId) -> ToSupervisor,
    ) -> Result<Process, Lost> {
        let permit = self.shared.writes.reserve().await.map_err(|_| Lost::Connection)?;
        let mut routes = self.shared.lock();
        if routes.closed {
            return Err(Lost::Connection);
        }
        let id = ProcId(routes.next);
        match routes.next.checked_add(1) {
            Some(next) => routes.next = next,
            // Ids must increase: after four billion processes, new ones take a new connection.
            None => routes.closed = true,
        }
        let frames = if self.shared.head_of_line { 1 } else { STREAM_FRAMES };
        let (tx, rx) = mpsc::channel(frames);
        let state = Arc::new(RouteState {
            queued: AtomicU64::new(0),
            limit: u64::from(output_window),
            ended: AtomicU8::new(OPEN),
        });
        routes.live.insert(id, Route { tx, state: Arc::clone(&state) });
        // Under the lock: ids reach the writer in the order they were given.
        permit.send(opening(id));
        drop(routes);
        Ok(Process { id, rx, state, conn: self.clone() })
    }
}

async fn read_frames(read: OwnedReadHalf, shared: Arc<Shared>) {
    let mut frames = FramedRead::new(read, FrameCodec::<ToClient, ToSupervisor>::new());
    loop {
        let next = tokio::select! {
            next = frames.next() => next,
            () = shared.closed.cancelled() => None,
        };
        let Some(Ok(msg)) = next else { break };
        shared.route(msg).await;
    }
    shared.close();
}

async fn write_frames(write: OwnedWriteHalf, mut queued: mpsc::Receiver<ToSupervisor>, shared: Arc<Shared>) {
    let mut sink = FramedWrite::new(write, FrameCodec::<ToClient, ToSupervisor>::new());
    loop {
        let next = tokio::select! {
            next = queued.recv() => next,
            () = shared.closed.cancelled() => None,
        };
        let Some(msg) = next else { break };
        if sink.feed(msg).await.is_err() {
            break;
        }
        // Whatever else is queued goes out in the same write.
        let mut failed = false;
        while let Ok(msg) = queued.try_recv() {
            if sink.feed(msg).await.is_err() {
                failed = true;
                break;
            }
        }
        if failed || sink.flush().await.is_err() {
            break;
        }
    }
    shared.close();
}

/// One process on a shared connection: its messages in, and a way to send its own.
#[derive(Debug)]
pub struct Process {
    id: ProcId,
    rx: mpsc::Receiver<ProcessEvent>,
    state: Arc<RouteState>,
    conn: Conn,
}

impl Process {
    /// Its id on the connection.
    pub fn id(&self) -> ProcId {
        self.id
    }

    /// The next message about the process.
    ///
    /// # Errors
    /// Why its stream ended: [`Lost`].
    pub async fn recv(&mut self) -> Result<ProcessEvent, Lost> {
        match self.rx.recv().await {
            Some(msg) => {
                if let ProcessEvent::Output { data, .. } = &msg {
                    self.state.queued.fetch_sub(data.len() as u64, Ordering::AcqRel);
                }
                Ok(msg)
            }
            None if self.state.ended.load(Ordering::Acquire) == OVERFLOWED => Err(Lost::Overflow),
            None => Err(Lost::Connection),
        }
    }

    /// Queues a message for the supervisor (waits while the connection's write queue is full).
    ///
    /// # Errors
    /// [`Lost::Connection`].
    pub async fn send(&self, msg: impl Into<ToSupervisor>) -> Result<(), Lost> {
        self.conn.shared.writes.send(msg.into()).await.map_err(|_| Lost::Connection)
    }

    /// Ends the stream. With `detach`, the process keeps running without it, its undelivered output held by
    /// the supervisor for an `ExecAttach` (what a closed connection did when each stream had its own).
    pub async fn release(self, detach: bool) {
        self.unroute();
        if detach {
            let _ = self.send(SupervisorRequest::Detach { id: self.id }).await;
        }
    }

    fn unroute(&self) {
        self.conn.shared.lock().live.remove(&self.id);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.unroute();
    }
}
