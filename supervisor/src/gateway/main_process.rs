//! The sandbox's main process: the gateway's canonical command, started once the boundary is attached and
//! owned by the supervisor for the sandbox's life, as OpenShell's own supervisor owns it in the guest.
//!
//! Its output is credited as it arrives and kept in a ring of the last [`RING_BYTES`], replayed to each
//! `openshell-main` attachment before what follows live; a subscriber that falls [`LIVE_ITEMS`] chunks
//! behind is cut, never waited for. One attachment at a time holds its input (stdin, resizes, signals);
//! the others watch. Its end is the status `ReportMainProcessExit` reports.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::{broadcast, mpsc, watch, Semaphore};
use vm_contract::gateway::MainProcess;
use vm_protocol::attach::ToSupervisor;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::message::EnvVar;
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, PtySize, SignalName, Spawn, Stream};

use super::attach::{Attach, Event};
use super::ssh::process::{grant, refusal, OUTPUT_WINDOW_BYTES};

/// Output kept for attachments that come later.
pub const RING_BYTES: usize = 1024 * 1024;
/// Chunks a live attachment may fall behind before it is cut.
pub const LIVE_ITEMS: usize = 1024;

/// A chunk of the main process's output.
#[derive(Debug, Clone)]
pub struct Chunk {
    /// Which stream.
    pub stream: Stream,
    /// The bytes.
    pub data: Bytes,
}

#[derive(Debug, Default)]
struct Ring {
    chunks: VecDeque<Chunk>,
    bytes: usize,
}

impl Ring {
    fn push(&mut self, chunk: Chunk) {
        self.bytes += chunk.data.len();
        self.chunks.push_back(chunk);
        while self.bytes > RING_BYTES {
            match self.chunks.pop_front() {
                Some(old) => self.bytes -= old.data.len(),
                None => break,
            }
        }
    }
}

#[derive(Debug)]
struct Inner {
    attach: Attach,
    id: ProcId,
    ring: Mutex<Ring>,
    live: broadcast::Sender<Chunk>,
    exit: watch::Sender<Option<ExitStatus>>,
    stdin: Semaphore,
    input_held: AtomicBool,
}

/// The main process; clones share it.
#[derive(Debug, Clone)]
pub struct MainSession(Arc<Inner>);

/// An attachment: what came before, what comes live, and the end.
#[derive(Debug)]
pub struct Subscription {
    /// The retained output, oldest first.
    pub replay: Vec<Chunk>,
    /// What follows.
    pub live: broadcast::Receiver<Chunk>,
    /// The process's status once it ended.
    pub exit: watch::Receiver<Option<ExitStatus>>,
}

impl MainSession {
    /// Starts `main` on `attach` with the sandbox's `env`; `None` if the connection is already gone.
    pub async fn start(attach: Attach, main: &MainProcess, env: &[(String, String)]) -> Option<Self> {
        let (id, route) = attach.process()?;
        let tty = main.tty.then_some(PtySize::from_client(0, 0));
        let term = main.tty.then(|| ("TERM".to_owned(), "xterm-256color".to_owned()));
        let spawn = Spawn {
            id,
            argv: main.command.clone(),
            env: env.iter().cloned().chain(term).map(|(key, value)| EnvVar { key, value }).collect(),
            cwd: None,
            pty: tty,
            output_window: OUTPUT_WINDOW_BYTES,
            rlimits: Vec::new(),
            root: None,
        };
        let (exit, _) = watch::channel(None);
        let inner = Arc::new(Inner {
            attach,
            id,
            ring: Mutex::default(),
            live: broadcast::channel(LIVE_ITEMS).0,
            exit,
            stdin: Semaphore::new(0),
            input_held: AtomicBool::new(false),
        });
        if !inner.attach.send(ToSupervisor::Process(ProcessRequest::Spawn(spawn))).await {
            return None;
        }
        tokio::spawn(follow(Arc::clone(&inner), route));
        Some(Self(inner))
    }

    /// Attaches: the replay and the live output, consistent with each other.
    pub fn subscribe(&self) -> Subscription {
        let ring = self.0.ring.lock().unwrap_or_else(PoisonError::into_inner);
        Subscription {
            replay: ring.chunks.iter().cloned().collect(),
            live: self.0.live.subscribe(),
            exit: self.0.exit.subscribe(),
        }
    }

