//! The one console writer: a bounded, non-blocking queue of complete lines in front of stderr.
//!
//! Diagnostics, OCSF shorthand lines and OCSF JSON lines all go through it. Each submission is one complete
//! line and is written with a single `write_all` by a single thread, so lines never tear or interleave. The
//! queue holds [`CONSOLE_QUEUE_LINES`]; when it is full (stderr is slow or nobody reads it), new lines are
//! dropped and counted, and the supervisor never waits. Past [`CAP_BYTES`] written, lines are dropped and
//! counted too. The count is reported at shutdown.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing_subscriber::fmt::MakeWriter;

/// Lines the console queue holds before it drops.
pub const CONSOLE_QUEUE_LINES: usize = 1024;

/// Longest line written, newline included: `PIPE_BUF`, so that on a pipe each line is written atomically
/// and cannot tear even when the process exits mid-write. Longer lines are cut and marked.
pub const MAX_LINE_BYTES: usize = 4096;

const CUT_MARK: &[u8] = b" [cut]";

/// A cloneable way to submit lines (also the `MakeWriter` for tracing).
#[derive(Debug, Clone)]
pub struct ConsoleHandle {
    tx: SyncSender<Vec<u8>>,
    dropped: Arc<AtomicU64>,
    /// Lines accepted but not yet written.
    pending: Arc<AtomicU64>,
}

/// The console writer and its thread. Dropping it without `shutdown` loses nothing already written.
#[derive(Debug)]
pub struct Console {
    handle: ConsoleHandle,
    thread: Option<JoinHandle<()>>,
    done: Receiver<()>,
}

impl Console {
    /// Starts the writer thread on stderr.
    pub fn start() -> Self {
        Self::start_on(Box::new(std::io::stderr()))
    }

    /// Starts the writer thread on `out` (tests use a pipe).
    pub fn start_on(mut out: Box<dyn Write + Send>) -> Self {
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(CONSOLE_QUEUE_LINES);
        let (done_tx, done) = mpsc::channel();
        let pending = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let (queued, over_cap) = (Arc::clone(&pending), Arc::clone(&dropped));
        let thread = std::thread::Builder::new()
            .name("console".into())
            .spawn(move || {
                let mut written = 0u64;
                // An empty submission is the end marker (`shutdown`).
                while let Ok(line) = rx.recv() {
                    if line.is_empty() {
                        break;
                    }
                    written += line.len() as u64;
                    if written > CAP_BYTES {
                        over_cap.fetch_add(1, Ordering::Relaxed);
                    } else {
                        // A broken stderr is not worth dying for; the lines are simply gone.
                        let _ = out.write_all(&line);
                    }
                    queued.fetch_sub(1, Ordering::Relaxed);
                }
                let _ = out.flush();
                let _ = done_tx.send(());
            })
            .ok();
        Self { handle: ConsoleHandle { tx, dropped, pending }, thread, done }
    }

    /// A handle for submitting lines.
    pub fn handle(&self) -> ConsoleHandle {
        self.handle.clone()
    }

    /// Lines dropped so far.
    pub fn dropped(&self) -> u64 {
        self.handle.dropped.load(Ordering::Relaxed)
    }

    /// Gives the thread until `deadline` to write what is queued, then stops it. Returns the dropped count,
    /// including lines still queued when the deadline passed. Other handles (tracing's) may still exist, so
    /// the end is an explicit empty line rather than the channel closing.
    pub fn shutdown(mut self, deadline: Instant) -> u64 {
        let ConsoleHandle { tx, dropped, pending } = self.handle;
        while tx.try_send(Vec::new()).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(tx);
        let wait = deadline.saturating_duration_since(Instant::now());
        if self.done.recv_timeout(wait).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
            dropped.load(Ordering::Relaxed)
        } else {
            // Blocked on a stderr nobody reads: what is still queued is lost with the process.
            dropped.load(Ordering::Relaxed) + pending.load(Ordering::Relaxed)
        }
    }
}

impl ConsoleHandle {
    /// Submits one complete line (a newline is added if missing). Never blocks.
    pub fn line(&self, mut line: Vec<u8>) {
        if line.last() == Some(&b'\n') {
            line.pop();
        }
        if line.len() >= MAX_LINE_BYTES {
            line.truncate(MAX_LINE_BYTES - 1 - CUT_MARK.len());
            line.extend_from_slice(CUT_MARK);
        }
        line.push(b'\n');
        self.pending.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.pending.fetch_sub(1, Ordering::Relaxed);
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// What tracing writes one event into; submitted as one line when dropped.
#[derive(Debug)]
pub struct LineWriter {
    buf: Vec<u8>,
    handle: ConsoleHandle,
}

impl Write for LineWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            self.handle.line(std::mem::take(&mut self.buf));
        }
    }
}

impl<'a> MakeWriter<'a> for ConsoleHandle {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter { buf: Vec::with_capacity(256), handle: self.clone() }
    }
}

/// How long the console gets to drain at shutdown, at least.
pub const CONSOLE_DRAIN: Duration = Duration::from_millis(200);

/// Most bytes written to stderr (`supervisor.log`) in all; later lines are dropped and counted.
pub const CAP_BYTES: u64 = 16 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_blocked_console_drops_and_counts_without_blocking() {
        // A socket nobody reads fills up; the writer thread blocks, the queue fills, submissions drop.
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let console = Console::start_on(Box::new(ours));
        let handle = console.handle();
        let start = Instant::now();
        let line = vec![b'x'; 200];
        for _ in 0..20_000 {
            handle.line(line.clone());
        }
        assert!(start.elapsed() < Duration::from_secs(5), "submitting never waits");
        assert!(console.dropped() > 0);
        // Everything that did get through is whole lines.
        theirs.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut got = Vec::new();
        let _ = theirs.read_to_end(&mut got);
        assert!(got.split(|b| *b == b'\n').filter(|l| !l.is_empty()).all(|l| l.len() == 200));
        drop(theirs);
    }

    #[test]
    fn long_lines_are_cut_to_pipe_buf() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let console = Console::start_on(Box::new(ours));
        console.handle().line(vec![b'y'; 10_000]);
        console.shutdown(Instant::now() + Duration::from_secs(2));
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), MAX_LINE_BYTES);
        assert!(got.ends_with(b" [cut]\n"));
    }

    #[test]
    fn lines_written_through_tracing_arrive_whole() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let console = Console::start_on(Box::new(ours));
        {
            let mut w = console.handle().make_writer();
            w.write_all(b"part one, ").unwrap();
            w.write_all(b"part two\n").unwrap();
        }
        assert_eq!(console.shutdown(Instant::now() + Duration::from_secs(2)), 0);
        let mut got = String::new();
        theirs.read_to_string(&mut got).unwrap();
        assert_eq!(got, "part one, part two\n");
    }
}
