//! A tar of a host file or tree, for a `CopyIn`: one top-level entry named after the source, symlinks kept
//! as links (never followed: a link in the user's tree may point anywhere on the host), modes kept.

use std::io::{self, Write};
use std::path::Path;

use tokio::sync::mpsc;
use vm_protocol::frame::MAX_DATA_BYTES;

/// Packs `source` on a thread of its own; the chunks come on the returned queue, which closes at the end.
/// The thread's outcome says whether the tar is whole.
///
/// # Errors
/// The source has no name (`/`, `..`) or is missing, or the thread cannot start.
pub fn start(source: &Path) -> io::Result<(mpsc::Receiver<Vec<u8>>, Packer)> {
    let name = source
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the source has no name to copy under"))?
        .to_owned();
    let meta = std::fs::symlink_metadata(source)?;
    let source = source.to_path_buf();
    let (tx, rx) = mpsc::channel(super::QUEUE_CHUNKS);
    let thread = std::thread::Builder::new().name("copy-in".into()).spawn(move || {
        let out = io::BufWriter::with_capacity(MAX_DATA_BYTES, ChunkWriter(tx));
        let mut tar = tar::Builder::new(out);
        tar.follow_symlinks(false);
        if meta.is_dir() {
            tar.append_dir_all(&name, &source)?;
        } else {
            tar.append_path_with_name(&source, &name)?;
        }
        tar.into_inner()?.flush()
    })?;
    Ok((rx, Packer(thread)))
}

/// The thread that makes the tar.
#[derive(Debug)]
pub struct Packer(std::thread::JoinHandle<io::Result<()>>);

impl Packer {
    /// Waits for the tar's end.
    ///
    /// # Errors
    /// The source could not be read whole (or the stream ended before the tar did).
    pub async fn finish(self) -> io::Result<()> {
        let thread = self.0;
        match tokio::task::spawn_blocking(move || thread.join()).await {
            Ok(Ok(packed)) => packed,
            _ => Err(io::Error::other("the tar's thread failed")),
        }
    }
}

/// Writes into a chunk queue; a closed queue (the stream ended) is a broken pipe.
struct ChunkWriter(mpsc::Sender<Vec<u8>>);

impl Write for ChunkWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(MAX_DATA_BYTES);
        self.0.blocking_send(buf[..n].to_vec()).map_err(|_| io::ErrorKind::BrokenPipe)?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
