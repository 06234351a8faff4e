//! This terminal as a process's client (`launch`, `exec`, `cp`): stdin from a queue (this process's own, or a
//! tar being made), stdout to this process's stdout or the hardened extractor, stderr here, signals and
//! window size changes as requests. Output is written out before it counts as delivered.

use std::collections::VecDeque;

use anyhow::anyhow;
use tokio::io::AsyncWriteExt;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;
use vm_protocol::{ExitStatus, SignalName, Stream};

use super::output::{Input, Output, OutputError, Verdict};
use super::{terminal, ClientEnd, ClientGone, FromClient, Outcome, ToClient};

/// Signals queued for the process before more are dropped (a person pressing Ctrl-C).
pub const SIGNAL_QUEUE: usize = 8;

/// What the process's stdin is.
#[derive(Debug)]
pub enum Stdin {
    /// These chunks, then EOF.
    Stream(Input),
    /// Nothing: EOF at once.
    Empty,
    /// Left as it is (a re-attach without `-i`: a later client may still write it).
    Untouched,
}

/// One process's client on this terminal.
pub struct LocalClient<'a> {
    stdin: Option<Input>,
    output: Option<Output>,
    /// The extractor's verdict, once it ended early, until it is in.
    verdict: Option<Verdict>,
    stderr: tokio::io::Stderr,
    signals: &'a mut mpsc::Receiver<SignalName>,
    /// Window size changes, for a process on a terminal.
    winch: Option<Signal>,
    /// What to say before reading anything else.
    pending: VecDeque<FromClient>,
    /// The first thing that went wrong here.
    error: Option<anyhow::Error>,
    /// The process ended (or failed): after the pending messages, the client is done.
    closed: bool,
}

impl<'a> LocalClient<'a> {
    /// A client with this stdin and stdout; `resizable`: the process may have a terminal whose size follows
    /// this one's.
    ///
    /// # Errors
    /// SIGWINCH cannot be watched.
    pub fn new(
        stdin: Stdin,
        output: Output,
        signals: &'a mut mpsc::Receiver<SignalName>,
        resizable: bool,
    ) -> anyhow::Result<Self> {
        let winch = if resizable { Some(signal(SignalKind::window_change())?) } else { None };
        let (stdin, pending) = match stdin {
            Stdin::Stream(chunks) => (Some(chunks), VecDeque::new()),
            Stdin::Empty => (None, VecDeque::from([FromClient::StdinEof])),
            Stdin::Untouched => (None, VecDeque::new()),
        };
        Ok(Self {
            stdin,
            output: Some(output),
            verdict: None,
            stderr: tokio::io::stderr(),
            signals,
            winch,
            pending,
            error: None,
            closed: false,
        })
    }

    /// The process's exit status, or why there is none: what went wrong here first (a refused tar, an
    /// unwritable stdout), else `sandbox`'s reason (the end that carried the process may know more), else
    /// the session's.
    ///
    /// # Errors
    /// As above.
    pub fn finish(self, outcome: &Outcome, sandbox: Option<String>) -> anyhow::Result<ExitStatus> {
        if let Some(error) = self.error {
            return Err(error);
        }
        match (outcome.status, sandbox, &outcome.failure) {
            (Some(status), _, _) => Ok(status),
            (None, Some(why), _) => Err(anyhow!(why)),
            (None, None, Some(failure)) => Err(failure.clone().into()),
            (None, None, None) => Err(anyhow!("the process's client went away")),
        }
    }

    fn failed(&mut self, error: OutputError) -> Option<FromClient> {
        let (refusal, error) = match error {
            OutputError::Refused(reason, error) => (Some(FromClient::TarRefused(reason)), error),
            OutputError::Failed(error) => (None, error),
        };
        self.error.get_or_insert(error);
        refusal
    }

    /// Waits for an early verdict still out, and queues the refusal it brings.
    async fn settle_verdict(&mut self) {
        if let Some(verdict) = self.verdict.take() {
            let error = verdict.await;
            let refusal = self.failed(error);
            self.pending.extend(refusal);
        }
    }

    async fn write_stderr(&mut self, data: &[u8]) -> Result<(), ClientGone> {
        let written = async {
            self.stderr.write_all(data).await?;
            self.stderr.flush().await
        };
        if written.await.is_err() {
            self.error.get_or_insert(anyhow!("cannot write stderr"));
            return Err(ClientGone);
        }
        Ok(())
    }
}

