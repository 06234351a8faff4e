//! Small file and stream helpers every part of the crate shares: a read with a bound, and a lock file.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// All of `from` if it holds at most `limit` bytes; `None` if it holds more (never reading past `limit + 1`).
pub(crate) fn read_up_to(from: impl Read, limit: u64) -> io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    from.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= limit).then_some(bytes))
}

/// The lock file at `path` (made 0600 if missing), held exclusively until the returned file is dropped.
pub(crate) fn lock(path: &Path) -> io::Result<fs::File> {
    let file = fs::OpenOptions::new().create(true).write(true).truncate(false).mode(0o600).open(path)?;
    file.lock()?;
    Ok(file)
}
