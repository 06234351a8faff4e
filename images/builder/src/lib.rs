//! Building the default guest image reproducibly from pinned Debian packages.
//!
//! - [`debian`]: fetch a pinned `.deb` with `apt-get download`, check its sha256, unpack it.
//! - [`modules`]: the kernel modules the channel needs, with their dependencies, in load order.
//! - [`rootfs`]: the initramfs layout.
//! - [`cpio`]: a deterministic `newc` writer.
//!
//! The `vm-image` binary drives these; the end-to-end tests use [`cpio`] to build deliberately broken images.
#![warn(missing_docs)]

pub mod cpio;
pub mod debian;
pub mod modules;
pub mod rootfs;
