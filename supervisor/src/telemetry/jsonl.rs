//! The per-sandbox JSONL file: one OCSF event per line, written by a thread of its own so a slow disk never
//! holds up the supervisor. Nothing is dropped: the queue is unbounded (bounded in practice by the event
//! rate) and shutdown waits for it to drain.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// The JSONL sink.
#[derive(Debug)]
pub struct Jsonl {
    tx: Sender<String>,
    failed: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
    done: Receiver<()>,
}

impl Jsonl {
    /// Opens (appends to) the events file, mode 0600.
    ///
    /// # Errors
    /// The file cannot be opened.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).mode(0o600).open(path)?;
        Ok(Self::start(file))
    }

    fn start(file: File) -> Self {
        let (tx, rx) = mpsc::channel::<String>();
        let (done_tx, done) = mpsc::channel();
        let failed = Arc::new(AtomicU64::new(0));
        let failures = Arc::clone(&failed);
        let thread = std::thread::Builder::new()
            .name("ocsf-jsonl".into())
            .spawn(move || {
                let mut out = BufWriter::new(file);
                while let Ok(first) = rx.recv() {
                    let mut ok = writeln!(out, "{first}").is_ok();
                    while let Ok(more) = rx.try_recv() {
                        ok &= writeln!(out, "{more}").is_ok();
                    }
                    ok &= out.flush().is_ok();
                    if !ok && crate::diagnostics::verbose_failures() {
                        // The control of the redaction test: what a naive sink would log.
                        tracing::warn!(record = %first, "OCSF JSONL sink write failed");
                    } else if !ok && failures.fetch_add(1, Ordering::Relaxed) == 0 {
                        // Fixed text: the error could quote the event.
                        tracing::warn!("OCSF JSONL sink write failed; counting further failures");
                    }
                }
                let _ = out.get_ref().sync_data();
                let _ = done_tx.send(());
            })
            .ok();
        Self { tx, failed, thread, done }
    }

    /// Queues one event (JSON without newline).
    pub fn write(&self, json: String) {
        let _ = self.tx.send(json);
    }

    /// Drains the queue to disk (until `deadline`) and syncs. Returns the failed batch count.
    pub fn shutdown(mut self, deadline: Instant) -> u64 {
        drop(self.tx);
        if self.done.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        self.failed.load(Ordering::Relaxed)
    }

    /// A sink on an arbitrary file (test builds inject a failing one).
    pub fn on_file(file: File) -> Self {
        Self::start(file)
    }
}
