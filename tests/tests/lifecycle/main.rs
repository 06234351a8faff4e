//! One sandbox's life through `vm-driver launch`, on real VMs, and the leash that ends it when what holds it
//! goes away (`scripts/test` runs every area; `cargo test -p vm-e2e --test lifecycle` runs this one).
//!
//! - [`launch`]: the workload's streams, stdin, exit status, signals, environment and clock.
//! - [`launch_tty`]: `launch -it` in a real terminal (a tmux pane).
//! - [`bad_input`]: bad ids, images, kernels and guests refused fast, nothing left running.
//! - [`admission`]: the launch descriptor admitted before any credential is read.
//! - [`liveness`]: no VM without a live driver, supervisor and watchdog; the reaper; the orderly stop.
//! - [`faults`]: every failure `docs/operations.md` promises an outcome for, provoked.
//! - [`doctor`]: `vm-driver doctor` against what a launch gets here; a jailed launch in a chroot.
//! - [`templates`]: launches and creates restored from a saved boot, their memory shared, tampering refused.
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod admission;
mod bad_input;
mod doctor;
mod faults;
mod launch;
mod launch_tty;
mod liveness;
mod templates;
