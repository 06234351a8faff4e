//! `Exec`: one gRPC stream per process, relayed over the sandbox's one shared attach connection by the
//! driver's one process session (`crate::process`): this file opens the process and is the stream's end of it
//! (`GrpcClient`); the session decides every message.
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
use vm_protocol::{Capabilities, ExitStatus, ProcId, ProcessRequest, PtySize, SignalName, Spawn, Stream};

use super::hub::Hub;
use crate::attach_mux::{Conn, Process};
use crate::process::{self, ClientEnd, ClientGone, Ended, Failure, FromClient, Lost, ProcessSession, ToClient};

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
            let size = PtySize::from_client(size.rows, size.cols);
            let spawn = Spawn {
                id: ProcId(1),
                argv: start.argv,
                env: Vec::new(),
                cwd: Some(start.cwd).filter(|c| !c.is_empty()),
                pty: start.tty.then_some(size),
                output_window: EXEC_OUTPUT_WINDOW,
                rlimits: Vec::new(),
                root: None,
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
        let session = ProcessSession::new(process.id(), reattach, copy_out);
        let mut client = GrpcClient { inbound, inbound_open: true, tx, taken: taken_rx, accounted: 0 };
        let outcome = process::run(session, &mut process, &mut client).await;
        process.release(outcome.ended == Ended::Detach).await;
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

/// The gRPC stream as the process's client: its requests come in (read only while the session listens, so
/// a client that floods stdin is held by the transport's flow control), its responses go out through the
/// bounded queue, and what the transport took from that queue is reported as delivered.
struct GrpcClient {
    inbound: Streaming<ExecRequest>,
    inbound_open: bool,
    tx: mpsc::Sender<Queued>,
    /// Output bytes the transport took.
    taken: watch::Receiver<u64>,
    /// Of those, the bytes already reported.
    accounted: u64,
}

impl GrpcClient {
    /// Output the transport took since the last call.
    fn newly_taken(&mut self) -> usize {
        let taken = *self.taken.borrow_and_update();
        let fresh = taken - self.accounted;
        self.accounted = taken;
        usize::try_from(fresh).unwrap_or(usize::MAX)
    }
}

impl ClientEnd for GrpcClient {
    async fn next(&mut self, listening: bool) -> FromClient {
        loop {
            let reading = listening && self.inbound_open;
            tokio::select! {
                Ok(()) = self.taken.changed() => {
                    let fresh = self.newly_taken();
                    if fresh > 0 {
                        return FromClient::Delivered(fresh);
                    }
                }
                () = self.tx.closed() => {
                    // What it took before it went counts as delivered.
                    let fresh = self.newly_taken();
                    return if fresh > 0 { FromClient::Delivered(fresh) } else { FromClient::Gone };
                }
                request = self.inbound.message(), if reading => match request {
                    Ok(Some(ExecRequest { request: Some(r) })) => return from_client(r),
                    Ok(Some(ExecRequest { request: None })) => {}
                    // The client closed its side (or is gone; then the next send fails).
                    Ok(None) | Err(_) => {
                        self.inbound_open = false;
                        return FromClient::Closed;
                    }
                },
            }
        }
    }

    async fn deliver(&mut self, msg: ToClient) -> Result<usize, ClientGone> {
        let (response, bytes) = match msg {
            ToClient::Started { pid, reattached } => {
                (response(exec_response::Response::Started(ExecStarted { process_id: pid, reattached })), 0)
            }
            ToClient::Output(stream, data) => {
                let bytes = data.len();
                let r = match stream {
                    Stream::Stdout => exec_response::Response::Stdout(data),
                    Stream::Stderr => exec_response::Response::Stderr(data),
                };
                (response(r), bytes)
            }
            ToClient::Message(line) => (response(exec_response::Response::Stderr(line.into_bytes())), 0),
            ToClient::Exited(status) => (response(exec_response::Response::Exited(exited(status))), 0),
            ToClient::Failed(failure) => (Err(failure_status(&failure)), 0),
        };
        self.tx.send(Queued(response, bytes)).await.map(|()| 0).map_err(|_| ClientGone)
    }
}

fn response(r: exec_response::Response) -> Result<ExecResponse, Status> {
    Ok(ExecResponse { response: Some(r) })
}

/// A request on an open stream, for the session.
fn from_client(r: exec_request::Request) -> FromClient {
    match r {
        exec_request::Request::Stdin(bytes) => FromClient::Stdin(bytes),
        exec_request::Request::StdinEof(_) => FromClient::StdinEof,
        exec_request::Request::Resize(size) => FromClient::Resize(PtySize::from_client(size.rows, size.cols)),
        exec_request::Request::Signal(name) => match SignalName::parse(&name) {
            Some(signal) => FromClient::Signal(signal),
            None => FromClient::Invalid("unknown signal name (see GetCapabilities.signals)"),
        },
        exec_request::Request::TarRefused(refused) => match TarRefusal::parse(&refused.reason) {
            Some(reason) => FromClient::TarRefused(reason),
            None => FromClient::Invalid("unknown tar refusal (see TarRefused.reason)"),
        },
        exec_request::Request::Start(_) | exec_request::Request::Attach(_) | exec_request::Request::Files(_) => {
            FromClient::Invalid("start, attach and files only open a stream")
        }
    }
}

/// Why a process did not run to its exit, as a status a client can act on.
fn failure_status(failure: &Failure) -> Status {
    match failure {
        Failure::Refused(reason) => refusal(*reason),
        Failure::Lost(Lost::Connection) => Status::unavailable("the sandbox stopped before the process exited"),
        Failure::Lost(Lost::Overflow) => Status::resource_exhausted(
            "the process's output came in more pieces than the stream may queue while its client does not read; \
             it keeps running, detached (ExecAttach with its pid replays what was not delivered)",
        ),
        Failure::Credit => Status::internal("the sandbox broke the stdin credit rules"),
        Failure::BadRequest(why) => Status::invalid_argument(*why),
    }
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
