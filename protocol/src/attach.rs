//! The attach socket: what a client (the driver, `vm-driver launch`) and the supervisor say to each other.
//!
//! The supervisor plays the guest's part: it forwards the process messages to the guest (under ids of its
//! own) and answers [`SupervisorRequest`]s itself. The guest link's [`crate::link::VmRequest`] has no tag here, so
//! a client can never ask for a shutdown or a reseed. Tags: [`crate::message`].

use serde::{Deserialize, Serialize};

use crate::credentials::{CredentialRotation, RotationOutcome};
use crate::files::TarRefusal;
use crate::handshake::Hello;
use crate::message::{Never, ProcessEvent, ProcessRequest};
use crate::net::{ForwardEvent, ForwardRequest};
use crate::policy::{PolicyUpdate, UpdateOutcome};
use crate::process::ProcId;

/// Attach client to supervisor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToSupervisor {
    /// Tag 0, never valid: an all-zero frame is not a message.
    #[doc(hidden)]
    Reserved(Never),
    /// Opens the connection (the client's reply to the supervisor's hello).
    Hello(Hello),
    /// About one process.
    Process(ProcessRequest),
    /// Answer with `Pong` carrying the same nonce.
    Ping {
        /// Echoed back.
        nonce: u64,
    },
    /// Tag 4 is the guest link's [`crate::link::VmRequest`]: never on this socket.
    #[doc(hidden)]
    LinkOnly(Never),
    /// Answered by the supervisor itself.
    Supervisor(SupervisorRequest),
    /// A port forward's stream.
    Forward(ForwardRequest),
}

/// What only an attach client asks, and the supervisor answers itself: it never reaches the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SupervisorRequest {
    /// Re-attach to a process whose client went away, taking it over as `id` on this connection. The output
    /// held meanwhile is replayed after `Started`.
    Reattach {
        /// The id this connection will use for it.
        id: ProcId,
        /// Its guest pid (from `Started` or `Processes`).
        pid: u32,
    },
    /// List the running processes (answered with `Processes`).
    ListProcesses,
    /// This connection lets go of process `id`, which keeps running, detached, as if the connection had
    /// closed (its uncredited output is kept for a `Reattach`). One connection can carry many processes;
    /// each can be given up alone.
    Detach {
        /// The process, as this connection knows it.
        id: ProcId,
    },
    /// The driver: restrict or restore operations within the approved policy (answered with `PolicyAck`).
    UpdatePolicy(PolicyUpdate),
    /// The driver: new OTLP collector credentials (answered with `CredentialsAck`). The supervisor keeps
    /// them; they never reach the guest.
    RotateCredentials(CredentialRotation),
    /// The driver: the tar that file operation `id` (a `CopyOut` of `path`) sends was refused by the host's
    /// extractor. The supervisor records a finding and kills the operation if it still runs; nothing is
    /// answered.
    TarRefused {
        /// The operation, as this connection knows it.
        id: ProcId,
        /// The guest path it copied (at most [`crate::files::MAX_PATH_BYTES`]).
        path: String,
        /// Why.
        reason: TarRefusal,
    },
}

/// Supervisor to attach client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToClient {
    /// Tag 0, never valid.
    #[doc(hidden)]
    Reserved(Never),
    /// Opens the connection; the supervisor speaks first, as the guest does on the link.
    Hello(Hello),
    /// About one process.
    Process(ProcessEvent),
    /// Answer to `Ping`.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// Tag 4 is kept for the guest link's own answers: never on this socket.
    #[doc(hidden)]
    LinkOnly(Never),
    /// The answer to a [`SupervisorRequest`].
    Supervisor(SupervisorReply),
    /// A port forward's stream.
    Forward(ForwardEvent),
}

/// The supervisor's answers to [`SupervisorRequest`]s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SupervisorReply {
    /// The answer to `ListProcesses`.
    Processes {
        /// The processes still running.
        #[serde(deserialize_with = "crate::message::seq_deserialize")]
        list: Vec<ProcessSummary>,
    },
    /// The answer to `UpdatePolicy`, sent once every operation admitted before it has been dispatched to the
    /// guest.
    PolicyAck {
        /// The update's revision.
        revision: u64,
        /// What became of it.
        outcome: UpdateOutcome,
    },
    /// The answer to `RotateCredentials`, sent once the slots hold the new credentials.
    CredentialsAck {
        /// What became of it.
        outcome: RotationOutcome,
    },
    /// Unasked, and the last frame on the socket: the supervisor disconnects this client, and says why.
    Disconnected {
        /// Why.
        reason: Disconnect,
    },
}

/// Why the supervisor disconnected an attach client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Disconnect {
    /// Its queue of frames stayed full while it took none of them: it was not reading.
    NotReading,
}

impl Disconnect {
    /// What the client tells its user (fixed text).
    pub fn describe(self) -> &'static str {
        match self {
            Self::NotReading => "the client was not reading its frames",
        }
    }
}

/// One running process, as `Processes` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSummary {
    /// Its guest pid.
    pub pid: u32,
    /// Its argv.
    #[serde(deserialize_with = "crate::message::seq_deserialize")]
    pub argv: Vec<String>,
    /// Whether a client is attached.
    pub attached: bool,
    /// Whether it runs on a PTY.
    pub tty: bool,
}

impl From<ProcessRequest> for ToSupervisor {
    fn from(msg: ProcessRequest) -> Self {
        Self::Process(msg)
    }
}

impl From<SupervisorRequest> for ToSupervisor {
    fn from(msg: SupervisorRequest) -> Self {
        Self::Supervisor(msg)
    }
}

impl From<ProcessEvent> for ToClient {
    fn from(msg: ProcessEvent) -> Self {
        Self::Process(msg)
    }
}

impl From<SupervisorReply> for ToClient {
    fn from(msg: SupervisorReply) -> Self {
        Self::Supervisor(msg)
    }
}

impl From<ForwardRequest> for ToSupervisor {
    fn from(msg: ForwardRequest) -> Self {
        Self::Forward(msg)
    }
}

impl From<ForwardEvent> for ToClient {
    fn from(msg: ForwardEvent) -> Self {
        Self::Forward(msg)
    }
}
