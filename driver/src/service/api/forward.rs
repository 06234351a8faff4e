//! `ForwardPort`: one host connection into a sandbox's guest loopback, relayed through its supervisor's
//! attach socket ([`crate::forward`]).

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};
use vm_protocol::driver_api::{ForwardPortRequest, ForwardPortResponse};
use vm_protocol::frame::MAX_DATA_BYTES;

use crate::forward::{self, ForwardError, Inbound};
use crate::service::hub::Hub;

/// The stream `ForwardPort` answers with.
pub(super) type ForwardStream = Pin<Box<dyn Stream<Item = Result<ForwardPortResponse, Status>> + Send>>;

/// Chunks queued each way: with the guest's credit, what one forward holds.
const QUEUED: usize = 16;

/// Opens the forward the first request names, then relays.
pub(super) async fn forward_port(
    hub: Arc<Hub>,
    mut requests: Streaming<ForwardPortRequest>,
) -> Result<ForwardStream, Status> {
    let first = requests.message().await?.ok_or_else(|| Status::invalid_argument("no request"))?;
    let id = super::sandbox_id(&first.sandbox_id)?;
    let port = u16::try_from(first.guest_port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| Status::invalid_argument("guest_port must be 1 to 65535"))?;
    hub.serving(&id)?;
    let opened = forward::open(&hub.ctx.state.layout(&id), port).await.map_err(|e| match e {
        ForwardError::Denied => Status::permission_denied(e.to_string()),
        ForwardError::NotListening(_) => Status::unavailable(e.to_string()),
        ForwardError::Refused(_) => Status::resource_exhausted(e.to_string()),
        ForwardError::Attach(_) | ForwardError::Broken => {
            Status::unavailable("the sandbox's supervisor is unreachable")
        }
    })?;
    let (in_tx, in_rx) = mpsc::channel(QUEUED);
    let (out_tx, mut out_rx) = mpsc::channel::<Vec<u8>>(QUEUED);
    tokio::spawn(async move {
        let mut chunk = Some(first.data);
        loop {
            let sent = match chunk.take() {
                Some(data) if data.is_empty() => true,
                Some(data) if data.len() <= MAX_DATA_BYTES => in_tx.send(Inbound::Data(data)).await.is_ok(),
                // Too large a message, or a broken or cancelled call: not an end in order.
                _ => {
                    let _ = in_tx.send(Inbound::Abort).await;
                    return;
                }
            };
            if !sent {
                return;
            }
            match requests.next().await {
                Some(Ok(req)) => chunk = Some(req.data),
                // The end of the request stream: EOF, the guest's side half-closed.
                None => return,
                Some(Err(_)) => chunk = None,
            }
        }
    });
    let (tx, rx) = mpsc::channel(QUEUED);
    tokio::spawn(async move {
        let relay = tokio::spawn(opened.run(in_rx, out_tx));
        let _ = tx.send(Ok(ForwardPortResponse { connected: true, data: Vec::new() })).await;
        while let Some(data) = out_rx.recv().await {
            if tx.send(Ok(ForwardPortResponse { connected: false, data })).await.is_err() {
                break;
            }
        }
        if let Ok(Err(_)) = relay.await {
            let _ = tx.send(Err(Status::aborted("the forward's stream broke"))).await;
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}
