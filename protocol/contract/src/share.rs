//! Host directories shared into a sandbox (`--mount type=bind,src=HOSTDIR,dst=GUESTDIR[,readonly]`), and
//! how the file server of each is started: `vm-jailer share`'s argv.
//!
//! Each mount is served by its own `virtiofsd`, started by the supervisor through `vm-jailer share`, which
//! confines it before it runs: a user namespace in which only the guest's workload uid and gid exist (mapped
//! to the directory's owner, never to root), its own mount, PID, network, IPC and UTS namespaces, a root
//! holding only the server's files and the directory, read-only when asked, and one capability (to
//! `chroot` into the directory). See `docs/files.md` ("Host directories").

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::jail::Confinement;

/// Where the shared directory is inside the file server's jail.
pub const JAIL_SOURCE: &str = "/shared";
/// The fd the file server takes its listening vhost-user socket on (the supervisor hands it to the jailer
/// as stdin; the jailer moves it here).
pub const SOCKET_FD: i32 = 3;
/// The file server's open-file limit: it holds a descriptor for every file the guest has looked up.
pub const RLIMIT_NOFILE: u64 = 65_536;
/// `vm-jailer`'s first argument for a file server.
pub const SUBCOMMAND: &str = "share";

/// A host directory shared into the guest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostMount {
    /// The host directory (absolute, resolved by the driver).
    pub source: PathBuf,
    /// Where the guest sees it.
    pub target: String,
    /// The host refuses every write.
    pub readonly: bool,
}

/// The socket QEMU connects to for mount `index`, in the VMM directory.
pub fn socket_name(index: usize) -> String {
    format!("fs{index}.sock")
}

impl FromStr for HostMount {
    type Err = String;

    /// Docker's `--mount` syntax: `type=bind,src=HOSTDIR,dst=GUESTDIR[,readonly]` (`source`, `target`,
    /// `destination` and `ro` too). Paths may not hold a comma.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (mut source, mut target, mut readonly) = (None, None, false);
        let mut seen: Vec<&str> = Vec::new();
        for item in s.split(',') {
            let (key, value) = item.split_once('=').map_or((item, None), |(k, v)| (k, Some(v)));
            // A later key must not override an earlier one: `src=/a,src=/b` is refused, not read as `/b`.
            let canonical = match key {
                "source" => "src",
                "destination" | "target" => "dst",
                "ro" => "readonly",
                other => other,
            };
            if seen.contains(&canonical) {
                return Err(format!("{key:?} is given twice"));
            }
            seen.push(canonical);
            match (key, value) {
                ("type", Some("bind")) => {}
                ("type", _) => return Err("only type=bind mounts are supported".into()),
                ("src" | "source", Some(v)) if !v.is_empty() => source = Some(PathBuf::from(v)),
                ("dst" | "destination" | "target", Some(v)) if !v.is_empty() => target = Some(v.to_owned()),
                ("readonly" | "ro", None | Some("true" | "1")) => readonly = true,
                ("readonly" | "ro", Some("false" | "0")) => readonly = false,
                _ => return Err(format!("{item:?} is not a bind mount option (type, src, dst, readonly)")),
            }
        }
        let source = source.ok_or("a mount needs src=HOSTDIR")?;
        let target = target.ok_or("a mount needs dst=GUESTDIR")?;
        if !vm_protocol::mounts::target_ok(&target) {
            return Err(format!(
                "dst={target:?} must be an absolute guest path of at most {} bytes, without `.` or `..`, and \
                 not /, /proc, /sys, /dev or /run",
                vm_protocol::mounts::MAX_TARGET_BYTES
            ));
        }
        Ok(Self { source, target, readonly })
    }
}

/// Whether a host path can be written in the mount syntax and read back as itself (the driver checks every
/// resolved source with it: the supervisor's argv carries mounts in this syntax).
pub fn source_ok(source: &std::path::Path) -> bool {
    source.to_str().is_some_and(|s| !s.contains(','))
}

impl fmt::Display for HostMount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "type=bind,src={},dst={}", self.source.display(), self.target)?;
        if self.readonly {
            f.write_str(",readonly")?;
        }
        Ok(())
    }
}

