//! Snapshots: saving a booted, idle VM once (`--save-snapshot`), so that pooled VMs can start from it
//! (`--restore-snapshot`) instead of booting. See `docs/operations.md` ("Snapshots").
//!
//! ```text
//! boot (pooled, no identity) -> hello -> Reseed, Ping, Pong (the agent took it) -> QMP: stop, migrate to
//!   vmm/migrate.sock (the supervisor copies it into STATE, capped) -> query-migrate until completed
//!   -> the agent's hello saved beside it -> QEMU killed
//! ```
//!
//! - **Only `fd:` and sockets get past QEMU's seccomp policy** (`exec:` is spawning), and a jailed QEMU may
//!   write no file (`RLIMIT_FSIZE` 0), so QEMU sends the stream to a socket the supervisor listens on, and
//!   the supervisor writes the file, up to a cap (`vm_contract::snapshot::max_state_bytes`; QEMU runs beside the guest: what it sends
//!   is untrusted).
//! - **The VM is saved stopped**, right after the agent answered, and without its run state
//!   (`migration.store-global-state=off`): guest time stands still from the agent's answer to the save, and a
//!   restored VM runs at once, with no monitor and no `cont`.
//! - **The saved VM had just reseeded** from the host's bytes (the `Reseed` after its hello), so what its
//!   clones share is only what the restore's own `Reseed` replaces before any process runs.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use vm_contract::layout::SandboxFile;
use vm_contract::snapshot::SnapshotFile;
use vm_protocol::handshake;
use vm_protocol::link::ToHost;
use vm_protocol::{frame, Hello};

use super::guest_link::{GuestLink, REQUIRED};
use super::qmp::{self, Qmp, QmpError};

/// The most bytes of a saved hello (a frame body of a few dozen).
const MAX_HELLO_BYTES: u64 = 4096;
/// How long the stream's connection may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the whole save may take, whatever QEMU sends meanwhile.
const SAVE_TIMEOUT: Duration = Duration::from_secs(120);
/// Effectively no cap: QEMU's default (32 MiB/s) would make a save of 100 MB take three seconds.
const MAX_BANDWIDTH: u64 = 100 * 1024 * 1024 * 1024;

