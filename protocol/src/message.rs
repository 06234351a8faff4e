//! What both channels carry: the process messages, shared by the guest link ([`crate::link`]) and the
//! attach socket ([`crate::attach`]) because they mean the same on both.
//!
//! **Tags.** Every channel type is an enum whose variant order is its wire tag, and all four share one
//! table, so a tag means one thing wherever it is valid:
//!
//! | tag | towards the guest / supervisor | towards the host / client |
//! |---|---|---|
//! | 0 | reserved, never valid | reserved, never valid |
//! | 1 | `Hello` (frozen) | `Hello` (frozen) |
//! | 2 | `Process(`[`ProcessRequest`]`)` | `Process(`[`ProcessEvent`]`)` |
//! | 3 | `Ping` | `Pong` |
//! | 4 | guest link only: [`crate::link::VmRequest`] | (guest link only: none yet) |
//! | 5 | attach socket only: [`crate::attach::SupervisorRequest`] | attach socket only: [`crate::attach::SupervisorReply`] |
//! | 6 | network streams: link [`crate::net::NetToGuest`], attach [`crate::net::ForwardRequest`] | link [`crate::net::NetToHost`], attach [`crate::net::ForwardEvent`] |
//!
//! A tag a channel does not carry is a [`Never`] variant there: it cannot be built, and it never decodes,
//! so each decoder accepts only its channel's messages. A new stream kind (network, files) takes the next
//! free tag with its own request and event enums, on both channels; a message for one channel only goes
//! inside that channel's sub-enum. Inside a sub-enum, too, variant order is the tag: append, never reorder.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::container::ContainerRoot;
use crate::files::FileSpawn;
use crate::process::{ExitStatus, ProcId, PtySize, SignalName, Stream};
use crate::rlimit::Rlimit;

/// A tag this channel does not carry: no value exists, and decoding one always fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Never {}

/// A request about one process, from the host (supervisor or driver) towards the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProcessRequest {
    /// Start a process.
    Spawn(Spawn),
    /// Bytes for a process's stdin, within the stdin credit the guest granted.
    Stdin {
        /// Target process.
        id: ProcId,
        /// At most [`crate::frame::MAX_DATA_BYTES`].
        data: ByteBuf,
    },
    /// Close the process's stdin. EOF is always explicit; a quiet host is not EOF.
    StdinEof {
        /// Target process.
        id: ProcId,
    },
    /// Deliver a signal to the process's process group.
    Signal {
        /// Target process.
        id: ProcId,
        /// Which signal.
        signal: SignalName,
    },
    /// Resize the process's terminal (PTY processes only).
    Resize {
        /// Target process.
        id: ProcId,
        /// New size.
        size: PtySize,
    },
    /// The host consumed output: the guest may send `bytes` more of it.
    Credit {
        /// Target process.
        id: ProcId,
        /// Bytes of additional output credit.
        bytes: u32,
    },
    /// Start one file operation ([`crate::files`]): a process of the agent's own, answered like a `Spawn`.
    Files(FileSpawn),
}

/// What became of one process, from the guest towards the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProcessEvent {
    /// The process is running.
    Started {
        /// Which process.
        id: ProcId,
        /// Its pid inside the guest (informational).
        pid: u32,
        /// Initial stdin credit: the host may send this many stdin bytes before the next `StdinCredit`.
        stdin_window: u32,
        /// The output window in force: the `Spawn`'s, which the supervisor may have made smaller. Output
        /// credit is returned in batches of a fraction of it.
        output_window: u32,
    },
    /// Output of a process, within the output credit.
    Output {
        /// Which process.
        id: ProcId,
        /// Which stream.
        stream: Stream,
        /// At most [`crate::frame::MAX_DATA_BYTES`].
        data: ByteBuf,
    },
    /// The guest consumed stdin: the host may send `bytes` more.
    StdinCredit {
        /// Which process.
        id: ProcId,
        /// Bytes of additional stdin credit.
        bytes: u32,
    },
    /// The process ended. Sent only after every byte of its output.
    Exited {
        /// Which process.
        id: ProcId,
        /// How it ended.
        status: ExitStatus,
    },
    /// A request about `id` was refused; nothing else follows for it.
    Refused {
        /// Which process.
        id: ProcId,
        /// Why.
        reason: Refusal,
    },
    /// The process could not be started (command not found, not executable, no such directory): what a shell
    /// would print, and the status it would exit with. No `Started`, `Output` or `Exited` comes for it.
    SpawnFailed {
        /// Which process.
        id: ProcId,
        /// `Code(127)` for a missing command, `Code(126)` otherwise.
        status: ExitStatus,
        /// One line for the process's stderr, at most [`MAX_FAILURE_MESSAGE_BYTES`].
        message: String,
    },
}

impl ProcessEvent {
    /// The process it is about.
    pub fn id(&self) -> ProcId {
        match self {
            Self::Started { id, .. }
            | Self::Output { id, .. }
            | Self::StdinCredit { id, .. }
            | Self::Exited { id, .. }
            | Self::Refused { id, .. }
            | Self::SpawnFailed { id, .. } => *id,
        }
    }
}

impl ProcessRequest {
    /// The process it is about.
    pub fn id(&self) -> ProcId {
        match self {
            Self::Spawn(spawn) => spawn.id,
            Self::Files(files) => files.id,
            Self::Stdin { id, .. }
            | Self::StdinEof { id }
            | Self::Signal { id, .. }
            | Self::Resize { id, .. }
            | Self::Credit { id, .. } => *id,
        }
    }
}