/// `vm-jailer share`'s arguments: every one from the supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Parser))]
#[cfg_attr(feature = "clap", command(name = "vm-jailer share", about = "Confines itself, then execs virtiofsd"))]
pub struct ShareJailerArgs {
    /// How to confine: `jail` (root, any owner) or `userns` (the caller's own uid only).
    #[cfg_attr(feature = "clap", arg(long, value_enum))]
    pub confinement: Confinement,
    /// The server's jail root (empty on the host; its mounts live only in the jail's namespace).
    #[cfg_attr(feature = "clap", arg(long))]
    pub root: PathBuf,
    /// The shared directory: opened without following any symlink, and refused unless its owner is
    /// `source_owner` (as checked by the supervisor, whose decision of the mapping rests on it).
    #[cfg_attr(feature = "clap", arg(long))]
    pub source: PathBuf,
    /// The owner the supervisor saw.
    #[cfg_attr(feature = "clap", arg(long))]
    pub source_owner: u32,
    /// Bind it read-only.
    #[cfg_attr(feature = "clap", arg(long))]
    pub readonly: bool,
    /// The guest's uid, and the host uid it is mapped to in the server's user namespace.
    #[cfg_attr(feature = "clap", arg(long, value_name = "GUEST:HOST", value_parser = parse_id_pair))]
    pub uid_map: (u32, u32),
    /// The guest's gid, and the host gid it is mapped to.
    #[cfg_attr(feature = "clap", arg(long, value_name = "GUEST:HOST", value_parser = parse_id_pair))]
    pub gid_map: (u32, u32),
    /// Cgroups to join before anything else (repeatable): the VMM's limits.
    #[cfg_attr(feature = "clap", arg(long = "cgroup"))]
    pub cgroups: Vec<PathBuf>,
    /// The niceness to run at.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = 0))]
    pub nice: u8,
    /// The file server's program and arguments.
    #[cfg_attr(feature = "clap", arg(last = true, required = true))]
    pub exec: Vec<OsString>,
}

/// `GUEST:HOST`.
pub fn parse_id_pair(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once(':').ok_or_else(|| format!("{s:?} is not GUEST:HOST"))?;
    Ok((a.parse().map_err(|_| format!("{a:?} is not an id"))?, b.parse().map_err(|_| format!("{b:?} is not an id"))?))
}

impl ShareJailerArgs {
    /// The argv (without the program name) that parses back into `self`, [`SUBCOMMAND`] first.
    pub fn to_argv(&self) -> Vec<OsString> {
        let mut argv: Vec<OsString> = vec![SUBCOMMAND.into()];
        let mut flag = |name: &str, value: OsString| {
            argv.push(name.into());
            argv.push(value);
        };
        flag("--confinement", self.confinement.as_str().into());
        flag("--root", self.root.clone().into());
        flag("--source", self.source.clone().into());
        flag("--source-owner", self.source_owner.to_string().into());
        flag("--uid-map", format!("{}:{}", self.uid_map.0, self.uid_map.1).into());
        flag("--gid-map", format!("{}:{}", self.gid_map.0, self.gid_map.1).into());
        flag("--nice", self.nice.to_string().into());
        for cgroup in &self.cgroups {
            flag("--cgroup", cgroup.clone().into());
        }
        if self.readonly {
            argv.push("--readonly".into());
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
    fn docker_mount_syntax_parses_and_prints_back() {
        let m: HostMount = "type=bind,src=/srv/data,dst=/work,readonly".parse().unwrap();
        assert_eq!(m, HostMount { source: "/srv/data".into(), target: "/work".into(), readonly: true });
        assert_eq!(m.to_string().parse::<HostMount>(), Ok(m));
        let rw: HostMount = "source=/a,target=/b/c".parse().unwrap();
        assert!(!rw.readonly && rw.target == "/b/c");
        for bad in [
            "type=volume,src=/a,dst=/b",
            "src=/a",
            "dst=/b",
            "src=/a,dst=b",
            "src=/a,dst=/",
            "src=/a,dst=/proc/x",
            "src=/a,dst=/b,bogus=1",
            "src=,dst=/b",
            "src=/a,dst=/b/../c",
            "src=/a,dst=/b,source=/c",
            "src=/a,dst=/b,target=/c",
        ] {
            assert!(bad.parse::<HostMount>().is_err(), "{bad}");
        }
    }

    #[cfg(feature = "clap")]
    #[test]
    fn share_jailer_args_round_trip_through_argv() {
        use clap::Parser;
        let args = ShareJailerArgs {
            confinement: Confinement::Jail,
            root: "/s/box/shares/0".into(),
            source: "/home/me/project".into(),
            source_owner: 1001,
            readonly: true,
            uid_map: (1000, 1001),
            gid_map: (1000, 100),
            cgroups: vec!["/sys/fs/cgroup/x".into()],
            nice: 10,
            exec: vec!["/usr/lib/qemu/virtiofsd".into(), "--fd=3".into()],
        };
        let argv = args.to_argv();
        assert_eq!(argv[0], SUBCOMMAND);
        let parsed = ShareJailerArgs::try_parse_from(
            std::iter::once(OsString::from("vm-jailer")).chain(argv.into_iter().skip(1)),
        );
        assert_eq!(parsed.unwrap(), args);
        let rw = ShareJailerArgs { readonly: false, cgroups: Vec::new(), ..args };
        let parsed = ShareJailerArgs::try_parse_from(
            std::iter::once(OsString::from("x")).chain(rw.to_argv().into_iter().skip(1)),
        );
        assert_eq!(parsed.unwrap(), rw);
    }
}
