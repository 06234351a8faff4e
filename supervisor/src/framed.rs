//! The guest link's writer half: drain a queue into a framed socket, flushing once per burst rather than
//! once per frame. (Attach clients have their own, `attach_server::outbox`.)

use futures_util::SinkExt;
use serde::Serialize;
use tokio::io::AsyncWrite;
use tokio::sync::mpsc::Receiver;
use tokio_util::codec::FramedWrite;
use vm_protocol::codec::FrameCodec;

/// Writes every queued message, in order, until the queue closes or the socket fails.
pub(crate) async fn drain_into<W, M>(write: W, mut rx: Receiver<M>)
where
    W: AsyncWrite + Unpin,
    M: Serialize,
{
    let mut sink = FramedWrite::new(write, FrameCodec::<(), M>::new());
    while let Some(msg) = rx.recv().await {
        if sink.feed(msg).await.is_err() {
            return;
        }
        while let Ok(more) = rx.try_recv() {
            if sink.feed(more).await.is_err() {
                return;
            }
        }
        if sink.flush().await.is_err() {
            return;
        }
    }
}
