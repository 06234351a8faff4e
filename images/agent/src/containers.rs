//! Containers' own roots in a pod's VM ([`vm_protocol::container`]): a root is mounted at the first `Spawn`
//! that names it and kept until the guest powers off. Its image disk, a file in the host's pod directory,
//! is attached to a loop device and mounted read-only (EROFS) under a writable layer of the guest's memory
//! (overlayfs on a tmpfs); `/proc`, `/sys` and the guest's `/dev` are mounted in it, the workload's home
//! made (and `/tmp` where the image has none), and the files the host binds (`/etc/hosts`,
//! `/etc/resolv.conf`, ...) copied in. A process of the root is chrooted into it by
//! [`crate::spawn`]. A root whose disk the host took out of the pod's directory (the container was deleted)
//! is unmounted and its loop device freed before the next root is mounted.
//!
//! The image is the tenant's: no path of it is followed. Every directory the agent mounts on or writes
//! into is walked one component at a time and refused where the image has a symlink, so a crafted image
//! cannot make the agent mount or write outside the root.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::c_ulong;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::libc;
use nix::mount::{mount, MsFlags};
use vm_protocol::container::{ContainerRoot, MAX_FILE_BYTES, MAX_ROOTS, POD_SHARE};

/// Where the roots are assembled, out of the workloads' reach (root's, 0700).
const ROOTS_DIR: &str = "/run/vmdriver-containers";
/// `<linux/loop.h>`: take a free loop device's number, bind a loop device to a file, and unbind it.
const LOOP_CTL_GET_FREE: c_ulong = 0x4C82;
const LOOP_SET_FD: c_ulong = 0x4C00;
const LOOP_CLR_FD: c_ulong = 0x4C01;
/// How long a new loop device's node may take to appear (devtmpfs makes it on its own thread).
const NODE_TIMEOUT: Duration = Duration::from_secs(5);

/// The roots mounted so far, by name.
static ROOTS: Mutex<BTreeMap<String, Mounted>> = Mutex::new(BTreeMap::new());

/// A mounted root.
struct Mounted {
    /// The merged directory each of its processes is chrooted into.
    merged: PathBuf,
    /// The loop device its disk is on.
    device: PathBuf,
}

/// Why a root could not be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ContainerError {
    /// The host's request is malformed.
    #[error("{0}")]
    Invalid(#[from] vm_protocol::container::RootError),
    /// More roots than one guest mounts.
    #[error("this VM already holds {MAX_ROOTS} container roots")]
    TooMany,
    /// A step failed.
    #[error("cannot {what}: {source}")]
    Step {
        /// Which.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn step(what: &'static str) -> impl FnOnce(io::Error) -> ContainerError {
    move |source| ContainerError::Step { what, source }
}

/// [`step`] for a mount, whose error is an errno.
fn mount_step(what: &'static str) -> impl FnOnce(Errno) -> ContainerError {
    move |e| step(what)(io::Error::from_raw_os_error(e as i32))
}

/// The merged directory of `root`, mounted now if this is its first process.
///
/// # Errors
/// [`ContainerError`]; a root that failed is tried again at its next `Spawn`.
pub(crate) fn enter(root: &ContainerRoot) -> Result<PathBuf, ContainerError> {
    root.check()?;
    let mut roots = ROOTS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(mounted) = roots.get(&root.name) {
        return Ok(mounted.merged.clone());
    }
    // The roots of containers the host deleted (their disks are gone from the pod's directory) go first: a
    // pod whose containers restart keeps making new ones. A listing, not a lookup: the guest may keep a
    // removed file's name cached for a while.
    if let Ok(listing) = fs::read_dir(POD_SHARE) {
        let disks: Vec<_> = listing.flatten().map(|entry| entry.file_name()).collect();
        roots.retain(|name, mounted| {
            let kept = disks.iter().any(|disk| disk.to_str() == Some(ContainerRoot::disk_of(name).as_str()));
            if !kept {
                release(mounted);
            }
            kept
        });
    }
    if roots.len() >= MAX_ROOTS {
        return Err(ContainerError::TooMany);
    }
    let mounted = assemble(root)?;
    let merged = mounted.merged.clone();
    roots.insert(root.name.clone(), mounted);
    Ok(merged)
}

/// Takes a root's mounts away (lazily: a process still in it keeps what it uses until it ends) and frees its
/// loop device (the kernel frees a busy one when its last user lets go).
fn release(mounted: &Mounted) {
    let merged = &mounted.merged;
    let parts = [merged.join("dev"), merged.join("sys"), merged.join("proc"), merged.clone()];
    let base = merged.parent().map(Path::to_path_buf).unwrap_or_default();
    // Never following a symlink: the image's `/proc` may lead anywhere in the guest, `/` included.
    let flags = nix::mount::MntFlags::MNT_DETACH | nix::mount::MntFlags::UMOUNT_NOFOLLOW;
    for dir in parts.iter().chain([&base.join("rw"), &base.join("image")]) {
        let _ = nix::mount::umount2(dir, flags);
    }
    if let Ok(device) = File::open(&mounted.device) {
        // SAFETY: LOOP_CLR_FD takes no argument; the descriptor is open for the call.
        let _ = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CLR_FD) };
    }
}

