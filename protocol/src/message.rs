//! The messages each side may send. Direction is part of the type: a guest can never send `Spawn`, and a
//! host can never send `Exited`.
//!
//! Variant order is the wire tag: append new variants, never reorder. Tag 0 (`Reserved`) is never valid,
//! and tag 1 is the frozen [`Hello`].

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::handshake::Hello;
use crate::process::{ExitStatus, ProcId, PtySize, SignalName, Stream};

/// Host (supervisor or driver) to guest agent (or to supervisor, on the attach socket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToGuest {
    /// Tag 0, never valid: an all-zero frame is not a message.
    #[doc(hidden)]
    Reserved,
    /// Opens the connection (host's reply to the guest's hello).
    Hello(Hello),
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
    /// Answer with `Pong` carrying the same nonce.
    Ping {
        /// Echoed back.
        nonce: u64,
    },
    /// Stop every process (SIGTERM, then SIGKILL after `grace_ms`) and power the VM off.
    Shutdown {
        /// Milliseconds between SIGTERM and SIGKILL.
        grace_ms: u32,
    },
    /// Attach socket only: re-attach to a process whose client went away, taking it over as `id` on this
    /// connection. The output held meanwhile is replayed after `Started`.
    Reattach {
        /// The id this connection will use for it.
        id: ProcId,
        /// Its guest pid (from `Started` or `Processes`).
        pid: u32,
    },
    /// Attach socket only: list the running processes (answered with `Processes`).
    ListProcesses,
    /// Attach socket only (the driver): restrict or restore operations within the approved policy (answered
    /// with `PolicyAck`).
    UpdatePolicy(crate::policy::PolicyUpdate),
    /// Attach socket only (the driver): new OTLP collector credentials (answered with `CredentialsAck`).
    /// The supervisor keeps it; it never reaches the guest.
    RotateCredentials(crate::credentials::CredentialRotation),
    /// Attach socket only: this connection lets go of process `id`, which keeps running, detached, as if the
    /// connection had closed (its uncredited output is kept for a `Reattach`). One connection can carry many
    /// processes; each can be given up alone.
    Detach {
        /// The process, as this connection knows it.
        id: ProcId,
    },
    /// Sent by the supervisor right after every hello, before any process: fresh host entropy and the host's
    /// wall clock. The agent adds the bytes to the kernel's pool, forces the kernel RNG to reseed from it,
    /// and sets the clock. A VM restored from a snapshot would otherwise serve every clone the RNG state and
    /// the stale time it was saved with. Never from an attach client.
    Reseed {
        /// [`RESEED_BYTES`] bytes from the host's RNG (more or fewer is a violation).
        entropy: HostEntropy,
        /// The host's wall clock: nanoseconds since the Unix epoch.
        unix_nanos: u64,
    },
}

/// Seed material: its `Debug` shows the length only, so no log line can carry it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostEntropy(pub ByteBuf);

impl std::fmt::Debug for HostEntropy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostEntropy({} bytes)", self.0.len())
    }
}

/// Bytes of host entropy in a [`ToGuest::Reseed`]: 512 bits, twice what the kernel needs to call its RNG
/// initialized.
pub const RESEED_BYTES: usize = 64;

/// Guest agent (or supervisor, on the attach socket) to host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToHost {
    /// Tag 0, never valid.
    #[doc(hidden)]
    Reserved,
    /// Opens the connection; the guest speaks first.
    Hello(Hello),
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
    /// Answer to `Ping`.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// A request about `id` was refused; nothing else follows for it.
    Refused {
        /// Which process.
        id: ProcId,
        /// Why.
        reason: Refusal,
    },
    /// Attach socket only: the answer to `ListProcesses`.
    Processes {
        /// The processes still running.
        #[serde(deserialize_with = "seq::deserialize")]
        list: Vec<ProcessSummary>,
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
    /// Attach socket only: the answer to `UpdatePolicy`, sent once every operation admitted before it has
    /// been dispatched to the guest.
    PolicyAck {
        /// The update's revision.
        revision: u64,
        /// What became of it.
        outcome: crate::policy::UpdateOutcome,
    },
    /// Attach socket only: the answer to `RotateCredentials`, sent once the slots hold the new credentials.
    CredentialsAck {
        /// What became of it.
        outcome: crate::credentials::RotationOutcome,
    },
    /// Attach socket only, and the last frame on it: the supervisor disconnects this client, and says why.
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

/// Longest `SpawnFailed::message`.
pub const MAX_FAILURE_MESSAGE_BYTES: usize = 1024;

/// One running process, as `Processes` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSummary {
    /// Its guest pid.
    pub pid: u32,
    /// Its argv.
    #[serde(deserialize_with = "seq::deserialize")]
    pub argv: Vec<String>,
    /// Whether a client is attached.
    pub attached: bool,
    /// Whether it runs on a PTY.
    pub tty: bool,
}

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
mod seq {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

    use super::MAX_SEQ_ITEMS;

    pub(super) fn deserialize<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
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
