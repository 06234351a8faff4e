//! containerd's stdio FIFOs as a process's client end for the driver's process session: stdin read from its
//! FIFO within the guest's credit, stdout and stderr written to theirs before the bytes count as delivered,
//! and the task service's requests (signals, resizes, `CloseIO`) as the client's.
//!
//! The stdin FIFO is opened for reading on a blocking thread: an open without a writer would read as an
//! immediate end of file. The output FIFOs are opened read-write, so the open never fails for want of a
//! reader (`ctr` opens its readers before `Create`, a restarted containerd again after), and a client that
//! stops reading slows the process instead of killing it.
//!
//! `CloseIO` comes after the client wrote its last stdin bytes into the FIFO, but they may not have been read
//! yet: stdin then ends only once what the FIFO holds is read (without waiting for more).

use std::collections::VecDeque;
use std::path::PathBuf;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use vm_driver::process::{ClientEnd, ClientGone, FromClient, ToClient};
use vm_protocol::Stream;

/// Stdin bytes read per message.
const STDIN_CHUNK: usize = 32 * 1024;
/// How often a blocked open of stdin is offered a writer to let it go, until it has begun.
const RELEASE_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

/// The FIFOs containerd named for one process (empty: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stdio {
    /// Stdin's FIFO.
    pub stdin: String,
    /// Stdout's FIFO.
    pub stdout: String,
    /// Stderr's FIFO (unused on a terminal: the terminal's output is stdout).
    pub stderr: String,
}

/// Where stdin stands.
enum Input {
    /// Being opened (until a writer opens its end): the open, and the FIFO's path.
    Opening(JoinHandle<std::io::Result<std::fs::File>>, PathBuf),
    Open(pipe::Receiver),
    Closed,
}

/// One process's client: its FIFOs, and what the task service asks of it.
pub struct FifoClient {
    stdin: Input,
    stdout: Option<pipe::Sender>,
    stderr: Option<pipe::Sender>,
    requests: mpsc::Receiver<FromClient>,
    /// The guest pid, for whoever waits on the start.
    started: Option<oneshot::Sender<Result<u32, String>>>,
    pending: VecDeque<FromClient>,
    /// What the sandbox said of a spawn that failed, for the start's error.
    message: String,
    /// `CloseIO` asked stdin to end: what the FIFO holds is read, then it ends.
    closing: bool,
    closed: bool,
}

impl FifoClient {
    /// Opens the output FIFOs at once and stdin in the background.
    ///
    /// # Errors
    /// An output FIFO cannot be opened.
    pub fn open(
        stdio: &Stdio,
        requests: mpsc::Receiver<FromClient>,
        started: oneshot::Sender<Result<u32, String>>,
    ) -> std::io::Result<Self> {
        let sender = |path: &str| -> std::io::Result<Option<pipe::Sender>> {
            if path.is_empty() {
                return Ok(None);
            }
            pipe::OpenOptions::new().read_write(true).open_sender(path).map(Some)
        };
        let (stdout, stderr) = (sender(&stdio.stdout)?, sender(&stdio.stderr)?);
        let mut pending = VecDeque::new();
        let stdin = if stdio.stdin.is_empty() {
            pending.push_back(FromClient::StdinEof);
            Input::Closed
        } else {
            let path = PathBuf::from(&stdio.stdin);
            let opening = path.clone();
            Input::Opening(tokio::task::spawn_blocking(move || std::fs::File::open(opening)), path)
        };
        Ok(Self {
            stdin,
            stdout,
            stderr,
            requests,
            started: Some(started),
            pending,
            message: String::new(),
            closing: false,
            closed: false,
        })
    }

    async fn write(&mut self, stream: Stream, data: &[u8]) {
        let fifo = match stream {
            Stream::Stdout => &mut self.stdout,
            Stream::Stderr => &mut self.stderr,
        };
        if let Some(writer) = fifo {
            if writer.write_all(data).await.is_err() {
                // Its reader is gone for good: the rest of this stream goes nowhere, the process runs on.
                *fifo = None;
            }
        }
    }

    fn answer_start(&mut self, result: Result<u32, String>) {
        if let Some(started) = self.started.take() {
            let _ = started.send(result);
        }
    }
}

