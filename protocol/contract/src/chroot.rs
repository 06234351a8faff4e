//! Whether this process is chrooted, as the kernel counts it: the one check the jailer, a host directory's
//! file server and `vm-driver doctor` ask.
//!
//! The kernel refuses a user namespace to a chrooted process (`current_chrooted()` in `fs/namespace.c`):
//! one whose root is not the root of its mount namespace, after following the mounts stacked on that
//! root. Whether `/` is a mount point does not decide it: a directory bound onto itself and then entered
//! with `chroot` (what schroot-style setups do) has a `/` that is a mount point, and is still a chroot.
//!
//! Userspace sees its namespace's root only through a process at it, and PID 1 is the one to ask: every
//! init and container runtime starts it at its namespace's root. So [`Root::of_this_process`] finds the
//! mount of this process's `/` (its line in `/proc/self/mountinfo`) and looks that mount up, by its id, in
//! `/proc/1/mountinfo` (readable by every user, where `/proc/1/root` and `/proc/1/ns/mnt` need the right
//! to trace PID 1, which even root lacks on some hosts):
//!
//! - no line of its own has `/` as its mount point: this root is a directory, not a mount, so not the
//!   namespace's root ([`Root::Directory`]);
//! - PID 1 has that mount at `/`: the same root as PID 1, the namespace's ([`Root::Namespace`]);
//! - PID 1 has it at another path: this root lies below PID 1's, so it is not the namespace's root,
//!   wherever PID 1 is ([`Root::Mount`]);
//! - PID 1 does not have it: mount ids are unique across the host, so PID 1 is in another mount namespace
//!   (a container sharing the host's PID namespace, a shell under `unshare --mount`), or chrooted away from
//!   this root; or `/proc/1` cannot be read (`hidepid`), or this process is PID 1 itself. Nothing in
//!   userspace then tells ([`Root::Unknown`]): `vm-driver doctor` says so, and the jailer, which as root in
//!   a mount namespace of its own can look for itself, climbs to the namespace's root and changes nothing
//!   where it was there already (`vm-jailer`'s `chroot.rs`).
//!
//! Mount ids are compared, not device and inode: `mount --bind / /mnt/x; chroot /mnt/x` has PID 1's device
//! and inode at `/`, and a mount of its own. The one case this gets wrong: a PID 1 that is itself chrooted
//! into the same mount as this process (`unshare --pid --fork chroot DIR`, DIR a mount point), which is
//! then taken for the namespace's root.

use std::fmt;

use crate::jail::root_mount_line;

/// Where a process's root is, against its mount namespace's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Root {
    /// The namespace's root: PID 1, in the same namespace, has the same mount at `/`.
    Namespace,
    /// Chrooted into a directory that is not a mount point.
    Directory,
    /// Chrooted into a mount point that PID 1 sees below its own root (a directory bound onto itself, then
    /// entered).
    Mount {
        /// Where PID 1 has this root, as its `mountinfo` writes it.
        at: String,
    },
    /// `/` is a mount point, and nothing here tells whether it is the namespace's root.
    Unknown(Unknown),
}

/// Why [`Root::Unknown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// This process's own `mountinfo` cannot be read (no `/proc`).
    NoMountinfo,
    /// PID 1's `mountinfo` cannot be read (`/proc` mounted with `hidepid`).
    InitUnreadable,
    /// PID 1 does not see this root's mount: another mount namespace, or chrooted itself.
    InitElsewhere,
    /// This process is PID 1: there is nothing to compare it with.
    ThisIsInit,
}

impl fmt::Display for Unknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoMountinfo => "/proc/self/mountinfo cannot be read",
            Self::InitUnreadable => "/proc/1/mountinfo cannot be read",
            Self::InitElsewhere => "PID 1 is in another mount namespace",
            Self::ThisIsInit => "this process is PID 1",
        })
    }
}

impl Root {
    /// This process's root, from `/proc/self/mountinfo` and `/proc/1/mountinfo`.
    pub fn of_this_process() -> Self {
        if std::process::id() == 1 {
            let own = std::fs::read_to_string("/proc/self/mountinfo").ok();
            return match own.as_deref().map(root_mount_line) {
                None => Self::Unknown(Unknown::NoMountinfo),
                Some(None) => Self::Directory,
                Some(Some(_)) => Self::Unknown(Unknown::ThisIsInit),
            };
        }
        let read = |path: &str| std::fs::read_to_string(path).ok();
        Self::from_mountinfo(read("/proc/self/mountinfo").as_deref(), read("/proc/1/mountinfo").as_deref())
    }

