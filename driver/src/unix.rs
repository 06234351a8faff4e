//! Connecting to a Unix socket inside a directory whose path may be too long for `sockaddr_un`.
//!
//! `sun_path` holds 107 bytes. A state directory plus a 128-character sandbox id can exceed that, so a long
//! path is reached through `/proc/self/fd/<dirfd>/<name>` instead, which is always short.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use tokio::net::UnixStream;

/// Longest path `sockaddr_un` takes, without the terminating NUL.
pub(crate) const MAX_SUN_PATH: usize = 107;

/// Connects to `dir/name`.
///
/// # Errors
/// The directory cannot be opened, or the connection fails.
pub(crate) async fn connect(dir: &Path, name: &str) -> io::Result<UnixStream> {
    let full = dir.join(name);
    if full.as_os_str().len() <= MAX_SUN_PATH {
        return UnixStream::connect(&full).await;
    }
    // Held open until the connection is made, so the fd number in the path stays valid.
    let handle = File::open(dir)?;
    let short = format!("/proc/self/fd/{}/{name}", handle.as_raw_fd());
    let stream = UnixStream::connect(&short).await;
    drop(handle);
    stream
}
