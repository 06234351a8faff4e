//! The host driver: turns "run this command in a sandbox" into a microVM under its own supervisor.
//!
//! - [`sandbox`]: the one sandbox lifecycle (start, ready, stop, end of a generation), and the supervisor
//!   process with its liveness pipe and stop ordering ([`sandbox::supervisor`]).
//! - [`process`]: the process session, the one loop that runs a process for a client (this terminal, or a
//!   gRPC `Exec` stream) over whatever carries it; [`attach_client`]: a connection to the supervisor's
//!   attach socket; [`attach_mux`]: one such connection per sandbox, shared by the service's `Exec` streams;
//!   [`forward`]: a port forward over one.
//! - [`reap`] (with `cgroup` and `procs`): nothing a supervisor leaves behind survives it.
//! - [`jail`]: how QEMU is confined on this host, and each jailed VMM's uid.
//! - [`state`], [`image`], [`oci`], [`telemetry`]: where sandboxes live, what they boot (the kernel and
//!   agent; an OCI image as the root), where their events go;
//!   [`tsc`]: the host's TSC rate, which keeps a TCG guest's clock right.
//! - [`service`]: `vm-driver serve`, the gateway-facing gRPC service for many sandboxes.
//! - [`files`]: host paths into a sandbox (a tar made here) and out of one (the guest's tar, unpacked only by
//!   the hardened extractor).
//! - [`controls`]: the test controls, read once by the binary and taken by the core as plain values.
//!
//! The `vm-driver` binary (`src/bin/vm-driver/`) is the edge: its command line and commands (`launch`, the
//! API clients) use this library. The driver never links the supervisor: it starts the `vm-supervisor`
//! binary, so the supervisor's forbid-unsafe boundary is a process boundary.
#![warn(missing_docs)]

#[cfg(all(feature = "test-controls", not(debug_assertions)))]
compile_error!("test controls switch safety mechanisms off: they are for debug test builds, never a release");

pub mod attach_client;
pub mod attach_mux;
pub mod audit;
mod cgroup;
pub mod controls;
pub mod doctor;
pub mod files;
pub mod forward;
pub mod gc;
pub mod image;
pub mod jail;
pub mod mounts;
pub mod oci;
pub mod process;
mod procs;
pub mod reap;
pub mod sandbox;
pub mod secrets;
pub mod service;
pub mod state;
pub mod telemetry;
pub mod template;
pub mod tsc;
mod unix;
