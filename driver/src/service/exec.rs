//! `Exec`: one gRPC stream per process, relayed over the sandbox's one shared attach connection.
//!
//! Every stream into a sandbox is a process on the same connection ([`crate::attach_mux`]): no connect or
//! handshake per stream, and a stream whose client does not read holds only its own process's queue (bounded
//! by its output window), never the connection. Output is credited back to the sandbox only once the gRPC
//! transport has taken it from the stream's bounded queue ([`ExecStream`] counts it), so a slow client slows
//! the process, and the supervisor keeps whatever was not taken. Stdin is sent within the guest's credit.
//! When the client goes away the stream lets go of its process (`Detach`) and the process keeps running,
//! detached; `ExecAttach` with its pid picks it up again, with everything the transport never took replayed
//! first. (What the transport took and the client never read, at most its send buffer, is beyond what the
//! driver can see.) When the connection breaks, every stream on it ends with `unavailable`; the next `Exec`
//! connects again.

use std::sync::Arc;

use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::Stream as FuturesStream;
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};
use vm_contract::ids::SandboxId;
use vm_protocol::attach::SupervisorRequest;
use vm_protocol::driver_api::{
    exec_request, exec_response, files_start, ExecExited, ExecRequest, ExecResponse, ExecStarted,
};
use vm_protocol::files::{FileOp, FileSpawn, TarLayout, TarRefusal};
use vm_protocol::flow::MAX_WINDOW_BYTES;
use vm_protocol::message::{EnvVar, Refusal};
use vm_protocol::{Capabilities, ExitStatus, ProcId, ProcessEvent, ProcessRequest, PtySize, SignalName, Spawn, Stream};

use super::hub::Hub;
use crate::attach_mux::{Conn, Lost, Process};
use crate::relay::ProcessRelay;

/// Responses queued towards a client before output stops being credited.
const RESPONSE_QUEUE: usize = 16;
/// The output window of a process started through `Exec`: what the driver may hold for one stream whose
/// client does not read (a gateway holds thousands). Smaller than `launch`'s, which has one.
const EXEC_OUTPUT_WINDOW: u32 = 256 * 1024;

/// The response stream of one Exec. It counts the output bytes the transport takes from it: as far as the
/// driver can see a delivery, and what it credits the sandbox for.
#[derive(Debug)]
pub struct ExecStream {
    rx: mpsc::Receiver<Queued>,
    taken: watch::Sender<u64>,
}

/// A response, and the output bytes in it.
#[derive(Debug)]
struct Queued(Result<ExecResponse, Status>, usize);

impl FuturesStream for ExecStream {
    type Item = Result<ExecResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Queued(response, bytes))) => {
                if bytes > 0 {
                    self.taken.send_modify(|t| *t += bytes as u64);
                }
                Poll::Ready(Some(response))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// What the first message asks for.
enum Opening {
    /// A new process, with the request's own environment (applied over the sandbox's).
    Start(Spawn, std::collections::HashMap<String, String>),
    /// A detached process, by guest pid.
    Reattach(u32),
    /// A file operation.
    Files(FileOp),
}

/// Starts an Exec from its first message.
///
/// # Errors
/// A status for a malformed opening, an unknown or unready sandbox, or an unreachable supervisor.
pub async fn exec(reg: Arc<Hub>, mut inbound: Streaming<ExecRequest>) -> Result<ExecStream, Status> {
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
                output_window: EXEC_OUTPUT_WINDOW,
            };
            (start.sandbox_id, Opening::Start(spawn, start.env), false)
        }
        Some(exec_request::Request::Attach(a)) => (a.sandbox_id, Opening::Reattach(a.process_id), true),
        Some(exec_request::Request::Files(f)) => {
            let op = file_op(f.op).ok_or_else(|| Status::invalid_argument("files names no operation"))?;
            op.validate().map_err(|e| Status::invalid_argument(e.to_string()))?;
            (f.sandbox_id, Opening::Files(op), false)
        }
        _ => return Err(Status::invalid_argument("the first Exec message must be start or attach")),
    };
    let id = SandboxId::parse(&sandbox).map_err(|e| Status::invalid_argument(e.to_string()))?;
    let view = reg.serving(&id)?;
    // Held by the relay until the stream ends.
    let permit = reg.exec_streams.acquire(&id).map_err(|why| Status::resource_exhausted(why.to_string()))?;
    let layout = reg.ctx.state.layout(&id);
    let unreachable = |_| Status::unavailable("the sandbox's supervisor is not reachable");
    let mut conn = reg.attach.get(&layout).await.map_err(unreachable)?;
    let opening = match opening {
        Opening::Reattach(pid) => Opened::Reattach(pid),
        Opening::Files(_) if !conn.capabilities().contains(Capabilities::FILES) => {
            return Err(Status::failed_precondition("the sandbox's agent offers no files API"));
        }
        Opening::Files(op) => Opened::Files(op),
        Opening::Start(mut spawn, extra_env) => {
            if spawn.pty.is_some() && !conn.capabilities().contains(Capabilities::PTY) {
                return Err(Status::failed_precondition("the sandbox's agent offers no terminals"));
            }
            let spec_env = view.spec.env;
            spawn.env = spec_env.into_iter().chain(extra_env).map(|(key, value)| EnvVar { key, value }).collect();
            Opened::Spawn(spawn)
        }
    };
    // A connection that broke since it was last used is found out here: one new one is tried.
    let process = match opening.open(&conn).await {
        Ok(process) => process,
        Err(_) => {
            conn = reg.attach.get(&layout).await.map_err(unreachable)?;
            opening.open(&conn).await.map_err(|_| Status::unavailable("the sandbox's supervisor is not reachable"))?
        }
    };
    let copy_out = match &opening {
        Opened::Files(FileOp::CopyOut { path }) => Some(path.clone()),
        _ => None,
    };
    let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
    let (taken, taken_rx) = watch::channel(0);
    tokio::spawn(async move {
        let mut process = process;
        let out = Responses { tx, taken: taken_rx, accounted: 0, queued: 0 };
        let ended = relay(&mut process, inbound, out, reattach, copy_out.as_deref()).await;
        process.release(ended == Ended::Detach).await;
        drop(permit);
    });
    Ok(ExecStream { rx, taken })
}

