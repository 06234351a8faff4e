//! `Exec`: one gRPC stream per process, relayed to the sandbox's attach socket.
//!
//! Output is credited back to the guest only once it is in the stream's bounded queue, so a slow client
//! slows the process. Stdin is sent within the guest's credit. When the client goes away the attach
//! connection closes and the process keeps running, detached; `ExecAttach` with its pid picks it up again,
//! with the output held meanwhile replayed first.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use vm_protocol::driver_api::{
    exec_request, exec_response, ExecExited, ExecRequest, ExecResponse, ExecStarted, SandboxState,
};
use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::message::{EnvVar, Refusal};
use vm_protocol::{Capabilities, ExitStatus, ProcId, PtySize, SandboxId, SignalName, Spawn, Stream, ToGuest, ToHost};

use super::registry::Registry;
use crate::attach::{self, Attached};

/// Responses queued towards a client before output stops being credited.
const RESPONSE_QUEUE: usize = 16;
/// Stdin buffered from the client before the stream stops being read.
const STDIN_BUFFER_BYTES: usize = 2 * MAX_DATA_BYTES;
/// Output credit goes back in batches of this size.
const CREDIT_BATCH_BYTES: u64 = DEFAULT_WINDOW_BYTES as u64 / 4;

/// The response stream of one Exec.
pub type ExecStream = ReceiverStream<Result<ExecResponse, Status>>;

/// What the first message asks for.
enum Opening {
    /// A new process, with the request's own environment (applied over the sandbox's).
    Start(Spawn, std::collections::HashMap<String, String>),
    /// A detached process, by guest pid.
    Attach(u32),
}

/// Starts an Exec from its first message.
///
/// # Errors
/// A status for a malformed opening, an unknown or unready sandbox, or an unreachable supervisor.
pub async fn exec(reg: Arc<Registry>, mut inbound: Streaming<ExecRequest>) -> Result<ExecStream, Status> {
    let first = inbound.message().await?.and_then(|m| m.request);
    let (sandbox, opening, reattach) = match first {
        Some(exec_request::Request::Start(start)) => {
            if start.argv.is_empty() {
                return Err(Status::invalid_argument("argv is empty"));
            }
            let size = start.size.unwrap_or_default();
            let size = PtySize {
                rows: u16::try_from(size.rows).ok().filter(|r| *r > 0).unwrap_or(24),
                cols: u16::try_from(size.cols).ok().filter(|c| *c > 0).unwrap_or(80),
            };
            let spawn = Spawn {
                id: ProcId(1),
                argv: start.argv,
                env: Vec::new(),
                cwd: Some(start.cwd).filter(|c| !c.is_empty()),
                pty: start.tty.then_some(size),
                output_window: DEFAULT_WINDOW_BYTES,
            };
            (start.sandbox_id, Opening::Start(spawn, start.env), false)
        }
        Some(exec_request::Request::Attach(a)) => (a.sandbox_id, Opening::Attach(a.process_id), true),
        _ => return Err(Status::invalid_argument("the first Exec message must be start or attach")),
    };
    let id = SandboxId::parse(&sandbox).map_err(|e| Status::invalid_argument(e.to_string()))?;
    let view = reg.get(&id).ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
    if view.state != i32::from(SandboxState::Ready) {
        return Err(Status::failed_precondition(format!("sandbox {id} is not ready")));
    }
    let dir = reg.ctx.state.sandbox_dir(&id);
    let mut attached = attach::connect(&dir, vm_protocol::status::ATTACH_SOCKET)
        .await
        .map_err(|_| Status::unavailable("the sandbox's supervisor is not reachable"))?;
    let opening = match opening {
        Opening::Attach(pid) => ToGuest::Attach { id: ProcId(1), pid },
        Opening::Start(mut spawn, extra_env) => {
            if spawn.pty.is_some() && !attached.capabilities.contains(Capabilities::PTY) {
                return Err(Status::failed_precondition("the sandbox's agent offers no terminals"));
            }
            let spec_env = view.spec.map(|s| s.env).unwrap_or_default();
            spawn.env = spec_env.into_iter().chain(extra_env).map(|(key, value)| EnvVar { key, value }).collect();
            ToGuest::Spawn(spawn)
        }
    };
    attached.send(opening).await.map_err(|_| Status::unavailable("the sandbox's supervisor is not reachable"))?;
    let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
    tokio::spawn(relay(attached, inbound, tx, reattach));
    Ok(ReceiverStream::new(rx))
}

fn response(r: exec_response::Response) -> Result<ExecResponse, Status> {
    Ok(ExecResponse { response: Some(r) })
}

#[derive(Default)]
struct Stdin {
    pending: VecDeque<u8>,
    credit: u64,
    eof_requested: bool,
    eof_sent: bool,
}

