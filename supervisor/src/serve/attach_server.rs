//! The attach socket's server: how the driver runs processes in the VM.
//!
//! It lives in the sandbox directory (0700) with mode 0600, and a connecting peer must also have our uid
//! (`SO_PEERCRED`). At most [`MAX_CLIENTS`] are connected at once. The supervisor plays the guest's part of the
//! handshake, advertising the agent's capabilities, then relays frames through the multiplexer. Each client's
//! frames reach the loop through the bounded client queue; the loop's frames to a client go through a bounded
//! queue of their own ([`outbox`]): a full one holds the guest link back, and a client that takes nothing
//! from it is not reading, and is disconnected with the reason.

pub mod outbox;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::net::{UnixListener, UnixStream};
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

/// Accepts clients forever, each in its own task.
pub fn serve(listener: UnixListener, capabilities: Capabilities, senders: Senders) {
    tokio::spawn(async move {
        let room = Arc::new(Semaphore::new(MAX_CLIENTS));
        let mut next = 0u64;
        loop {
            // An accept error (out of descriptors, say) is waited out: the sandbox stays reachable.
            let Ok((stream, _)) = listener.accept().await else {
                tracing::warn!("cannot accept an attach connection; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let Ok(place) = Arc::clone(&room).try_acquire_owned() else {
                refuse(&senders, "too many attach connections");
                continue;
            };
            next += 1;
            let id = ClientId(next);
            let senders = senders.clone();
            tokio::spawn(async move {
                client(stream, id, capabilities, senders).await;
                drop(place);
            });
        }
    });
}

fn refuse(senders: &Senders, why: &'static str) {
    tracing::warn!(reason = why, "refused an attach connection");
    // A full control queue drops the report, never the refusal.
    let _ = senders.notices.try_send(Notice::AdmissionRefused(why));
}

async fn client(mut stream: UnixStream, id: ClientId, capabilities: Capabilities, senders: Senders) {
    let our_uid = rustix::process::getuid().as_raw();
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == our_uid => {}
        _ => return refuse(&senders, "attach connection from another user"),
    }
    let ours = Hello::ours(capabilities, concat!("vm-supervisor ", env!("CARGO_PKG_VERSION")));
    let shake = codec::guest_handshake(&mut stream, ours, Capabilities::NONE);
    match tokio::time::timeout(Duration::from_millis(HANDSHAKE_TIMEOUT_MS), shake).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => return refuse(&senders, "attach handshake failed"),
        Err(_) => return refuse(&senders, "attach handshake timed out"),
    }
    let (read, write) = stream.into_split();
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
