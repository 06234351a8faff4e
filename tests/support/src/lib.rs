//! The end-to-end harness: real `vm-driver` binaries, the real guest image, real QEMU; and everything the
//! end-to-end tests (`tests/tests/`) and the benchmarks (`tests/benches/`) share to drive sandboxes and to
//! observe them from the outside.
//!
//! Every test gets a [`Scratch`] directory of its own, with its deadline. While a driver runs, a
//! [`procs::Watcher`] polls `/proc` for every process whose working directory or command line lies inside
//! that directory (the supervisor, QEMU, later the watchdog), recording pid and start time. From that
//! record, and not from anything the code under test reports, the harness learns the accelerator QEMU
//! really ran with and checks that nothing it started is left once the driver has exited. A failing test
//! keeps its scratch directory (console.log, vmm.log, supervisor.log) and prints where it is.
//!
//! The tests of one area share a test binary, and so a process: nothing here keeps state per process that
//! a test sets (no environment variable, working directory or signal disposition is changed; settings
//! travel as arguments), and a test that needs the machine to itself says so with [`exclusive::alone`].
//!
//! The binaries must be built first (`scripts/test` does it); a missing binary or image fails the test.
//!
//! - [`harness`]: where the builds and the image are ([`Harness`], [`Binaries`]), and the repository.
//! - [`scratch`]: a test's directory and deadline ([`Scratch`]); [`exclusive`]: tests that run alone.
//! - [`launch`]: one `vm-driver launch` ([`Launch`], [`Outcome`]); [`running`]: one left running for fault
//!   injection ([`Running`]); [`direct`]: a supervisor started without a driver.
//! - [`serve`]: a `vm-driver serve` and its CLI; [`api`]: its gRPC API; [`attach`]: a sandbox's attach
//!   socket spoken directly.
//! - [`procs`]: processes seen through `/proc`; [`wait`]: polling against a deadline, or
//!   for as long as a count keeps growing.
//! - [`sandbox`], [`events`]: what a sandbox directory holds, `events.jsonl` above all; [`ocsf_schema`]: the
//!   OCSF 1.8.0 validator; [`output`]: what a finished command said; [`leaks`]: looking for a secret where
//!   it must not be.
//! - [`image`]: broken and hostile guest images; [`test_image`]: the Debian test image; [`registry`]: a
//!   real OCI registry; [`net`]: real servers on the host's loopback; [`tls`]: throwaway certificates;
//!   [`otlp_receiver`]: a real OTLP collector.
//!
//! ```no_run
//! use vm_test_support::{Launch, Scratch};
//!
//! let s = Scratch::new("example");
//! let out = Launch::new(&s, &["/bin/sh", "-c", "echo hi"]).run();
//! assert_eq!(out.succeeded(), "hi\n");
//! ```
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "a test harness fails loudly")]

pub mod api;
pub mod attach;
pub mod containerd;
pub mod cri;
pub mod direct;
pub mod events;
pub mod exclusive;
pub mod harness;
pub mod image;
pub mod launch;
pub mod leaks;
pub mod net;
pub mod ocsf_schema;
pub mod openshell;
pub mod otlp_receiver;
pub mod output;
pub mod procs;
pub mod registry;
pub mod running;
pub mod sandbox;
pub mod scratch;
pub mod serve;
pub mod test_image;
pub mod tls;
pub mod wait;

pub use direct::DirectSupervisor;
pub use harness::{control_env, harness, repo, Binaries, Harness, TestControl};
pub use launch::{launch_as_nobody, report_accel, Launch, Outcome, CANARY, DRIVER_ERROR, NOBODY};
pub use procs::{gone_within, survives};
pub use running::{Running, SandboxProcs};
pub use scratch::{Scratch, DEFAULT_DEADLINE};
pub use wait::{wait_for_count, wait_until};
