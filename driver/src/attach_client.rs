//! The driver's connection to a supervisor's attach socket: connect (with a deadline), handshake, then
//! frames both ways. A process over it is an [`AttachedProcess`], run by [`crate::process`]. `vm-driver launch` and the control
//! requests (policy updates, credential rotations) use a connection of their own; the service's `Exec`
//! streams share one per sandbox ([`crate::attach_mux`]).

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio_util::codec::{FramedRead, FramedWrite};
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_protocol::attach::{SupervisorReply, SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::codec::{self, FrameCodec};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};
use vm_protocol::handshake::FirstFrameError;
use vm_protocol::policy::{PolicyUpdate, UpdateOutcome};
use vm_protocol::{Capabilities, FrameError, Hello, ProcId, ProcessEvent, ProcessRequest};

use crate::process::{Lost, SandboxEnd, ToSandbox};

/// Longest wait for the connection and the handshake: a supervisor that accepts but never answers (frozen,
/// or its loop hung) must not hold a caller forever.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the connection failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The attach socket did not accept the connection.
    #[error("cannot connect to the sandbox's attach socket")]
    Connect(#[source] std::io::Error),
    /// The handshake failed.
    #[error("attach handshake failed")]
    Handshake(#[source] FirstFrameError),
    /// No connection and handshake within [`CONNECT_TIMEOUT`].
    #[error("the sandbox's supervisor did not answer within {} s", CONNECT_TIMEOUT.as_secs())]
    Timeout,
    /// The connection broke.
    #[error("the attach connection failed")]
    Frame(#[source] FrameError),
}

/// A handshaken attach connection.
#[derive(Debug)]
pub struct Attached {
    frames: FramedRead<OwnedReadHalf, FrameCodec<ToClient, ToSupervisor>>,
    sink: FramedWrite<OwnedWriteHalf, FrameCodec<ToClient, ToSupervisor>>,
    /// The sandbox's capabilities (the agent's, as the supervisor relays them).
    pub capabilities: Capabilities,
}

/// Connects to the sandbox's attach socket and completes the handshake, within [`CONNECT_TIMEOUT`].
///
/// # Errors
/// [`AttachError`].
pub async fn connect(layout: &SandboxLayout) -> Result<Attached, AttachError> {
    let (stream, capabilities) = handshaken(layout).await?;
    let (read, write) = stream.into_split();
    Ok(Attached {
        frames: FramedRead::new(read, FrameCodec::new()),
        sink: FramedWrite::new(write, FrameCodec::new()),
        capabilities,
    })
}

/// Connects to the sandbox's attach socket and completes the handshake, within [`CONNECT_TIMEOUT`]: the
/// stream, and the sandbox's capabilities.
///
/// # Errors
/// [`AttachError`].
pub async fn handshaken(layout: &SandboxLayout) -> Result<(UnixStream, Capabilities), AttachError> {
    tokio::time::timeout(CONNECT_TIMEOUT, async {
        let mut stream =
            crate::unix::connect(layout.dir(), SandboxFile::Attach.name()).await.map_err(AttachError::Connect)?;
        let ours = Hello::ours(Capabilities::NONE, concat!("vm-driver ", env!("CARGO_PKG_VERSION")));
        let theirs =
            codec::host_handshake(&mut stream, ours, Capabilities::EXEC).await.map_err(AttachError::Handshake)?;
        Ok((stream, theirs.capabilities))
    })
    .await
    .map_err(|_| AttachError::Timeout)?
}

impl Attached {
    /// Sends one message.
    ///
    /// # Errors
    /// [`AttachError::Frame`].
    pub async fn send(&mut self, msg: impl Into<ToSupervisor>) -> Result<(), AttachError> {
        self.sink.send(msg.into()).await.map_err(AttachError::Frame)
    }

    /// The next message from the supervisor; `None` when it closed the connection.
    pub async fn recv(&mut self) -> Option<Result<ToClient, FrameError>> {
        self.frames.next().await
    }

    /// Sends a process's first message (`Spawn`, `Files`) and hands back the process, for one session.
    ///
    /// # Errors
    /// [`AttachError::Frame`].
    pub async fn open(&mut self, opening: ProcessRequest) -> Result<AttachedProcess<'_>, AttachError> {
        let id = opening.id();
        self.send(opening).await?;
        Ok(AttachedProcess { attached: self, id, why: None })
    }
}

/// One process on a connection of its own ([`Attached::open`]): `launch` runs its processes one at a time,
/// so every process message on the connection is this one's.
#[derive(Debug)]
pub struct AttachedProcess<'a> {
    attached: &'a mut Attached,
    id: ProcId,
    why: Option<String>,
}