impl ClientEnd for LocalClient<'_> {
    async fn next(&mut self, listening: bool) -> FromClient {
        if let Some(msg) = self.pending.pop_front() {
            return msg;
        }
        if self.closed {
            // Said once; from here on only the session's end is awaited.
            return std::future::pending().await;
        }
        loop {
            let Self { stdin, output, signals, winch, verdict, .. } = self;
            let ended_early = async {
                match output {
                    Some(output) => output.ended_early().await,
                    None => std::future::pending().await,
                }
            };
            let verdict = async {
                match verdict {
                    Some(verdict) => verdict.as_mut().await,
                    None => std::future::pending().await,
                }
            };
            let winch = async {
                match winch {
                    Some(winch) => winch.recv().await,
                    None => std::future::pending().await,
                }
            };
            let reading = listening && stdin.is_some();
            let chunk = async {
                match stdin {
                    Some(chunks) => chunks.recv().await,
                    None => std::future::pending().await,
                }
            };
            // Every branch is cancel-safe, and nothing is awaited after one fired: the pump may drop this.
            let woke = tokio::select! {
                chunk = chunk, if reading => Woke::Said(chunk.map_or(FromClient::StdinEof, FromClient::Stdin)),
                Some(signal) = signals.recv() => Woke::Said(FromClient::Signal(signal)),
                Some(()) = winch => Woke::Said(FromClient::Resize(terminal::pty_size())),
                () = ended_early => Woke::EndedEarly,
                error = verdict => Woke::Verdict(error),
            };
            match woke {
                Woke::Said(FromClient::StdinEof) => {
                    self.stdin = None;
                    return FromClient::StdinEof;
                }
                Woke::Said(msg) => return msg,
                // The extractor refused a bad entry: its verdict is awaited next, and the guest told at once.
                Woke::EndedEarly => self.verdict = self.output.as_mut().and_then(Output::verdict),
                Woke::Verdict(error) => {
                    self.verdict = None;
                    return self.failed(error).unwrap_or(FromClient::Gone);
                }
            }
        }
    }

    async fn deliver(&mut self, msg: ToClient) -> Result<usize, ClientGone> {
        match msg {
            ToClient::Started { .. } => Ok(0),
            ToClient::Output(Stream::Stderr, data) => self.write_stderr(&data).await.map(|()| data.len()),
            ToClient::Message(line) => self.write_stderr(line.as_bytes()).await.map(|()| 0),
            ToClient::Output(Stream::Stdout, data) => {
                let Some(output) = self.output.as_mut() else { return Ok(data.len()) };
                match output.write(&data).await {
                    Ok(()) => Ok(data.len()),
                    Err(e) => match self.failed(e) {
                        Some(refusal) => {
                            self.pending.push_back(refusal);
                            Ok(data.len())
                        }
                        None => Err(ClientGone),
                    },
                }
            }
            ToClient::Exited(status) => {
                self.closed = true;
                self.settle_verdict().await;
                // The extractor's verdict while the sandbox still knows the operation (for its finding).
                if let Some(output) = self.output.take() {
                    if let Err(e) = output.finish(status == ExitStatus::Code(0)).await {
                        let refusal = self.failed(e);
                        self.pending.extend(refusal);
                    }
                }
                self.pending.push_back(FromClient::Closed);
                Ok(0)
            }
            ToClient::Failed(_) => {
                self.closed = true;
                Ok(0)
            }
        }
    }
}

/// What woke [`LocalClient::next`].
enum Woke {
    Said(FromClient),
    EndedEarly,
    Verdict(OutputError),
}

impl std::fmt::Debug for LocalClient<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalClient")
            .field("output", &self.output)
            .field("verdict", &self.verdict.is_some())
            .field("pending", &self.pending)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

/// SIGINT, as requests for the process: `vm-driver exec` and `cp` forward each Ctrl-C (`launch` counts them
/// itself).
///
/// # Errors
/// SIGINT cannot be watched.
pub fn interrupts() -> anyhow::Result<mpsc::Receiver<SignalName>> {
    let mut interrupt = signal(SignalKind::interrupt())?;
    let (tx, rx) = mpsc::channel(SIGNAL_QUEUE);
    tokio::spawn(async move {
        while interrupt.recv().await.is_some() {
            if tx.is_closed() {
                return;
            }
            let _ = tx.try_send(SignalName::Int);
        }
    });
    Ok(rx)
}