/// Longest `SpawnFailed::message`.
pub const MAX_FAILURE_MESSAGE_BYTES: usize = 1024;

/// Why a spawn or another request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// The sandbox is stopping and accepts no new processes.
    ShuttingDown,
    /// The id was not greater than every earlier id on this connection.
    IdNotIncreasing,
    /// Too many processes are running.
    TooManyProcesses,
    /// The request was not valid (empty argv, oversized data, ...).
    Invalid,
    /// No detached process has that pid.
    NoSuchProcess,
    /// The sandbox's policy does not allow it (now, or ever), or admission is closed.
    Denied,
}

/// A request to start a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spawn {
    /// Chosen by the sender; strictly increasing per connection.
    pub id: ProcId,
    /// Program and arguments. `argv[0]` is looked up in `PATH` when it has no slash.
    #[serde(deserialize_with = "seq::deserialize")]
    pub argv: Vec<String>,
    /// Extra environment, applied over the guest's defaults.
    #[serde(deserialize_with = "seq::deserialize")]
    pub env: Vec<EnvVar>,
    /// Working directory; the guest default (`/`) when absent.
    pub cwd: Option<String>,
    /// Run on a PTY of this size instead of pipes.
    pub pty: Option<PtySize>,
    /// Initial output credit, in bytes, shared by stdout and stderr.
    pub output_window: u32,
    /// Resource limits set before the program runs; the guest's defaults for the others.
    #[serde(deserialize_with = "seq::deserialize")]
    pub rlimits: Vec<Rlimit>,
    /// The container root to run in (a pod's VM, [`crate::container`]); the guest's own root when absent.
    pub root: Option<ContainerRoot>,
}

/// One environment variable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvVar {
    /// Name (no `=`, no NUL).
    pub key: String,
    /// Value (no NUL).
    pub value: String,
}

/// Most entries in `Spawn::argv` or `Spawn::env`. With the frame limit this bounds every allocation a
/// decoded `Spawn` makes to less than one frame.
pub const MAX_SEQ_ITEMS: usize = 4096;

/// [`seq`] for other modules of this crate.
pub(crate) fn seq_deserialize<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    seq::deserialize(d)
}

/// Sequence deserialization that never pre-allocates from an untrusted length (serde's default reserves
/// capacity from the announced count) and refuses more than [`MAX_SEQ_ITEMS`] entries.
pub(crate) mod seq {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

    use super::MAX_SEQ_ITEMS;

    pub(crate) fn deserialize<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de>,
    {
        struct Grow<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for Grow<T> {
            type Value = Vec<T>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
                let mut out = Vec::new();
                while let Some(item) = seq.next_element()? {
                    if out.len() == MAX_SEQ_ITEMS {
                        return Err(A::Error::custom("too many entries"));
                    }
                    out.push(item);
                }
                Ok(out)
            }
        }

        d.deserialize_seq(Grow(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::{SupervisorReply, SupervisorRequest, ToClient, ToSupervisor};
    use crate::credentials::RotationOutcome;
    use crate::link::{HostEntropy, ToGuest, ToHost, VmRequest};

    /// The first two `u32`s of a message's body: its tag, and its sub-message's.
    fn tags(msg: &impl Serialize) -> (u32, u32) {
        let mut wire = Vec::new();
        crate::frame::encode(msg, &mut wire).unwrap();
        let word = |at: usize| u32::from_le_bytes(wire[at..at + 4].try_into().unwrap());
        (word(4), word(8))
    }

    #[test]
    fn the_tag_table_of_docs_protocol_md_holds() {
        let id = ProcId(1);
        let data = ByteBuf::from(vec![1]);
        assert_eq!(tags(&ToGuest::Process(ProcessRequest::StdinEof { id })), (2, 2));
        assert_eq!(tags(&ToSupervisor::Process(ProcessRequest::Credit { id, bytes: 1 })), (2, 5));
        assert_eq!(tags(&ToGuest::Ping { nonce: 7 }).0, 3);
        assert_eq!(tags(&ToSupervisor::Ping { nonce: 7 }).0, 3);
        let event = ProcessEvent::Output { id, stream: Stream::Stderr, data };
        assert_eq!(tags(&ToHost::Process(event.clone())), (2, 1));
        assert_eq!(tags(&ToClient::Process(event)), (2, 1));
        assert_eq!(tags(&ToHost::Pong { nonce: 7 }).0, 3);
        assert_eq!(tags(&ToClient::Pong { nonce: 7 }).0, 3);
        let reseed = VmRequest::Reseed { entropy: HostEntropy(vec![0; 64].into()), unix_nanos: 0 };
        assert_eq!(tags(&ToGuest::Vm(VmRequest::Shutdown { grace_ms: 9, signal: SignalName::Term })), (4, 0));
        assert_eq!(tags(&ToGuest::Vm(reseed)), (4, 1));
        assert_eq!(tags(&ToSupervisor::Supervisor(SupervisorRequest::Detach { id })), (5, 2));
        let ack = SupervisorReply::CredentialsAck { outcome: RotationOutcome::Applied };
        assert_eq!(tags(&ToClient::Supervisor(ack)), (5, 2));
    }
}