/// The first message of a process on the connection, before it has an id there.
enum Opened {
    Spawn(Spawn),
    Reattach(u32),
    Files(FileOp),
}

impl Opened {
    async fn open(&self, conn: &Conn) -> Result<Process, Lost> {
        match self {
            Self::Spawn(spawn) => {
                conn.open(spawn.output_window, |id| ProcessRequest::Spawn(Spawn { id, ..spawn.clone() }).into()).await
            }
            // A re-attached process keeps the window it was started with, which the supervisor enforces; the
            // driver's queue for it is bounded by the largest window any process may have.
            Self::Reattach(pid) => {
                conn.open(MAX_WINDOW_BYTES, |id| SupervisorRequest::Reattach { id, pid: *pid }.into()).await
            }
            Self::Files(op) => {
                let output_window = EXEC_OUTPUT_WINDOW;
                conn.open(output_window, |id| {
                    ProcessRequest::Files(FileSpawn { id, op: op.clone(), output_window }).into()
                })
                .await
            }
        }
    }
}

/// How a stream ended, for its process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Its exit, and every byte of its output, were delivered: the supervisor already forgot it.
    Delivered,
    /// The process keeps running (or keeps its undelivered output) without the stream.
    Detach,
    /// The connection is gone; so is the supervisor's state for it.
    Lost,
}

fn response(r: exec_response::Response) -> Result<ExecResponse, Status> {
    Ok(ExecResponse { response: Some(r) })
}

/// The relay's side of the response stream.
struct Responses {
    tx: mpsc::Sender<Queued>,
    /// Output bytes the transport took.
    taken: watch::Receiver<u64>,
    /// Of those, the bytes already handed to the relay's credit.
    accounted: u64,
    /// Output bytes queued in all.
    queued: u64,
}

impl Responses {
    async fn send(&mut self, response: Result<ExecResponse, Status>, bytes: usize) -> bool {
        self.queued += bytes as u64;
        self.tx.send(Queued(response, bytes)).await.is_ok()
    }

    /// Output the transport took since the last call.
    fn newly_taken(&mut self) -> usize {
        let taken = *self.taken.borrow_and_update();
        let fresh = taken - self.accounted;
        self.accounted = taken;
        usize::try_from(fresh).unwrap_or(usize::MAX)
    }
}

