//! Files in and out of real sandboxes (`cargo test -p vm-e2e --test files`).
//!
//! - [`files`]: the files API through the attach socket, as the workload identity, by policy.
//! - [`copy`]: `vm-driver cp` and `launch --copy-in/--copy-out`, and a hostile guest's tar refused.
//! - [`mounts`]: host directories (`--mount`, virtiofs through a confined `virtiofsd`).
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod copy;
mod files;
mod mounts;