impl AttachedProcess<'_> {
    /// Why the connection ended under the process, when the supervisor said so.
    pub fn why(&self) -> Option<String> {
        self.why.clone()
    }
}

impl SandboxEnd for AttachedProcess<'_> {
    async fn send(&mut self, msg: ToSandbox) -> Result<(), Lost> {
        self.attached.send(msg).await.map_err(|_| Lost::Connection)
    }

    async fn recv(&mut self) -> Result<ProcessEvent, Lost> {
        loop {
            match self.attached.recv().await {
                Some(Ok(ToClient::Process(event))) if event.id() == self.id => return Ok(event),
                Some(Ok(ToClient::Supervisor(SupervisorReply::Disconnected { reason }))) => {
                    self.why = Some(format!("the sandbox cut the attach connection: {}", reason.describe()));
                    return Err(Lost::Connection);
                }
                Some(Ok(_)) => {}
                Some(Err(_)) => {
                    self.why = Some("the attach connection failed".to_owned());
                    return Err(Lost::Connection);
                }
                None => return Err(Lost::Connection),
            }
        }
    }
}

/// Sends a policy update over a fresh attach connection and waits (within [`CONNECT_TIMEOUT`]) for its
/// acknowledgment, which the supervisor sends once every operation admitted before it is dispatched.
///
/// # Errors
/// [`AttachError`]; [`AttachError::Timeout`] when no acknowledgment comes.
pub async fn update_policy(layout: &SandboxLayout, update: PolicyUpdate) -> Result<UpdateOutcome, AttachError> {
    let revision = update.revision;
    request(layout, SupervisorRequest::UpdatePolicy(update), |msg| match msg {
        SupervisorReply::PolicyAck { revision: r, outcome } if r == revision => Some(outcome),
        _ => None,
    })
    .await
}

/// Sends new collector credentials over a fresh attach connection (the supervisor keeps them; they never
/// reach the guest) and waits, within [`CONNECT_TIMEOUT`], for the answer.
///
/// # Errors
/// [`AttachError`]; [`AttachError::Timeout`] when no answer comes.
pub async fn rotate_credentials(
    layout: &SandboxLayout,
    rotation: CredentialRotation,
) -> Result<RotationOutcome, AttachError> {
    request(layout, SupervisorRequest::RotateCredentials(rotation), |msg| match msg {
        SupervisorReply::CredentialsAck { outcome } => Some(outcome),
        _ => None,
    })
    .await
}

/// One control request on a fresh attach connection: sends `msg`, then waits (within [`CONNECT_TIMEOUT`])
/// for the first answer `answer` picks.
async fn request<T>(
    layout: &SandboxLayout,
    msg: SupervisorRequest,
    mut answer: impl FnMut(SupervisorReply) -> Option<T>,
) -> Result<T, AttachError> {
    let mut attached = connect(layout).await?;
    attached.send(msg).await?;
    let answered = async {
        while let Some(Ok(msg)) = attached.recv().await {
            if let Some(found) = match msg {
                ToClient::Supervisor(reply) => answer(reply),
                _ => None,
            } {
                return Some(found);
            }
        }
        None
    };
    tokio::time::timeout(CONNECT_TIMEOUT, answered).await.ok().flatten().ok_or(AttachError::Timeout)
}
