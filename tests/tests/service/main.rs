//! `vm-driver serve` on real VMs: its CLI and gRPC API, the sandbox policy it applies live, the warm pool,
//! snapshots and the load it admits (`cargo test -p vm-e2e --test service`).
//!
//! - [`service`]: the lifecycle through the CLI and a generic gRPC client, terminals, restart recovery,
//!   refusals, re-attach, readiness.
//! - [`exec_mux`]: every Exec stream of a sandbox over one attach connection.
//! - [`policy`]: operations approved at create, revoked and restored by revision.
//! - [`pool`]: the warm pool (`--pool`): claimed identity, no reuse, replacement, capacity.
//! - [`snapshot`]: pooled VMs restored from a snapshot (`--pool-snapshots`), reseeded.
//! - [`load`]: a busy host keeps its idle sandboxes and the fault bounds; admission limits.
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod exec_mux;
mod load;
mod policy;
mod pool;
mod service;
mod snapshot;
