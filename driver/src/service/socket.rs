//! The API socket: in a private directory, mode 0600, never through a symlink, and only for peers with our
//! uid (and, when configured, the gateway's pid), checked with `SO_PEERCRED` on every connection.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use futures_util::Stream;
use tokio::net::{UnixListener, UnixStream};

/// Why the socket cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The path or its directory is a symlink.
    #[error("{} is a symlink; refusing to serve through it", .0.display())]
    Symlink(PathBuf),
    /// The directory is not private to this user.
    #[error("{} must be a directory owned by this user with mode 0700", .0.display())]
    NotPrivate(PathBuf),
    /// Something other than a socket is in the way.
    #[error("{} exists and is not a socket", .0.display())]
    NotASocket(PathBuf),
    /// Another server answers on it.
    #[error("another server is listening on {}", .0.display())]
    InUse(PathBuf),
    /// Creating or binding failed.
    #[error("cannot bind {}", .0.display())]
    Bind(PathBuf, #[source] io::Error),
}

/// Who may connect.
#[derive(Debug, Clone, Copy)]
pub struct PeerPolicy {
    /// Required peer uid.
    pub uid: u32,
    /// Required peer pid, if a gateway pid was given.
    pub pid: Option<i32>,
    /// The `api-no-peer-check` control: any peer is served, to show the check is what refuses another user.
    pub any_peer: bool,
}

/// Prepares `path` and binds it with mode 0600.
///
/// # Errors
/// [`SocketError`].
pub async fn bind(path: &Path) -> Result<UnixListener, SocketError> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    private_dir(dir)?;
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => return Err(SocketError::Symlink(path.to_owned())),
        Ok(meta) if !meta.file_type().is_socket() => return Err(SocketError::NotASocket(path.to_owned())),
        Ok(_) => {
            // A socket of ours: live (another server) or stale (a crashed one).
            if UnixStream::connect(path).await.is_ok() {
                return Err(SocketError::InUse(path.to_owned()));
            }
            fs::remove_file(path).map_err(|e| SocketError::Bind(path.to_owned(), e))?;
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(|e| SocketError::Bind(path.to_owned(), e))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(|e| SocketError::Bind(path.to_owned(), e))?;
    Ok(listener)
}

fn private_dir(dir: &Path) -> Result<(), SocketError> {
    if fs::symlink_metadata(dir).is_err() {
        fs::create_dir_all(dir).map_err(|e| SocketError::Bind(dir.to_owned(), e))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| SocketError::Bind(dir.to_owned(), e))?;
    }
    let meta = fs::symlink_metadata(dir).map_err(|e| SocketError::Bind(dir.to_owned(), e))?;
    if meta.file_type().is_symlink() {
        return Err(SocketError::Symlink(dir.to_owned()));
    }
    let ours = meta.uid() == rustix::process::getuid().as_raw();
    if !meta.is_dir() || !ours || meta.permissions().mode() & 0o077 != 0 {
        return Err(SocketError::NotPrivate(dir.to_owned()));
    }
    Ok(())
}

impl PeerPolicy {
    fn admits(&self, peer: &tokio::net::unix::UCred) -> bool {
        if self.any_peer {
            return true;
        }
        peer.uid() == self.uid && self.pid.is_none_or(|p| peer.pid() == Some(p))
    }
}

/// Accepted connections whose peer passes `policy`; others are closed at once and logged (fixed text).
///
/// An accept that fails (out of descriptors, most likely) is waited out with a backoff up to
/// [`ACCEPT_BACKOFF_MAX`], never handed to the server, which would retry at once and spin: the connection
/// stays in the listen backlog until descriptors are free again.
pub fn incoming(listener: UnixListener, policy: PeerPolicy) -> impl Stream<Item = io::Result<UnixStream>> {
    futures_util::stream::unfold(listener, move |listener| async move {
        let mut backoff = ACCEPT_BACKOFF_MIN;
        loop {
            match listener.accept().await {
                Ok((stream, _)) => match stream.peer_cred() {
                    Ok(cred) if policy.admits(&cred) => return Some((Ok(stream), listener)),
                    _ => tracing::warn!("refused an API connection from a peer that is not the gateway"),
                },
                Err(_) => {
                    tracing::warn!(?backoff, "cannot accept an API connection (out of descriptors?); waiting");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
            }
        }
    })
}

/// The first wait after a failed accept.
const ACCEPT_BACKOFF_MIN: std::time::Duration = std::time::Duration::from_millis(50);
/// The longest.
const ACCEPT_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(1);
