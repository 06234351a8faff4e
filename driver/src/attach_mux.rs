//! One attach connection per sandbox, shared by every process the service runs in it.
//!
//! The attach protocol already lets one connection drive many processes, each under its own increasing id
//! (the supervisor maps them to guest-wide ids), and `Detach` lets go of one of them as a disconnect would.
//! So the service connects and shakes hands once per sandbox, not once per `Exec`.
//!
//! A connection is two tasks. The reader routes each frame to its process's queue and never waits on one:
//! a queue is bounded in frames ([`STREAM_FRAMES`]) and in output bytes (the process's output window, which
//! the supervisor enforces too), and one that would overflow ends its own process's stream (the supervisor
//! still holds every uncredited byte, for a re-attach), never the connection. The writer sends what the
//! streams queue ([`WRITE_QUEUE`] frames, each at most one frame's size), in order; opening a process takes
//! its id and queues its first message under one lock, so ids reach the supervisor in increasing order.
//!
//! A connection that breaks ends every stream on it; the next open connects again (a restarted supervisor
//! is a new generation with a new socket).

mod conn;
mod registry;
#[cfg(test)]
mod tests;

pub use conn::{Conn, Lost, Process};
pub use registry::Connections;

/// Frames queued for one process before its stream is ended. The supervisor's own bound on what it queues
/// for one client (`TO_CLIENT_ITEMS`), so what a client could take over its own connection it takes here.
pub const STREAM_FRAMES: usize = 4096;

/// Frames queued towards the supervisor, from all the connection's processes.
pub const WRITE_QUEUE: usize = 256;
