//! `vm-driver exec [-i] [-t] SANDBOX -- CMD`, `vm-driver exec --attach PID SANDBOX`, and `vm-driver cp`
//! (one file operation on the same stream).
//!
//! With `-i` this process's stdin is streamed (EOF included); without it the process gets an empty stdin.
//! With `-t` the process runs on a pseudo-terminal: when our stdin is a terminal it is put in raw mode (so
//! Ctrl-C travels as a byte and the guest's terminal turns it into SIGINT) and window size changes are
//! forwarded. Without `-t`, Ctrl-C is forwarded as SIGINT.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Result};
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use vm_contract::ids::SandboxId;
use vm_protocol::driver_api::{
    exec_request, exec_response, ExecAttach, ExecRequest, ExecStart, FilesStart, StdinEof, TarRefused,
};

use crate::cli::SocketArgs;
use crate::copy::{Input, Output, OutputError};
use crate::terminal::{local_size, RawMode};

#[derive(Debug, Args)]
/// `vm-driver exec`'s arguments.
pub struct ExecArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// Stream this stdin to the process (EOF included).
    #[arg(short, long)]
    pub interactive: bool,
    /// Run on a pseudo-terminal.
    #[arg(short, long)]
    pub tty: bool,
    /// Environment for the process (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = crate::launch::parse_env)]
    pub env: Vec<(String, String)>,
    /// Working directory in the guest.
    #[arg(long, short = 'w', value_name = "DIR")]
    pub workdir: Option<String>,
    /// Attach to this running process (a pid from `vm-driver ps`) instead of starting one.
    #[arg(long, value_name = "PID", conflicts_with = "cmd")]
    pub attach: Option<u32>,
    /// The sandbox.
    pub id: SandboxId,
    /// The command and its arguments.
    #[arg(last = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// What to run or attach to.
#[derive(Debug, Clone)]
pub enum Target {
    /// A new process.
    Start {
        /// argv.
        argv: Vec<String>,
        /// Extra environment.
        env: Vec<(String, String)>,
        /// Working directory.
        cwd: Option<String>,
    },
    /// A running process to re-attach to, by its guest pid.
    Reattach(u32),
    /// One file operation (`vm-driver cp`).
    Files(vm_protocol::driver_api::files_start::Op),
}

fn request(r: exec_request::Request) -> ExecRequest {
    ExecRequest { request: Some(r) }
}

/// A refusal of the extractor's goes to the sandbox (for its finding) before the copy fails with it.
/// The stream's end is awaited (within [`REFUSAL_DELIVERY`]), so the refusal is delivered before this process
/// exits.
async fn refused(
    tx: mpsc::Sender<ExecRequest>,
    e: OutputError,
    responses: &mut tonic::Streaming<vm_protocol::driver_api::ExecResponse>,
) -> anyhow::Error {
    match e {
        OutputError::Refused(reason, why) => {
            let refusal = TarRefused { reason: reason.name().to_owned() };
            if tx.send(request(exec_request::Request::TarRefused(refusal))).await.is_ok() {
                // The request stream's end too: the service waits for it after the copy's exit.
                drop(tx);
                let ended = async { while let Some(Ok(_)) = responses.next().await {} };
                let _ = tokio::time::timeout(REFUSAL_DELIVERY, ended).await;
            }
            why
        }
        OutputError::Failed(why) => why,
    }
}

/// How long a refusal waits for the sandbox to end the copy it refused.
const REFUSAL_DELIVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs the exec; returns the exit status to exit with.
///
/// # Errors
/// The service refused or the stream broke before an exit status.
pub async fn exec(
    socket: &Path,
    sandbox: &str,
    target: Target,
    input: Option<Input>,
    tty: bool,
    output: Output,
) -> Result<u8> {
    let mut output = output;
    let mut client = crate::client::connect(socket).await?;
    let (tx, rx) = mpsc::channel::<ExecRequest>(16);
    let starting = !matches!(target, Target::Reattach(_));
    // Re-attaching may find a terminal; the service drops a resize for a process without one.
    let resizable = tty || !starting;
    let opening = match target {
        Target::Start { argv, env, cwd } => exec_request::Request::Start(ExecStart {
            sandbox_id: sandbox.to_owned(),
            argv,
            env: env.into_iter().collect(),
            cwd: cwd.unwrap_or_default(),
            tty,
            size: if tty { local_size() } else { None },
        }),
        Target::Reattach(pid) => {
            exec_request::Request::Attach(ExecAttach { sandbox_id: sandbox.to_owned(), process_id: pid })
        }
        Target::Files(op) => exec_request::Request::Files(FilesStart { sandbox_id: sandbox.to_owned(), op: Some(op) }),
    };
    tx.send(request(opening)).await?;
    let _raw = if tty && local_size().is_some() { RawMode::enter() } else { None };
    if let Some(mut chunks) = input {
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(bytes) = chunks.recv().await {
                if tx.send(request(exec_request::Request::Stdin(bytes))).await.is_err() {
                    return;
                }
            }
            let _ = tx.send(request(exec_request::Request::StdinEof(StdinEof {}))).await;
        });
    } else if starting {
        tx.send(request(exec_request::Request::StdinEof(StdinEof {}))).await?;
    }
    // Re-attaching without -i leaves the process's stdin as it was, for a later client.
    let mut winch = signal(SignalKind::window_change())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut responses = client.exec(ReceiverStream::new(rx)).await?.into_inner();
    let mut stderr = std::io::stderr();
    loop {
        tokio::select! {
            next = responses.next() => match next {
                Some(Ok(r)) => match r.response {
                    Some(exec_response::Response::Stdout(b)) => {
                        if let Err(e) = output.write(&b).await {
                            return Err(refused(tx, e, &mut responses).await);
                        }
                    }
                    Some(exec_response::Response::Stderr(b)) => {
                        stderr.write_all(&b)?;
                        stderr.flush()?;
                    }
                    Some(exec_response::Response::Exited(e)) => {
                        if let Err(e) = output.finish(e.status == 0).await {
                            return Err(refused(tx, e, &mut responses).await);
                        }
                        return Ok(u8::try_from(e.status.rem_euclid(256)).unwrap_or(u8::MAX));
                    }
                    Some(exec_response::Response::Started(_)) | None => {}
                },
                Some(Err(status)) => bail!("{}", status.message()),
                None => bail!("the stream ended before the process exited"),
            },
            () = output.ended_early() => {
                if let Err(e) = output.write(&[]).await {
                    return Err(refused(tx, e, &mut responses).await);
                }
            }
            _ = winch.recv(), if resizable => {
                if let Some(size) = local_size() {
                    let _ = tx.send(request(exec_request::Request::Resize(size))).await;
                }
            }
            _ = interrupt.recv() => {
                let _ = tx.send(request(exec_request::Request::Signal("INT".into()))).await;
            }
        }
    }
}
