//! A container's own root in a pod's VM (containerd's CRI: a pod is one VM, each of its containers a root of
//! its own in it). The host puts each container's image disk (EROFS) and the files it binds into one
//! directory it shares with the guest, read-only, at [`POD_SHARE`]; a `Spawn` that names a root runs in it.
//! The agent mounts a root at its first `Spawn` (the disk through a loop device, under a writable layer of
//! the guest's memory) and copies the files in; later `Spawn`s reuse it.

use serde::{Deserialize, Serialize};

use crate::mounts::target_ok;

/// Where the guest mounts the host's pod directory (read-only).
pub const POD_SHARE: &str = "/.vmdriver-pod";
/// Most roots one guest mounts; a pod with more containers is refused by the host first.
pub const MAX_ROOTS: usize = 32;
/// Most files one root has copied in.
pub const MAX_FILES: usize = 16;
/// Most bytes of one copied file (`/etc/hosts` and its kind are a few hundred).
pub const MAX_FILE_BYTES: u64 = 64 * 1024;
/// Longest root name.
const MAX_NAME_BYTES: usize = 64;

/// The root a process runs in: `name` picks the disk `POD_SHARE/<name>.erofs`; file `i` of `files` is
/// `POD_SHARE/<name>.files/<i>`, copied to the target path given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRoot {
    /// The container's name in the pod directory.
    pub name: String,
    /// Absolute paths in the root that the files are copied to, in order.
    #[serde(deserialize_with = "crate::message::seq::deserialize")]
    pub files: Vec<String>,
}

/// Why a root is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RootError {
    /// The name is empty, long, or not made of letters, digits, `-` and `_`.
    #[error("a container root's name is letters, digits, '-' and '_', at most {MAX_NAME_BYTES} bytes")]
    Name,
    /// Too many files.
    #[error("a container root takes at most {MAX_FILES} files")]
    TooManyFiles,
    /// A target that is not an absolute, normal path outside the kernel's file systems.
    #[error("a container file's target must be an absolute, normal path outside /proc, /sys, /dev and /run")]
    Target,
}

impl ContainerRoot {
    /// The disk's file name in the pod directory.
    pub fn disk_name(&self) -> String {
        Self::disk_of(&self.name)
    }

    /// The disk's file name in the pod directory of the root named `name`.
    pub fn disk_of(name: &str) -> String {
        format!("{name}.erofs")
    }

    /// The directory of its files in the pod directory.
    pub fn files_dir(&self) -> String {
        format!("{}.files", self.name)
    }

    /// Checks what a decoded root may hold.
    ///
    /// # Errors
    /// [`RootError`].
    pub fn check(&self) -> Result<(), RootError> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= MAX_NAME_BYTES
            && self.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(RootError::Name);
        }
        if self.files.len() > MAX_FILES {
            return Err(RootError::TooManyFiles);
        }
        if !self.files.iter().all(|t| target_ok(t)) {
            return Err(RootError::Target);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(name: &str, files: &[&str]) -> ContainerRoot {
        ContainerRoot { name: name.to_owned(), files: files.iter().map(|f| (*f).to_owned()).collect() }
    }

    #[test]
    fn a_name_or_target_that_could_leave_the_pod_directory_is_refused() {
        assert_eq!(root("web-1_a", &["/etc/hosts", "/etc/resolv.conf"]).check(), Ok(()));
        for name in ["", "../x", "a/b", ".", "a.b", &"x".repeat(65)] {
            assert_eq!(root(name, &[]).check(), Err(RootError::Name), "{name}");
        }
        for target in ["etc/hosts", "/etc/../x", "/proc/x", "/", "/etc//hosts"] {
            assert_eq!(root("a", &[target]).check(), Err(RootError::Target), "{target}");
        }
        let many: Vec<&str> = std::iter::repeat_n("/etc/hosts", MAX_FILES + 1).collect();
        assert_eq!(root("a", &many).check(), Err(RootError::TooManyFiles));
    }
}
