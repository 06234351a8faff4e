//! What a hostile guest, or a process that escaped into the VMM's place, cannot do to the host (`cargo test
//! -p vm-e2e --test hostile`).
//!
//! - [`hostile_guest`]: the rogue agent's protocol attacks, floods and a guest that ignores shutdown.
//! - [`output_flood`]: a flood of 1-byte output frames (issue 20).
//! - [`jail`]: QEMU's confinement (`vm-jailer`), and a simulated escape from it.
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod hostile_guest;
mod jail;
mod output_flood;
