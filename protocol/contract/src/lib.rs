//! The contracts between the host's processes: `vm-driver`, `vm-supervisor` and `vm-watchdog`.
//!
//! Each contract is one type that both sides use, so the two ends of a process boundary cannot drift apart.
//! Nothing here is linked into the guest agent: the boundary protocol with the guest is `vm-protocol`.
//!
//! | contract | type | between |
//! |---|---|---|
//! | the supervisor's and the watchdog's argv | [`args::SupervisorArgs`], [`args::WatchdogArgs`] | driver -> supervisor -> watchdog |
//! | the sandbox directory's files | [`layout::SandboxFile`], [`layout::SandboxLayout`] | all three, and the tests |
//! | exit statuses | [`exit::SupervisorExit`], [`exit::WatchdogExit`], [`exit::driver`] | child -> parent, driver -> user |
//! | status lines on the supervisor's stdout | [`status::SupervisorStatus`] | supervisor -> driver |
//! | secrets, in a 0600 file read once | [`auth::AuthBundle`] | driver -> supervisor |
//! | an OpenShell gateway's sandbox: endpoint, name, main process | [`gateway::GatewayBinding`] | driver -> supervisor |
//! | a pooled VM's claim, on its liveness pipe | [`claim::Claim`] | driver -> supervisor |
//! | the launch descriptor, admitted first | [`descriptor::LaunchDescriptor`], [`descriptor::Backend`] | driver -> supervisor |
//! | processes for the reaper | [`pids::SandboxPids`], [`pids::ProcessRecord`] | supervisor -> driver |
//! | how a generation ended | [`tombstone::Tombstone`], [`tombstone::EndReason`] | driver -> later drivers |
//! | the session with `serve` | [`session::SessionHello`], [`session::Generation`], [`session::SessionId`] | supervisor <-> driver |
//! | telemetry settings, in the environment or a claim | [`telemetry::TelemetryConfig`], [`env`] | driver -> supervisor |
//! | the stop budget and the driver's stop deadline | [`stop`] | driver -> supervisor |
//! | sandbox ids and shapes | [`ids::SandboxId`], [`shape::SandboxShape`] | user -> driver -> supervisor |
//! | the accelerator | [`accel::AccelChoice`], [`accel::Accelerator`] | user -> driver -> supervisor |
//! | a guest's RAM memfd, reopened from the parent | [`guest_ram::reopen_from_parent`], [`guest_ram::RamUse`] | driver -> supervisor -> jailer |
//! | QEMU's confinement and `vm-jailer`'s argv | [`jail::Confinement`], [`jail::JailerArgs`] | driver -> supervisor -> jailer |
//! | QEMU's pid, on the jailer's stdout | [`jail::vmm_pid_line`] | jailer -> supervisor |
//! | whether a process is chrooted, as the kernel counts it | [`chroot::Root`] | jailer, doctor |
//! | what may be logged | [`logs`] | all |
//! | test-build switches | [`test_control::TestControl`] | tests -> all |
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod accel;
pub mod args;
pub mod attach;
pub mod audit;
pub mod auth;
pub mod chroot;
pub mod claim;
pub mod descriptor;
pub mod env;
pub mod exit;
pub mod gateway;
pub mod guest_ram;
pub mod ids;
pub mod jail;
pub mod layout;
pub mod logs;
pub mod pids;
pub mod root;
pub mod session;
pub mod shape;
pub mod share;
pub mod snapshot;
pub mod status;
pub mod stop;
pub mod telemetry;
pub mod test_control;
pub mod tombstone;

pub use ids::{SandboxId, SandboxIdError};
