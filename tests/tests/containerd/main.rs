//! vm-driver as a containerd runtime, against a real containerd (Debian's, private root and socket) and a
//! real registry (`cargo test -p vm-e2e --test containerd`).
//!
//! - [`shim`]: `containerd-shim-vmdriver-v2` under `ctr` (docs/kubernetes.md).
//! - [`cri`]: the same under containerd's CRI plugin: a pod and its containers in one VM.
#![expect(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![expect(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

mod cri;
mod shim;
