//! Relaying an egress stream's bytes both ways once it is open, within the stream's windows, and the idle
//! clock that ends a stream no byte crossed for [`IDLE_TIMEOUT`].

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use vm_protocol::net::{NetToGuest, StreamFrame, StreamId};

use super::{credit, Context, CHUNK_BYTES, IDLE_TIMEOUT, LEAK};
use crate::boot::guest_link::Queued;
use crate::network::intercept::secrets::Scanner;
use crate::network::pipe::{End, Inbound, Pipe};

/// Destination to guest. Returns the bytes and why it stopped, when not at the destination's EOF.
pub(super) async fn download(
    ctx: &Context,
    id: StreamId,
    pipe: &Pipe,
    up: &mut (impl AsyncRead + Unpin),
    activity: &Activity,
) -> (u64, Option<&'static str>) {
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut total = 0u64;
    loop {
        let n = match pipe.reserve(buf.len()).await {
            Ok(n) => n,
            Err(end) => return (total, Some(describe(end))),
        };
        let read = match up.read(&mut buf[..n]).await {
            Ok(read) => read,
            Err(_) => {
                pipe.unreserve(n);
                return (total, Some("the destination reset the connection"));
            }
        };
        pipe.unreserve(n - read);
        if read == 0 {
            let _ = ctx.guest.send(NetToGuest::Stream(StreamFrame::Eof { id }).into()).await;
            return (total, None);
        }
        activity.touch(read as u64, 0);
        total += read as u64;
        // Within the budget before the copy is made; the writer gives it back once it took the frame.
        let share = u32::try_from(read).unwrap_or(u32::MAX);
        let Ok(budget) = Arc::clone(&ctx.download_budget).acquire_many_owned(share).await else {
            return (total, Some("the sandbox is stopping"));
        };
        let data = buf[..read].to_vec().into();
        let queued = Queued::budgeted(NetToGuest::Stream(StreamFrame::Data { id, data }), budget);
        if ctx.guest.send(queued).await.is_err() {
            return (total, Some("the sandbox is stopping"));
        }
    }
}

/// Why an upload stopped when the destination took no more bytes.
pub(super) const DESTINATION_CLOSED: &str = "the destination closed";

/// Guest to destination, returning credit for what was written. With a scanner, a chunk that completes a
/// placeholder is not written, and the stream ends with [`LEAK`].
pub(super) async fn upload(
    ctx: &Context,
    id: StreamId,
    pipe: &Pipe,
    up: &mut (impl AsyncWrite + Unpin),
    activity: &Activity,
    mut scanner: Option<&mut Scanner>,
) -> (u64, Option<&'static str>) {
    let mut total = 0u64;
    loop {
        match pipe.take(CHUNK_BYTES).await {
            Inbound::Bytes(bytes) => {
                if scanner.as_mut().is_some_and(|s| s.feed(&bytes).is_some()) {
                    return (total, Some(LEAK));
                }
                if up.write_all(&bytes).await.is_err() {
                    return (total, Some(DESTINATION_CLOSED));
                }
                activity.touch(0, bytes.len() as u64);
                total += bytes.len() as u64;
                pipe.credit_back(bytes.len());
                credit(ctx, id, bytes.len()).await;
            }
            Inbound::Eof => {
                let _ = up.shutdown().await;
                return (total, None);
            }
            Inbound::Ended(end) => return (total, Some(describe(end))),
        }
    }
}

pub(super) fn describe(end: End) -> &'static str {
    match end {
        End::GuestClosed => "the workload closed the connection",
        End::Aborted(reason) => reason,
    }
}

/// When bytes last moved, and how many, for the idle timeout.
#[derive(Debug)]
pub(super) struct Activity {
    state: std::sync::Mutex<(Instant, u64, u64)>,
}

impl Activity {
    pub(super) fn new() -> Self {
        Self { state: std::sync::Mutex::new((Instant::now(), 0, 0)) }
    }

    pub(super) fn touch(&self, to_guest: u64, from_guest: u64) {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *state = (Instant::now(), state.1 + to_guest, state.2 + from_guest);
    }

    pub(super) fn totals(&self) -> (u64, u64) {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (state.1, state.2)
    }

    /// Resolves once nothing moved for [`IDLE_TIMEOUT`].
    pub(super) async fn idle(&self) {
        loop {
            let last = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).0;
            let left = IDLE_TIMEOUT.saturating_sub(last.elapsed());
            if left.is_zero() {
                return;
            }
            tokio::time::sleep(left).await;
        }
    }
}
