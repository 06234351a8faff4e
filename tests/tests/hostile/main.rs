//! What a hostile guest, or a process that escaped into the VMM's place, cannot do to the host (`cargo test
//! -p vm-e2e --test hostile`).
//!
//! - [`hostile_guest`]: the rogue agent's protocol attacks, floods and a guest that ignores shutdown.
//! - [`output_flood`]: a flood of 1-byte output frames (issue 20).
//! - [`downloads`]: downloads into a guest that stops reading its link.
//! - [`jail`]: QEMU's confinement (`vm-jailer`), and a simulated escape from it.
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod downloads;
mod hostile_guest;
mod jail;
mod output_flood;

/// The supervisor's resident memory must stay under this whatever the guest does (issue 9).
const RSS_BOUND_KIB: u64 = 32 * 1024;
