//! The attach socket's server: how the driver runs processes in the VM.
//!
//! It lives in the sandbox directory (0700) with mode 0600, and a connecting peer must also have our uid
//! (`SO_PEERCRED`). At most [`MAX_CLIENTS`] are connected at once. The supervisor's own clients (the
//! gateway's relayed SSH sessions, `crate::gateway`) connect in process ([`Connector::connect`]), over an
//! in-memory pipe, and are served exactly as a socket's: same handshake, queues, bounds and gate. The supervisor plays the guest's part of the
//! handshake, advertising the agent's capabilities, then relays frames through the multiplexer. Each client's
//! frames reach the loop through the bounded client queue; the loop's frames to a client go through a bounded
//! queue of their own ([`outbox`]): a full one holds the guest link back, and a client that takes nothing
//! from it is not reading, and is disconnected with the reason.

pub mod outbox;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream};
use tokio::net::UnixListener;
use tokio::sync::Semaphore;
use tokio_util::codec::FramedRead;
use vm_protocol::attach::{ToClient, ToSupervisor};
use vm_protocol::codec::{self, FrameCodec};
use vm_protocol::{Capabilities, Hello};

pub use self::outbox::{Outbox, TO_CLIENT_BYTES, TO_CLIENT_ITEMS};
use crate::boundary::ClientId;
use crate::inbox::{Notice, Senders};

/// How long a connecting client has to complete its handshake.
const HANDSHAKE_TIMEOUT_MS: u64 = 5_000;

/// Bytes an in-process connection's pipe holds each way.
const PIPE_BYTES: usize = 256 * 1024;

/// Attach connections at once (the driver's contract).
pub const MAX_CLIENTS: usize = vm_contract::attach::MAX_CLIENTS;

/// The loop's handle on one connected client.
#[derive(Debug)]
pub struct ClientHandle {
    /// Frames to the client, in order.
    pub tx: Outbox,
    /// The task writing them; it ends after the last queued frame once `tx` is dropped.
    pub writer: tokio::task::JoinHandle<()>,
    /// The task reading the client's frames; aborting it (with `tx` dropped) disconnects the client.
    pub reader: tokio::task::AbortHandle,
}

/// Where clients come from: the places (at most [`MAX_CLIENTS`]) and the ids, shared by the socket and the
/// supervisor's own clients.
#[derive(Debug, Clone)]
pub struct Connector {
    room: Arc<Semaphore>,
    next: Arc<std::sync::atomic::AtomicU64>,
    capabilities: Capabilities,
    senders: Senders,
}

impl Connector {
    /// Serves an in-process client: the returned end of a pipe speaks the attach protocol as a socket's
    /// client would (the supervisor's hello first). `None` when every place is taken (refused, recorded).
    pub fn connect(&self) -> Option<DuplexStream> {
        let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
        self.admit(ours).then_some(theirs)
    }

    /// Takes a place for `stream` and serves it in a task of its own; `false` when none is free.
    fn admit<S>(&self, stream: S) -> bool
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let Ok(place) = Arc::clone(&self.room).try_acquire_owned() else {
            refuse(&self.senders, "too many attach connections");
            return false;
        };
        let id = ClientId(self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1);
        let (capabilities, senders) = (self.capabilities, self.senders.clone());
        tokio::spawn(async move {
            client(stream, id, capabilities, senders).await;
            drop(place);
        });
        true
    }
}

/// Accepts clients forever, each in its own task; the returned connector admits in-process ones into the
/// same places.
pub fn serve(listener: UnixListener, capabilities: Capabilities, senders: Senders) -> Connector {
    let connector =
        Connector { room: Arc::new(Semaphore::new(MAX_CLIENTS)), next: Arc::default(), capabilities, senders };
    let accepting = connector.clone();
    tokio::spawn(async move {
        let our_uid = rustix::process::getuid().as_raw();
        loop {
            // An accept error (out of descriptors, say) is waited out: the sandbox stays reachable.
            let Ok((stream, _)) = listener.accept().await else {
                tracing::warn!("cannot accept an attach connection; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            match stream.peer_cred() {
                Ok(cred) if cred.uid() == our_uid => {
                    accepting.admit(stream);
                }
                _ => refuse(&accepting.senders, "attach connection from another user"),
            }
        }
    });
    connector
}

fn refuse(senders: &Senders, why: &'static str) {
    tracing::warn!(reason = why, "refused an attach connection");
    // A full control queue drops the report, never the refusal.
    let _ = senders.notices.try_send(Notice::AdmissionRefused(why));
}

async fn client<S>(mut stream: S, id: ClientId, capabilities: Capabilities, senders: Senders)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let ours = Hello::ours(capabilities, concat!("vm-supervisor ", env!("CARGO_PKG_VERSION")));
    let shake = codec::guest_handshake(&mut stream, ours, Capabilities::NONE);
    match tokio::time::timeout(Duration::from_millis(HANDSHAKE_TIMEOUT_MS), shake).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => return refuse(&senders, "attach handshake failed"),
        Err(_) => return refuse(&senders, "attach handshake timed out"),
    }
    let (read, write) = tokio::io::split(stream);
    // A writer that finds its client not reading tells the loop, as if the client had gone.
    let stalled = {
        let senders = senders.clone();
        async move { senders.client_closed(id).await }
    };
    let (tx, writer) = outbox::start(&senders.pressure, write, stalled);
    // The reader starts only once `Connected` is queued: the same queue carries its frames, after it.
    let (known, known_rx) = tokio::sync::oneshot::channel::<()>();
    let reader_senders = senders.clone();
    let reader = tokio::spawn(async move {
        if known_rx.await.is_err() {
            return;
        }
        let mut frames = FramedRead::new(read, FrameCodec::<ToSupervisor, ToClient>::new());
        while let Some(Ok(msg)) = frames.next().await {
            if !reader_senders.client(id, msg).await {
                return;
            }
        }
        reader_senders.client_closed(id).await;
    });
    let handle = ClientHandle { tx, writer, reader: reader.abort_handle() };
    if senders.client_connected(id, handle).await {
        let _ = known.send(());
        // Keep the place while the client is served.
        let _ = reader.await;
    }
}
