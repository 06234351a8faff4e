//! The contracts between the host's processes: `vm-driver`, `vm-supervisor` and `vm-watchdog`.
//!
//! Each contract is one type that both sides use, so the two ends of a process boundary cannot drift apart.
//! Nothing here is linked into the guest agent: the boundary protocol with the guest is `vm-protocol`.
//!
//! - [`logs`]: what no host process may log.
//! - [`test_control`]: the switches that turn a safety mechanism off in test builds.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod logs;
pub mod test_control;
