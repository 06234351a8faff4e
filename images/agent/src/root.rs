//! Moving the guest into an image root, as `switch_root` does: the image's disk (EROFS, read-only) under
//! the sandbox's writable layer (ext4), merged by overlayfs, with the kernel filesystems moved in. The
//! agent stays PID 1 and serves from inside it, so every workload runs in the image. The initramfs stays
//! underneath, out of reach: the workload user may not `chroot`.

use std::fs;
use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::{mount, MsFlags};
use vm_protocol::identity::WorkloadIdentity;
use vm_protocol::root::{IMAGE_DISK_SERIAL, KERNEL_ARG, WRITABLE_DISK_SERIAL};

/// The extra modules an image root needs (block device, EROFS, overlayfs), in load order.
pub const MODULE_LIST: &str = "/etc/vm-agent/modules-root";
/// How long the disks may take to appear once their driver loaded (it probes them as it loads).
const DISK_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the parts are mounted in the initramfs before the move.
const IMAGE_DIR: &str = "/layers/image";
const WRITABLE_DIR: &str = "/layers/writable";
const MERGED_DIR: &str = "/sysroot";

/// Why the image root could not be entered.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// `/proc/cmdline` could not be read.
    #[error("cannot read the kernel command line")]
    Cmdline(#[source] std::io::Error),
    /// A disk did not appear.
    #[error("no disk with serial {0} appeared")]
    NoDisk(&'static str),
    /// A mount failed.
    #[error("cannot mount {what}")]
    Mount {
        /// Which.
        what: &'static str,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// A directory or file of the root could not be made.
    #[error("cannot prepare {what} in the image root")]
    Prepare {
        /// Which.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Whether the host asked for an image root.
///
/// # Errors
/// [`RootError::Cmdline`].
pub fn asked() -> Result<bool, RootError> {
    let cmdline = fs::read_to_string("/proc/cmdline").map_err(RootError::Cmdline)?;
    Ok(cmdline.split_whitespace().any(|arg| arg == KERNEL_ARG))
}

/// Mounts the image root and makes it this process's root, with `who`'s home and account in it. The
/// modules in [`MODULE_LIST`] must be loaded.
///
/// # Errors
/// [`RootError`] naming the step.
pub fn enter(who: &WorkloadIdentity) -> Result<(), RootError> {
    let image = find_disk(IMAGE_DISK_SERIAL)?;
    let writable = find_disk(WRITABLE_DISK_SERIAL)?;
    let prepare = |what: &'static str| move |source| RootError::Prepare { what, source };
    for dir in [IMAGE_DIR, WRITABLE_DIR, MERGED_DIR] {
        fs::create_dir_all(dir).map_err(prepare("the mount points"))?;
    }
    // Nothing of the image runs with more than the workload's identity: no setuid, no device nodes.
    let contained = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount_at(&image, IMAGE_DIR, "erofs", contained | MsFlags::MS_RDONLY, None, "the image")?;
    mount_at(&writable, WRITABLE_DIR, "ext4", contained, None, "the writable layer")?;
    let upper = format!("{WRITABLE_DIR}/upper");
    let work = format!("{WRITABLE_DIR}/work");
    for dir in [&upper, &work] {
        fs::create_dir_all(dir).map_err(prepare("the overlay's directories"))?;
    }
    let options = format!("lowerdir={IMAGE_DIR},upperdir={upper},workdir={work}");
    mount_at(Path::new("overlay"), MERGED_DIR, "overlay", contained, Some(&options), "the overlay")?;

    let merged = Path::new(MERGED_DIR);
    for dir in ["proc", "sys", "dev", "run", "tmp"] {
        fs::create_dir_all(merged.join(dir)).map_err(prepare("the kernel filesystems' mount points"))?;
    }
    for dir in ["/proc", "/sys", "/dev"] {
        let target = merged.join(&dir[1..]);
        mount(Some(dir), &target, None::<&str>, MsFlags::MS_MOVE, None::<&str>)
            .map_err(|source| RootError::Mount { what: "a kernel filesystem into the image root", source })?;
    }
    let tmp_options = Some("mode=1777");
    mount_at(Path::new("tmpfs"), &format!("{MERGED_DIR}/tmp"), "tmpfs", contained, tmp_options, "/tmp")?;
    mount_at(Path::new("tmpfs"), &format!("{MERGED_DIR}/run"), "tmpfs", contained, Some("mode=755"), "/run")?;
    std::env::set_current_dir(merged).map_err(prepare("the move"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|source| RootError::Mount { what: "the image root over /", source })?;
    nix::unistd::chroot(".").map_err(|source| RootError::Mount { what: "the image root (chroot)", source })?;
    std::env::set_current_dir("/").map_err(prepare("the move"))?;
    // Inside the image now: its own symlinks (`/home -> var/home`, a linked `/etc/passwd`) resolve in it.
    let root = Path::new("/");
    add_account(root, who).map_err(prepare("the workload's account"))?;
    make_home(root, who).map_err(prepare("the workload's home"))
}

/// The device whose virtio serial is `serial`, waiting while its driver probes.
fn find_disk(serial: &'static str) -> Result<PathBuf, RootError> {
    let deadline = Instant::now() + DISK_TIMEOUT;
    loop {
        let found = fs::read_dir("/sys/block").into_iter().flatten().flatten().find_map(|entry| {
            let name = entry.file_name();
            let own = fs::read_to_string(entry.path().join("serial")).ok()?;
            (own.trim() == serial).then(|| Path::new("/dev").join(name))
        });
        match found {
            Some(dev) if dev.exists() => return Ok(dev),
            _ if Instant::now() >= deadline => return Err(RootError::NoDisk(serial)),
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn mount_at(
    source: &Path,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    options: Option<&str>,
    what: &'static str,
) -> Result<(), RootError> {
    mount(Some(source), target, Some(fstype), flags, options).map_err(|source| RootError::Mount { what, source })
}

/// Adds `who` to the image's `/etc/passwd` and `/etc/group` (in the writable layer) unless it has an entry
/// of that name: programs that look the user up (`id`, `getpwuid`, Python's `pathlib.Path.home`) find it.
fn add_account(root: &Path, who: &WorkloadIdentity) -> std::io::Result<()> {
    fs::create_dir_all(root.join("etc"))?;
    for (file, line, fallback) in [
        ("etc/passwd", who.passwd_line(), "root:x:0:0:root:/root:/bin/sh\n"),
        ("etc/group", who.group_line(), "root:x:0:\n"),
    ] {
        let path = root.join(file);
        let mut text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        if text.lines().any(|l| l.split(':').next() == Some(who.name)) {
            continue;
        }
        if text.is_empty() {
            text.push_str(fallback);
        } else if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&line);
        fs::write(&path, text)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644))?;
    }
    Ok(())
}

/// The workload's home, its own and private, whatever the image holds there.
fn make_home(root: &Path, who: &WorkloadIdentity) -> std::io::Result<()> {
    let home = root.join(who.home.trim_start_matches('/'));
    fs::create_dir_all(&home)?;
    chown(&home, Some(who.uid), Some(who.gid))?;
    fs::set_permissions(&home, fs::Permissions::from_mode(0o700))
}
