//! An image root, as the supervisor and the agent agree on it: the kernel argument that asks the agent
//! for one, and the serials that name its two disks (the guest's device names follow probe order, the
//! serials do not).

/// On the guest kernel's command line: boot into the image on the disks below.
pub const KERNEL_ARG: &str = "vm.root=image";
/// The image's read-only disk (EROFS), shared by every sandbox of the image.
pub const IMAGE_DISK_SERIAL: &str = "vm-image";
/// The sandbox's own writable layer (ext4).
pub const WRITABLE_DISK_SERIAL: &str = "vm-writable";
