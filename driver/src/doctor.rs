//! `vm-driver doctor`: what a sandbox would get on this host, and what it lacks, each shortfall with its
//! fix. Every check asks the code a sandbox's start uses (the accelerator probe, the confinement choice,
//! the cgroup limits, the image lookup), so the report cannot drift from what a start does.

use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use vm_contract::accel::{AccelChoice, Accelerator, Host, KvmUnusable};
use vm_contract::chroot::{Root, Unknown};
use vm_contract::jail::Confinement;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// As a sandbox needs it.
    Ok,
    /// Sandboxes start, weaker or slower, or a feature is missing.
    Warn,
    /// No sandbox can start.
    Fail,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "FAIL",
        })
    }
}

/// One line of the report.
#[derive(Debug, Clone)]
pub struct Check {
    /// What was checked.
    pub topic: &'static str,
    /// How it came out.
    pub level: Level,
    /// What was found.
    pub found: String,
    /// What to do about a shortfall.
    pub fix: Option<String>,
}

impl Check {
    fn new(topic: &'static str, level: Level, found: impl Into<String>, fix: Option<&str>) -> Self {
        Self { topic, level, found: found.into(), fix: fix.map(str::to_owned) }
    }
}

/// Where the driver would keep its state and find its guest image.
#[derive(Debug, Clone)]
pub struct Places {
    /// The state directory.
    pub state: PathBuf,
    /// The guest image directory, if a default could be worked out.
    pub image: Result<PathBuf, String>,
    /// `vm-supervisor`, beside the driver.
    pub supervisor: Result<PathBuf, String>,
    /// The cache of images (`$XDG_CACHE_HOME/vm-driver`, else `~/.cache/vm-driver`), if one can be named.
    pub cache: Option<PathBuf>,
}

/// Runs every check.
pub fn run(places: &Places) -> Vec<Check> {
    let mut checks = vec![accelerator(&Host::default())];
    checks.extend(qemu());
    checks.push(binaries(&places.supervisor));
    if let Ok(supervisor) = &places.supervisor {
        checks.push(confinement(supervisor));
    }
    checks.push(cgroups());
    let own = std::fs::read_to_string("/proc/self/mountinfo").ok();
    checks.push(root_mount(&Root::of_this_process(), own.as_deref().unwrap_or_default()));
    checks.push(directory("state directory", &places.state));
    if let Some(cache) = &places.cache {
        checks.push(directory("cache directory", cache));
    }
    checks.push(boot_image(&places.image));
    checks.push(fd_limit());
    checks.extend(tools());
    checks
}

/// The exit status of a report: non-zero when no sandbox could start.
pub fn exit_code(checks: &[Check]) -> u8 {
    u8::from(checks.iter().any(|c| c.level == Level::Fail))
}

/// The accelerator `auto` gets here, and why.
pub fn accelerator(host: &Host) -> Check {
    match host.choose(AccelChoice::Auto) {
        Ok((Accelerator::Kvm, _)) => Check::new("accelerator", Level::Ok, "KVM: /dev/kvm can boot a stock guest", None),
        Ok((_, why)) => {
            let fix = match &why {
                Some(KvmUnusable::Missing { .. }) => {
                    "load kvm_intel or kvm_amd, or enable nested virtualization for the VM this host runs in"
                }
                Some(KvmUnusable::NoAccess { .. }) => "add this user to /dev/kvm's group (kvm), or run as root",
                Some(KvmUnusable::PvmOnly) | None => "none on this host; sandboxes run, slower, under TCG",
            };
            let why = why.map_or_else(String::new, |w| format!(": {w}"));
            Check::new("accelerator", Level::Warn, format!("TCG software emulation{why}"), Some(fix))
        }
        Err(e) => Check::new("accelerator", Level::Fail, e.to_string(), None),
    }
}

