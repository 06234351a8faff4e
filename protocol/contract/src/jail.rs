//! QEMU's confinement: the modes a host gives, the ids a jailed VMM runs as, and `vm-jailer`'s argv.
//!
//! The supervisor starts QEMU through `vm-jailer`, which confines itself and then forks QEMU into a PID
//! namespace of its own, staying as its parent (with [`Confinement::None`] it execs QEMU instead), so
//! everything the jail sets up holds from QEMU's first instruction. See `docs/operations.md` ("Confinement").

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How a VMM is confined. Chosen once by the driver from what the host allows, and reported (startup warning,
/// OCSF configuration event, `GetCapabilities`, `vm-driver list`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Confinement {
    /// Root: its own uid and gid, no capabilities, new mount/IPC/UTS namespaces, a pivot_root into the jail.
    #[default]
    Jail,
    /// Not root, with unprivileged user namespaces: new user/mount/IPC/UTS namespaces and the jail's root,
    /// but the driver's own uid.
    Userns,
    /// No namespaces and no separate ids: rlimits, no new privileges and QEMU's seccomp only.
    None,
}

impl Confinement {
    /// `jail`, `userns` or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Jail => "jail",
            Self::Userns => "userns",
            Self::None => "none",
        }
    }

    /// Whether QEMU sees only its jail's files (and so names the kernel and initrd by their jail names).
    pub fn has_jail_root(self) -> bool {
        self != Self::None
    }

    /// Whether QEMU runs as the first process of its own PID namespace, a child of the jailer.
    pub fn has_pid_namespace(self) -> bool {
        self != Self::None
    }
}

impl fmt::Display for Confinement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Confinement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Self::Jail, Self::Userns, Self::None]
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| format!("unknown confinement {s:?} (jail, userns or none)"))
    }
}

/// The guest kernel's name inside the jail.
pub const JAIL_KERNEL: &str = "kernel";
/// The guest initramfs's name inside the jail.
pub const JAIL_INITRD: &str = "initrd";
/// An image root's disk (read-only) inside the jail.
pub const JAIL_IMAGE_DISK: &str = "image-disk";
/// The sandbox's writable layer inside the jail.
pub const JAIL_WRITABLE_DISK: &str = "writable-disk";
/// The line of `mountinfo` (`/proc/self/mountinfo`'s text) whose mount point is `/`; `None` in a plain
/// chroot, where `/` is a directory. Whether `/` is a mount point is not whether the process is chrooted:
/// [`crate::chroot::Root`] says that.
pub fn root_mount_line(mountinfo: &str) -> Option<&str> {
    // id parent major:minor root mount-point options [optional fields] - type source super-options
    mountinfo.lines().find(|line| line.split(' ').nth(4) == Some("/"))
}

/// The firmware QEMU's `microvm` machine loads from its data directory when it boots a `-kernel`: the
/// only data files its jail holds (the supervisor's `-M microvm`).
pub const MICROVM_FIRMWARE: [&str; 2] = ["bios-microvm.bin", "linuxboot_dma.bin"];

/// Open files: QEMU's eventfds, sockets and vCPU fds, with room.
pub const RLIMIT_NOFILE: u64 = 4096;
/// Processes and threads of the jail's uid: QEMU's vCPU, I/O and RCU threads (it may not fork).
pub const RLIMIT_NPROC: u64 = 256;
/// QEMU writes no regular file: any attempt is killed (SIGXFSZ). With a writable layer the limit is its
/// size: QEMU writes within it and grows no file.
pub const RLIMIT_FSIZE: u64 = 0;

/// `vm-jailer --probe-userns`: exit 0 if this host lets an unprivileged process create a user namespace
/// with a mount namespace (what `Confinement::Userns` needs), 1 otherwise.
pub const PROBE_USERNS: &str = "--probe-userns";

/// What `vm-jailer` writes on its stdout before QEMU starts: QEMU's pid as the host sees it, one decimal line.
/// With a PID namespace QEMU is the jailer's child, so the supervisor cannot take it from its own child's pid.
pub fn vmm_pid_line(pid: u32) -> String {
    format!("{pid}\n")
}

/// Reads [`vmm_pid_line`]'s line back.
pub fn parse_vmm_pid_line(line: &str) -> Option<u32> {
    line.strip_suffix('\n')?.parse().ok().filter(|pid| *pid > 0)
}

/// A jailed VMM's uid and gid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct JailIds {
    /// Its uid.
    pub uid: u32,
    /// Its gid (the same number, from the same range).
    pub gid: u32,
}

/// The range that per-sandbox ids are taken from, as `START:COUNT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdRange {
    /// The first id.
    pub start: u32,
    /// How many.
    pub count: u32,
}

