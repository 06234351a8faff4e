//! `vm-driver exec [-i] [-t] SANDBOX -- CMD`, `vm-driver exec --attach PID SANDBOX`, and `vm-driver cp`
//! (one file operation on the same stream).
//!
//! With `-i` this process's stdin is streamed (EOF included); without it the process gets an empty stdin.
//! With `-t` the process runs on a pseudo-terminal: when our stdin is a terminal it is put in raw mode (so
//! Ctrl-C travels as a byte and the guest's terminal turns it into SIGINT) and window size changes are
//! forwarded. Without `-t`, Ctrl-C is forwarded as SIGINT.

use std::path::Path;

use anyhow::{anyhow, Result};
use clap::Args;
use vm_contract::ids::SandboxId;
use vm_driver::process::local::{self, LocalClient, Stdin};
use vm_driver::process::output::{Input, Output};
use vm_driver::process::remote::{RemoteProcess, REMOTE_ID};
use vm_driver::process::terminal::{local_size, RawMode};
use vm_driver::process::{self, ProcessSession};
use vm_protocol::driver_api::files_start::Op;
use vm_protocol::driver_api::{exec_request, ExecAttach, ExecStart, FilesStart};

use crate::cli::SocketArgs;

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
    Files(Op),
}

/// Runs the exec through the process session: this terminal is the client, the service's stream the
/// sandbox end. Returns the exit status to exit with.
///
/// # Errors
/// The service refused or the stream broke before an exit status, or the copy's tar was refused.
pub async fn exec(
    socket: &Path,
    sandbox: &str,
    target: Target,
    input: Option<Input>,
    tty: bool,
    output: Output,
) -> Result<u8> {
    let mut client = crate::client::connect(socket).await?;
    let (starting, copy_out) = match &target {
        Target::Reattach(_) => (false, None),
        Target::Files(Op::CopyOut(p)) => (true, Some(p.path.clone())),
        _ => (true, None),
    };
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
    let stdin = match input {
        Some(chunks) => Stdin::Stream(chunks),
        None if starting => Stdin::Empty,
        // Re-attaching without -i leaves the process's stdin as it was, for a later client.
        None => Stdin::Untouched,
    };
    let mut signals = local::interrupts()?;
    // Re-attaching may find a terminal; the service drops a resize for a process without one.
    let mut local = LocalClient::new(stdin, output, &mut signals, tty || !starting)?;
    let mut remote =
        RemoteProcess::open(&mut client, opening).await.map_err(|status| anyhow!("{}", status.message()))?;
    let _raw = if tty && local_size().is_some() { RawMode::enter() } else { None };
    let session = ProcessSession::new(REMOTE_ID, !starting, copy_out);
    let outcome = process::run(session, &mut remote, &mut local).await;
    Ok(local.finish(&outcome, remote.why())?.exit_code())
}