/// QEMU on `PATH`: its version and whether it has the `microvm` machine.
fn qemu() -> Vec<Check> {
    const INSTALL: &str = "install Debian's qemu-system-x86 (scripts/deps)";
    let Some(qemu) = on_path("qemu-system-x86_64") else {
        return vec![Check::new("qemu", Level::Fail, "qemu-system-x86_64 is not on PATH", Some(INSTALL))];
    };
    let run = |args: &[&str]| {
        std::process::Command::new(&qemu)
            .args(args)
            .env_clear()
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    let version = run(&["--version"]).lines().next().unwrap_or("no version").to_owned();
    let microvm = run(&["-machine", "help"]).lines().any(|l| l.starts_with("microvm "));
    vec![
        Check::new("qemu", Level::Ok, format!("{}: {version}", qemu.display()), None),
        if microvm {
            Check::new("microvm", Level::Ok, "QEMU has the microvm machine", None)
        } else {
            Check::new("microvm", Level::Fail, "QEMU has no microvm machine", Some(INSTALL))
        },
    ]
}

/// The supervisor and jailer a start runs.
fn binaries(supervisor: &Result<PathBuf, String>) -> Check {
    const FIX: &str = "install vm-supervisor, vm-watchdog and vm-jailer beside vm-driver (scripts/install)";
    match supervisor {
        Ok(path) => {
            let missing: Vec<&str> =
                ["vm-watchdog", "vm-jailer"].into_iter().filter(|name| !path.with_file_name(name).is_file()).collect();
            if missing.is_empty() {
                Check::new(
                    "binaries",
                    Level::Ok,
                    format!("vm-supervisor, vm-watchdog, vm-jailer in {}", dir_of(path)),
                    None,
                )
            } else {
                Check::new(
                    "binaries",
                    Level::Fail,
                    format!("{} missing in {}", missing.join(", "), dir_of(path)),
                    Some(FIX),
                )
            }
        }
        Err(why) => Check::new("binaries", Level::Fail, why.clone(), Some(FIX)),
    }
}

fn dir_of(path: &Path) -> String {
    path.parent().unwrap_or(path).display().to_string()
}

/// The confinement a sandbox gets without `--confinement`.
fn confinement(supervisor: &Path) -> Check {
    match crate::jail::choose(None, &supervisor.with_file_name("vm-jailer")) {
        Ok(Confinement::Jail) => {
            Check::new("confinement", Level::Ok, "jail: root, a uid and namespaces of its own per VMM", None)
        }
        Ok(Confinement::Userns) => Check::new(
            "confinement",
            Level::Warn,
            "userns: not root, so every VMM runs as this user in namespaces of its own",
            Some("run as root for a uid per VMM"),
        ),
        Ok(Confinement::None) => Check::new(
            "confinement",
            Level::Warn,
            "none: not root and no unprivileged user namespaces, so VMMs run unconfined",
            Some("run as root, or allow unprivileged user namespaces (sysctl user.max_user_namespaces)"),
        ),
        Err(e) => Check::new("confinement", Level::Fail, e.to_string(), None),
    }
}

/// The cgroup mode of the VMM's limits, and the sweep's cgroup v2.
fn cgroups() -> Check {
    let sweep = match crate::cgroup::mount_point() {
        Some(mount) => format!("; cgroup v2 at {} for the sweep", mount.display()),
        None => "; no cgroup v2 mount, so no cgroup sweep".into(),
    };
    match crate::cgroup::limits::available() {
        Ok(kind) => {
            Check::new("cgroups", Level::Ok, format!("VMM limits in {} (memory, pids, cpu){sweep}", kind.name()), None)
        }
        Err(why) => Check::new(
            "cgroups",
            Level::Warn,
            format!("{why}: VMMs run without memory, pids and CPU limits{sweep}"),
            Some("run as root on a host with cgroup v2's memory and pids controllers, or cgroup v1's"),
        ),
    }
}

/// Whether this process is chrooted, as the kernel counts it (`root`: [`Root::of_this_process`]), and the
/// propagation of `/` (from `mountinfo`, this process's): a jail makes its mounts private from `/`, or, in
/// a chroot, gives its namespace the chroot's root first (`vm-jailer`'s `chroot.rs`).
pub fn root_mount(root: &Root, mountinfo: &str) -> Check {
    const JAIL: &str = "each jail first gives its namespace a root that is one";
    let propagation = vm_contract::jail::root_mount_line(mountinfo).map(|line| {
        let tagged = line.split(" - ").next().unwrap_or_default().split(' ').skip(6);
        let propagation: Vec<&str> = tagged.filter(|t| !t.is_empty()).collect();
        if propagation.is_empty() {
            "private".to_owned()
        } else {
            propagation.join(" ")
        }
    });
    let point = format!("/ is a mount point ({})", propagation.as_deref().unwrap_or("no mountinfo"));
    match root {
        Root::Namespace => Check::new("mounts", Level::Ok, format!("{point}, the mount namespace's root"), None),
        Root::Directory => Check::new("mounts", Level::Ok, format!("/ is not a mount point (a chroot): {JAIL}"), None),
        Root::Mount { at } => Check::new(
            "mounts",
            Level::Ok,
            format!("{point} but not the mount namespace's root (a chroot of PID 1's {at}): each jail first makes it its namespace's"),
            None,
        ),
        Root::Unknown(Unknown::NoMountinfo) => Check::new(
            "mounts",
            Level::Warn,
            format!("{}: no jail can read its mounts", Unknown::NoMountinfo),
            Some("mount /proc"),
        ),
        Root::Unknown(why) => Check::new(
            "mounts",
            Level::Ok,
            format!("{point}; whether it is the mount namespace's root cannot be told ({why}): each jail checks"),
            None,
        ),
    }
}

/// A directory the driver writes: absent (made at first use), or this user's and not writable by others.
fn directory(topic: &'static str, dir: &Path) -> Check {
    let me = rustix::process::geteuid().as_raw();
    match std::fs::metadata(dir) {
        Err(_) => Check::new(topic, Level::Ok, format!("{} (made at first use)", dir.display()), None),
        Ok(meta) if meta.uid() != me => Check::new(
            topic,
            Level::Fail,
            format!("{} belongs to uid {}, not to this user ({me})", dir.display(), meta.uid()),
            Some("use a directory of your own (--state-dir, or VM_DRIVER_STATE_DIR)"),
        ),
        Ok(meta) if meta.mode() & 0o022 != 0 => Check::new(
            topic,
            Level::Fail,
            format!("{} is writable by others (mode {:o})", dir.display(), meta.mode() & 0o7777),
            Some("chmod go-w it"),
        ),
        Ok(meta) => {
            Check::new(topic, Level::Ok, format!("{} (mode {:o}, yours)", dir.display(), meta.mode() & 0o7777), None)
        }
    }
}

/// The default guest image: a kernel and an initramfs.
fn boot_image(dir: &Result<PathBuf, String>) -> Check {
    let found = dir
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|d| crate::image::resolve(Some(d), None, None).map(|_| d.clone()).map_err(|e| e.to_string()));
    match found {
        Ok(dir) => Check::new("boot image", Level::Ok, format!("kernel and initramfs in {}", dir.display()), None),
        Err(why) => {
            Check::new("boot image", Level::Fail, why, Some("build it with scripts/build-image, or pass --image DIR"))
        }
    }
}

