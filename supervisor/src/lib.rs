//! The supervisor: one process per microVM, and the VM's only keeper.
//!
//! Organised by phase, one folder each:
//! - [`start`]: the two start-up scripts, [`start::cold`] and [`start::pooled`] (a VM booted or restored
//!   before its sandbox existed, then saved, or claimed for a sandbox), over the phases below; admission
//!   (descriptor, telemetry, session, policy), the wait for a claim, and the one failure path.
//! - [`boot`]: choose the accelerator ([`boot::accel`]), start QEMU hardened ([`boot::vmm`],
//!   [`boot::vmm_process`]), start the lease with the watchdog ([`boot::lease`]), connect the guest link,
//!   check the agent's handshake and reseed the guest ([`boot::guest_link`]); the logs QEMU fills
//!   ([`boot::guest_logs`]), snapshots ([`boot::snapshot`]), the VMM's cgroup limits ([`boot::vmm_limits`]).
//! - [`boundary`]: the one I/O-free core that decides every message after boot: prepare, the policy gate
//!   ([`policy`]), the process router, the stream router (egress and port forwards), control requests; its
//!   notes become OCSF events in the [`report`]er, whose rate limits are [`bucket`]'s token buckets.
//! - [`serve`]: the event loop, which only moves bytes between the boundary and the sockets: the attach
//!   socket's server ([`serve::attach_server`]), the guest link's queue, the egress tasks ([`network`]); the
//!   session with `vm-driver serve` ([`serve::session`]).
//! - [`gateway`]: OpenShell's supervisor protocol, for a sandbox an OpenShell gateway created: the session
//!   with the gateway, its relays, the SSH server on them and the main process, all clients of the boundary.
//! - [`stop`]: why a sandbox stops and what asks for a stop (signals; the liveness pipe is
//!   [`stop::liveness`], which ends the VM through [`stop::kill_switch`] before the loop hears of it).
//! - Beside them: the loop's queues ([`inbox`]); the safety mechanisms a test build can switch off, read once
//!   in `main` ([`safeguards`]); [`diagnostics`]: what reaches `supervisor.log`; [`telemetry`]: OCSF events
//!   and their sinks; [`status`]: status lines to the driver.
//!
//! The crate forbids unsafe code: everything that needs a syscall goes through `rustix`, `tokio` or `std`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

vm_contract::test_controls!();

pub mod boot;
pub mod boundary;
pub mod bucket;
pub mod diagnostics;
mod framed;
pub mod gateway;
pub mod inbox;
pub mod network;
pub mod policy;
pub mod report;
pub mod safeguards;
pub mod serve;
pub mod start;
pub mod status;
pub mod stop;
pub mod telemetry;