impl IdRange {
    /// The default: far above any login account, and clear of the usual subordinate-id ranges
    /// (`/etc/subuid` starts at 100000 and grows by 65536 per user).
    pub const DEFAULT: Self = Self { start: 2_000_000_000, count: 65_536 };

    /// The `n`th id, if `n` is inside the range.
    pub fn nth(self, n: u32) -> Option<u32> {
        (n < self.count).then(|| self.start + n)
    }
}

impl fmt::Display for IdRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.start, self.count)
    }
}

impl FromStr for IdRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not START:COUNT (ids above 0, ending below 4294967295)");
        let (start, count) = s.split_once(':').ok_or_else(bad)?;
        let (start, count): (u32, u32) = (start.parse().map_err(|_| bad())?, count.parse().map_err(|_| bad())?);
        // 0 is root, and u32::MAX is "no id" to the kernel.
        if start == 0 || count == 0 || start.checked_add(count).is_none_or(|end| end == u32::MAX) {
            return Err(bad());
        }
        Ok(Self { start, count })
    }
}

/// `vm-jailer`'s arguments: every one from the supervisor, which has them from the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Parser))]
#[cfg_attr(
    feature = "clap",
    command(
        name = "vm-jailer",
        version,
        about = "Confines itself, then starts QEMU and stays as its parent; started by vm-supervisor"
    )
)]
pub struct JailerArgs {
    /// How to confine.
    #[cfg_attr(feature = "clap", arg(long, value_enum))]
    pub confinement: Confinement,
    /// The jail: QEMU's root (with a jail root) or working directory. Holds its sockets.
    #[cfg_attr(feature = "clap", arg(long))]
    pub root: PathBuf,
    /// The uid to run as (`jail` only).
    #[cfg_attr(feature = "clap", arg(long))]
    pub uid: Option<u32>,
    /// The gid to run as (`jail` only).
    #[cfg_attr(feature = "clap", arg(long))]
    pub gid: Option<u32>,
    /// The guest kernel, bound read-only into the jail as [`JAIL_KERNEL`].
    #[cfg_attr(feature = "clap", arg(long))]
    pub kernel: PathBuf,
    /// The guest initramfs, bound read-only into the jail as [`JAIL_INITRD`].
    #[cfg_attr(feature = "clap", arg(long))]
    pub initrd: PathBuf,
    /// Bind `/dev/kvm` into the jail.
    #[cfg_attr(feature = "clap", arg(long))]
    pub kvm: bool,
    /// The niceness to run at.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 0))]
    pub nice: u8,
    /// Cgroups to join before anything else (repeatable): the VMM's limits.
    #[cfg_attr(feature = "clap", arg(long = "cgroup"))]
    pub cgroups: Vec<PathBuf>,
    /// A migration stream to start QEMU from ([`crate::snapshot::SnapshotFile::State`]): the jailer opens
    /// it before it confines itself and hands it to QEMU as `-incoming fd:N` (QEMU's seccomp policy allows
    /// no other way in, and the jail has no such file).
    #[cfg_attr(feature = "clap", arg(long))]
    pub incoming: Option<PathBuf>,
    /// An image root's disk, bound read-only into the jail as [`JAIL_IMAGE_DISK`].
    #[cfg_attr(feature = "clap", arg(long, requires = "writable_disk"))]
    pub image_disk: Option<PathBuf>,
    /// The sandbox's writable layer, bound read-write into the jail as [`JAIL_WRITABLE_DISK`].
    #[cfg_attr(feature = "clap", arg(long, requires = "image_disk"))]
    pub writable_disk: Option<PathBuf>,
    /// Guest memory in a shared memory file of this many MiB (host directories need it): QEMU may size a
    /// file that large.
    #[cfg_attr(feature = "clap", arg(long))]
    pub shared_memory_mib: Option<u32>,
    /// The guest's RAM: the memfd the supervisor holds at this descriptor ([`crate::guest_ram`]), reopened
    /// before the jail is entered and given to QEMU as its memory backend, with a `/proc` in the jail that
    /// shows QEMU only its own processes.
    #[cfg_attr(feature = "clap", arg(long, requires = "guest_ram_mib"))]
    pub guest_ram_fd: Option<u32>,
    /// The guest RAM memfd's size in MiB.
    #[cfg_attr(feature = "clap", arg(long, requires = "guest_ram_fd"))]
    pub guest_ram_mib: Option<u32>,
    /// The guest RAM memfd is a sealed template, mapped private (otherwise written through).
    #[cfg_attr(feature = "clap", arg(long, requires = "guest_ram_fd"))]
    pub guest_ram_private: bool,
    /// QEMU's program and arguments.
    #[cfg_attr(feature = "clap", arg(last = true, required = true))]
    pub exec: Vec<OsString>,
}

impl JailerArgs {
    /// The ids, when both are given.
    pub fn ids(&self) -> Option<JailIds> {
        Some(JailIds { uid: self.uid?, gid: self.gid? })
    }

