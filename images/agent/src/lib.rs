//! The guest agent: PID 1 inside the microVM.
//!
//! It brings the guest up ([`init`]), opens the boundary channel ([`port`]) and serves the boundary protocol
//! ([`session`]): it runs processes with separate stdout and stderr, explicit stdin EOF, named signals and
//! exit statuses, under credit-based flow control, and reaps every zombie (it is PID 1). When the host asks,
//! or goes away, the binary powers the VM off ([`power`]).
//!
//! The session logic is independent of PID 1 and of virtio, so `tests/session.rs` drives it over a socket
//! pair on the host.
// Unsafe code is denied everywhere but `sys`, which holds the one `pre_exec` a PTY needs.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod init;
pub mod port;
pub mod power;
pub mod session;

mod credit;
mod outbox;
mod process;
mod pty;
mod reaper;
mod sys;