/// Open files: a serving driver holds a few per sandbox.
fn fd_limit() -> Check {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft >= 4096 {
        Check::new("fd limit", Level::Ok, format!("{soft} open files"), None)
    } else {
        Check::new(
            "fd limit",
            Level::Warn,
            format!("{soft} open files: a serve with many sandboxes runs out"),
            Some("raise it (ulimit -n 65536, or LimitNOFILE= in a unit)"),
        )
    }
}

/// The tools the optional features run.
fn tools() -> Vec<Check> {
    let tool = |topic: &'static str, found: Option<PathBuf>, what: &str, fix: &str| match found {
        Some(path) => Check::new(topic, Level::Ok, format!("{}: {what}", path.display()), None),
        None => Check::new(topic, Level::Warn, format!("missing: no {what}"), Some(fix)),
    };
    let virtiofsd = Path::new("/usr/lib/qemu/virtiofsd");
    vec![
        tool("images", on_path("mkfs.erofs"), "--image roots", "install erofs-utils"),
        tool("disks", on_path("mkfs.ext4"), "writable layers (--image, --disk)", "install e2fsprogs"),
        tool(
            "files",
            virtiofsd.is_file().then(|| virtiofsd.to_path_buf()),
            "host directories (--mount)",
            "install qemu-system-common",
        ),
        tool(
            "egress",
            Path::new("/etc/resolv.conf").exists().then(|| PathBuf::from("/etc/resolv.conf")),
            "the host's resolver, for network rules by host name",
            "give the host a resolver (/etc/resolv.conf), or pass --egress-resolver IP:PORT",
        ),
    ]
}

