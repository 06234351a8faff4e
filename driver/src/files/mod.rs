//! Host paths in and out of a sandbox (`vm-driver cp`, `launch --copy-in/--copy-out`; docs/files.md).
//!
//! In: [`pack`] makes a tar of a host file or tree (the user's own, trusted), sent as a `CopyIn`'s stdin.
//! Out: a `CopyOut`'s tar comes from the guest and is untrusted; [`copy_out`] unpacks it into a staging
//! directory beside the destination with the hardened extractor ([`extract`]) and renames it into place only
//! when the whole tar was accepted. A refusal leaves nothing behind, and its reason goes to the supervisor,
//! which records a `tar_refused` finding. Both run on a thread of their own, fed or drained through a small
//! bounded queue of chunks, so a slow disk slows the stream's credit and never grows memory.

mod beneath;
mod extract;
mod names;
pub mod pack;

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use tokio::sync::mpsc;
use vm_protocol::files::TarRefusal;

use self::beneath::Beneath;
use self::extract::UnpackError;
pub use self::extract::{Limits, Unpacked};

/// The name the tar's top-level entry has in the staging directory, whatever the tar calls it.
const STAGED_TOP: &[u8] = b"top";

/// Chunks queued between the stream and the thread that packs or unpacks.
const QUEUE_CHUNKS: usize = 4;