fn assemble(root: &ContainerRoot) -> Result<Mounted, ContainerError> {
    let base = Path::new(ROOTS_DIR).join(&root.name);
    let (image, rw, merged) = (base.join("image"), base.join("rw"), base.join("merged"));
    let mut private = fs::DirBuilder::new();
    private.recursive(true).mode(0o700);
    for dir in [&image, &rw, &merged] {
        private.create(dir).map_err(step("make the root's directories"))?;
    }
    let device = attach(&Path::new(POD_SHARE).join(root.disk_name())).map_err(step("attach the image disk"))?;
    let mounted = Mounted { merged, device };
    match fill(root, &mounted, &image, &rw) {
        Ok(()) => Ok(mounted),
        Err(e) => {
            // Its next `Spawn` starts again from nothing: no loop device is left bound.
            release(&mounted);
            Err(e)
        }
    }
}

/// Mounts the parts of a root whose disk is on `mounted.device`, and puts the workload's and the host's files
/// in it.
fn fill(root: &ContainerRoot, mounted: &Mounted, image: &Path, rw: &Path) -> Result<(), ContainerError> {
    let (merged, device) = (&mounted.merged, &mounted.device);
    let contained = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(Some(device), image, Some("erofs"), contained | MsFlags::MS_RDONLY, None::<&str>)
        .map_err(mount_step("mount the image disk"))?;
    mount(Some("tmpfs"), rw, Some("tmpfs"), contained, Some("mode=755"))
        .map_err(mount_step("mount the writable layer"))?;
    let (upper, work) = (rw.join("upper"), rw.join("work"));
    for dir in [&upper, &work] {
        fs::create_dir(dir).map_err(step("make the writable layer"))?;
    }
    let options = format!("lowerdir={},upperdir={},workdir={}", image.display(), upper.display(), work.display());
    mount(Some("overlay"), merged, Some("overlay"), contained, Some(options.as_str()))
        .map_err(mount_step("mount the root's overlay"))?;

    let proc_dir = dir_in(merged, Path::new("proc")).map_err(step("make /proc in the root"))?;
    mount(Some("proc"), &proc_dir, Some("proc"), contained | MsFlags::MS_NOEXEC, None::<&str>)
        .map_err(mount_step("mount /proc in the root"))?;
    let sys_dir = dir_in(merged, Path::new("sys")).map_err(step("make /sys in the root"))?;
    let sys_flags = contained | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY;
    mount(Some("sysfs"), &sys_dir, Some("sysfs"), sys_flags, None::<&str>)
        .map_err(mount_step("mount /sys in the root"))?;
    // The guest's devices, terminals and /dev/shm: one pod, one /dev, as a pod's containers share IPC.
    let dev_dir = dir_in(merged, Path::new("dev")).map_err(step("make /dev in the root"))?;
    mount(Some("/dev"), &dev_dir, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
        .map_err(mount_step("mount /dev in the root"))?;

    // What the workload user may write, as in the VM's own root: its home, its own and private, and a /tmp
    // where the image has none.
    let who = vm_protocol::identity::WORKLOAD;
    let home = dir_in(merged, Path::new(who.home.trim_start_matches('/'))).map_err(step("make the home"))?;
    std::os::unix::fs::chown(&home, Some(who.uid), Some(who.gid)).map_err(step("make the home"))?;
    fs::set_permissions(&home, fs::Permissions::from_mode(0o700)).map_err(step("make the home"))?;
    if fs::symlink_metadata(merged.join("tmp")).is_err() {
        let tmp = dir_in(merged, Path::new("tmp")).map_err(step("make /tmp"))?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777)).map_err(step("make /tmp"))?;
    }

    let sources = Path::new(POD_SHARE).join(root.files_dir());
    for (i, target) in root.files.iter().enumerate() {
        copy_in(&sources.join(i.to_string()), merged, target).map_err(step("copy a file into the root"))?;
    }
    Ok(())
}

