//! The per-sandbox JSONL file: one OCSF event per line, written by a thread of its own so a slow disk never
//! holds up the supervisor.
//!
//! Bounded: the queue holds [`QUEUE_LINES`] (a full queue makes the audit thread, its only writer, wait: the
//! wait backs up into the audit queue, which stops the guest being read), and the file stops growing at
//! [`CAP_BYTES`]. The last [`RESERVE_BYTES`] of the cap are kept for essential events (lifecycle,
//! drop reports), so the record of how the sandbox ended is never the part that is missing. Dropped lines are
//! counted and reported at shutdown.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Most bytes the file grows to.
pub const CAP_BYTES: u64 = 64 * 1024 * 1024;
/// Bytes of the cap kept for essential events.
pub const RESERVE_BYTES: u64 = 1024 * 1024;
/// Lines waiting for the writer thread.
pub const QUEUE_LINES: usize = 8192;

/// One line to write, and whether it is essential.
type Line = (String, bool);

/// The JSONL sink.
#[derive(Debug)]
pub struct Jsonl {
    tx: SyncSender<Line>,
    failed: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
    done: Receiver<()>,
}

/// What the sink lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JsonlReport {
    /// Write batches that failed.
    pub failures: u64,
    /// Lines dropped: the cap was reached, or the writer was gone.
    pub dropped: u64,
}

impl Jsonl {
    /// Opens (appends to) the events file, mode 0600; `cap` is [`CAP_BYTES`] except in the
    /// `no-telemetry-limits` control; `verbose_failures` is the `verbose-failure-logs` control.
    ///
    /// # Errors
    /// The file cannot be opened.
    pub fn open(path: &Path, cap: u64, verbose_failures: bool) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).mode(0o600).open(path)?;
        Ok(Self::start(file, cap, verbose_failures))
    }

    /// A sink on an arbitrary file (test builds inject a failing one).
    pub fn on_file(file: File, verbose_failures: bool) -> Self {
        Self::start(file, CAP_BYTES, verbose_failures)
    }

    fn start(file: File, cap: u64, verbose_failures: bool) -> Self {
        let (tx, rx) = mpsc::sync_channel::<Line>(QUEUE_LINES);
        let (done_tx, done) = mpsc::channel();
        let failed = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let (failures, drops) = (Arc::clone(&failed), Arc::clone(&dropped));
        let mut written = file.metadata().map_or(0, |m| m.len());
        let thread = std::thread::Builder::new()
            .name("ocsf-jsonl".into())
            .spawn(move || {
                let mut out = BufWriter::new(file);
                while let Ok(first) = rx.recv() {
                    let batch: Vec<Line> =
                        std::iter::once(first).chain(std::iter::from_fn(|| rx.try_recv().ok())).collect();
                    let mut ok = true;
                    for (line, essential) in &batch {
                        let len = line.len() as u64 + 1;
                        let room = if *essential { cap } else { cap.saturating_sub(RESERVE_BYTES) };
                        if written + len > room {
                            drops.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        written += len;
                        ok &= writeln!(out, "{line}").is_ok();
                    }
                    ok &= out.flush().is_ok();
                    if !ok && verbose_failures {
                        // The control of the redaction test: what a naive sink would log.
                        tracing::warn!(record = %batch[0].0, "OCSF JSONL sink write failed");
                    } else if !ok && failures.fetch_add(1, Ordering::Relaxed) == 0 {
                        // Fixed text: the error could quote the event.
                        tracing::warn!("OCSF JSONL sink write failed; counting further failures");
                    }
                }
                let _ = out.get_ref().sync_data();
                let _ = done_tx.send(());
            })
            .ok();
        Self { tx, failed, dropped, thread, done }
    }

    /// Queues one event (JSON without newline), waiting for room while the writer catches up; counted as
    /// dropped only when the writer is gone.
    pub fn write(&self, json: String, essential: bool) {
        if self.tx.send((json, essential)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drains the queue to disk (until `deadline`) and syncs.
    pub fn shutdown(mut self, deadline: Instant) -> JsonlReport {
        drop(self.tx);
        if self.done.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        JsonlReport { failures: self.failed.load(Ordering::Relaxed), dropped: self.dropped.load(Ordering::Relaxed) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_stops_at_its_cap_keeping_room_for_essential_events() {
        let path = std::env::temp_dir().join(format!("jsonl-cap-{}.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let cap = RESERVE_BYTES + 10_000;
        let sink = Jsonl::open(&path, cap, false).unwrap();
        for _ in 0..1_000 {
            sink.write("x".repeat(99), false);
        }
        sink.write("essential".into(), true);
        let report = sink.shutdown(Instant::now() + std::time::Duration::from_secs(5));
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(text.len() as u64 <= cap, "{}", text.len());
        assert_eq!(text.lines().filter(|l| l.starts_with('x')).count(), 100, "up to the cap less the reserve");
        assert!(text.ends_with("essential\n"), "the reserve holds the essential line");
        assert_eq!(report.dropped, 900);
    }
}
