//! Guest images, on real sources and real VMs (`cargo test -p vm-e2e --test images`).
//!
//! - [`image`]: the default guest image build, reproducible and pinned (`scripts/build-image`).
//! - [`images`]: OCI images from a real registry, layout and archive into the store and onto a disk.
//! - [`image_roots`]: sandboxes booted on OCI image roots (`launch --image`, `serve`, the pool).
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod image;
mod image_roots;
mod images;