/// Why a save failed.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// A step took too long.
    #[error("saving the VM timed out ({0})")]
    Timeout(&'static str),
    /// QEMU's monitor failed, or answered with an error or something that is not QMP.
    #[error(transparent)]
    Monitor(#[from] QmpError),
    /// The migration ended without completing.
    #[error("the migration ended as {0:?}")]
    Migration(String),
    /// The stream was larger than a guest of this shape can make.
    #[error("the migration stream passed {0} bytes")]
    TooLarge(u64),
    /// The snapshot files could not be written.
    #[error("cannot write the snapshot")]
    Write(#[source] std::io::Error),
}

/// What a VM to be saved has beyond any other: its monitor, and the socket its stream comes to.
#[derive(Debug)]
pub struct SaveLine {
    /// QEMU's monitor connection.
    pub monitor: UnixStream,
    /// [`SandboxFile::Migration`].
    pub migration: UnixListener,
    /// The guest's RAM is a file of the driver's (a template): the stream leaves it out (`x-ignore-shared`).
    pub ram_in_file: bool,
}

/// The agent's hello saved with the snapshot in `dir`, checked as a fresh one would be, before QEMU starts.
///
/// # Errors
/// The file is missing, unreadable or too large, or not a hello this supervisor accepts (`InvalidData`).
pub fn saved_hello(dir: &Path) -> std::io::Result<Hello> {
    let mut body = Vec::new();
    let file = std::fs::File::open(SnapshotFile::Hello.path(dir))?;
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_HELLO_BYTES + 1), &mut body)?;
    if body.len() as u64 > MAX_HELLO_BYTES {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    handshake::accept_first(&body, REQUIRED).map_err(|_| std::io::ErrorKind::InvalidData.into())
}

/// Saves the VM behind `line` and `link` into `dir` (which must not hold a snapshot yet) within
/// [`SAVE_TIMEOUT`], refusing a stream past `cap` bytes, and returns the stream's size. The caller keeps the lease stepping meanwhile and kills
/// QEMU after.
///
/// # Errors
/// A [`SaveError`]; the files written so far are left for the caller (the driver) to remove.
pub async fn save(line: SaveLine, link: &GuestLink, dir: &Path, cap: u64) -> Result<u64, SaveError> {
    tokio::time::timeout(SAVE_TIMEOUT, save_unbounded(line, link, dir, cap))
        .await
        .map_err(|_| SaveError::Timeout("the save"))?
}

async fn save_unbounded(line: SaveLine, link: &GuestLink, dir: &Path, cap: u64) -> Result<u64, SaveError> {
    let mut qmp = Qmp::open(line.monitor).await?;
    if line.ram_in_file {
        qmp.execute("migrate-set-capabilities", qmp::IGNORE_SHARED.clone()).await?;
    }
    qmp.execute("migrate-set-parameters", json!({ "max-bandwidth": MAX_BANDWIDTH })).await?;
    qmp.execute("stop", Value::Null).await?;
    let state = create_private(&SnapshotFile::State.path(dir)).await?;
    let mut copy = AbortOnDrop(tokio::spawn(receive(line.migration, state, cap)));
    qmp.execute("migrate", json!({ "uri": format!("unix:{}", SandboxFile::Migration.name()) })).await?;
    loop {
        let status = qmp.execute("query-migrate", Value::Null).await?;
        match status.get("status").and_then(Value::as_str) {
            Some("completed") => break,
            Some("failed" | "cancelled") | None => {
                // The copy's refusal (too large) is why QEMU's side failed: name that.
                if copy.0.is_finished() {
                    if let Ok(Err(refused)) = (&mut copy.0).await {
                        return Err(refused);
                    }
                }
                let what = status.get("status").and_then(Value::as_str).unwrap_or("unknown");
                return Err(SaveError::Migration(what.chars().take(32).collect()));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let bytes = tokio::time::timeout(STEP_TIMEOUT, &mut copy.0)
        .await
        .map_err(|_| SaveError::Timeout("the stream's end"))?
        .map_err(|_| SaveError::Write(std::io::ErrorKind::Other.into()))??;
    // The hello as this supervisor accepted it, encoded again: what a restore checks.
    let mut hello = Vec::new();
    frame::encode(&ToHost::Hello(link.hello.clone()), &mut hello)
        .map_err(|_| SaveError::Monitor(QmpError::Monitor("hello")))?;
    let mut file = create_private(&SnapshotFile::Hello.path(dir)).await?;
    file.write_all(&hello[frame::HEADER_BYTES..]).await.map_err(SaveError::Write)?;
    file.sync_all().await.map_err(SaveError::Write)?;
    Ok(bytes)
}

/// The stream's copy, stopped if the save fails before it ends: nothing writes into a snapshot directory the
/// driver is about to remove.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A new file, 0600 (a snapshot holds all guest memory).
async fn create_private(path: &Path) -> Result<tokio::fs::File, SaveError> {
    tokio::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).await.map_err(SaveError::Write)
}

/// Takes QEMU's connection on `listener` and writes what it sends into `file`, up to `cap` bytes.
async fn receive(listener: UnixListener, mut file: tokio::fs::File, cap: u64) -> Result<u64, SaveError> {
    let (stream, _) = tokio::time::timeout(STEP_TIMEOUT, listener.accept())
        .await
        .map_err(|_| SaveError::Timeout("the stream's connection"))?
        .map_err(SaveError::Write)?;
    let mut limited = stream.take(cap + 1);
    let bytes = tokio::io::copy(&mut limited, &mut file).await.map_err(SaveError::Write)?;
    if bytes > cap {
        return Err(SaveError::TooLarge(cap));
    }
    file.sync_all().await.map_err(SaveError::Write)?;
    Ok(bytes)
}

/// Why a restore from a template failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// QEMU's monitor failed, refused, or was too slow.
    #[error(transparent)]
    Monitor(#[from] QmpError),
    /// The saved stream cannot be opened.
    #[error("cannot open the saved state")]
    Open(#[source] std::io::Error),
    /// The incoming migration ended, but the VM does not run.
    #[error("the restored VM is {0:?}, not running")]
    NotRunning(String),
    /// It took too long.
    #[error("the restore timed out")]
    Timeout,
}

impl RestoreError {
    /// Whether the saved state itself failed (QEMU refused it, exited loading it, or did not run it), not the
    /// host (a timeout).
    pub fn is_refusal(&self) -> bool {
        match self {
            Self::Monitor(QmpError::Monitor(_)) | Self::Open(_) | Self::NotRunning(_) => true,
            Self::Monitor(QmpError::Timeout(_)) | Self::Timeout => false,
        }
    }
}

/// A template's restore: QEMU started with `-incoming defer`, its RAM the template's memfd. Its monitor
/// turns on `x-ignore-shared` (the stream has no RAM; QEMU 7.2 has no command-line switch for it), takes the
/// saved state as a descriptor sent over the monitor (the jail has no such file), loads it, and the VM runs.
///
/// # Errors
/// [`RestoreError`].
pub async fn restore_deferred(monitor: UnixStream, state: &Path) -> Result<(), RestoreError> {
    let file = std::fs::File::open(state).map_err(RestoreError::Open)?;
    let started = std::time::Instant::now();
    let run = async {
        let mut qmp = Qmp::open(monitor).await?;
        qmp.execute("migrate-set-capabilities", qmp::IGNORE_SHARED.clone()).await?;
        qmp.send_fd("state", &file).await?;
        qmp.execute("migrate-incoming", json!({ "uri": "fd:state" })).await?;
        loop {
            let status = qmp.execute("query-status", Value::Null).await?;
            match status.get("status").and_then(Value::as_str) {
                Some("inmigrate") => tokio::time::sleep(Duration::from_millis(5)).await,
                Some("running") => {
                    tracing::info!(ms = started.elapsed().as_millis(), "restored from the template's saved state");
                    return Ok(());
                }
                other => return Err(RestoreError::NotRunning(other.unwrap_or("unknown").chars().take(32).collect())),
            }
        }
    };
    tokio::time::timeout(SAVE_TIMEOUT, run).await.map_err(|_| RestoreError::Timeout)?
}
