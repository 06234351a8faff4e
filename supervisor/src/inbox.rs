//! What reaches the event loop, on four queues with an order between them, each bounded.
//!
//! - **Stop requests** (SIGTERM, the driver gone) are flags in a watch channel, set by threads that never
//!   wait: they cannot queue behind anything, and the loop looks at them first.
//! - **Notices** (a client connected, a refusal, the session's state): a small bounded queue.
//! - **The guest** and **the clients**: bounded in items and in bytes. A reader that finds its queue full
//!   waits, and stops reading its socket: the guest (or client) is slowed down, never buffered without end.
//!   The guest's reader also waits while a client's outbound queue is full (`attach_server::outbox`).
//!   Each message carries the byte permits it holds until the loop has handled it.

use std::sync::Arc;

use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use vm_protocol::attach::ToSupervisor;
use vm_protocol::link::ToHost;
use vm_protocol::{FrameError, ProcessEvent, ProcessRequest};

use crate::boundary::ClientId;
use crate::serve::attach_server::outbox::Pressure;
use crate::serve::attach_server::ClientHandle;

/// Messages from the guest waiting for the loop.
pub const GUEST_QUEUE_ITEMS: usize = 256;
/// Bytes of them.
pub const GUEST_QUEUE_BYTES: u32 = 4 * 1024 * 1024;
/// Messages from all clients together waiting for the loop.
pub const CLIENT_QUEUE_ITEMS: usize = 256;
/// Bytes of them.
pub const CLIENT_QUEUE_BYTES: u32 = 4 * 1024 * 1024;
/// Notices waiting for the loop.
const NOTICE_QUEUE_ITEMS: usize = 64;

/// Why the sandbox was asked to stop from outside.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StopRequests {
    /// SIGTERM, SIGINT or SIGHUP: an orderly stop.
    pub terminate: bool,
    /// The parent-liveness pipe reached EOF: the driver is gone.
    pub driver_gone: bool,
}