async fn relay(
    process: &mut Process,
    mut inbound: Streaming<ExecRequest>,
    mut out: Responses,
    reattached: bool,
    copy_out: Option<&str>,
) -> Ended {
    let mut relay = ProcessRelay::new(process.id());
    let mut inbound_open = true;
    loop {
        tokio::select! {
            frame = process.recv() => {
                let msg = match frame {
                    Ok(msg) => msg,
                    Err(lost) => {
                        let _ = out.send(Err(lost_status(lost)), 0).await;
                        return if lost == Lost::Overflow { Ended::Detach } else { Ended::Lost };
                    }
                };
                match from_sandbox(&mut relay, msg, reattached) {
                    Reply::Send(response, bytes) => {
                        if !out.send(response, bytes).await {
                            break;
                        }
                    }
                    Reply::End(responses) => {
                        for response in responses {
                            let _ = out.send(response, 0).await;
                        }
                        // The client's verdict on a copy's tar comes after everything was sent, and before
                        // the last credit, so the operation is still known when a refusal arrives.
                        if let (Some(path), true) = (copy_out, inbound_open) {
                            verdict(process, &mut relay, &mut inbound, path).await;
                        }
                        return finish(process, &mut relay, &mut out).await;
                    }
                    Reply::Nothing => {}
                }
            }
            Ok(()) = out.taken.changed() => {
                if let Some(credit) = relay.output_handed_on(out.newly_taken()) {
                    if process.send(credit).await.is_err() {
                        return Ended::Lost;
                    }
                }
            }
            // A copy_out takes no stdin, but its client may refuse the tar at any time.
            request = inbound.message(), if inbound_open && (relay.wants_stdin() || copy_out.is_some()) => match request {
                Ok(Some(ExecRequest { request: Some(r) })) => {
                    if let Err(status) = from_client(process, &mut relay, r, copy_out).await {
                        let _ = out.send(Err(status), 0).await;
                        return Ended::Detach;
                    }
                }
                Ok(Some(ExecRequest { request: None })) => {}
                // The client closed its side (or is gone; then the next send fails): stdin is done.
                Ok(None) | Err(_) => inbound_open = false,
            },
            () = out.tx.closed() => break,
        }
        while let Some(msg) = relay.next_stdin() {
            if process.send(msg).await.is_err() {
                return Ended::Lost;
            }
        }
    }
    // The client is gone: credit what the transport took; the sandbox keeps the rest for a re-attach.
    let _ = relay.output_handed_on(out.newly_taken());
    if let Some(credit) = relay.finish() {
        let _ = process.send(credit).await;
    }
    Ended::Detach
}

/// How long a `copy_out`'s client may take, after the exit, to say whether its extractor took the tar.
const VERDICT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// After a `copy_out` ended: the client's extractor still holds the tail of the tar, and may refuse it. Its
/// `tar_refused` (or its closing the stream) is awaited, within [`VERDICT_TIMEOUT`].
async fn verdict(process: &Process, relay: &mut ProcessRelay, inbound: &mut Streaming<ExecRequest>, path: &str) {
    let wait = async {
        while let Ok(Some(ExecRequest { request: Some(r) })) = inbound.message().await {
            if let exec_request::Request::TarRefused(_) = r {
                let _ = from_client(process, relay, r, Some(path)).await;
                return;
            }
        }
    };
    let _ = tokio::time::timeout(VERDICT_TIMEOUT, wait).await;
}

/// The client's status for a stream that ended under its process.
fn lost_status(lost: Lost) -> Status {
    match lost {
        Lost::Connection => Status::unavailable("the sandbox stopped before the process exited"),
        Lost::Overflow => Status::resource_exhausted(
            "the process's output came in more pieces than the stream may queue while its client does not read; \
             it keeps running, detached (ExecAttach with its pid replays what was not delivered)",
        ),
    }
}

/// After the last response: waits until the transport took everything (or the client is gone), then credits
/// it, so the supervisor knows the output was delivered and forgets the process.
async fn finish(process: &Process, relay: &mut ProcessRelay, out: &mut Responses) -> Ended {
    let mut ended = Ended::Delivered;
    while out.accounted < out.queued {
        tokio::select! {
            Ok(()) = out.taken.changed() => {
                let _ = relay.output_handed_on(out.newly_taken());
            }
            () = out.tx.closed() => {
                // Not all delivered: the supervisor keeps the rest, detached, for a re-attach.
                ended = Ended::Detach;
                break;
            }
        }
    }
    let _ = relay.output_handed_on(out.newly_taken());
    if let Some(credit) = relay.finish() {
        let _ = process.send(credit).await;
    }
    ended
}

/// What a message from the sandbox means for the stream.
enum Reply {
    /// A response for the client, and the output bytes in it.
    Send(Result<ExecResponse, Status>, usize),
    /// The last responses.
    End(Vec<Result<ExecResponse, Status>>),
    Nothing,
}