    /// The root that `own` (this process's `mountinfo` text) and `init` (PID 1's, from the same `/proc`)
    /// show; `None` for a file that could not be read.
    pub fn from_mountinfo(own: Option<&str>, init: Option<&str>) -> Self {
        let Some(own) = own else { return Self::Unknown(Unknown::NoMountinfo) };
        // id parent major:minor root mount-point ...
        let Some(id) = root_mount_line(own).and_then(|line| line.split(' ').next()) else {
            return Self::Directory;
        };
        let Some(init) = init else { return Self::Unknown(Unknown::InitUnreadable) };
        match init.lines().find(|line| line.split(' ').next() == Some(id)).and_then(|line| line.split(' ').nth(4)) {
            Some("/") => Self::Namespace,
            Some(at) => Self::Mount { at: at.to_owned() },
            None => Self::Unknown(Unknown::InitElsewhere),
        }
    }

    /// Whether the kernel counts this process chrooted (and refuses it a user namespace); `None` when
    /// [`Root::Unknown`].
    pub fn chrooted(&self) -> Option<bool> {
        match self {
            Self::Namespace => Some(false),
            Self::Directory | Self::Mount { .. } => Some(true),
            Self::Unknown(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host's view: its root mount 27, `/srv/root` bound onto itself as 60, `/proc` in it as 61.
    const HOST: &str = "22 27 0:21 / /proc rw - proc proc rw\n\
                        27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                        60 27 254:0 /srv/root /srv/root rw,relatime shared:1 - ext4 /dev/vda rw\n\
                        61 60 0:21 / /srv/root/proc rw - proc proc rw\n";

    #[test]
    fn the_root_pid_1_shares_is_the_namespaces() {
        assert_eq!(Root::from_mountinfo(Some(HOST), Some(HOST)), Root::Namespace);
        assert_eq!(Root::Namespace.chrooted(), Some(false));
    }

    #[test]
    fn a_chroot_of_a_directory_is_one_without_asking_pid_1() {
        // Inside, the host's root is out of view: no line has "/" as its mount point.
        let own = "61 60 0:21 / /proc rw - proc proc rw\n";
        for init in [Some(HOST), None, Some("")] {
            assert_eq!(Root::from_mountinfo(Some(own), init), Root::Directory);
        }
        assert_eq!(Root::Directory.chrooted(), Some(true));
    }

    #[test]
    fn a_chroot_of_a_directory_bound_onto_itself_is_one_though_its_root_is_a_mount_point() {
        // The shape that broke `--mount`: "/" is a mount point (60), which PID 1 has at /srv/root.
        let own = "60 27 254:0 /srv/root / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                   61 60 0:21 / /proc rw - proc proc rw\n";
        assert!(root_mount_line(own).is_some(), "the old test took this for no chroot");
        let root = Root::from_mountinfo(Some(own), Some(HOST));
        assert_eq!(root, Root::Mount { at: "/srv/root".into() });
        assert_eq!(root.chrooted(), Some(true));
    }

    #[test]
    fn a_bind_of_the_whole_root_is_told_by_its_mount_not_its_inode() {
        // `mount --bind / /mnt/x; chroot /mnt/x`: PID 1's device and inode at "/", but mount 70.
        let host = format!("{HOST}70 27 254:0 / /mnt/x rw - ext4 /dev/vda rw\n");
        let own = "70 27 254:0 / / rw - ext4 /dev/vda rw\n";
        assert_eq!(Root::from_mountinfo(Some(own), Some(&host)), Root::Mount { at: "/mnt/x".into() });
    }

    #[test]
    fn without_pid_1_to_compare_a_mount_point_root_is_unknown() {
        // Another mount namespace: every mount a copy with an id of its own.
        let own = "90 89 254:0 / / rw - ext4 /dev/vda rw\n91 90 0:21 / /proc rw - proc proc rw\n";
        let elsewhere = Root::from_mountinfo(Some(own), Some(HOST));
        assert_eq!(elsewhere, Root::Unknown(Unknown::InitElsewhere));
        assert_eq!(elsewhere.chrooted(), None);
        assert_eq!(Root::from_mountinfo(Some(own), None), Root::Unknown(Unknown::InitUnreadable));
        // No /proc at all: not taken for a chroot of a directory.
        assert_eq!(Root::from_mountinfo(None, Some(HOST)), Root::Unknown(Unknown::NoMountinfo));
    }

    #[test]
    fn this_process_is_seen_one_way() {
        // Whatever this host is, the answer agrees with the two files it came from.
        let own = std::fs::read_to_string("/proc/self/mountinfo").ok();
        let root = Root::of_this_process();
        if own.as_deref().is_some_and(|own| root_mount_line(own).is_none()) {
            assert_eq!(root, Root::Directory);
        } else {
            assert_ne!(root, Root::Directory);
        }
    }
}
