//! One port forward through a sandbox's attach socket: a stream to the guest's `127.0.0.1:PORT`, with bytes
//! both ways under the protocol's credit ([`vm_protocol::net`]). `serve`'s `ForwardPort` runs one per
//! connection that `vm-driver port-forward` accepted on the host.

use tokio::sync::mpsc;
use vm_contract::layout::SandboxLayout;
use vm_protocol::attach::ToClient;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::message::Refusal;
use vm_protocol::net::{ForwardEvent, ForwardRequest, StreamFrame, StreamId, NET_WINDOW_BYTES};
use vm_protocol::Window;

use crate::attach_client::{self, AttachError, Attached};

/// The one stream a forward's connection carries.
const ID: StreamId = StreamId(1);

/// Why a forward did not open or broke.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The attach connection failed.
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// The policy does not allow `port_forward`.
    #[error("the sandbox's policy does not allow port_forward")]
    Denied,
    /// The sandbox is stopping, or at its connection cap.
    #[error("the sandbox refused the forward ({0})")]
    Refused(&'static str),
    /// Nothing accepted on the guest's port.
    #[error("nothing accepts connections on the guest's 127.0.0.1:{0}")]
    NotListening(u16),
    /// The supervisor broke the stream's rules, or went away.
    #[error("the forward's stream broke")]
    Broken,
}

/// What the host side of a forward sends in; the end of the channel is its EOF (a half-close).
#[derive(Debug)]
pub enum Inbound {
    /// Bytes for the guest, at most [`MAX_DATA_BYTES`].
    Data(Vec<u8>),
    /// The host side broke (a reset, a cancelled call): the connection ends both ways, not in order.
    Abort,
}

/// An open forward, connected to the guest's port.
#[derive(Debug)]
pub struct Forward {
    attached: Attached,
    /// What the guest may still be sent.
    send: Window,
}

/// Connects to the guest's `127.0.0.1:port` through the sandbox's supervisor.
///
/// # Errors
/// [`ForwardError`].
pub async fn open(layout: &SandboxLayout, port: u16) -> Result<Forward, ForwardError> {
    let mut attached = attach_client::connect(layout).await?;
    attached.send(ForwardRequest::Connect { id: ID, port, window: NET_WINDOW_BYTES }).await?;
    let answer = tokio::time::timeout(attach_client::CONNECT_TIMEOUT + DIAL, async {
        while let Some(Ok(msg)) = attached.recv().await {
            match msg {
                ToClient::Forward(ForwardEvent::Connected { window, .. }) => return Ok(window),
                ToClient::Forward(ForwardEvent::Refused { reason: Refusal::Denied, .. }) => {
                    return Err(ForwardError::Denied)
                }
                ToClient::Forward(ForwardEvent::Refused { reason: Refusal::ShuttingDown, .. }) => {
                    return Err(ForwardError::Refused("it is stopping"))
                }
                ToClient::Forward(ForwardEvent::Refused { .. }) => {
                    return Err(ForwardError::Refused("at its connection cap"))
                }
                ToClient::Forward(ForwardEvent::Stream(StreamFrame::Close { .. })) => {
                    return Err(ForwardError::NotListening(port))
                }
                _ => {}
            }
        }
        Err(ForwardError::Broken)
    });
    let window = answer.await.map_err(|_| ForwardError::Broken)??;
    Ok(Forward { attached, send: Window::new(window) })
}

/// How long the guest may take to dial its port (the agent's own bound is 5 s).
const DIAL: std::time::Duration = std::time::Duration::from_secs(6);

impl Forward {
    /// Relays until both directions ended: chunks from `input` (its close is EOF) to the guest, the guest's
    /// bytes to `output` (dropped at the guest's EOF). An [`Inbound::Abort`], or `output`'s receiver gone,
    /// closes the stream at once. Returns the bytes each way.
    ///
    /// # Errors
    /// [`ForwardError::Broken`] when the supervisor breaks the rules or goes away first.
    pub async fn run(
        mut self,
        mut input: mpsc::Receiver<Inbound>,
        output: mpsc::Sender<Vec<u8>>,
    ) -> Result<(u64, u64), ForwardError> {
        let (mut sent, mut received) = (0u64, 0u64);
        let mut output = Some(output);
        let mut pending: Vec<u8> = Vec::new();
        let mut input_done = false;
        loop {
            if input_done && pending.is_empty() && output.is_none() {
                return Ok((sent, received));
            }
            let can_send = !pending.is_empty() && self.send.available() > 0;
            tokio::select! {
                msg = self.attached.recv() => {
                    let Some(Ok(ToClient::Forward(ForwardEvent::Stream(frame)))) = msg else {
                        match msg {
                            Some(Ok(_)) => continue,
                            _ => return Err(ForwardError::Broken),
                        }
                    };
                    match frame {
                        StreamFrame::Data { data, .. } => {
                            received += data.len() as u64;
                            let len = u32::try_from(data.len()).map_err(|_| ForwardError::Broken)?;
                            let Some(out) = output.as_ref() else { return Err(ForwardError::Broken) };
                            // The host side went away: the connection is over both ways, and its slot is freed.
                            if out.send(data.into_vec()).await.is_err() {
                                return self.close(sent, received).await;
                            }
                            self.attached.send(ForwardRequest::Stream(StreamFrame::Credit { id: ID, bytes: len })).await?;
                        }
                        StreamFrame::Eof { .. } => output = None,
                        StreamFrame::Credit { bytes, .. } => self.send.grant(bytes).map_err(|_| ForwardError::Broken)?,
                        StreamFrame::Close { .. } => return Ok((sent, received)),
                    }
                }
                () = std::future::ready(()), if can_send => {
                    let n = usize::try_from(self.send.available()).unwrap_or(usize::MAX).min(pending.len());
                    let data: Vec<u8> = pending.drain(..n).collect();
                    self.send.consume(n).map_err(|_| ForwardError::Broken)?;
                    sent += n as u64;
                    self.attached.send(ForwardRequest::Stream(StreamFrame::Data { id: ID, data: data.into() })).await?;
                }
                () = closed(output.as_ref()) => return self.close(sent, received).await,
                chunk = input.recv(), if !input_done && pending.is_empty() => match chunk {
                    Some(Inbound::Data(chunk)) if chunk.len() > MAX_DATA_BYTES => return Err(ForwardError::Broken),
                    Some(Inbound::Data(chunk)) => pending = chunk,
                    Some(Inbound::Abort) => return self.close(sent, received).await,
                    None => {
                        input_done = true;
                        self.attached.send(ForwardRequest::Stream(StreamFrame::Eof { id: ID })).await?;
                    }
                },
            }
        }
    }

    /// Ends the stream out of order: the guest's side is closed, the supervisor frees its slot.
    async fn close(mut self, sent: u64, received: u64) -> Result<(u64, u64), ForwardError> {
        self.attached.send(ForwardRequest::Stream(StreamFrame::Close { id: ID })).await?;
        Ok((sent, received))
    }
}

/// Resolves once `output`'s receiver is gone; never while there is none to watch (after the guest's EOF).
async fn closed(output: Option<&mpsc::Sender<Vec<u8>>>) {
    match output {
        Some(out) => out.closed().await,
        None => std::future::pending().await,
    }
}