fn from_sandbox(relay: &mut ProcessRelay, msg: ProcessEvent, reattached: bool) -> Reply {
    match msg {
        ProcessEvent::Started { pid, stdin_window, output_window, .. } => {
            relay.started(stdin_window, output_window);
            Reply::Send(response(exec_response::Response::Started(ExecStarted { process_id: pid, reattached })), 0)
        }
        ProcessEvent::Output { stream, data, .. } => {
            let bytes = data.len();
            let r = match stream {
                Stream::Stdout => exec_response::Response::Stdout(data.into_vec()),
                Stream::Stderr => exec_response::Response::Stderr(data.into_vec()),
            };
            Reply::Send(response(r), bytes)
        }
        ProcessEvent::StdinCredit { bytes, .. } => match relay.stdin_credit(bytes) {
            Ok(()) => Reply::Nothing,
            Err(_) => Reply::End(vec![Err(Status::internal("the sandbox broke the stdin credit rules"))]),
        },
        ProcessEvent::Exited { status, .. } => {
            Reply::End(vec![response(exec_response::Response::Exited(exited(status)))])
        }
        // As a shell shows it: the message on stderr, then the status.
        ProcessEvent::SpawnFailed { status, message, .. } => Reply::End(vec![
            response(exec_response::Response::Stderr(format!("{message}\n").into_bytes())),
            response(exec_response::Response::Exited(exited(status))),
        ]),
        ProcessEvent::Refused { reason, .. } => Reply::End(vec![Err(refusal(reason))]),
    }
}

async fn from_client(
    process: &Process,
    relay: &mut ProcessRelay,
    r: exec_request::Request,
    copy_out: Option<&str>,
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
            process.send(ProcessRequest::Resize { id, size }).await
        }
        exec_request::Request::Signal(name) => {
            let signal = SignalName::parse(&name)
                .ok_or_else(|| Status::invalid_argument("unknown signal name (see GetCapabilities.signals)"))?;
            process.send(ProcessRequest::Signal { id, signal }).await
        }
        exec_request::Request::TarRefused(refused) => {
            let path =
                copy_out.ok_or_else(|| Status::invalid_argument("tar_refused on a stream that is no copy_out"))?;
            let reason = TarRefusal::parse(&refused.reason)
                .ok_or_else(|| Status::invalid_argument("unknown tar refusal (see TarRefused.reason)"))?;
            process.send(SupervisorRequest::TarRefused { id, path: path.to_owned(), reason }).await
        }
        exec_request::Request::Start(_) | exec_request::Request::Attach(_) | exec_request::Request::Files(_) => {
            return Err(Status::invalid_argument("start, attach and files only open a stream"));
        }
    };
    sent.map_err(|_| Status::unavailable("the sandbox's supervisor is not reachable"))
}

fn exited(status: ExitStatus) -> ExecExited {
    let (code, signal) = match status {
        ExitStatus::Code(c) => (c, 0),
        ExitStatus::Signaled(s) => (-1, s),
    };
    ExecExited { code, signal, status: status.shell_code() }
}

/// A refusal from the guest, as a status a client can act on.
fn refusal(reason: Refusal) -> Status {
    match reason {
        Refusal::NoSuchProcess => Status::not_found("no detached process with that pid in the sandbox"),
        Refusal::Denied => Status::permission_denied("denied by the sandbox policy (see its policy_denied finding)"),
        Refusal::ShuttingDown => Status::unavailable("the sandbox is stopping"),
        Refusal::TooManyProcesses => Status::resource_exhausted("too many processes in the sandbox"),
        Refusal::IdNotIncreasing | Refusal::Invalid => Status::invalid_argument("the sandbox refused the request"),
    }
}

/// The protocol's file operation for the API's.
fn file_op(op: Option<files_start::Op>) -> Option<FileOp> {
    use files_start::Op;
    Some(match op? {
        Op::Read(p) => FileOp::Read { path: p.path },
        Op::Write(w) => FileOp::Write { path: w.path, mode: w.mode },
        Op::List(p) => FileOp::List { path: p.path },
        Op::Stat(p) => FileOp::Stat { path: p.path },
        Op::MakeDir(m) => FileOp::MakeDir { path: m.path, parents: m.parents },
        Op::Remove(r) => FileOp::Remove { path: r.path, recursive: r.recursive },
        Op::Rename(r) => FileOp::Rename { from: r.from, to: r.to },
        Op::CopyIn(c) => {
            FileOp::CopyIn { path: c.path, layout: if c.into { TarLayout::Into } else { TarLayout::Named } }
        }
        Op::CopyOut(p) => FileOp::CopyOut { path: p.path },
    })
}
