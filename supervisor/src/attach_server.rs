//! The attach socket's server: how the driver runs processes in the VM.
//!
//! It lives in the sandbox directory (0700) with mode 0600, and a connecting peer must also have our uid
//! (`SO_PEERCRED`). The supervisor plays the guest's part of the handshake, advertising the agent's
//! capabilities, then relays frames through the multiplexer.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc::{self, UnboundedSender};
use tokio_util::codec::FramedRead;
use vm_protocol::codec::{self, FrameCodec};
use vm_protocol::{Capabilities, Hello, ToGuest, ToHost};

use crate::mux::ClientId;
use crate::Event;

/// How long a connecting client has to complete its handshake.
const HANDSHAKE_TIMEOUT_MS: u64 = 5_000;

/// The loop's handle on one connected client.
#[derive(Debug)]
pub struct ClientHandle {
    /// Frames to the client, in order.
    pub tx: UnboundedSender<ToHost>,
    /// The task writing them; it ends after the last queued frame once `tx` is dropped.
    pub writer: tokio::task::JoinHandle<()>,
    /// The task reading the client's frames; aborting it (with `tx` dropped) disconnects the client.
    pub reader: tokio::task::AbortHandle,
}

/// Accepts clients forever, each in its own task.
pub fn serve(listener: UnixListener, capabilities: Capabilities, events: UnboundedSender<Event>) {
    tokio::spawn(async move {
        let mut next = 0u64;
        loop {
            // An accept error (out of descriptors, say) is waited out: the sandbox stays reachable.
            let Ok((stream, _)) = listener.accept().await else {
                tracing::warn!("cannot accept an attach connection; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            next += 1;
            let id = ClientId(next);
            let events = events.clone();
            tokio::spawn(async move { client(stream, id, capabilities, events).await });
        }
    });
}

async fn client(mut stream: UnixStream, id: ClientId, capabilities: Capabilities, events: UnboundedSender<Event>) {
    let our_uid = rustix::process::getuid().as_raw();
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == our_uid => {}
        _ => {
            tracing::warn!("refused an attach connection from another user");
            let _ = events.send(Event::AdmissionRefused("attach connection from another user"));
            return;
        }
    }
    let ours = Hello::ours(capabilities, concat!("vm-supervisor ", env!("CARGO_PKG_VERSION")));
    let shake = codec::guest_handshake(&mut stream, ours, Capabilities::NONE);
    match tokio::time::timeout(Duration::from_millis(HANDSHAKE_TIMEOUT_MS), shake).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "attach handshake failed");
            let _ = events.send(Event::AdmissionRefused("attach handshake failed"));
            return;
        }
        Err(_) => {
            tracing::warn!("attach handshake timed out");
            let _ = events.send(Event::AdmissionRefused("attach handshake timed out"));
            return;
        }
    }
    let (read, write) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel::<ToHost>();
    let writer = tokio::spawn(crate::framed::drain_into(write, rx));
    // The reader starts only once the loop knows the client, so its frames never precede `ClientConnected`.
    let (known, known_rx) = tokio::sync::oneshot::channel::<()>();
    let reader_events = events.clone();
    let reader = tokio::spawn(async move {
        if known_rx.await.is_err() {
            return;
        }
        let mut frames = FramedRead::new(read, FrameCodec::<ToGuest, ToHost>::new());
        while let Some(Ok(msg)) = frames.next().await {
            if reader_events.send(Event::Client(id, msg)).is_err() {
                return;
            }
        }
        let _ = reader_events.send(Event::ClientClosed(id));
    });
    let handle = ClientHandle { tx, writer, reader: reader.abort_handle() };
    if events.send(Event::ClientConnected(id, handle)).is_ok() {
        let _ = known.send(());
    }
}
