//! One SSH session channel as a boundary process: `pty-req` and `env` set it up, `exec` or `shell` starts
//! it (through the policy gate, as any client's spawn), then `data`, `eof`, `window-change` and `signal` reach
//! it, and its output, stderr as extended data, comes back under both flow controls (the SSH window, then
//! our credit). It always ends with `exit-status` (the code, or 128 + the signal), which the gateway's exec
//! waits for.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use russh::server::Msg;
use russh::{Channel, ChannelMsg, ChannelReadHalf, ChannelWriteHalf};
use tokio::sync::{mpsc, Semaphore};
use vm_protocol::attach::ToSupervisor;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::message::{EnvVar, Refusal};
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, PtySize, Spawn, Stream};

use super::signal_name;
use crate::gateway::attach::{Attach, Event};

/// A process's output window (our credit): small, since the SSH window in front of it holds data too.
pub const OUTPUT_WINDOW_BYTES: u32 = 256 * 1024;
/// How long a channel may take to say what to run.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Most `env` requests a channel may make (more are answered but not applied).
pub const MAX_ENV: usize = 64;
/// Longest `env` value.
pub const MAX_ENV_VALUE_BYTES: usize = 4096;
/// Longest `exec` command.
pub const MAX_COMMAND_BYTES: usize = 256 * 1024;
/// The shell `exec` and `shell` run.
const SHELL: &str = "/bin/sh";

/// What a channel asked to run.
#[derive(Debug)]
pub enum Request {
    /// `exec`: a command line for the shell.
    Exec(String),
    /// `shell`: a login shell.
    Shell,
    /// `subsystem openshell-main`: the main process.
    Main,
}

/// What a channel set up before it asked.
#[derive(Debug, Default)]
pub struct Setup {
    /// The terminal, from `pty-req` (and its later size).
    pub pty: Option<(String, PtySize)>,
    /// From `env`, checked.
    pub env: Vec<(String, String)>,
}

/// Reads a channel's setup until it asks for something to run; `None` if it closed or took too long.
pub async fn setup(channel: &mut Channel<Msg>) -> Option<(Setup, Request)> {
    let mut setup = Setup::default();
    let read = async {
        loop {
            match channel.wait().await? {
                ChannelMsg::RequestPty { term, col_width, row_height, .. } => {
                    setup.pty = Some((term, PtySize::from_client(row_height, col_width)));
                }
                ChannelMsg::WindowChange { col_width, row_height, .. } => {
                    if let Some((_, size)) = setup.pty.as_mut() {
                        *size = PtySize::from_client(row_height, col_width);
                    }
                }
                ChannelMsg::SetEnv { variable_name, variable_value, .. }
                    if setup.env.len() < MAX_ENV && env_ok(&variable_name, &variable_value) =>
                {
                    setup.env.push((variable_name, variable_value));
                }
                ChannelMsg::Exec { command, .. } => {
                    if command.len() > MAX_COMMAND_BYTES {
                        return None;
                    }
                    return Some(Request::Exec(String::from_utf8_lossy(&command).into_owned()));
                }
                ChannelMsg::RequestShell { .. } => return Some(Request::Shell),
                ChannelMsg::RequestSubsystem { name, .. } if name == super::MAIN_SUBSYSTEM => {
                    return Some(Request::Main)
                }
                ChannelMsg::Eof | ChannelMsg::Close => return None,
                _ => {}
            }
        }
    };
    let request = tokio::time::timeout(SETUP_TIMEOUT, read).await.ok().flatten()?;
    Some((setup, request))
}

/// A variable a client may set: a plain name that is not one of OpenShell's or the dynamic loader's, with a
/// bounded value.
fn env_ok(name: &str, value: &str) -> bool {
    let plain = !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit();
    plain
        && !name.starts_with("OPENSHELL_")
        && !name.starts_with("LD_")
        && value.len() <= MAX_ENV_VALUE_BYTES
        && !value.contains('\0')
}

/// The spawn of what `request` asks (`Exec` or `Shell`), with the sandbox's environment `base` under the
/// channel's own.
pub fn spawn(id: ProcId, request: &Request, setup: &Setup, base: &[(String, String)]) -> Spawn {
    let argv: Vec<String> = match request {
        Request::Exec(command) => vec![SHELL.into(), "-c".into(), command.clone()],
        _ => vec![SHELL.into(), "-l".into()],
    };
    let term = setup
        .pty
        .as_ref()
        .map(|(term, _)| ("TERM".to_owned(), if term.is_empty() { "xterm".into() } else { term.clone() }));
    let env = base.iter().cloned().chain(term).chain(setup.env.iter().cloned());
    Spawn {
        id,
        argv,
        env: env.map(|(key, value)| EnvVar { key, value }).collect(),
        cwd: None,
        pty: setup.pty.as_ref().map(|(_, size)| *size),
        output_window: OUTPUT_WINDOW_BYTES,
        rlimits: Vec::new(),
        root: None,
    }
}

/// Runs `spawn` for `channel` on `attach` until it ends, then ends the channel.
pub async fn run(channel: Channel<Msg>, attach: Attach, spawn: Spawn, route: mpsc::Receiver<Event>) {
    let id = spawn.id;
    let (read, write) = channel.split();
    if !attach.send(ToSupervisor::Process(ProcessRequest::Spawn(spawn))).await {
        let _ = end(&write, "the sandbox is gone", 255).await;
        return;
    }
    let stdin = Arc::new(Semaphore::new(0));
    let output = tokio::spawn(output(write, attach.clone(), id, route, Arc::clone(&stdin)));
    let input = input(read, &attach, id, &stdin);
    tokio::pin!(output);
    tokio::select! {
        // The process ended (or its route did): the output side ended the channel.
        _ = &mut output => {}
        // The client closed the channel first: the process goes with it.
        () = input => {
            let _ = attach.send(ToSupervisor::Process(ProcessRequest::Signal { id, signal: vm_protocol::SignalName::Kill })).await;
            let _ = output.await;
        }
    }
    attach.forget_process(id);
}

