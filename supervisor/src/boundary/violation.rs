//! The rules a client or the guest can break, each a value the caller reports: a client is disconnected,
//! a guest gets a Detection Finding and an orderly stop.

use vm_protocol::net::StreamId;
use vm_protocol::{CreditError, FrameViolation, ProcId};

/// A client broke the protocol; it is disconnected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientViolation {
    /// A message for an id it never spawned.
    #[error("message for unknown process {0}")]
    UnknownProcess(ProcId),
    /// Stdin beyond the credit, or credit for output it never received.
    #[error("credit rules broken for process {id}")]
    Credit {
        /// The process.
        id: ProcId,
        /// What broke.
        #[source]
        source: CreditError,
    },
    /// A data or credit message with nothing in it.
    #[error("an empty stdin or credit message for process {0}")]
    Empty(ProcId),
    /// A message clients may not send.
    #[error("clients may not send {0}")]
    Unexpected(&'static str),
    /// A port forward's message broke the stream rules (fixed text).
    #[error("stream {0}: {1}")]
    Stream(StreamId, &'static str),
    /// Its outgoing queue is full: it is not reading.
    #[error("the client is not reading its frames")]
    NotReading,
}

/// The guest broke the protocol; the VM is stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuestViolation {
    /// A message for an id we never assigned, or for a process that already ended.
    #[error("message for unknown process {0}")]
    UnknownProcess(ProcId),
    /// Output beyond the credit, or stdin credit for bytes never sent.
    #[error("credit rules broken for process {id}")]
    Credit {
        /// The process.
        id: ProcId,
        /// What broke.
        #[source]
        source: CreditError,
    },
    /// A second `Started` for one process.
    #[error("a second Started for process {0}")]
    StartedTwice(ProcId),
    /// Output, stdin credit or an exit before `Started`; or a start failure after it.
    #[error("message out of order for process {0} (before Started, or a start failure after it)")]
    OutOfOrder(ProcId),
    /// A zero-length `Output` or a zero `StdinCredit`.
    #[error("an empty output or credit message for process {0}")]
    Empty(ProcId),
    /// A stdin window above the limit, or an output window other than the one granted.
    #[error("a window above the limit or other than granted for process {0}")]
    WindowTooLarge(ProcId),
    /// An exit status no Linux process can have.
    #[error("an impossible exit status for process {0}")]
    ImplausibleStatus(ProcId),
    /// A start-failure message longer than the limit.
    #[error("a start-failure message too long for process {0}")]
    MessageTooLong(ProcId),
    /// A message the guest may not send after the handshake.
    #[error("the guest may not send {0} after the handshake")]
    Unexpected(&'static str),
    /// A network stream's message broke the stream rules (fixed text).
    #[error("stream {0}: {1}")]
    Stream(StreamId, &'static str),
    /// Bytes that are not a frame.
    #[error(transparent)]
    Frame(#[from] FrameViolation),
}
