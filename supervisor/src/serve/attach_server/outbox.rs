//! One client's outbound queue, and the task that writes it to the client.
//!
//! The loop pushes and never waits. Adjacent `Output` of one process and stream becomes one frame, up to
//! the frame data limit, so a guest that writes byte by byte costs one queued frame per megabyte, not one
//! per byte. The queue is bounded in frames and in bytes (each frame's overhead, and the payload of every
//! message but `Output`, whose bytes the client's windows already bound):
//!
//! - past [`TO_CLIENT_ITEMS`] or [`TO_CLIENT_BYTES`] it is *full*: the guest link waits
//!   ([`Pressure`]) until the writer takes the queue, so a client that reads sets the pace and is never cut;
//! - a client whose queue stays full while nothing is written to it for [`STALL_MS`] is not reading, and is
//!   cut; so is one whose queue passes twice the bounds (answers to requests it sends and does not read).
//!
//! A stall is measured on the socket: when a write last went through.
//!
//! A cut client gets what the writer had already taken, then [`SupervisorReply::Disconnected`] with the reason, if
//! it takes them within [`FAREWELL_MS`].

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::SinkExt;
use tokio::io::AsyncWrite;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::codec::FramedWrite;
use vm_protocol::attach::{Disconnect, SupervisorReply, ToClient};
use vm_protocol::codec::FrameCodec;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::ProcessEvent;

/// Frames queued towards one client before the guest link waits for it.
pub const TO_CLIENT_ITEMS: usize = 4096;
/// Bytes of them (overhead, and payloads other than `Output`) before the guest link waits for it.
pub const TO_CLIENT_BYTES: usize = 4 * 1024 * 1024;
/// A full queue and nothing written for this long: the client is not reading. Generous: a client that
/// reads tiny frames slowly on a loaded host frees a write's worth of socket buffer only every few seconds.
pub const STALL_MS: u64 = 10_000;
/// How long a cut client has to take what was already on its way, and the reason.
pub const FAREWELL_MS: u64 = 10_000;
/// A queue this many times over its bounds is cut at once.
const HARD_FACTOR: usize = 2;
/// What one queued frame costs beyond its payload, roughly.
const FRAME_OVERHEAD_BYTES: usize = 64;
/// How often a writer that is waiting on its client looks for a stall or a cut.
const CHECK_MS: u64 = 250;
/// The most one write hands the socket: the kernel frees a write's buffer only once the client has read all
/// of it, so smaller writes show a slow reader's progress sooner.
const WRITE_CHUNK_BYTES: usize = 64 * 1024;

/// How many clients' queues are full; the guest link waits while any is.
#[derive(Debug, Clone)]
pub struct Pressure(Arc<watch::Sender<usize>>);

impl Default for Pressure {
    fn default() -> Self {
        Self(Arc::new(watch::Sender::new(0)))
    }
}

impl Pressure {
    /// Returns once no client's queue is full.
    pub async fn room(&self) {
        if *self.0.borrow() == 0 {
            return;
        }
        // The sender lives as long as `self`, so the wait ends only when the count is zero.
        let _ = self.0.subscribe().wait_for(|full| *full == 0).await;
    }

    fn add(&self, full: bool) {
        self.0.send_modify(|n| if full { *n += 1 } else { *n = n.saturating_sub(1) });
    }
}

#[derive(Debug)]
struct State {
    items: VecDeque<ToClient>,
    bytes: usize,
    /// Over a bound (and counted in the pressure) since then.
    full_since: Option<Instant>,
    cut: Option<Disconnect>,
    /// The loop let go of the client: deliver what is queued, then end.
    closed: bool,
    last_write: Instant,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Notify,
    pressure: Pressure,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks the queue full or not, keeping the pressure in step.
    fn set_full(&self, st: &mut State, full: bool) {
        if full == st.full_since.is_some() {
            return;
        }
        st.full_since = full.then(Instant::now);
        self.pressure.add(full);
    }

    fn cut(&self, st: &mut State, reason: Disconnect) {
        st.cut.get_or_insert(reason);
        st.items.clear();
        st.bytes = 0;
        self.set_full(st, false);
        self.wake.notify_one();
    }

    /// Why the writer must stop writing its batch: the loop cut the client, or it stalled.
    fn interrupted(&self) -> Option<(Disconnect, bool)> {
        let mut st = self.lock();
        if let Some(reason) = st.cut {
            return Some((reason, false));
        }
        let stall = Duration::from_millis(STALL_MS);
        let stalled = st.full_since.is_some_and(|t| t.elapsed() >= stall) && st.last_write.elapsed() >= stall;
        if stalled {
            self.cut(&mut st, Disconnect::NotReading);
            return Some((Disconnect::NotReading, true));
        }
        None
    }
}

/// The loop's end of a client's queue. Dropping it lets the writer deliver what is queued and end.
#[derive(Debug)]
pub struct Outbox(Arc<Shared>);

/// The queue passed twice its bounds: the client is not reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the client's queue passed twice its bounds")]
pub struct Overflow;

impl Outbox {
    /// Queues `msg`, joining it to the `Output` before it where it can. Never waits.
    ///
    /// # Errors
    /// [`Overflow`]: the client is cut (it gets the reason once it reads); the caller forgets it.
    pub fn push(&self, msg: ToClient) -> Result<(), Overflow> {
        let shared = &self.0;
        let mut st = shared.lock();
        if st.cut.is_some() || st.closed {
            return Ok(());
        }
        let Some(msg) = join(st.items.back_mut(), msg) else { return Ok(()) };
        st.bytes += weight(&msg);
        st.items.push_back(msg);
        let (items, bytes) = (st.items.len(), st.bytes);
        if items > HARD_FACTOR * TO_CLIENT_ITEMS || bytes > HARD_FACTOR * TO_CLIENT_BYTES {
            shared.cut(&mut st, Disconnect::NotReading);
            return Err(Overflow);
        }
        if items > TO_CLIENT_ITEMS || bytes > TO_CLIENT_BYTES {
            shared.set_full(&mut st, true);
        }
        shared.wake.notify_one();
        Ok(())
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.wake.notify_one();
    }
}

