//! The guest link: the boundary channel to the guest agent. Accept QEMU's connection, check the agent's
//! hello, then pump frames between the socket and the event loop.

use std::time::Duration;

use serde::{Serialize, Serializer};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use vm_protocol::codec::{self, HostFrameReader};
use vm_protocol::handshake::FirstFrameError;
use vm_protocol::link::{HostEntropy, ToGuest, ToHost, VmRequest, RESEED_BYTES};
use vm_protocol::net::NetToGuest;
use vm_protocol::{frame, Capabilities, Hello};

use crate::inbox::Senders;

/// Messages to the guest waiting to be written. Stdin and forwards travel within the guest's credit, egress
/// downloads within the download budget; the rest is small.
pub const TO_GUEST_ITEMS: usize = 4096;

/// A message in the link writer's queue. An egress download's bytes hold their share of the sandbox's
/// download budget until the writer has taken them.
#[derive(Debug)]
pub struct Queued {
    /// The message.
    pub msg: ToGuest,
    budget: Option<OwnedSemaphorePermit>,
}

impl Queued {
    /// `msg`, holding `budget` until it is written.
    pub fn budgeted(msg: impl Into<ToGuest>, budget: OwnedSemaphorePermit) -> Self {
        Self { msg: msg.into(), budget: Some(budget) }
    }

    /// Whether it holds a share of the download budget.
    pub fn holds_budget(&self) -> bool {
        self.budget.is_some()
    }
}

impl From<ToGuest> for Queued {
    fn from(msg: ToGuest) -> Self {
        Self { msg, budget: None }
    }
}

impl From<NetToGuest> for Queued {
    fn from(msg: NetToGuest) -> Self {
        ToGuest::from(msg).into()
    }
}

/// Written as the message alone.
impl Serialize for Queued {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.msg.serialize(serializer)
    }
}

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
    /// The host's RNG did not give the guest's seed.
    #[error("cannot read the host's RNG")]
    Entropy(#[source] std::io::Error),
    /// The first requests or the agent's answer to them failed.
    #[error("the guest agent did not take its first requests")]
    Settle(#[source] vm_protocol::FrameError),
    /// The agent answered its first requests with something other than the pong.
    #[error("the guest agent answered its first requests out of turn")]
    Unsettled,
}

/// A connected, handshaken guest.
#[derive(Debug)]
pub struct GuestLink {
    /// The agent's hello.
    pub hello: Hello,
    /// Messages to the guest, in order.
    pub tx: mpsc::Sender<Queued>,
}

/// How the link starts.
#[derive(Debug, Clone, Copy)]
pub struct LinkStart<'a> {
    /// A guest restored from a snapshot finished its handshake with the supervisor that saved it and waits
    /// for requests: this is its hello, saved with the snapshot and checked before QEMU started
    /// ([`super::snapshot::saved_hello`]), in place of a fresh exchange.
    pub saved_hello: Option<&'a Hello>,
    /// Wait until the agent has handled the `Reseed` (a ping, answered in order) before the link counts as
    /// up: a restored guest proves it runs, and a guest to be saved is saved reseeded.
    pub settle: bool,
    /// Reseed a restored guest too (off only in the `no-reseed-at-restore` control).
    pub reseed_restored: bool,
}

/// Accepts the VMM's connection and completes the handshake within `timeout`, queues the [`VmRequest::Reseed`]
/// first of all, then starts the reader and writer tasks. Guest messages go to the loop's bounded guest
/// queue: when it is full the reader waits, and the guest with it.
///
/// # Errors
/// A [`LinkError`].
pub async fn connect(
    listener: &UnixListener,
    timeout: Duration,
    senders: Senders,
    how: LinkStart<'_>,
) -> Result<GuestLink, LinkError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let (mut stream, _) = listener.accept().await.map_err(LinkError::Accept)?;
    let hello = match how.saved_hello {
        Some(hello) => hello.clone(),
        None => {
            let ours = Hello::ours(Capabilities::NONE, concat!("vm-supervisor ", env!("CARGO_PKG_VERSION")));
            tokio::time::timeout_at(deadline, codec::host_handshake(&mut stream, ours, REQUIRED))
                .await
                .map_err(|_| LinkError::Timeout(timeout))?
                .map_err(LinkError::Handshake)?
        }
    };
    let mut first = Vec::new();
    if how.saved_hello.is_none() || how.reseed_restored {
        first.push(reseed().map_err(LinkError::Entropy)?);
    }
    if how.settle {
        tokio::time::timeout_at(deadline, settle(&mut stream, first.drain(..)))
            .await
            .map_err(|_| LinkError::Timeout(timeout))??;
    }
    let tx = pump(stream, senders);
    // Before anything else is queued: the guest reseeds before any process runs. The queue is new and
    // empty, so this cannot fail.
    for msg in first {
        let _ = tx.try_send(msg.into());
    }
    Ok(GuestLink { hello, tx })
}

/// Sends `first` and a ping, and waits for the pong. Nothing runs in the guest yet, so any other answer
/// breaks the protocol. The nonce is fresh, so the pong answers this ping and nothing saved before.
async fn settle(stream: &mut UnixStream, first: impl Iterator<Item = ToGuest>) -> Result<(), LinkError> {
    let mut nonce = [0u8; 8];
    host_random(&mut nonce).map_err(LinkError::Entropy)?;
    let nonce = u64::from_le_bytes(nonce);
    for msg in first.chain([ToGuest::Ping { nonce }]) {
        codec::write_frame(stream, &msg).await.map_err(LinkError::Settle)?;
    }
    let body = codec::read_body(stream).await.map_err(LinkError::Settle)?;
    match frame::decode_body::<ToHost>(&body) {
        Ok(ToHost::Pong { nonce: answered }) if answered == nonce => Ok(()),
        _ => Err(LinkError::Unsettled),
    }
}

/// Fresh host entropy and the wall clock for the guest ([`VmRequest::Reseed`]).
fn reseed() -> std::io::Result<ToGuest> {
    let mut entropy = vec![0u8; RESEED_BYTES];
    host_random(&mut entropy)?;
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let unix_nanos = u64::try_from(since_epoch.as_nanos()).unwrap_or(u64::MAX);
    Ok(VmRequest::Reseed { entropy: HostEntropy(entropy.into()), unix_nanos }.into())
}

/// Fills `buf` from the host's RNG.
fn host_random(buf: &mut [u8]) -> std::io::Result<()> {
    let n = rustix::rand::getrandom(&mut *buf, rustix::rand::GetRandomFlags::empty())?;
    if n == buf.len() {
        Ok(())
    } else {
        Err(std::io::ErrorKind::UnexpectedEof.into())
    }
}

fn pump(stream: UnixStream, senders: Senders) -> mpsc::Sender<Queued> {
    let (read, write) = stream.into_split();
    let (tx, rx) = mpsc::channel::<Queued>(TO_GUEST_ITEMS);
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