async fn relay(
    mut attached: Attached,
    mut inbound: Streaming<ExecRequest>,
    tx: mpsc::Sender<Result<ExecResponse, Status>>,
    reattached: bool,
) {
    let id = ProcId(1);
    let mut stdin = Stdin::default();
    let mut inbound_open = true;
    let mut uncredited = 0u64;
    loop {
        tokio::select! {
            frame = attached.recv() => {
                let msg = match frame {
                    Some(Ok(msg)) => msg,
                    _ => {
                        let _ = tx.send(Err(Status::unavailable("the sandbox stopped before the process exited"))).await;
                        return;
                    }
                };
                match msg {
                    ToHost::Started { pid, stdin_window, .. } => {
                        stdin.credit = u64::from(stdin_window);
                        let started = ExecStarted { process_id: pid, reattached };
                        if tx.send(response(exec_response::Response::Started(started))).await.is_err() {
                            return;
                        }
                    }
                    ToHost::Output { stream, data, .. } => {
                        let n = data.len() as u64;
                        let r = match stream {
                            Stream::Stdout => exec_response::Response::Stdout(data.into_vec()),
                            Stream::Stderr => exec_response::Response::Stderr(data.into_vec()),
                        };
                        if tx.send(response(r)).await.is_err() {
                            return;
                        }
                        uncredited += n;
                        if uncredited >= CREDIT_BATCH_BYTES {
                            let bytes = u32::try_from(uncredited).unwrap_or(u32::MAX);
                            uncredited -= u64::from(bytes);
                            if attached.send(ToGuest::Credit { id, bytes }).await.is_err() {
                                return;
                            }
                        }
                    }
                    ToHost::StdinCredit { bytes, .. } => stdin.credit += u64::from(bytes),
                    ToHost::Exited { status, .. } => {
                        let (code, signal) = match status {
                            ExitStatus::Code(c) => (c, 0),
                            ExitStatus::Signaled(s) => (-1, s),
                        };
                        let exited = ExecExited { code, signal, status: status.shell_code() };
                        let _ = tx.send(response(exec_response::Response::Exited(exited))).await;
                        return;
                    }
                    ToHost::Refused { reason, .. } => {
                        let _ = tx.send(Err(refusal(reason))).await;
                        return;
                    }
                    ToHost::Pong { .. } | ToHost::Processes { .. } | ToHost::Hello(_) | ToHost::Reserved => {}
                }
            }
            request = inbound.message(), if inbound_open && stdin.pending.len() < STDIN_BUFFER_BYTES => match request {
                Ok(Some(ExecRequest { request: Some(r) })) => {
                    if let Err(status) = client_request(&mut attached, &mut stdin, r).await {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                }
                Ok(Some(ExecRequest { request: None })) => {}
                // The client closed its side (or is gone; then the next send fails): stdin is done.
                Ok(None) | Err(_) => inbound_open = false,
            },
            () = tx.closed() => return,
        }
        if flush_stdin(&mut attached, &mut stdin).await.is_err() {
            return;
        }
    }
}

async fn client_request(attached: &mut Attached, stdin: &mut Stdin, r: exec_request::Request) -> Result<(), Status> {
    let id = ProcId(1);
    let sent = match r {
        exec_request::Request::Stdin(_) if stdin.eof_requested => {
            return Err(Status::invalid_argument("stdin after stdin_eof"));
        }
        exec_request::Request::Stdin(bytes) => {
            stdin.pending.extend(bytes);
            Ok(())
        }
        exec_request::Request::StdinEof(_) => {
            stdin.eof_requested = true;
            Ok(())
        }
        exec_request::Request::Resize(size) => {
            let size = PtySize {
                rows: u16::try_from(size.rows).unwrap_or(u16::MAX),
                cols: u16::try_from(size.cols).unwrap_or(u16::MAX),
            };
            attached.send(ToGuest::Resize { id, size }).await
        }
        exec_request::Request::Signal(name) => {
            let signal = SignalName::parse(&name)
                .ok_or_else(|| Status::invalid_argument("unknown signal name (see GetCapabilities.signals)"))?;
            attached.send(ToGuest::Signal { id, signal }).await
        }
        exec_request::Request::Start(_) | exec_request::Request::Attach(_) => {
            return Err(Status::invalid_argument("start and attach only open a stream"));
        }
    };
    sent.map_err(|_| Status::unavailable("the sandbox's supervisor is not reachable"))
}

async fn flush_stdin(attached: &mut Attached, stdin: &mut Stdin) -> Result<(), attach::AttachError> {
    let id = ProcId(1);
    while !stdin.pending.is_empty() && stdin.credit > 0 {
        let n = stdin.pending.len().min(MAX_DATA_BYTES).min(usize::try_from(stdin.credit).unwrap_or(usize::MAX));
        let chunk: Vec<u8> = stdin.pending.drain(..n).collect();
        stdin.credit -= n as u64;
        attached.send(ToGuest::Stdin { id, data: chunk.into() }).await?;
    }
    if stdin.eof_requested && stdin.pending.is_empty() && !stdin.eof_sent {
        stdin.eof_sent = true;
        attached.send(ToGuest::StdinEof { id }).await?;
    }
    Ok(())
}

/// A refusal from the guest, as a status a client can act on.
fn refusal(reason: Refusal) -> Status {
    match reason {
        Refusal::NoSuchProcess => Status::not_found("no detached process with that pid in the sandbox"),
        Refusal::ShuttingDown => Status::unavailable("the sandbox is stopping"),
        Refusal::TooManyProcesses => Status::resource_exhausted("too many processes in the sandbox"),
        Refusal::IdNotIncreasing | Refusal::Invalid => Status::invalid_argument("the sandbox refused the request"),
    }
}
