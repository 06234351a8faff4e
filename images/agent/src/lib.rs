//! The guest agent: PID 1 inside the microVM.
//!
//! It brings the guest up ([`init`]), opens the boundary channel ([`port`]) and serves the boundary protocol
//! on it, one link to the host ([`link`]): it runs processes with separate stdout and stderr, explicit stdin EOF, named signals and
//! exit statuses, under credit-based flow control, and reaps every zombie (it is PID 1). When the host asks,
//! or goes away, the binary powers the VM off ([`power`]).
//!
//! A file operation ([`files`]) is the agent's own binary, run as a workload process in files mode.
//!
//! The link logic is independent of PID 1 and of virtio, so `tests/link.rs` drives it over a socket pair on
//! the host.
// Unsafe code is denied everywhere but `spawn`, which starts a process without forking the agent, and
// `entropy`, whose two ioctls have no safe wrapper.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod entropy;
pub mod files;
pub mod init;
pub mod link;
pub mod mounts;
pub mod port;
pub mod power;
pub mod root;

mod containers;
mod credit;
mod loopback;
mod net;
mod outbox;
mod process;
mod pty;
mod reaper;
mod spawn;
mod trust;

pub use entropy::ReseedError;