/// Everything but stop requests and messages.
#[derive(Debug)]
pub enum Notice {
    /// An attach connection was refused (fixed text).
    AdmissionRefused(&'static str),
    /// The driver accepted the session; the readiness listener is open at this address.
    SessionUp(String),
    /// The session was lost; the readiness listener is closed.
    SessionDown,
    /// The driver refused the session: this sandbox is not the one it expects.
    SessionRefused,
    /// A log the guest fills reached its cap (the file's name).
    LogCapped(&'static str),
    /// The OpenShell gateway's session or relays.
    Gateway(crate::gateway::GatewayEvent),
}

/// From the guest link.
#[derive(Debug)]
pub enum FromGuest {
    /// A message, with the byte permits it holds.
    Message(ToHost, Permit),
    /// The link closed (with the reason, if it was not a clean EOF).
    Closed(Option<FrameError>),
}

/// From an attach client. A client's connection, messages and end share this one queue, so the loop always
/// learns of a client before its first message.
#[derive(Debug)]
pub enum FromClient {
    /// A client finished its handshake.
    Connected(ClientId, ClientHandle),
    /// A message, with the byte permits it holds.
    Message(ClientId, ToSupervisor, Permit),
    /// The client disconnected or sent bytes that are not frames.
    Closed(ClientId),
}

/// Bytes a queued message holds until it is handled.
#[derive(Debug)]
pub struct Permit(
    #[allow(dead_code, reason = "held, not read: dropping it returns the bytes")] Option<OwnedSemaphorePermit>,
);

/// The producers' side.
#[derive(Debug, Clone)]
pub struct Senders {
    /// Stop requests.
    pub stop: Arc<watch::Sender<StopRequests>>,
    /// Notices.
    pub notices: mpsc::Sender<Notice>,
    guest: mpsc::Sender<FromGuest>,
    guest_bytes: Arc<Semaphore>,
    clients: mpsc::Sender<FromClient>,
    client_bytes: Arc<Semaphore>,
    /// The VMM's SIGKILL, for the liveness thread.
    pub vmm_kill: crate::stop::kill_switch::KillSwitch,
    /// Clients' full queues, which the guest's messages wait for.
    pub pressure: Pressure,
}

/// The loop's side.
#[derive(Debug)]
pub struct Inbox {
    /// Stop requests.
    pub stop: watch::Receiver<StopRequests>,
    /// Notices.
    pub notices: mpsc::Receiver<Notice>,
    /// The guest.
    pub guest: mpsc::Receiver<FromGuest>,
    /// The clients.
    pub clients: mpsc::Receiver<FromClient>,
}

/// The four queues.
pub fn new() -> (Senders, Inbox) {
    let (stop, stop_rx) = watch::channel(StopRequests::default());
    let (notices, notices_rx) = mpsc::channel(NOTICE_QUEUE_ITEMS);
    let (guest, guest_rx) = mpsc::channel(GUEST_QUEUE_ITEMS);
    let (clients, clients_rx) = mpsc::channel(CLIENT_QUEUE_ITEMS);
    let senders = Senders {
        stop: Arc::new(stop),
        notices,
        guest,
        guest_bytes: Arc::new(Semaphore::new(GUEST_QUEUE_BYTES as usize)),
        clients,
        client_bytes: Arc::new(Semaphore::new(CLIENT_QUEUE_BYTES as usize)),
        vmm_kill: crate::stop::kill_switch::KillSwitch::default(),
        pressure: Pressure::default(),
    };
    (senders, Inbox { stop: stop_rx, notices: notices_rx, guest: guest_rx, clients: clients_rx })
}

/// Waits for `bytes` of a budget (all of it, for a message larger than the budget).
async fn permit(budget: &Arc<Semaphore>, limit: u32, bytes: usize) -> Permit {
    let n = u32::try_from(bytes).unwrap_or(u32::MAX).clamp(1, limit);
    Permit(Arc::clone(budget).acquire_many_owned(n).await.ok())
}

/// The in-memory size of a message, roughly: its data and a fixed overhead.
fn size_of_guest(msg: &ToHost) -> usize {
    64 + match msg {
        ToHost::Process(ProcessEvent::Output { data, .. }) => data.len(),
        ToHost::Process(ProcessEvent::SpawnFailed { message, .. }) => message.len(),
        _ => 0,
    }
}

fn size_of_client(msg: &ToSupervisor) -> usize {
    64 + match msg {
        ToSupervisor::Process(ProcessRequest::Stdin { data, .. }) => data.len(),
        ToSupervisor::Process(ProcessRequest::Spawn(s)) => {
            s.argv.iter().map(String::len).sum::<usize>()
                + s.env.iter().map(|e| e.key.len() + e.value.len()).sum::<usize>()
        }
        _ => 0,
    }
}

impl Senders {
    /// Queues a guest message, waiting for room, and first for every client's queue to have room (a client
    /// that reads sets the guest's pace). `false` once the loop is gone.
    pub async fn guest(&self, msg: ToHost) -> bool {
        self.pressure.room().await;
        let permit = permit(&self.guest_bytes, GUEST_QUEUE_BYTES, size_of_guest(&msg)).await;
        self.guest.send(FromGuest::Message(msg, permit)).await.is_ok()
    }

    /// The guest link closed.
    pub async fn guest_closed(&self, why: Option<FrameError>) {
        let _ = self.guest.send(FromGuest::Closed(why)).await;
    }

    /// Queues a client's message, waiting for room. `false` once the loop is gone.
    pub async fn client(&self, id: ClientId, msg: ToSupervisor) -> bool {
        let permit = permit(&self.client_bytes, CLIENT_QUEUE_BYTES, size_of_client(&msg)).await;
        self.clients.send(FromClient::Message(id, msg, permit)).await.is_ok()
    }

    /// A client connected. `false` once the loop is gone.
    pub async fn client_connected(&self, id: ClientId, handle: ClientHandle) -> bool {
        self.clients.send(FromClient::Connected(id, handle)).await.is_ok()
    }

    /// A client closed.
    pub async fn client_closed(&self, id: ClientId) {
        let _ = self.clients.send(FromClient::Closed(id)).await;
    }

    /// Asks for an orderly stop. Never waits.
    pub fn terminate(&self) {
        self.stop.send_modify(|s| s.terminate = true);
    }

    /// Reports the driver gone. Never waits.
    pub fn driver_gone(&self) {
        self.stop.send_modify(|s| s.driver_gone = true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_protocol::{ProcId, Stream};

    #[tokio::test]
    async fn a_full_guest_queue_makes_the_reader_wait_and_stop_requests_never_do() {
        let (senders, mut inbox) = new();
        let big =
            || ProcessEvent::Output { id: ProcId(1), stream: Stream::Stdout, data: vec![0; 1 << 20].into() }.into();
        let mut sent = 0;
        while tokio::time::timeout(std::time::Duration::from_millis(50), senders.guest(big())).await.is_ok() {
            sent += 1;
        }
        assert!(sent <= 4, "bounded in bytes: {sent} MiB queued");
        senders.driver_gone();
        assert!(inbox.stop.borrow_and_update().driver_gone, "a stop request passes a full queue");
        let Some(FromGuest::Message(_, permit)) = inbox.guest.recv().await else { panic!("a message") };
        drop(permit);
        assert!(tokio::time::timeout(std::time::Duration::from_millis(500), senders.guest(big())).await.is_ok());
    }
}
