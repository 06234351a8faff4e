//! The process session: the one loop that runs a process of a sandbox for a client, whoever the client and
//! whatever carries the process.
//!
//! ```text
//!   client end                          process session                        sandbox end
//!   this terminal (launch, exec, cp)    stdin within the guest's credit         the attach connection
//!   a gRPC Exec stream (the service)    output credited once handed on          (launch, the service)
//!                                       signals, resizes; the refused-tar       the service's Exec stream
//!                                       handshake; the exit status              (the CLI's exec and cp)
//! ```
//!
//! - [`session`]: the I/O-free core ([`ProcessSession`]) that decides every message of one process;
//!   [`relay`]: its flow-control state.
//! - [`pump`]: the loop that moves the messages between a [`SandboxEnd`] and a [`ClientEnd`].
//! - The ends: [`local`] (this terminal: [`terminal`], and [`output`] for a copy's tar), [`remote`] (the
//!   service's Exec stream, as the CLI sees it); the service's side of an Exec stream is
//!   `crate::service`'s; the attach connection's processes are sandbox ends (`crate::attach_mux::Process`
//!   for the service, `crate::attach_client::AttachedProcess` for `launch`).

pub mod local;
pub mod output;
pub mod pump;
pub mod relay;
pub mod remote;
pub mod session;
pub mod terminal;

use vm_protocol::attach::{SupervisorRequest, ToSupervisor};
use vm_protocol::files::TarRefusal;
use vm_protocol::message::Refusal;
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, PtySize, SignalName, Stream};

pub use self::pump::run;
pub use self::session::ProcessSession;

/// How long a client's refusal of a copy's tar waits for the sandbox to end the copy it refused.
pub const REFUSAL_DELIVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a `copy_out`'s client may take, after the exit, to say whether its extractor took the tar.
pub const VERDICT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// What the session sends towards the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToSandbox {
    /// A message about the process.
    Process(ProcessRequest),
    /// The client's extractor refused what a `CopyOut` sent (for the sandbox's finding).
    TarRefused {
        /// The process.
        id: ProcId,
        /// The guest path copied out.
        path: String,
        /// Why.
        reason: TarRefusal,
    },
}

impl From<ToSandbox> for ToSupervisor {
    fn from(msg: ToSandbox) -> Self {
        match msg {
            ToSandbox::Process(req) => Self::Process(req),
            ToSandbox::TarRefused { id, path, reason } => {
                Self::Supervisor(SupervisorRequest::TarRefused { id, path, reason })
            }
        }
    }
}

/// Why the sandbox side of a process ended before the process did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Lost {
    /// The connection broke, or the sandbox stopped.
    #[error("the sandbox stopped before the process exited")]
    Connection,
    /// The process's output came in more pieces than its stream may queue while its client did not read
    /// (`crate::attach_mux`'s bound); it keeps running, detached, with its output held by the supervisor.
    #[error("the process's output queue is full")]
    Overflow,
}

/// What carries a process to the sandbox: its messages out, the sandbox's about it in.
#[expect(async_fn_in_trait, reason = "used with static dispatch only, within this crate's loop")]
pub trait SandboxEnd {
    /// Sends one message about the process.
    ///
    /// # Errors
    /// [`Lost`].
    async fn send(&mut self, msg: ToSandbox) -> Result<(), Lost>;

    /// The next message about the process. Must be cancel-safe.
    ///
    /// # Errors
    /// [`Lost`]: the process's stream ended.
    async fn recv(&mut self) -> Result<ProcessEvent, Lost>;

    /// The session is over: lets the other side see the end (a stream half-closed, and its end awaited
    /// within [`REFUSAL_DELIVERY`], so a last refusal is delivered before this process moves on).
    async fn close(&mut self) {}
}

impl SandboxEnd for crate::attach_mux::Process {
    async fn send(&mut self, msg: ToSandbox) -> Result<(), Lost> {
        crate::attach_mux::Process::send(self, msg).await
    }

    async fn recv(&mut self) -> Result<ProcessEvent, Lost> {
        crate::attach_mux::Process::recv(self).await
    }
}

/// What a client asks of its process, or tells about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromClient {
    /// Stdin bytes.
    Stdin(Vec<u8>),
    /// Stdin ended.
    StdinEof,
    /// A signal for the process.
    Signal(SignalName),
    /// Its terminal's new size.
    Resize(PtySize),
    /// The client's extractor refused the copy's tar.
    TarRefused(TarRefusal),
    /// Output bytes the client took (for the credit that tells the sandbox they were delivered).
    Delivered(usize),
    /// The client sent what a process cannot take (an unknown signal, an opening on an open stream); fixed
    /// text.
    Invalid(&'static str),
    /// The client has nothing more to say (its stream closed); it may still be sent the rest.
    Closed,
    /// The client is gone: nothing more reaches it.
    Gone,
}

/// What the session tells its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToClient {
    /// The process runs, as `pid` in the guest (`reattached`: it was running already).
    Started {
        /// Its pid in the guest.
        pid: u32,
        /// Whether this was a re-attach.
        reattached: bool,
    },
    /// Output.
    Output(Stream, Vec<u8>),
    /// A line the sandbox wrote about the process for its stderr (why its spawn failed): no output of the
    /// process, so never credited.
    Message(String),
    /// It exited with this status: the last message.
    Exited(ExitStatus),
    /// The process could not run: the last message.
    Failed(Failure),
}

/// Why a process did not run to its exit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The sandbox refused to start it (or to re-attach).
    #[error("the sandbox refused the process ({0:?})")]
    Refused(Refusal),
    /// The sandbox side ended first.
    #[error(transparent)]
    Lost(#[from] Lost),
    /// The sandbox broke the stdin credit rules.
    #[error("the sandbox broke the stdin credit rules")]
    Credit,
    /// The client sent what a process cannot take (stdin after its EOF, an unknown signal, a refusal of
    /// what is no copy); fixed text.
    #[error("{0}")]
    BadRequest(&'static str),
}

/// What the client end of a process does: a terminal, or a gRPC stream.
#[expect(async_fn_in_trait, reason = "used with static dispatch only, within this crate's loop")]
pub trait ClientEnd {
    /// The next thing the client says. Its requests (stdin, signals, a refusal) are read only while
    /// `listening` (the session has room for stdin, or awaits a verdict); deliveries and its going away are
    /// always reported. Must be cancel-safe.
    async fn next(&mut self, listening: bool) -> FromClient;

    /// Hands the client one message. The output bytes it took at once come back (a terminal writes them
    /// straight out; a stream reports them later, as [`FromClient::Delivered`]).
    ///
    /// # Errors
    /// The client is gone.
    async fn deliver(&mut self, msg: ToClient) -> Result<usize, ClientGone>;
}

/// The client went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the client went away")]
pub struct ClientGone;

/// How a process's session ended, for the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Its exit, and every byte of its output, were delivered: the supervisor forgot it.
    Delivered,
    /// The process keeps running (or keeps its undelivered output) without the session.
    Detach,
    /// The sandbox side is gone.
    Lost,
}

/// What a session came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// How it ended, for the process.
    pub ended: Ended,
    /// Its exit status, when it exited.
    pub status: Option<ExitStatus>,
    /// Why it did not exit, when it did not.
    pub failure: Option<Failure>,
}
