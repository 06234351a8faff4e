//! The supervisor: one process per microVM, and the VM's only keeper.
//!
//! It chooses the accelerator ([`accel`]), starts QEMU hardened ([`vmm`]), attaches the boundary channel
//! and checks the agent's handshake ([`guest`]), serves the attach socket through which the driver runs
//! processes ([`attach`], routed by [`mux`]), reports its progress to the driver on stdout ([`status`]) and
//! treats EOF on stdin as the driver's death ([`liveness`]), keeps the lease with the watchdog ([`lease`])
//! and records its processes for the driver's reaper ([`pids`]). [`supervisor`] boots the VM; `serve` runs
//! the event loop and the stop.
//!
//! The crate forbids unsafe code: everything that needs a syscall goes through `rustix`, `tokio` or `std`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(all(feature = "test-controls", not(debug_assertions)))]
compile_error!("test controls switch safety mechanisms off: they are for debug test builds, never a release");

pub mod accel;
pub mod attach;
pub mod auth;
pub mod config;
pub mod diagnostics;
mod framed;
pub mod guest;
pub mod lease;
pub mod liveness;
pub mod mux;
pub mod pids;
mod serve;
pub mod session;
pub mod status;
pub mod supervisor;
pub mod telemetry;
pub mod vmm;

/// Everything that reaches the event loop.
#[derive(Debug)]
pub enum Event {
    /// A message from the guest agent.
    Guest(vm_protocol::ToHost),
    /// The guest channel closed (with the reason, if it was not a clean EOF).
    GuestClosed(Option<vm_protocol::FrameError>),
    /// A client finished its handshake.
    ClientConnected(mux::ClientId, attach::ClientHandle),
    /// A message from a client.
    Client(mux::ClientId, vm_protocol::ToGuest),
    /// A client disconnected or sent bytes that are not frames.
    ClientClosed(mux::ClientId),
    /// An attach connection was refused (fixed text).
    AdmissionRefused(&'static str),
    /// The driver accepted the session; the readiness listener is open at this address.
    SessionUp(String),
    /// The session was lost; the readiness listener is closed.
    SessionDown,
    /// The driver refused the session: this sandbox is not the one it expects.
    SessionRefused,
    /// SIGTERM, SIGINT or SIGHUP.
    Terminate,
    /// The parent-liveness pipe reached EOF: the driver is gone.
    DriverGone,
}
