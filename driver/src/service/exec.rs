//! `Exec`: one gRPC stream per process, relayed to the sandbox's attach socket.
//!
//! Output is credited back to the guest only once it is in the stream's bounded queue, so a slow client
//! slows the process. Stdin is sent within the guest's credit. When the client goes away the attach
//! connection closes and the process keeps running, detached; `ExecAttach` with its pid picks it up again,
//! with the output held meanwhile replayed first.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use vm_contract::ids::SandboxId;
use vm_protocol::driver_api::{
    exec_request, exec_response, ExecExited, ExecRequest, ExecResponse, ExecStarted, SandboxState,
};
use vm_protocol::message::{EnvVar, Refusal};
use vm_protocol::{Capabilities, ExitStatus, ProcId, PtySize, SignalName, Spawn, Stream, ToGuest, ToHost};

use super::registry::Registry;
use crate::attach_client::{self, Attached};
use crate::relay::{ProcessRelay, OUTPUT_WINDOW};

/// Responses queued towards a client before output stops being credited.
const RESPONSE_QUEUE: usize = 16;

/// The response stream of one Exec.
pub type ExecStream = ReceiverStream<Result<ExecResponse, Status>>;

/// What the first message asks for.
enum Opening {
    /// A new process, with the request's own environment (applied over the sandbox's).
    Start(Spawn, std::collections::HashMap<String, String>),
    /// A detached process, by guest pid.
    Reattach(u32),
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
                output_window: OUTPUT_WINDOW,
            };
            (start.sandbox_id, Opening::Start(spawn, start.env), false)
        }
        Some(exec_request::Request::Attach(a)) => (a.sandbox_id, Opening::Reattach(a.process_id), true),
        _ => return Err(Status::invalid_argument("the first Exec message must be start or attach")),
    };
    let id = SandboxId::parse(&sandbox).map_err(|e| Status::invalid_argument(e.to_string()))?;
    let view = reg.get(&id).ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
    if view.state != i32::from(SandboxState::Ready) {
        return Err(Status::failed_precondition(format!("sandbox {id} is not ready")));
    }
    let mut attached = attach_client::connect(&reg.ctx.state.layout(&id))
        .await
        .map_err(|_| Status::unavailable("the sandbox's supervisor is not reachable"))?;
    let opening = match opening {
        Opening::Reattach(pid) => ToGuest::Reattach { id: ProcId(1), pid },
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

async fn relay(
    mut attached: Attached,
    mut inbound: Streaming<ExecRequest>,
    tx: mpsc::Sender<Result<ExecResponse, Status>>,
    reattached: bool,
) {
    let mut relay = ProcessRelay::new(ProcId(1));
    let mut inbound_open = true;
    loop {
        tokio::select! {
            frame = attached.recv() => {
                let Some(Ok(msg)) = frame else {
                    let _ = tx.send(Err(Status::unavailable("the sandbox stopped before the process exited"))).await;
                    return;
                };
                match from_sandbox(&mut relay, msg, reattached) {
                    Reply::Send(response, credit) => {
                        if tx.send(response).await.is_err() {
                            return;
                        }
                        if let Some(credit) = credit {
                            if attached.send(credit).await.is_err() {
                                return;
                            }
                        }
                    }
                    Reply::End(response) => {
                        let _ = tx.send(response).await;
                        return;
                    }
                    Reply::Nothing => {}
                }
            }
            request = inbound.message(), if inbound_open && relay.wants_stdin() => match request {
                Ok(Some(ExecRequest { request: Some(r) })) => {
                    if let Err(status) = from_client(&mut attached, &mut relay, r).await {
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
        while let Some(msg) = relay.next_stdin() {
            if attached.send(msg).await.is_err() {
                return;
            }
        }
    }
}

/// What a message from the sandbox means for the stream.
enum Reply {
    /// A response for the client, and the output credit to return once it is queued.
    Send(Result<ExecResponse, Status>, Option<ToGuest>),
    /// The last response.
    End(Result<ExecResponse, Status>),
    Nothing,
}

fn from_sandbox(relay: &mut ProcessRelay, msg: ToHost, reattached: bool) -> Reply {
    match msg {
        ToHost::Started { pid, stdin_window, .. } => {
            relay.started(stdin_window);
            Reply::Send(response(exec_response::Response::Started(ExecStarted { process_id: pid, reattached })), None)
        }
        ToHost::Output { stream, data, .. } => {
            let credit = relay.output_handed_on(data.len());
            let r = match stream {
                Stream::Stdout => exec_response::Response::Stdout(data.into_vec()),
                Stream::Stderr => exec_response::Response::Stderr(data.into_vec()),
            };
            Reply::Send(response(r), credit)
        }
        ToHost::StdinCredit { bytes, .. } => match relay.stdin_credit(bytes) {
            Ok(()) => Reply::Nothing,
            Err(_) => Reply::End(Err(Status::internal("the sandbox broke the stdin credit rules"))),
        },
        ToHost::Exited { status, .. } => {
            let (code, signal) = match status {
                ExitStatus::Code(c) => (c, 0),
                ExitStatus::Signaled(s) => (-1, s),
            };
            Reply::End(response(exec_response::Response::Exited(ExecExited {
                code,
                signal,
                status: status.shell_code(),
            })))
        }
        ToHost::Refused { reason, .. } => Reply::End(Err(refusal(reason))),
        ToHost::Pong { .. } | ToHost::Processes { .. } | ToHost::Hello(_) | ToHost::Reserved => Reply::Nothing,
    }
}

async fn from_client(
    attached: &mut Attached,
    relay: &mut ProcessRelay,
    r: exec_request::Request,
) -> Result<(), Status> {
    let id = relay.id();
    let sent = match r {
        exec_request::Request::Stdin(bytes) => {
            return relay.push_stdin(&bytes).map_err(|e| Status::invalid_argument(e.to_string()));
        }
        exec_request::Request::StdinEof(_) => {
            relay.stdin_eof();
            return Ok(());
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

/// A refusal from the guest, as a status a client can act on.
fn refusal(reason: Refusal) -> Status {
    match reason {
        Refusal::NoSuchProcess => Status::not_found("no detached process with that pid in the sandbox"),
        Refusal::ShuttingDown => Status::unavailable("the sandbox is stopping"),
        Refusal::TooManyProcesses => Status::resource_exhausted("too many processes in the sandbox"),
        Refusal::IdNotIncreasing | Refusal::Invalid => Status::invalid_argument("the sandbox refused the request"),
    }
}
