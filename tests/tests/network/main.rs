//! Network by policy with no guest NIC, on real VMs against real servers on the host's loopback (`cargo test
//! -p vm-e2e --test network`).
//!
//! - [`network`]: egress by rule, names resolved and checked on the host, real clients, the operator's proxy.
//! - [`network_serve`]: live policy updates of the network rules, and `vm-driver port-forward`.
//! - [`secrets`]: TLS interception and credentials the guest never holds.
#![expect(clippy::unwrap_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod network;
mod network_serve;
mod secrets;