/// The client's side: stdin within the process's credit, its end, resizes and signals. Returns when the
/// client closed the channel (or the connection went).
async fn input(mut read: ChannelReadHalf, attach: &Attach, id: ProcId, stdin: &Semaphore) {
    let mut stdin_open = true;
    while let Some(msg) = read.wait().await {
        match msg {
            ChannelMsg::Data { data } if stdin_open => {
                for chunk in data.chunks(MAX_DATA_BYTES) {
                    let Ok(n) = u32::try_from(chunk.len()) else { return };
                    // Waits for the guest's credit; closed when the process ended.
                    let Ok(permits) = stdin.acquire_many(n).await else { return };
                    permits.forget();
                    let data = serde_bytes::ByteBuf::from(chunk.to_vec());
                    if !attach.send(ToSupervisor::Process(ProcessRequest::Stdin { id, data })).await {
                        return;
                    }
                }
            }
            ChannelMsg::Eof if stdin_open => {
                stdin_open = false;
                let _ = attach.send(ToSupervisor::Process(ProcessRequest::StdinEof { id })).await;
            }
            ChannelMsg::WindowChange { col_width, row_height, .. } => {
                let size = PtySize::from_client(row_height, col_width);
                let _ = attach.send(ToSupervisor::Process(ProcessRequest::Resize { id, size })).await;
            }
            ChannelMsg::Signal { signal } => {
                if let Some(signal) = signal_name(&signal) {
                    let _ = attach.send(ToSupervisor::Process(ProcessRequest::Signal { id, signal })).await;
                }
            }
            ChannelMsg::Close => return,
            _ => {}
        }
    }
}

/// The process's side: output to the channel, credit back, then its status; ends the channel.
async fn output(
    write: ChannelWriteHalf<Msg>,
    attach: Attach,
    id: ProcId,
    mut route: mpsc::Receiver<Event>,
    stdin: Arc<Semaphore>,
) {
    let code = loop {
        let Some(Event::Process(event)) = route.recv().await else {
            // The route went: the connection ended, or the guest flooded this process past its bound.
            break Err("the process's output could not be followed");
        };
        match event {
            ProcessEvent::Started { stdin_window, .. } => grant(&stdin, stdin_window),
            ProcessEvent::StdinCredit { bytes, .. } => grant(&stdin, bytes),
            ProcessEvent::Output { stream, data, .. } => {
                let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
                let data = Bytes::from(data.into_vec());
                let sent = match stream {
                    Stream::Stdout => write.data_bytes(data).await,
                    Stream::Stderr => write.extended_data_bytes(1, data).await,
                };
                if sent.is_err() {
                    break Err("the channel closed");
                }
                let _ = attach.send(ToSupervisor::Process(ProcessRequest::Credit { id, bytes: n })).await;
            }
            ProcessEvent::Exited { status, .. } => break Ok(status),
            ProcessEvent::SpawnFailed { status, message, .. } => {
                let _ = write.extended_data_bytes(1, Bytes::from(format!("{message}\n"))).await;
                break Ok(status);
            }
            ProcessEvent::Refused { reason, .. } => {
                let why = refusal(reason);
                let _ = write.extended_data_bytes(1, Bytes::from(format!("vm-supervisor: {why}\n"))).await;
                break Ok(ExitStatus::Code(if reason == Refusal::Denied { 126 } else { 255 }));
            }
        }
    };
    stdin.close();
    match code {
        Ok(status) => {
            let _ = write.eof().await;
            let _ = write.exit_status(u32::from(status.exit_code())).await;
            let _ = write.close().await;
        }
        Err(why) => {
            let _ = end(&write, why, 255).await;
        }
    }
}

/// Ends a channel with a message on its stderr and `code`.
pub async fn end(write: &ChannelWriteHalf<Msg>, why: &str, code: u32) -> Result<(), russh::Error> {
    write.extended_data_bytes(1, Bytes::from(format!("vm-supervisor: {why}\n"))).await?;
    write.eof().await?;
    write.exit_status(code).await?;
    write.close().await
}

/// Adds the guest's stdin credit, never past the largest window (the boundary holds the guest to its
/// window; this only keeps the count in range whatever arrives).
pub fn grant(stdin: &Semaphore, bytes: u32) {
    let most = usize::try_from(vm_protocol::flow::MAX_WINDOW_BYTES).unwrap_or(usize::MAX);
    let room = most.saturating_sub(stdin.available_permits());
    stdin.add_permits(usize::try_from(bytes).unwrap_or(usize::MAX).min(room));
}

/// A refusal, as the channel's stderr says it (fixed text).
pub fn refusal(reason: Refusal) -> &'static str {
    match reason {
        Refusal::Denied => "denied by the sandbox's policy",
        Refusal::ShuttingDown => "the sandbox is stopping",
        Refusal::TooManyProcesses => "too many processes are running in the sandbox",
        Refusal::Invalid | Refusal::IdNotIncreasing | Refusal::NoSuchProcess => "the request was not valid",
    }
}
