//! The gateway's side of one in-process attach connection: a client of the boundary core like any socket's
//! (`crate::serve::attach_server::Connector`), shared by the channels of one relayed SSH connection (or by
//! the main process's owner).
//!
//! A reader task routes what the supervisor sends to the process or stream it is about; a writer task
//! sends the frames the routes give it. Each route's queue is bounded in items: the credit windows bound it
//! in bytes, and a guest that floods one with tiny frames past [`ROUTE_ITEMS`] loses that route (its
//! channel ends with an error), never the others.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::{SinkExt, StreamExt};
use tokio::io::DuplexStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use vm_protocol::attach::{SupervisorReply, ToClient, ToSupervisor};
use vm_protocol::codec::{self, FrameCodec};
use vm_protocol::net::{ForwardEvent, StreamId};
use vm_protocol::{Capabilities, Hello, ProcId, ProcessEvent};

/// Frames waiting to be written to the boundary.
const OUTBOUND_ITEMS: usize = 256;
/// Events waiting for one process or stream's task.
pub const ROUTE_ITEMS: usize = 4096;

/// What a route receives.
#[derive(Debug)]
pub enum Event {
    /// About a process.
    Process(ProcessEvent),
    /// About a forward stream.
    Forward(ForwardEvent),
}

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// Every attach place is taken.
    #[error("every attach connection is taken")]
    Full,
    /// The boundary's handshake failed.
    #[error("the attach handshake failed")]
    Handshake,
}

#[derive(Debug, Default)]
struct Routes {
    processes: HashMap<ProcId, mpsc::Sender<Event>>,
    streams: HashMap<StreamId, mpsc::Sender<Event>>,
    closed: bool,
}

/// One connection; clones share it.
#[derive(Debug, Clone)]
pub struct Attach {
    tx: mpsc::Sender<ToSupervisor>,
    routes: Arc<Mutex<Routes>>,
    next_proc: Arc<AtomicU32>,
    next_stream: Arc<AtomicU32>,
}

impl Attach {
    /// Connects through `connector` and handshakes.
    ///
    /// # Errors
    /// [`AttachError`].
    pub async fn connect(connector: &crate::serve::attach_server::Connector) -> Result<Self, AttachError> {
        let mut pipe = connector.connect().ok_or(AttachError::Full)?;
        let ours = Hello::ours(Capabilities::NONE, concat!("vm-supervisor gateway ", env!("CARGO_PKG_VERSION")));
        codec::host_handshake(&mut pipe, ours, Capabilities::EXEC).await.map_err(|_| AttachError::Handshake)?;
        Ok(Self::start(pipe))
    }

    fn start(pipe: DuplexStream) -> Self {
        let (read, write) = tokio::io::split(pipe);
        let (tx, mut outbound) = mpsc::channel::<ToSupervisor>(OUTBOUND_ITEMS);
        let routes = Arc::new(Mutex::new(Routes::default()));
        tokio::spawn(async move {
            let mut frames = FramedWrite::new(write, FrameCodec::<ToClient, ToSupervisor>::new());
            while let Some(msg) = outbound.recv().await {
                if frames.send(msg).await.is_err() {
                    return;
                }
            }
        });
        let reading = Arc::clone(&routes);
        tokio::spawn(async move {
            let mut frames = FramedRead::new(read, FrameCodec::<ToClient, ToSupervisor>::new());
            while let Some(Ok(msg)) = frames.next().await {
                match msg {
                    ToClient::Process(event) => route_process(&reading, event),
                    ToClient::Forward(event) => route_forward(&reading, event),
                    ToClient::Supervisor(SupervisorReply::Disconnected { .. }) => break,
                    _ => {}
                }
            }
            // Every route's sender goes: their tasks see the end.
            let mut routes = reading.lock().unwrap_or_else(PoisonError::into_inner);
            *routes = Routes { closed: true, ..Routes::default() };
        });
        Self { tx, routes, next_proc: Arc::new(AtomicU32::new(1)), next_stream: Arc::new(AtomicU32::new(1)) }
    }

    /// A new process id on this connection, with its route.
    pub fn process(&self) -> Option<(ProcId, mpsc::Receiver<Event>)> {
        let id = ProcId(self.next_proc.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::channel(ROUTE_ITEMS);
        let mut routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        if routes.closed {
            return None;
        }
        routes.processes.insert(id, tx);
        Some((id, rx))
    }

    /// A new stream id on this connection, with its route.
    pub fn stream(&self) -> Option<(StreamId, mpsc::Receiver<Event>)> {
        let id = StreamId(self.next_stream.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::channel(ROUTE_ITEMS);
        let mut routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        if routes.closed {
            return None;
        }
        routes.streams.insert(id, tx);
        Some((id, rx))
    }

    /// Forgets a process's route (it ended, or its channel did).
    pub fn forget_process(&self, id: ProcId) {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner).processes.remove(&id);
    }

    /// Forgets a stream's route.
    pub fn forget_stream(&self, id: StreamId) {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner).streams.remove(&id);
    }

    /// Sends one frame to the boundary, waiting for room; `false` once the connection is gone.
    pub async fn send(&self, msg: ToSupervisor) -> bool {
        self.tx.send(msg).await.is_ok()
    }
}

fn route_process(routes: &Mutex<Routes>, event: ProcessEvent) {
    let id = event.id();
    let mut routes = routes.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(route) = routes.processes.get(&id) else { return };
    if route.try_send(Event::Process(event)).is_err() {
        // Its task fell this far behind (or ended): the route goes, and its task sees the end.
        routes.processes.remove(&id);
    }
}

fn route_forward(routes: &Mutex<Routes>, event: ForwardEvent) {
    let id = match &event {
        ForwardEvent::Connected { id, .. } | ForwardEvent::Refused { id, .. } => *id,
        ForwardEvent::Stream(frame) => frame.id(),
        ForwardEvent::LinkOnly(never) => match *never {},
    };
    let mut routes = routes.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(route) = routes.streams.get(&id) else { return };
    if route.try_send(Event::Forward(event)).is_err() {
        routes.streams.remove(&id);
    }
}
