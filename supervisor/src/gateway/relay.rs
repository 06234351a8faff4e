//! One relay: the gateway asked (`RelayOpen`) for a byte stream to this sandbox, and the supervisor claims
//! it with a `RelayStream` call whose first frame names it. Its bytes go to the SSH server, or, for a TCP
//! target, to a port-forward stream to the guest's loopback.
//!
//! Bounded: [`MAX_RELAYS`] open at once (more are answered with a failure the gateway reports), each one
//! an attach client of the boundary; frames of at most [`CHUNK_BYTES`] each way, through a pipe of
//! [`PIPE_BYTES`], so a stalled end holds the other back rather than buffer.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use vm_protocol::openshell::v1::relay_frame::Payload;
use vm_protocol::openshell::v1::relay_open::Target;
use vm_protocol::openshell::v1::{RelayFrame, RelayInit, RelayOpen};

use super::attach::Attach;
use super::client::Gateway;
use super::ssh;
use super::GatewayEvent;
use crate::inbox::{Notice, Senders};

/// Relays open at once, per sandbox (the gateway allows 32 pending per sandbox).
pub const MAX_RELAYS: usize = 32;
/// Largest data frame either way (the gateway's own chunk).
pub const CHUNK_BYTES: usize = 16 * 1024;
/// The pipe between a relay and its SSH server or forward.
const PIPE_BYTES: usize = 64 * 1024;
/// Frames waiting to go to the gateway.
const OUTBOUND_FRAMES: usize = 8;

/// What a relay is for, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Relayed {
    /// The SSH server.
    Ssh,
    /// The guest's loopback port.
    Tcp(u16),
}

/// Why a relay was refused (fixed text, for the gateway and the record).
pub fn target(open: &RelayOpen) -> Result<Relayed, &'static str> {
    if open.channel_id.is_empty() || open.channel_id.len() > 128 {
        return Err("the relay has no usable channel id");
    }
    match &open.target {
        None | Some(Target::Ssh(_)) => Ok(Relayed::Ssh),
        Some(Target::Tcp(tcp)) => {
            let port = u16::try_from(tcp.port).ok().filter(|p| *p > 0).ok_or("the relay's port is not 1 to 65535")?;
            if !super::forward::loopback(&tcp.host) {
                return Err("a relay may reach only the sandbox's loopback");
            }
            Ok(Relayed::Tcp(port))
        }
    }
}

/// Serves relay `channel_id` for `what` as the attach client `attach`, holding `place` until it ends.
pub async fn run(
    mut gateway: Gateway,
    channel_id: String,
    what: Relayed,
    attach: Attach,
    shared: Arc<ssh::Shared>,
    senders: Senders,
    place: OwnedSemaphorePermit,
) {
    let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
    let (tx, rx) = mpsc::channel(OUTBOUND_FRAMES);
    let init = RelayFrame { payload: Some(Payload::Init(RelayInit { channel_id })) };
    if tx.send(init).await.is_err() {
        return;
    }
    let inbound = match gateway.relay_stream(ReceiverStream::new(rx)).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::warn!(code = ?status.code(), "the gateway refused to open a relay stream");
            let _ = senders
                .notices
                .try_send(Notice::Gateway(GatewayEvent::RelayRefused("the gateway refused the relay stream")));
            return;
        }
    };
    let serving = async move {
        match what {
            Relayed::Ssh => ssh::serve(shared, attach, theirs).await,
            Relayed::Tcp(port) => {
                let _ = super::forward::forward(&attach, port, theirs).await;
            }
        }
    };
    let (mut from_server, mut to_server) = tokio::io::split(ours);
    let upward = async move {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            match from_server.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let frame = RelayFrame { payload: Some(Payload::Data(buf[..n].to_vec())) };
                    if tx.send(frame).await.is_err() {
                        return;
                    }
                }
            }
        }
        // Dropping `tx` ends our request stream: the gateway sees the end.
    };
    let downward = async move {
        let mut inbound = inbound;
        while let Some(Ok(frame)) = inbound.next().await {
            let data = match frame.payload {
                Some(Payload::Data(data)) if data.len() <= 4 * CHUNK_BYTES => data,
                None => continue,
                // Oversized, or a second init: the gateway broke the relay's rules.
                Some(_) => return,
            };
            if to_server.write_all(&data).await.is_err() {
                return;
            }
        }
        let _ = to_server.shutdown().await;
    };
    tokio::join!(serving, upward, downward);
    drop(place);
}
