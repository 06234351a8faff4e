//! The supervisor: one process per microVM, and the VM's only keeper.
//!
//! Organised by phase:
//! - [`run`]: one sandbox from start to exit, around the phases below; [`pooled`]: a VM booted (or restored)
//!   before its sandbox existed, waiting for its claim, or saved for restores ([`snapshot`]).
//! - [`boot`]: choose the accelerator ([`accel`]), start QEMU hardened ([`vmm`]), start the lease with the
//!   watchdog ([`lease`]), connect the guest link, check the agent's handshake and reseed the guest
//!   ([`guest_link`]).
//! - `serve`: the event loop; the attach socket's server ([`attach_server`]) and the multiplexer that routes
//!   between its clients and the guest ([`mux`]), with the policy gate ([`policy`]); the session with `vm-driver serve` ([`session`]).
//! - [`stop`]: why a sandbox stops and what asks for a stop (signals; the liveness pipe is [`liveness`],
//!   which ends the VM through [`kill_switch`] before the loop hears of it).
//! - [`diagnostics`]: what reaches `supervisor.log`; [`telemetry`]: OCSF events and their sinks; [`status`]:
//!   status lines to the driver.
//!
//! The crate forbids unsafe code: everything that needs a syscall goes through `rustix`, `tokio` or `std`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

vm_contract::test_controls!();

pub mod boot;
pub mod diagnostics;
mod framed;
pub mod inbox;
pub mod mux;
pub mod policy;
pub mod safeguards;
pub mod serve;
pub mod start;
pub mod status;
pub mod stop;
pub mod telemetry;