    /// The status once it ended.
    pub fn ended(&self) -> watch::Receiver<Option<ExitStatus>> {
        self.0.exit.subscribe()
    }

    /// Takes the input if no attachment holds it.
    pub fn take_input(&self) -> Option<Input> {
        let free = self.0.input_held.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok();
        free.then(|| Input(Arc::clone(&self.0)))
    }
}

/// The main process's input, held by one attachment; dropping it lets another take it.
#[derive(Debug)]
pub struct Input(Arc<Inner>);

impl Input {
    /// Writes to its stdin within its credit; `false` once it ended.
    pub async fn stdin(&self, data: &[u8]) -> bool {
        for chunk in data.chunks(MAX_DATA_BYTES) {
            let Ok(n) = u32::try_from(chunk.len()) else { return false };
            let Ok(permits) = self.0.stdin.acquire_many(n).await else { return false };
            permits.forget();
            let data = serde_bytes::ByteBuf::from(chunk.to_vec());
            if !self.0.attach.send(ToSupervisor::Process(ProcessRequest::Stdin { id: self.0.id, data })).await {
                return false;
            }
        }
        true
    }

    /// Resizes its terminal.
    pub async fn resize(&self, size: PtySize) {
        let _ = self.0.attach.send(ToSupervisor::Process(ProcessRequest::Resize { id: self.0.id, size })).await;
    }

    /// Signals it.
    pub async fn signal(&self, signal: SignalName) {
        let _ = self.0.attach.send(ToSupervisor::Process(ProcessRequest::Signal { id: self.0.id, signal })).await;
    }
}

impl Drop for Input {
    fn drop(&mut self) {
        self.0.input_held.store(false, Ordering::Release);
    }
}

/// Follows the process until it ends: output into the ring and to the live attachments, credited at once.
async fn follow(inner: Arc<Inner>, mut route: mpsc::Receiver<Event>) {
    let keep = |stream: Stream, data: Bytes| {
        let chunk = Chunk { stream, data };
        let mut ring = inner.ring.lock().unwrap_or_else(PoisonError::into_inner);
        ring.push(chunk.clone());
        // No attachment is fine; a lagging one is cut by the broadcast itself.
        let _ = inner.live.send(chunk);
    };
    let status = loop {
        let Some(Event::Process(event)) = route.recv().await else {
            // The connection ended with the sandbox, or the guest flooded the route past its bound.
            break ExitStatus::Code(255);
        };
        match event {
            ProcessEvent::Started { stdin_window, .. } => grant(&inner.stdin, stdin_window),
            ProcessEvent::StdinCredit { bytes, .. } => grant(&inner.stdin, bytes),
            ProcessEvent::Output { stream, data, .. } => {
                let bytes = u32::try_from(data.len()).unwrap_or(u32::MAX);
                keep(stream, Bytes::from(data.into_vec()));
                let credit = ProcessRequest::Credit { id: inner.id, bytes };
                let _ = inner.attach.send(ToSupervisor::Process(credit)).await;
            }
            ProcessEvent::Exited { status, .. } => break status,
            ProcessEvent::SpawnFailed { status, message, .. } => {
                keep(Stream::Stderr, Bytes::from(format!("{message}\n")));
                break status;
            }
            ProcessEvent::Refused { reason, .. } => {
                keep(Stream::Stderr, Bytes::from(format!("vm-supervisor: {}\n", refusal(reason))));
                break ExitStatus::Code(126);
            }
        }
    };
    inner.stdin.close();
    inner.attach.forget_process(inner.id);
    tracing::info!(status = status.shell_code(), "the main process ended");
    inner.exit.send_replace(Some(status));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_output_within_its_bound() {
        let mut ring = Ring::default();
        for i in 0..5u8 {
            ring.push(Chunk { stream: Stream::Stdout, data: Bytes::from(vec![i; RING_BYTES / 2]) });
        }
        assert!(ring.bytes <= RING_BYTES);
        assert_eq!(ring.chunks.len(), 2);
        assert_eq!(ring.chunks[0].data[0], 3, "the oldest go first");
    }
}
