//! The logs the guest can fill: its serial console (`console.log`) and QEMU's own stderr (`vmm.log`). QEMU
//! never writes a file itself: the console comes through a socket and stderr through a pipe, and the
//! supervisor copies each into its file up to a cap. Past the cap it keeps reading (so the guest is never
//! stalled by a full log) and counts what it drops; the first time, it reports a `log_capped` finding.
//!
//! QEMU's UART hands the socket one byte at a time. Read as it comes, a console flood costs the supervisor
//! a read and a file write per byte, a whole host core under TCG. So a read that did not fill the buffer is
//! followed by a short pause in which bytes pile up in the socket, and the file is written in batches. The
//! socket holds only a few hundred of those one-byte writes (each is its own buffer), so the pause is what
//! bounds the console's rate: about 200 KB/s, far past what any healthy guest prints there.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::inbox::Notice;

/// Most bytes of the guest's console kept.
pub const CONSOLE_CAP_BYTES: u64 = 8 * 1024 * 1024;
/// Most bytes of QEMU's stderr kept.
pub const VMM_LOG_CAP_BYTES: u64 = 1024 * 1024;
/// The pause after a short read.
const SETTLE: Duration = Duration::from_millis(1);
/// Bytes kept back before a write to the file.
const BATCH_BYTES: usize = 64 * 1024;
/// The longest a kept-back byte waits for its write.
const BATCH_DELAY: Duration = Duration::from_millis(100);

/// Bytes a log dropped past its cap.
#[derive(Debug, Default)]
pub struct Dropped(AtomicU64);

impl Dropped {
    /// Bytes dropped so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Copies `from` into `path` (created 0600, truncated) up to `cap` bytes, then keeps reading and counting.
/// `what` names the log in the finding sent on `notices` when the cap is first reached.
pub fn copy_capped(
    mut from: Box<dyn AsyncRead + Unpin + Send>,
    path: &Path,
    cap: u64,
    what: &'static str,
    notices: mpsc::Sender<Notice>,
) -> std::io::Result<Arc<Dropped>> {
    let file = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(path)?;
    let dropped = Arc::new(Dropped::default());
    let counter = Arc::clone(&dropped);
    tokio::spawn(async move {
        let mut file = tokio::fs::File::from_std(file);
        let mut buf = vec![0u8; BATCH_BYTES];
        let mut batch = Vec::with_capacity(BATCH_BYTES);
        let mut written = 0u64;
        // When the oldest kept-back byte must be in the file.
        let mut due: Option<Instant> = None;
        loop {
            let read = from.read(&mut buf);
            let got = match due {
                None => read.await,
                // A read is cancel-safe: on timeout nothing was taken from the stream.
                Some(at) => match tokio::time::timeout_at(at.into(), read).await {
                    Ok(got) => got,
                    Err(_) => {
                        let _ = file.write_all(&batch).await;
                        batch.clear();
                        due = None;
                        continue;
                    }
                },
            };
            let n = match got {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let room = usize::try_from(cap.saturating_sub(written)).unwrap_or(usize::MAX).min(n);
            batch.extend_from_slice(&buf[..room]);
            written += room as u64;
            if room < n && counter.0.fetch_add((n - room) as u64, Ordering::Relaxed) == 0 {
                let _ = notices.try_send(Notice::LogCapped(what));
            }
            if batch.len() >= BATCH_BYTES {
                let _ = file.write_all(&batch).await;
                batch.clear();
                due = None;
            } else if !batch.is_empty() && due.is_none() {
                due = Some(Instant::now() + BATCH_DELAY);
            }
            if n < buf.len() {
                tokio::time::sleep(SETTLE).await;
            }
        }
        let _ = file.write_all(&batch).await;
        let _ = file.flush().await;
    });
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_log_stops_at_its_cap_and_counts_the_rest() {
        let path = std::env::temp_dir().join(format!("capped-{}.log", std::process::id()));
        let (notices, mut rx) = mpsc::channel(4);
        let (mut writer, reader) = tokio::io::duplex(4096);
        let dropped = copy_capped(Box::new(reader), &path, 1000, "console.log", notices).unwrap();
        writer.write_all(&[b'x'; 5000]).await.unwrap();
        drop(writer);
        assert!(matches!(rx.recv().await, Some(Notice::LogCapped("console.log"))));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1000);
        assert_eq!(dropped.get(), 4000);
        let _ = std::fs::remove_file(&path);
    }

    #[tokio::test]
    async fn a_kept_back_line_reaches_the_file_while_the_stream_stays_open() {
        let path = std::env::temp_dir().join(format!("batched-{}.log", std::process::id()));
        let (notices, _rx) = mpsc::channel(4);
        let (mut writer, reader) = tokio::io::duplex(4096);
        copy_capped(Box::new(reader), &path, 1000, "console.log", notices).unwrap();
        writer.write_all(b"one line\n").await.unwrap();
        tokio::time::sleep(BATCH_DELAY * 3).await;
        assert_eq!(std::fs::read(&path).unwrap(), b"one line\n");
        drop(writer);
        let _ = std::fs::remove_file(&path);
    }
}
