//! What a sandbox records and reports, on real VMs (`cargo test -p vm-e2e --test telemetry`).
//!
//! - [`telemetry`]: OCSF events to a real OTLP receiver, the JSONL file and the console; secrets kept out.
//! - [`ocsf`]: every event the supervisor builds, valid OCSF 1.8.0 (no VM).
//! - [`spans`]: the supervisor's spans as OTLP traces.
//! - [`credentials`]: the collector's token and CA rotated live.
//! - [`audit`]: the hash-chained audit record, and every edit a forger could make, named.
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod audit;
mod credentials;
mod ocsf;
mod spans;
mod telemetry;