/// Why a copy out of the sandbox did not land.
#[derive(Debug, thiserror::Error)]
pub enum CopyOutError {
    /// The hardened extractor refused the tar.
    #[error("refused the sandbox's tar: {}; nothing was written", .0.describe())]
    Refused(TarRefusal),
    /// The destination cannot take it.
    #[error("{0}")]
    Destination(String),
    /// The copy failed in the sandbox: what came is not put in place.
    #[error("the copy failed in the sandbox; nothing was written")]
    Abandoned,
    /// The host failed (a full disk, a permission).
    #[error("cannot write {path}: {source}")]
    Host {
        /// The destination.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

/// Where a copy out lands, by `docker cp`'s rules, settled before any byte arrives: into an existing
/// directory under the source's name, or as the destination path itself.
#[derive(Debug)]
pub struct Destination {
    parent: OwnedFd,
    parent_path: PathBuf,
    name: OsString,
    shown: PathBuf,
}

impl Destination {
    /// The landing place for a copy of the guest's `source` to the host's `dest`.
    ///
    /// # Errors
    /// A source without a name (`/`), a destination whose directory is missing, or one ending in `/` that is
    /// not a directory.
    pub fn resolve(source: &str, dest: &Path) -> Result<Self, CopyOutError> {
        let bad = |why: String| CopyOutError::Destination(why);
        let source_name = Path::new(source)
            .file_name()
            .filter(|n| n.as_bytes() != b"..")
            .ok_or_else(|| bad(format!("{source:?} has no name to copy under: name a file or directory")))?;
        let (parent_path, name) = if dest.is_dir() {
            (dest.to_path_buf(), source_name.to_owned())
        } else if dest.as_os_str().as_bytes().ends_with(b"/") {
            return Err(bad(format!("{} is not a directory", dest.display())));
        } else {
            let name = dest.file_name().ok_or_else(|| bad(format!("{} names no file", dest.display())))?;
            let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            (parent.to_path_buf(), name.to_owned())
        };
        let parent =
            rustix::fs::open(&parent_path, OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| bad(format!("cannot open the directory {}: {e}", parent_path.display())))?;
        let shown = parent_path.join(&name);
        if shown.symlink_metadata().is_ok_and(|m| m.is_dir()) {
            return Err(bad(merge_refused(&shown)));
        }
        Ok(Self { parent, parent_path, name, shown })
    }

    fn host(&self, source: io::Error) -> CopyOutError {
        CopyOutError::Host { path: self.shown.clone(), source }
    }
}

/// Unpacks a guest's tar to `dest` (see the module's doc) and, once `commit` says the operation succeeded,
/// puts it in place; `confined` is off only for the `unchecked-extract` control.
///
/// # Errors
/// A refusal, a destination that cannot take the tree, or the host's failure; nothing is left either way.
pub fn copy_out(
    tar: impl Read,
    dest: &Destination,
    mut limits: Limits,
    confined: bool,
    commit: impl FnOnce() -> bool,
) -> Result<Unpacked, CopyOutError> {
    // Nothing is made beside the destination before the first byte: a copy that fails to start (an
    // unreachable service, a refused operation) leaves nothing behind.
    let mut tar = io::BufReader::new(tar);
    if io::BufRead::fill_buf(&mut tar).map_err(|e| dest.host(e))?.is_empty() {
        return Err(CopyOutError::Refused(TarRefusal::Malformed));
    }
    if let Ok(fs) = rustix::fs::fstatvfs(&dest.parent) {
        limits.max_bytes = limits.max_bytes.min(fs.f_bavail.saturating_mul(fs.f_frsize));
    }
    let staging = OsString::from(format!(".vm-driver-cp.{}.{}", std::process::id(), nonce()));
    rustix::fs::mkdirat(&dest.parent, &staging, Mode::from_raw_mode(0o700)).map_err(|e| dest.host(e.into()))?;
    let flags = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let placed = rustix::fs::openat(&dest.parent, &staging, flags, Mode::empty())
        .map_err(|e| dest.host(e.into()))
        .and_then(|fd| unpack_then_place(Beneath::new(fd, confined), tar, dest, limits, commit));
    // Empty after a rename into place; what a refusal left, otherwise (never followed through a symlink).
    let _ = std::fs::remove_dir_all(dest.parent_path.join(&staging));
    placed
}

fn unpack_then_place(
    tree: Beneath,
    tar: impl Read,
    dest: &Destination,
    limits: Limits,
    commit: impl FnOnce() -> bool,
) -> Result<Unpacked, CopyOutError> {
    let unpacked = extract::unpack(tar, &tree, limits).map_err(|e| match e {
        UnpackError::Refused(reason) => CopyOutError::Refused(reason),
        UnpackError::Io(e) => dest.host(e),
    })?;
    if !commit() {
        return Err(CopyOutError::Abandoned);
    }
    place(tree.root(), dest, unpacked.top_is_dir).map_err(|e| match e {
        Placed::Refused(why) => CopyOutError::Destination(why),
        Placed::Io(e) => dest.host(e.into()),
    })?;
    Ok(unpacked)
}

enum Placed {
    Refused(String),
    Io(Errno),
}

/// Moves the staged tree to its place: a new name, or a file over a file. An existing directory is never
/// merged into (that could not be atomic: a half-copied tree would mix with the old one).
fn place(staging: &OwnedFd, dest: &Destination, top_is_dir: bool) -> Result<(), Placed> {
    let top = std::ffi::OsStr::from_bytes(STAGED_TOP);
    match rustix::fs::statat(&dest.parent, &dest.name, AtFlags::SYMLINK_NOFOLLOW) {
        Err(Errno::NOENT) => rustix::fs::renameat_with(staging, top, &dest.parent, &dest.name, RenameFlags::NOREPLACE)
            .map_err(Placed::Io),
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
            Err(Placed::Refused(merge_refused(&dest.shown)))
        }
        Ok(_) if top_is_dir => {
            Err(Placed::Refused(format!("cannot copy a directory over the file {}", dest.shown.display())))
        }
        Ok(_) => rustix::fs::renameat(staging, top, &dest.parent, &dest.name).map_err(Placed::Io),
        Err(e) => Err(Placed::Io(e)),
    }
}

fn merge_refused(path: &Path) -> String {
    format!(
        "{} exists and is a directory; cp does not merge into one (remove it, or name another destination)",
        path.display()
    )
}

/// A name no other copy uses at the same time.
fn nonce() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// A copy out running on its own thread: feed it the tar's chunks, then take its outcome.
#[derive(Debug)]
pub struct Unpacking {
    /// The tar's chunks. A failed send means the extractor already ended (a refusal): take the outcome.
    pub chunks: mpsc::Sender<Vec<u8>>,
    commit: std::sync::mpsc::Sender<bool>,
    thread: std::thread::JoinHandle<Result<Unpacked, CopyOutError>>,
}

impl Unpacking {
    /// Starts unpacking into `dest`.
    ///
    /// # Errors
    /// The thread cannot start.
    pub fn start(dest: Destination, limits: Limits, confined: bool) -> io::Result<Self> {
        let (chunks, rx) = mpsc::channel(QUEUE_CHUNKS);
        let (commit, committed) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("copy-out".into()).spawn(move || {
            let tar = ChunkReader { rx, chunk: Vec::new(), at: 0 };
            copy_out(tar, &dest, limits, confined, || committed.recv().unwrap_or(false))
        })?;
        Ok(Self { chunks, commit, thread })
    }

    /// Ends the input (when it is not ended yet), says whether the operation succeeded (only then does a
    /// whole tar land), and waits for the outcome.
    pub async fn finish(self, success: bool) -> Result<Unpacked, CopyOutError> {
        drop(self.chunks);
        let _ = self.commit.send(success);
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_else(|| Err(CopyOutError::Destination("the extractor's thread failed".into())))
    }
}

/// Reads the chunks a channel carries; its end is EOF.
struct ChunkReader {
    rx: mpsc::Receiver<Vec<u8>>,
    chunk: Vec<u8>,
    at: usize,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.chunk.len() {
            match self.rx.blocking_recv() {
                Some(chunk) => (self.chunk, self.at) = (chunk, 0),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
