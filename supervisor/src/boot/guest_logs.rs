//! The logs the guest can fill: its serial console (`console.log`) and QEMU's own stderr (`vmm.log`). QEMU
//! never writes a file itself: the console comes through a socket and stderr through a pipe, and the
//! supervisor copies each into its file up to a cap. Past the cap it keeps reading (so the guest is never
//! stalled by a full log) and counts what it drops; the first time, it reports a `log_capped` finding.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::inbox::Control;

/// Most bytes of the guest's console kept.
pub const CONSOLE_CAP_BYTES: u64 = 8 * 1024 * 1024;
/// Most bytes of QEMU's stderr kept.
pub const VMM_LOG_CAP_BYTES: u64 = 1024 * 1024;

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
/// `what` names the log in the finding sent on `control` when the cap is first reached.
pub fn copy_capped(
    mut from: Box<dyn AsyncRead + Unpin + Send>,
    path: &Path,
    cap: u64,
    what: &'static str,
    control: mpsc::Sender<Control>,
) -> std::io::Result<Arc<Dropped>> {
    let file = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(path)?;
    let dropped = Arc::new(Dropped::default());
    let counter = Arc::clone(&dropped);
    tokio::spawn(async move {
        let mut file = tokio::fs::File::from_std(file);
        let mut buf = vec![0u8; 64 * 1024];
        let mut written = 0u64;
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let room = usize::try_from(cap.saturating_sub(written)).unwrap_or(usize::MAX).min(n);
            if room > 0 && file.write_all(&buf[..room]).await.is_ok() {
                written += room as u64;
            }
            if room < n && counter.0.fetch_add((n - room) as u64, Ordering::Relaxed) == 0 {
                let _ = control.try_send(Control::LogCapped(what));
            }
        }
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
        let (control, mut rx) = mpsc::channel(4);
        let (mut writer, reader) = tokio::io::duplex(4096);
        let dropped = copy_capped(Box::new(reader), &path, 1000, "console.log", control).unwrap();
        writer.write_all(&[b'x'; 5000]).await.unwrap();
        drop(writer);
        assert!(matches!(rx.recv().await, Some(Control::LogCapped("console.log"))));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1000);
        assert_eq!(dropped.get(), 4000);
        let _ = std::fs::remove_file(&path);
    }
}