/// Appends `msg`'s data to `tail` when both are output of one process and stream and the sum fits a frame;
/// otherwise hands `msg` back.
fn join(tail: Option<&mut ToClient>, msg: ToClient) -> Option<ToClient> {
    if let (
        Some(ToClient::Process(ProcessEvent::Output { id, stream, data })),
        ToClient::Process(ProcessEvent::Output { id: next, stream: next_stream, data: more }),
    ) = (tail, &msg)
    {
        if id == next && stream == next_stream && data.len() + more.len() <= MAX_DATA_BYTES {
            data.extend_from_slice(more);
            return None;
        }
    }
    Some(msg)
}

/// What a queued message counts against [`TO_CLIENT_BYTES`].
fn weight(msg: &ToClient) -> usize {
    FRAME_OVERHEAD_BYTES
        + match msg {
            ToClient::Process(ProcessEvent::Output { .. }) => 0,
            ToClient::Process(ProcessEvent::SpawnFailed { message, .. }) => message.len(),
            ToClient::Supervisor(SupervisorReply::Processes { list }) => {
                list.iter().map(|p| p.argv.iter().map(String::len).sum::<usize>()).sum()
            }
            _ => 0,
        }
}

/// What the writer does next.
enum Next {
    Batch(VecDeque<ToClient>),
    Cut(Disconnect),
    Closed,
}

/// A queue and its writer: the writer runs until the client is let go of (or cut) and its frames written.
/// `on_stall` runs once if the writer itself finds the client not reading (so the loop forgets it).
pub fn start<W>(
    pressure: &Pressure,
    write: W,
    on_stall: impl std::future::Future<Output = ()> + Send + 'static,
) -> (Outbox, tokio::task::JoinHandle<()>)
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let state = State {
        items: VecDeque::new(),
        bytes: 0,
        full_since: None,
        cut: None,
        closed: false,
        last_write: Instant::now(),
    };
    let shared = Arc::new(Shared { state: Mutex::new(state), wake: Notify::new(), pressure: pressure.clone() });
    let writer = tokio::spawn(write_all(Arc::clone(&shared), write, on_stall));
    (Outbox(shared), writer)
}

async fn write_all<W>(shared: Arc<Shared>, write: W, on_stall: impl std::future::Future<Output = ()>)
where
    W: AsyncWrite + Unpin,
{
    let _release = Release(Arc::clone(&shared));
    let counted = Progress { inner: write, shared: Arc::clone(&shared) };
    let mut sink = FramedWrite::new(counted, FrameCodec::<(), ToClient>::new());
    loop {
        let batch = match next(&shared).await {
            Next::Batch(batch) => batch,
            Next::Cut(reason) => return farewell(&mut sink, reason).await,
            Next::Closed => return,
        };
        let written = async {
            for msg in batch {
                sink.feed(msg).await?;
            }
            sink.flush().await
        };
        tokio::select! {
            done = written => if done.is_err() { return },
            (reason, stalled) = interruption(&shared) => {
                if stalled {
                    tracing::warn!(stall_ms = STALL_MS, "an attach client took no frame from a full queue; disconnected");
                    on_stall.await;
                }
                return farewell(&mut sink, reason).await;
            }
        }
    }
}

/// Waits for frames, a cut or the close.
async fn next(shared: &Shared) -> Next {
    loop {
        {
            let mut st = shared.lock();
            if let Some(reason) = st.cut {
                return Next::Cut(reason);
            }
            if !st.items.is_empty() {
                st.bytes = 0;
                shared.set_full(&mut st, false);
                return Next::Batch(std::mem::take(&mut st.items));
            }
            if st.closed {
                return Next::Closed;
            }
        }
        shared.wake.notified().await;
    }
}

async fn interruption(shared: &Shared) -> (Disconnect, bool) {
    loop {
        tokio::time::sleep(Duration::from_millis(CHECK_MS)).await;
        if let Some(found) = shared.interrupted() {
            return found;
        }
    }
}

/// What was already on its way, then the reason, within [`FAREWELL_MS`]; then the connection closes.
async fn farewell<W: AsyncWrite + Unpin>(sink: &mut FramedWrite<W, FrameCodec<(), ToClient>>, reason: Disconnect) {
    let last = async {
        sink.feed(ToClient::Supervisor(SupervisorReply::Disconnected { reason })).await?;
        sink.flush().await
    };
    let _ = tokio::time::timeout(Duration::from_millis(FAREWELL_MS), last).await;
}

/// However the writer ends, its queue takes no more and holds the guest link no longer.
struct Release(Arc<Shared>);

impl Drop for Release {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.closed = true;
        st.items.clear();
        self.0.set_full(&mut st, false);
    }
}

/// The client's socket, noting when a write last went through.
struct Progress<W> {
    inner: W,
    shared: Arc<Shared>,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Progress<W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let chunk = &buf[..buf.len().min(WRITE_CHUNK_BYTES)];
        let polled = Pin::new(&mut self.inner).poll_write(cx, chunk);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.shared.lock().last_write = Instant::now();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