/// Binds a free loop device to `file`, read-only, and returns the device's path.
fn attach(file: &Path) -> io::Result<PathBuf> {
    // Opened read-only, the kernel makes the loop device read-only too.
    let backing = File::open(file)?;
    let control = OpenOptions::new().read(true).write(true).open("/dev/loop-control")?;
    // Another attach between the two calls takes the device first (EBUSY): ask again.
    for _ in 0..MAX_ROOTS {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number; the fd is open for the call.
        let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if number < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{number}"));
        let device = open_node(&path)?;
        // SAFETY: LOOP_SET_FD takes a descriptor by value; both descriptors are open for the call.
        let bound = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_SET_FD, backing.as_raw_fd()) };
        if bound == 0 {
            return Ok(path);
        }
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EBUSY) {
            return Err(error);
        }
    }
    Err(io::Error::from_raw_os_error(libc::EBUSY))
}

fn open_node(path: &Path) -> io::Result<File> {
    let deadline = Instant::now() + NODE_TIMEOUT;
    loop {
        match OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            other => return other,
        }
    }
}

/// The directory `relative` under `root`, made (0755) where missing; refused where the root has a symlink or a
/// file on the way.
fn dir_in(root: &Path, relative: &Path) -> io::Result<PathBuf> {
    let mut path = root.to_path_buf();
    for part in relative.components() {
        let Component::Normal(name) = part else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a plain relative path"));
        };
        path.push(name);
        match fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_dir() => {}
            Ok(_) => return Err(io::Error::new(io::ErrorKind::InvalidInput, "the image has no directory there")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs::DirBuilder::new().mode(0o755).create(&path)?,
            Err(e) => return Err(e),
        }
    }
    Ok(path)
}

/// Copies the host's file `source` (at most [`MAX_FILE_BYTES`]) to `target` in `root`, replacing a file or
/// symlink of the image's there (never following it).
fn copy_in(source: &Path, root: &Path, target: &str) -> io::Result<()> {
    let mut bytes = Vec::new();
    File::open(source)?.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "the file is too large"));
    }
    let relative = Path::new(target.trim_start_matches('/'));
    let (Some(parent), Some(name)) = (relative.parent(), relative.file_name()) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no file name"));
    };
    let path = dir_in(root, parent)?.join(name);
    match fs::symlink_metadata(&path) {
        Ok(meta) if meta.is_dir() => {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the image has a directory there"));
        }
        Ok(_) => fs::remove_file(&path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)?;
    io::Write::write_all(&mut file, &bytes)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use super::*;

    #[test]
    fn a_symlink_of_the_image_is_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let (root, outside) = (dir.path().join("root"), dir.path().join("outside"));
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("proc")).unwrap();
        std::os::unix::fs::symlink(outside.join("hosts"), root.join("etc/hosts")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("lnk")).unwrap();
        let source = dir.path().join("source");
        fs::write(&source, "127.0.0.1 pod\n").unwrap();

        // Control: a plain write follows the image's symlink out of the root.
        fs::write(root.join("etc/hosts"), "x").unwrap();
        assert!(outside.join("hosts").exists(), "control: the symlink leads outside");
        fs::remove_file(outside.join("hosts")).unwrap();

        assert!(dir_in(&root, Path::new("proc")).is_err(), "a symlinked mount point is refused");
        copy_in(&source, &root, "/etc/hosts").unwrap();
        assert!(!outside.join("hosts").exists(), "the image's symlink was replaced, not followed");
        assert_eq!(fs::read_to_string(root.join("etc/hosts")).unwrap(), "127.0.0.1 pod\n");
        assert!(copy_in(&source, &root, "/lnk/x").is_err(), "a symlinked parent is refused");
        assert!(fs::read_dir(&outside).unwrap().next().is_none(), "nothing was written outside the root");
        copy_in(&source, &root, "/new/dir/file").unwrap();
        assert!(root.join("new/dir/file").is_file());
    }

    #[test]
    fn a_file_over_the_bound_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("big");
        fs::write(&source, vec![b'x'; usize::try_from(MAX_FILE_BYTES).unwrap() + 1]).unwrap();
        let error = copy_in(&source, dir.path(), "/etc/hosts").unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }
}
