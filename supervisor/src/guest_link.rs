//! The guest link: the boundary channel to the guest agent. Accept QEMU's connection, check the agent's
//! hello, then pump frames between the socket and the event loop.

use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use vm_protocol::codec::{self, HostFrameReader};
use vm_protocol::handshake::FirstFrameError;
use vm_protocol::{Capabilities, Hello, ToGuest};

use crate::inbox::Senders;

/// Messages to the guest waiting to be written. Stdin travels within the guest's credit; the rest is small.
pub const TO_GUEST_ITEMS: usize = 4096;

/// What the supervisor needs from any agent.
pub const REQUIRED: Capabilities = Capabilities::EXEC.union(Capabilities::SIGNALS).union(Capabilities::POWER_OFF);

/// Why the guest link did not come up.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// QEMU never connected to the channel socket.
    #[error("the VMM did not connect to the boundary channel")]
    Accept(#[source] std::io::Error),
    /// The agent did not say hello in time.
    #[error("the guest agent did not answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The agent's hello was wrong.
    #[error("the guest agent's handshake failed")]
    Handshake(#[source] FirstFrameError),
}

/// A connected, handshaken guest.
#[derive(Debug)]
pub struct GuestLink {
    /// The agent's hello.
    pub hello: Hello,
    /// Messages to the guest, in order.
    pub tx: mpsc::Sender<ToGuest>,
}

/// Accepts the VMM's connection and completes the handshake within `timeout`, then starts the reader and
/// writer tasks. Guest messages go to the loop's bounded guest queue: when it is full the reader waits, and
/// the guest with it.
///
/// # Errors
/// A [`LinkError`].
pub async fn connect(listener: &UnixListener, timeout: Duration, senders: Senders) -> Result<GuestLink, LinkError> {
    let start = tokio::time::Instant::now();
    let (mut stream, _) = listener.accept().await.map_err(LinkError::Accept)?;
    let ours = Hello::ours(Capabilities::NONE, concat!("vm-supervisor ", env!("CARGO_PKG_VERSION")));
    let hello = tokio::time::timeout_at(start + timeout, codec::host_handshake(&mut stream, ours, REQUIRED))
        .await
        .map_err(|_| LinkError::Timeout(timeout))?
        .map_err(LinkError::Handshake)?;
    Ok(GuestLink { hello, tx: pump(stream, senders) })
}

fn pump(stream: UnixStream, senders: Senders) -> mpsc::Sender<ToGuest> {
    let (read, write) = stream.into_split();
    let (tx, rx) = mpsc::channel::<ToGuest>(TO_GUEST_ITEMS);
    tokio::spawn(crate::framed::drain_into(write, rx));
    tokio::spawn(async move {
        // Output data goes into the message's own buffer, mostly straight from the socket (at most one read
        // buffer's worth is copied).
        let mut frames = HostFrameReader::new(read);
        let end = loop {
            match frames.next().await {
                Some(Ok(msg)) => {
                    if !senders.guest(msg).await {
                        return;
                    }
                }
                Some(Err(e)) => break Some(e),
                None => break None,
            }
        };
        senders.guest_closed(end).await;
    });
    tx
}