/// `name` on `PATH` (the supervisor's default when unset), then in the sbin directories where the
/// supervisor looks for `mkfs.ext4`.
pub(crate) fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    let sbin = [PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")];
    std::env::split_paths(&path).chain(sbin).map(|dir| dir.join(name)).find(|p| p.is_file())
}

/// The report, a line per check and its fix beneath.
pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.topic.len()).max().unwrap_or(0);
    let mut out = String::new();
    for c in checks {
        out.push_str(&format!("{:<4}  {:<width$}  {}\n", c.level, c.topic, c.found));
        if let Some(fix) = &c.fix {
            out.push_str(&format!("{:<4}  {:<width$}  fix: {fix}\n", "", ""));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chroot_is_named_in_both_shapes() {
        let host = "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw\n23 22 0:5 / /proc rw - proc proc rw\n";
        let check = root_mount(&Root::Namespace, host);
        assert!(check.found.contains("/ is a mount point (shared:1), the mount namespace's root"), "{}", check.found);
        // Inside a chroot of a directory the host's root is out of view: no line has "/" as its mount point.
        let check = root_mount(&Root::Directory, "23 22 0:5 / /proc rw - proc proc rw\n");
        assert!(check.found.contains("not a mount point (a chroot)"), "{}", check.found);
        // A directory bound onto itself, then entered: "/" is a mount point, and it is a chroot all the same.
        let bound = "60 22 0:21 /srv/root / rw shared:1 - ext4 /dev/vda rw\n";
        let check = root_mount(&Root::Mount { at: "/srv/root".into() }, bound);
        assert_eq!(check.level, Level::Ok);
        assert!(
            check.found.contains("not the mount namespace's root (a chroot of PID 1's /srv/root)"),
            "{}",
            check.found
        );
        let check = root_mount(&Root::Unknown(Unknown::InitElsewhere), bound);
        assert!(check.found.contains("cannot be told (PID 1 is in another mount namespace)"), "{}", check.found);
        assert_eq!(root_mount(&Root::Unknown(Unknown::NoMountinfo), "").level, Level::Warn);
    }

    #[test]
    fn the_exit_code_is_non_zero_only_on_a_failure() {
        let warn = Check::new("a", Level::Warn, "slow", Some("fix"));
        assert_eq!(exit_code(std::slice::from_ref(&warn)), 0);
        assert_eq!(exit_code(&[warn, Check::new("b", Level::Fail, "no", None)]), 1);
    }

    #[test]
    fn a_pvm_only_host_is_reported_as_tcg_and_why() {
        let root = tempfile::tempdir().unwrap();
        for module in ["kvm", "kvm_pvm"] {
            std::fs::create_dir_all(root.path().join("module").join(module)).unwrap();
        }
        let device = root.path().join("kvm");
        std::fs::write(&device, b"").unwrap();
        let check = accelerator(&Host { kvm_device: device, sys_module: root.path().join("module") });
        assert_eq!(check.level, Level::Warn);
        assert!(check.found.contains("TCG") && check.found.contains("kvm_pvm"), "{}", check.found);
        assert!(check.fix.unwrap().contains("none on this host"));
    }
}
