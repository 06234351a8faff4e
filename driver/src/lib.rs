//! The host driver: turns "run this command in a sandbox" into a microVM under its own supervisor.
//!
//! - [`image`]: which kernel and initramfs to boot.
//! - [`state`]: the state directory and each sandbox's private directory.
//! - [`supervisor`]: starting a supervisor with the parent-liveness pipe, and the orderly stop.
//! - [`attach`]: running a process through the supervisor's attach socket.
//! - [`reap`]: killing the VMs of sandboxes whose supervisor is gone ([`procs`], [`cgroup`]).
//! - [`launch`]: `vm-driver launch`, which ties them together for one command.
//! - [`service`]: `vm-driver serve`, the gateway-facing gRPC service for many sandboxes.
//!
//! The driver never links the supervisor: it starts the `vm-supervisor` binary, so the supervisor's
//! forbid-unsafe boundary is a process boundary.
#![warn(missing_docs)]

#[cfg(all(feature = "test-controls", not(debug_assertions)))]
compile_error!("test controls switch safety mechanisms off: they are for debug test builds, never a release");

pub mod attach;
pub mod cgroup;
pub mod client;
pub mod image;
pub mod launch;
pub mod procs;
pub mod reap;
pub mod service;
pub mod state;
pub mod supervisor;
pub mod telemetry;
mod unix;

/// Exit status of `vm-driver` when it fails before the workload produced one (as `docker run` uses 125).
pub const EXIT_DRIVER_ERROR: u8 = 125;
/// Exit status when `--timeout` expired (as `timeout(1)` uses 124).
pub const EXIT_TIMEOUT: u8 = 124;