    /// The argv (without the program name) that parses back into `self`.
    pub fn to_argv(&self) -> Vec<OsString> {
        let mut argv: Vec<OsString> = vec!["--confinement".into(), self.confinement.as_str().into()];
        let mut flag = |name: &str, value: OsString| {
            argv.push(name.into());
            argv.push(value);
        };
        flag("--root", self.root.clone().into());
        if let Some(uid) = self.uid {
            flag("--uid", uid.to_string().into());
        }
        if let Some(gid) = self.gid {
            flag("--gid", gid.to_string().into());
        }
        flag("--kernel", self.kernel.clone().into());
        flag("--initrd", self.initrd.clone().into());
        flag("--nice", self.nice.to_string().into());
        for cgroup in &self.cgroups {
            flag("--cgroup", cgroup.clone().into());
        }
        if let Some(incoming) = &self.incoming {
            flag("--incoming", incoming.clone().into());
        }
        if let Some(disk) = &self.image_disk {
            flag("--image-disk", disk.clone().into());
        }
        if let Some(disk) = &self.writable_disk {
            flag("--writable-disk", disk.clone().into());
        }
        if let Some(mib) = self.shared_memory_mib {
            flag("--shared-memory-mib", mib.to_string().into());
        }
        if let (Some(fd), Some(mib)) = (self.guest_ram_fd, self.guest_ram_mib) {
            flag("--guest-ram-fd", fd.to_string().into());
            flag("--guest-ram-mib", mib.to_string().into());
        }
        if self.kvm {
            argv.push("--kvm".into());
        }
        if self.guest_ram_private {
            argv.push("--guest-ram-private".into());
        }
        argv.push("--".into());
        argv.extend(self.exec.iter().cloned());
        argv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_ranges_parse_and_refuse_root_and_overflow() {
        assert_eq!("2000:10".parse::<IdRange>(), Ok(IdRange { start: 2000, count: 10 }));
        assert_eq!(IdRange { start: 2000, count: 10 }.nth(9), Some(2009));
        assert_eq!(IdRange { start: 2000, count: 10 }.nth(10), None);
        for bad in ["0:10", "10:0", "4294967290:5", "4294967290:10", "x:1", "10"] {
            assert!(bad.parse::<IdRange>().is_err(), "{bad}");
        }
        assert_eq!(IdRange::DEFAULT.to_string().parse::<IdRange>(), Ok(IdRange::DEFAULT));
    }

    #[test]
    fn the_vmm_pid_line_round_trips_and_refuses_the_rest() {
        assert_eq!(parse_vmm_pid_line(&vmm_pid_line(4242)), Some(4242));
        for bad in ["", "4242", "0\n", "-1\n", "x\n", "42 43\n"] {
            assert_eq!(parse_vmm_pid_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn confinement_names_round_trip() {
        for c in [Confinement::Jail, Confinement::Userns, Confinement::None] {
            assert_eq!(c.as_str().parse::<Confinement>(), Ok(c));
        }
    }

    #[cfg(feature = "clap")]
    #[test]
    fn jailer_args_round_trip_through_argv() {
        use clap::Parser;
        let full = JailerArgs {
            confinement: Confinement::Jail,
            root: "/run/vm-driver/sandboxes/a/vmm".into(),
            uid: Some(2_000_000_001),
            gid: Some(2_000_000_001),
            kernel: "/img/vmlinuz".into(),
            initrd: "/img/initramfs.cpio".into(),
            kvm: true,
            nice: 10,
            cgroups: vec!["/sys/fs/cgroup/vm-driver/a-1234-vmm".into()],
            incoming: Some("/run/vm-driver/snapshots/k/state".into()),
            image_disk: Some("/cache/disks/00/rootfs.erofs".into()),
            writable_disk: Some("/run/vm-driver/sandboxes/a/disk.ext4".into()),
            shared_memory_mib: Some(256),
            guest_ram_fd: Some(9),
            guest_ram_mib: Some(256),
            guest_ram_private: true,
            exec: vec!["/usr/bin/qemu-system-x86_64".into(), "-m".into(), "256M".into(), "--".into()],
        };
        let minimal = JailerArgs {
            confinement: Confinement::None,
            uid: None,
            gid: None,
            kvm: false,
            cgroups: Vec::new(),
            incoming: None,
            image_disk: None,
            writable_disk: None,
            shared_memory_mib: None,
            guest_ram_fd: None,
            guest_ram_mib: None,
            guest_ram_private: false,
            ..full.clone()
        };
        for args in [full, minimal] {
            let argv = std::iter::once(OsString::from("vm-jailer")).chain(args.to_argv());
            assert_eq!(JailerArgs::try_parse_from(argv).unwrap(), args);
        }
    }
}
