//! A byte stream to the guest's loopback port: an SSH `direct-tcpip` channel (`openshell sandbox forward`),
//! or a relay whose target is a TCP port (the gateway's service routing). Either is a port-forward stream of
//! the boundary, through the policy gate (`port_forward`) as any client's, both directions under credit.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use vm_protocol::attach::ToSupervisor;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::net::{ForwardEvent, ForwardRequest, StreamFrame, NET_WINDOW_BYTES};
use vm_protocol::Window;

use super::attach::{Attach, Event};

/// How long the guest's port has to accept.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a forward did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// The connection to the boundary is gone, or its places are taken.
    #[error("the sandbox cannot take another stream")]
    Unavailable,
    /// The policy does not allow it, or the sandbox refused it.
    #[error("the sandbox refused the forward")]
    Refused,
    /// Nothing accepted on the guest's port in time.
    #[error("nothing accepts connections on that port in the sandbox")]
    NotListening,
}

/// Whether `host` names the guest's loopback, the only place a forward may reach.
pub fn loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
        || host.parse::<std::net::Ipv6Addr>().ok().and_then(|ip| ip.to_ipv4_mapped()).is_some_and(|ip| ip.is_loopback())
}

/// Connects to the guest's `127.0.0.1:port`, then relays `stream` to it until both directions end.
///
/// # Errors
/// [`ForwardError`] if it did not open; once open, a break just ends it.
pub async fn forward<S>(attach: &Attach, port: u16, stream: S) -> Result<(), ForwardError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (id, mut route) = attach.stream().ok_or(ForwardError::Unavailable)?;
    let connect = ForwardRequest::Connect { id, port, window: NET_WINDOW_BYTES };
    if !attach.send(ToSupervisor::Forward(connect)).await {
        return Err(ForwardError::Unavailable);
    }
    let opened = tokio::time::timeout(CONNECT_TIMEOUT, async {
        match route.recv().await {
            Some(Event::Forward(ForwardEvent::Connected { window, .. })) => Ok(window),
            Some(Event::Forward(ForwardEvent::Refused { .. })) => Err(ForwardError::Refused),
            Some(_) => Err(ForwardError::NotListening),
            None => Err(ForwardError::Unavailable),
        }
    });
    let window = match opened.await {
        Ok(Ok(window)) => window,
        Ok(Err(e)) => {
            attach.forget_stream(id);
            return Err(e);
        }
        Err(_) => {
            let _ = attach.send(ToSupervisor::Forward(ForwardRequest::Stream(StreamFrame::Close { id }))).await;
            attach.forget_stream(id);
            return Err(ForwardError::NotListening);
        }
    };
    let (mut from_client, mut to_client) = tokio::io::split(stream);
    let mut send = Window::new(window);
    let credit = tokio::sync::Notify::new();
    let credited = std::sync::Mutex::new(0u32);
    // Client -> guest, within the guest's credit.
    let upward = async {
        let mut buf = vec![0u8; MAX_DATA_BYTES.min(64 * 1024)];
        loop {
            while send.available() == 0 {
                credit.notified().await;
                let got = std::mem::take(&mut *credited.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
                if send.grant(got).is_err() {
                    return false;
                }
            }
            let most = usize::try_from(send.available()).unwrap_or(usize::MAX).min(buf.len());
            let n = match from_client.read(&mut buf[..most]).await {
                Ok(0) | Err(_) => {
                    let eof = StreamFrame::Eof { id };
                    return attach.send(ToSupervisor::Forward(ForwardRequest::Stream(eof))).await;
                }
                Ok(n) => n,
            };
            if send.consume(n).is_err() {
                return false;
            }
            let data = StreamFrame::Data { id, data: serde_bytes::ByteBuf::from(buf[..n].to_vec()) };
            if !attach.send(ToSupervisor::Forward(ForwardRequest::Stream(data))).await {
                return false;
            }
        }
    };
    // Guest -> client, crediting what the client took.
    let downward = async {
        while let Some(Event::Forward(ForwardEvent::Stream(frame))) = route.recv().await {
            match frame {
                StreamFrame::Data { data, .. } => {
                    if to_client.write_all(&data).await.is_err() {
                        return;
                    }
                    let bytes = u32::try_from(data.len()).unwrap_or(u32::MAX);
                    let back = StreamFrame::Credit { id, bytes };
                    let _ = attach.send(ToSupervisor::Forward(ForwardRequest::Stream(back))).await;
                }
                StreamFrame::Credit { bytes, .. } => {
                    *credited.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += bytes;
                    credit.notify_one();
                }
                StreamFrame::Eof { .. } => {
                    let _ = to_client.shutdown().await;
                }
                StreamFrame::Close { .. } => return,
            }
        }
    };
    tokio::pin!(upward);
    tokio::pin!(downward);
    let mut client_done = false;
    loop {
        tokio::select! {
            () = &mut downward => break,
            // The client's direction ended in order (true): the guest's may go on.
            in_order = &mut upward, if !client_done => {
                if !in_order {
                    break;
                }
                client_done = true;
            }
        }
    }
    let _ = attach.send(ToSupervisor::Forward(ForwardRequest::Stream(StreamFrame::Close { id }))).await;
    attach.forget_stream(id);
    Ok(())
}
