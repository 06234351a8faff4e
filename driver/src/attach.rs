//! Running one process through a supervisor's attach socket.
//!
//! The driver is the host end of the boundary protocol here: it sends `Spawn`, streams stdin within the
//! credit the guest grants, writes output to its sinks and grants credit back only once the bytes are
//! written, so a slow terminal slows the guest instead of filling memory.

use std::path::Path;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use vm_protocol::codec::{self, FrameCodec};
use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::handshake::FirstFrameError;
use vm_protocol::message::Refusal;
use vm_protocol::{Capabilities, ExitStatus, FrameError, Hello, ProcId, SignalName, Spawn, Stream, ToGuest, ToHost};

/// Why running a process failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The attach socket did not accept the connection.
    #[error("cannot connect to the sandbox's attach socket")]
    Connect(#[source] std::io::Error),
    /// The handshake failed.
    #[error("attach handshake failed")]
    Handshake(#[source] FirstFrameError),
    /// The connection broke.
    #[error("the attach connection failed")]
    Frame(#[source] FrameError),
    /// The sandbox went away before the process exited.
    #[error("the sandbox stopped before the process exited")]
    SandboxEnded,
    /// The sandbox refused to start the process.
    #[error("the sandbox refused to start the process ({0:?})")]
    Refused(Refusal),
    /// Writing the process's output locally failed.
    #[error("cannot write the process's output")]
    Output(#[source] std::io::Error),
}

/// Where a process's I/O comes from and goes to.
pub struct ProcessIo {
    /// Chunks for stdin; the channel closing is EOF.
    pub stdin: mpsc::Receiver<Vec<u8>>,
    /// Sink for stdout.
    pub stdout: Box<dyn AsyncWrite + Unpin + Send>,
    /// Sink for stderr.
    pub stderr: Box<dyn AsyncWrite + Unpin + Send>,
    /// Signals to deliver to the process group while it runs.
    pub signals: mpsc::UnboundedReceiver<SignalName>,
}

impl std::fmt::Debug for ProcessIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessIo").finish_non_exhaustive()
    }
}

/// A handshaken attach connection.
#[derive(Debug)]
pub struct Attached {
    frames: FramedRead<OwnedReadHalf, FrameCodec<ToHost, ToGuest>>,
    sink: FramedWrite<OwnedWriteHalf, FrameCodec<ToHost, ToGuest>>,
    /// The sandbox's capabilities (the agent's, as the supervisor relays them).
    pub capabilities: Capabilities,
    /// Output bytes written locally but not yet credited back.
    consumed: u64,
}

/// Output credit is returned once this much has been written locally. A quarter of the window keeps the
/// guest streaming while the credit travels back.
const CREDIT_BATCH_BYTES: u64 = DEFAULT_WINDOW_BYTES as u64 / 4;

/// Connects to `dir/socket` and completes the handshake.
///
/// # Errors
/// [`AttachError::Connect`] or [`AttachError::Handshake`].
pub async fn connect(dir: &Path, socket: &str) -> Result<Attached, AttachError> {
    let mut stream = crate::unix::connect(dir, socket).await.map_err(AttachError::Connect)?;
    let ours = Hello::ours(Capabilities::NONE, concat!("vm-driver ", env!("CARGO_PKG_VERSION")));
    let theirs = codec::host_handshake(&mut stream, ours, Capabilities::EXEC).await.map_err(AttachError::Handshake)?;
    let (read, write) = stream.into_split();
    Ok(Attached {
        frames: FramedRead::new(read, FrameCodec::new()),
        sink: FramedWrite::new(write, FrameCodec::new()),
        capabilities: theirs.capabilities,
        consumed: 0,
    })
}

/// Stdin chunks not yet sent, and whether EOF follows them.
#[derive(Default)]
struct StdinState {
    pending: Vec<u8>,
    credit: u64,
    started: bool,
    source_done: bool,
    eof_sent: bool,
}

impl Attached {
    /// Runs one process to its exit.
    ///
    /// # Errors
    /// [`AttachError`] if the process could not run or the sandbox went away first.
    pub async fn run(
        mut self,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        cwd: Option<String>,
        mut io: ProcessIo,
    ) -> Result<ExitStatus, AttachError> {
        let id = ProcId(1);
        let spawn = Spawn {
            id,
            argv,
            env: env.into_iter().map(|(key, value)| vm_protocol::message::EnvVar { key, value }).collect(),
            cwd,
            pty: None,
            output_window: DEFAULT_WINDOW_BYTES,
        };
        self.send(ToGuest::Spawn(spawn)).await?;
        let mut stdin = StdinState::default();
        loop {
            tokio::select! {
                frame = self.frames.next() => match frame {
                    Some(Ok(msg)) => {
                        if let Some(status) = self.on_message(id, msg, &mut io, &mut stdin).await? {
                            io.stdout.flush().await.map_err(AttachError::Output)?;
                            io.stderr.flush().await.map_err(AttachError::Output)?;
                            return Ok(status);
                        }
                    }
                    Some(Err(e)) => return Err(AttachError::Frame(e)),
                    None => return Err(AttachError::SandboxEnded),
                },
                chunk = io.stdin.recv(), if stdin.started && stdin.pending.is_empty() && !stdin.source_done => {
                    match chunk {
                        Some(bytes) => stdin.pending = bytes,
                        None => stdin.source_done = true,
                    }
                }
                Some(signal) = io.signals.recv() => self.send(ToGuest::Signal { id, signal }).await?,
            }
            self.flush_stdin(id, &mut stdin).await?;
        }
    }

    async fn on_message(
        &mut self,
        id: ProcId,
        msg: ToHost,
        io: &mut ProcessIo,
        stdin: &mut StdinState,
    ) -> Result<Option<ExitStatus>, AttachError> {
        match msg {
            ToHost::Started { stdin_window, .. } => {
                stdin.started = true;
                stdin.credit = u64::from(stdin_window);
            }
            ToHost::Output { stream, data, .. } => {
                let sink = match stream {
                    Stream::Stdout => &mut io.stdout,
                    Stream::Stderr => &mut io.stderr,
                };
                sink.write_all(&data).await.map_err(AttachError::Output)?;
                sink.flush().await.map_err(AttachError::Output)?;
                // Credit goes back in batches: one small frame per quarter window, not one per chunk.
                self.consumed += data.len() as u64;
                if self.consumed >= CREDIT_BATCH_BYTES {
                    let bytes = u32::try_from(self.consumed).unwrap_or(u32::MAX);
                    self.consumed -= u64::from(bytes);
                    self.send(ToGuest::Credit { id, bytes }).await?;
                }
            }
            ToHost::StdinCredit { bytes, .. } => stdin.credit += u64::from(bytes),
            ToHost::Exited { status, .. } => return Ok(Some(status)),
            ToHost::Refused { reason, .. } => return Err(AttachError::Refused(reason)),
            ToHost::Pong { .. } | ToHost::Processes { .. } | ToHost::Hello(_) | ToHost::Reserved => {}
        }
        Ok(None)
    }

    /// Sends as much pending stdin as the credit allows, then EOF once the source is done and drained.
    async fn flush_stdin(&mut self, id: ProcId, stdin: &mut StdinState) -> Result<(), AttachError> {
        while !stdin.pending.is_empty() && stdin.credit > 0 {
            let n = stdin.pending.len().min(MAX_DATA_BYTES).min(usize::try_from(stdin.credit).unwrap_or(usize::MAX));
            let rest = stdin.pending.split_off(n);
            let chunk = std::mem::replace(&mut stdin.pending, rest);
            stdin.credit -= n as u64;
            self.send(ToGuest::Stdin { id, data: chunk.into() }).await?;
        }
        if stdin.source_done && stdin.pending.is_empty() && !stdin.eof_sent && stdin.started {
            stdin.eof_sent = true;
            self.send(ToGuest::StdinEof { id }).await?;
        }
        Ok(())
    }

    /// Sends one message.
    ///
    /// # Errors
    /// [`AttachError::Frame`].
    pub async fn send(&mut self, msg: ToGuest) -> Result<(), AttachError> {
        self.sink.send(msg).await.map_err(AttachError::Frame)
    }

    /// The next message from the supervisor; `None` when it closed the connection.
    pub async fn recv(&mut self) -> Option<Result<ToHost, FrameError>> {
        self.frames.next().await
    }
}

/// Reads this process's stdin on a dedicated thread (a blocking read cannot be cancelled, so it must not
/// hold up the runtime) into a small bounded queue.
pub fn stdin_chunks() -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(4);
    let spawned = std::thread::Builder::new().name("stdin".into()).spawn(move || {
        use std::io::Read;
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; MAX_DATA_BYTES];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // An unreadable stdin is treated as an empty one.
                Err(_) => return,
            }
        }
    });
    if spawned.is_err() {
        tracing::warn!("cannot start the stdin thread; the process gets an empty stdin");
    }
    rx
}