impl ClientEnd for FifoClient {
    async fn next(&mut self, listening: bool) -> FromClient {
        if let Some(msg) = self.pending.pop_front() {
            return msg;
        }
        if self.closed {
            return std::future::pending().await;
        }
        loop {
            let reading = listening && !matches!(self.stdin, Input::Closed);
            let mut buf = vec![0; STDIN_CHUNK];
            let closing = self.closing;
            let input = async {
                match &mut self.stdin {
                    Input::Opening(handle, path) if closing => Woke::Opened(release(handle, path).await),
                    Input::Opening(handle, _) => Woke::Opened(handle.await),
                    // Nothing left in the FIFO ends it, as its end would. The read is the kernel's own, not
                    // the reactor's: a FIFO just opened has no readiness recorded yet, whatever it holds.
                    Input::Open(receiver) if closing => Woke::Read(match rustix::io::read(&*receiver, &mut buf) {
                        Err(rustix::io::Errno::AGAIN) => Ok(0),
                        read => read.map_err(std::io::Error::from),
                    }),
                    Input::Open(receiver) => Woke::Read(receiver.read(&mut buf).await),
                    Input::Closed => std::future::pending().await,
                }
            };
            // Both branches are cancel-safe: a join handle and a pipe read keep nothing when dropped.
            let woke = tokio::select! {
                woke = input, if reading => woke,
                Some(request) = self.requests.recv() => Woke::Asked(request),
            };
            match woke {
                Woke::Opened(Ok(Ok(file))) => match pipe::Receiver::from_file(file) {
                    Ok(receiver) => self.stdin = Input::Open(receiver),
                    Err(_) => return self.stdin_ended(),
                },
                Woke::Opened(_) | Woke::Read(Ok(0) | Err(_)) => return self.stdin_ended(),
                Woke::Read(Ok(n)) => {
                    buf.truncate(n);
                    return FromClient::Stdin(buf);
                }
                Woke::Asked(FromClient::StdinEof) => self.closing = true,
                Woke::Asked(request) => return request,
            }
        }
    }

    async fn deliver(&mut self, msg: ToClient) -> Result<usize, ClientGone> {
        match msg {
            ToClient::Started { pid, .. } => {
                self.answer_start(Ok(pid));
                Ok(0)
            }
            ToClient::Output(stream, data) => {
                self.write(stream, &data).await;
                Ok(data.len())
            }
            ToClient::Message(line) => {
                self.write(Stream::Stderr, line.as_bytes()).await;
                self.message.push_str(&line);
                Ok(0)
            }
            ToClient::Exited(_) => {
                self.closed = true;
                let why = std::mem::take(&mut self.message);
                self.answer_start(Err(if why.is_empty() {
                    "the process exited before it started".into()
                } else {
                    why
                }));
                self.pending.push_back(FromClient::Closed);
                Ok(0)
            }
            ToClient::Failed(failure) => {
                self.closed = true;
                self.answer_start(Err(failure.to_string()));
                Ok(0)
            }
        }
    }
}

impl FifoClient {
    fn stdin_ended(&mut self) -> FromClient {
        self.stdin = Input::Closed;
        FromClient::StdinEof
    }
}

/// Lets an open of stdin that waits for a writer go, by opening the FIFO's write end (without blocking: the
/// waiting open is its reader; tried again until the open has begun), and takes the opened file.
async fn release(
    handle: &mut JoinHandle<std::io::Result<std::fs::File>>,
    path: &std::path::Path,
) -> Result<std::io::Result<std::fs::File>, tokio::task::JoinError> {
    loop {
        let _ = pipe::OpenOptions::new().open_sender(path);
        if let Ok(opened) = tokio::time::timeout(RELEASE_RETRY, &mut *handle).await {
            return opened;
        }
    }
}

impl Drop for FifoClient {
    fn drop(&mut self) {
        // A stdin whose writer never came: its blocked open is let go in the background.
        if let Input::Opening(mut handle, path) = std::mem::replace(&mut self.stdin, Input::Closed) {
            tokio::spawn(async move {
                let _ = release(&mut handle, &path).await;
            });
        }
    }
}

/// What woke [`FifoClient::next`].
enum Woke {
    Opened(Result<std::io::Result<std::fs::File>, tokio::task::JoinError>),
    Read(std::io::Result<usize>),
    Asked(FromClient),
}

impl std::fmt::Debug for FifoClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FifoClient")
            .field("stdout", &self.stdout.is_some())
            .field("stderr", &self.stderr.is_some())
            .field("pending", &self.pending)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
