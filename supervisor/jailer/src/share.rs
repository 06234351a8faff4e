//! `vm-jailer share`: confines itself, then execs `virtiofsd` for one host directory
//! ([`vm_contract::share`]).
//!
//! ```text
//! join cgroups -> socket (stdin) to fd 3 -> no supplementary groups -> user namespace (only the guest's
//!   workload uid and gid, mapped to the directory's owner) -> mount/IPC/UTS/net/PID namespaces -> fork
//!   (the server is the PID namespace's init) -> jail root: system libraries, the server, a /proc of its
//!   own, the directory at /shared (read-only if asked) -> pivot_root -> the workload ids, CAP_SYS_CHROOT
//!   and CAP_SETPCAP alone (virtiofsd chroots into /shared) -> no new privileges -> no set-id files or
//!   devices (a seccomp filter) -> exec
//! ```
//!
//! The mapping is the whole of the server's identity: a guest request as any other uid (root included)
//! fails in the server's `setresuid` (EINVAL), and nothing it creates can belong to a host uid but the one
//! mapped. Its capabilities count only in its own user namespace, over files whose owner is mapped.

use std::convert::Infallible;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::sched::{unshare, CloneFlags};
use nix::unistd::{setgroups, setresgid, setresuid, Gid, Uid};
use rustix::mount::{mount, mount_remount, MountFlags};
use rustix::thread::{
    configure_capability_in_ambient_set, set_capabilities, set_keep_capabilities, CapabilitySet, CapabilitySets,
};
use vm_contract::jail::Confinement;
use vm_contract::share::{ShareJailerArgs, JAIL_SOURCE, RLIMIT_NOFILE, SOCKET_FD};

use crate::{chroot, creds, fds, pidns, root, setid, userns, JailError, Safeguards, JAIL_NAMESPACES};

/// What the server keeps, in its own namespace only: `chroot` into the shared directory, which it does
/// itself, and `setpcap`, to empty its bounding set as it starts (without it libcap-ng takes a path that
/// its own seccomp filter kills).
const KEPT: CapabilitySet = CapabilitySet::SYS_CHROOT.union(CapabilitySet::SETPCAP);

/// Confines this process for the file server and execs it.
pub fn confine_and_exec(args: &ShareJailerArgs, safeguards: Safeguards) -> Result<Infallible, JailError> {
    let supervisor = rustix::process::getppid();
    for cgroup in &args.cgroups {
        std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
            .map_err(JailError::step("join the VMM's cgroup"))?;
    }
    let mut inherited = fds::close_on_exec_beyond_stdio()?;
    let socket = take_socket()?;
    // The socket now owns that number: it is not an inherited descriptor to close.
    inherited.retain(|fd| *fd != SOCKET_FD);
    let source = checked_source(args)?;
    let last_cap = creds::last_capability();
    rustix::process::setpriority_process(None, i32::from(args.nice))
        .map_err(|e| JailError::step("set the niceness")(e.into()))?;
    creds::limit_files(RLIMIT_NOFILE)?;
    match args.confinement {
        Confinement::Jail => {
            // Host groups (root's among them) would still count in every permission check.
            setgroups(&[]).map_err(JailError::errno("drop the supplementary groups"))?;
            // The kernel makes no user namespace for a chrooted process: the namespace's own root first.
            if chroot::may_be_chrooted() {
                unshare(CloneFlags::CLONE_NEWNS).map_err(JailError::errno("create the namespaces"))?;
                chroot::rebase(&args.root, safeguards.chroot_private)?;
            }
            userns::enter_mapped_by_helper(&maps(args))?;
        }
        Confinement::Userns => userns::enter_self_mapped(&maps(args))?,
        Confinement::None => return Err(JailError::NoShareConfinement),
    }
    unshare(JAIL_NAMESPACES).map_err(JailError::errno("create the namespaces"))?;
    if safeguards.share_death_signal {
        die_with(supervisor)?;
    }
    let jailer = pidns::split(&inherited, vec![socket], safeguards)?;
    enter(args, source)?;
    become_workload(args, last_cap)?;
    jailer.die_with(safeguards)?;
    rustix::thread::set_no_new_privs(true).map_err(|e| JailError::step("set no-new-privileges")(e.into()))?;
    if safeguards.share_setid_filter {
        setid::forbid()?;
    }
    crate::exec(&args.exec)
}

/// One uid and one gid: the guest's workload ids, mapped to the directory's owner.
fn maps(args: &ShareJailerArgs) -> userns::Maps {
    userns::Maps::one(args.uid_map, args.gid_map)
}

/// The shared directory, opened through no symlink (the driver resolved its path: a symlink in it now was
/// put there since), and only if its owner is still the one the supervisor mapped the guest to.
fn open_source(args: &ShareJailerArgs) -> Result<OwnedFd, JailError> {
    use rustix::fs::{Mode, OFlags, ResolveFlags, CWD};
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let resolve = ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    rustix::fs::openat2(CWD, &args.source, flags, Mode::empty(), resolve)
        .map_err(|e| JailError::step("open the shared directory without following symlinks")(e.into()))
}

/// Device and inode: the same directory in every namespace.
fn identity(fd: &OwnedFd) -> Result<(u64, u64), JailError> {
    let st = rustix::fs::fstat(fd).map_err(|e| JailError::step("stat the shared directory")(e.into()))?;
    Ok((st.st_dev, st.st_ino))
}

/// The directory checked on the host ([`open_source`] there, and its owner against the supervisor's).
fn checked_source(args: &ShareJailerArgs) -> Result<(u64, u64), JailError> {
    let fd = open_source(args)?;
    let owner = rustix::fs::fstat(&fd).map_err(|e| JailError::step("stat the shared directory")(e.into()))?.st_uid;
    if owner != args.source_owner {
        return Err(JailError::Step("keep the shared directory's owner", std::io::ErrorKind::PermissionDenied.into()));
    }
    identity(&fd)
}

/// Unlike QEMU, the server has no watchdog: this process (and with it the server, its parent-death
/// signal armed in [`pidns::split`]) dies with the supervisor, even before QEMU has connected.
fn die_with(supervisor: Option<rustix::process::Pid>) -> Result<(), JailError> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .map_err(|e| JailError::step("arm the parent-death signal")(e.into()))?;
    // Gone before the signal was armed: this process has been reparented.
    if rustix::process::getppid() != supervisor {
        return Err(JailError::step("outlive the supervisor")(std::io::Error::from(std::io::ErrorKind::NotConnected)));
    }
    Ok(())
}

/// The listening socket the supervisor gave as stdin, moved to [`SOCKET_FD`] (open across the exec);
/// stdin becomes `/dev/null`.
fn take_socket() -> Result<OwnedFd, JailError> {
    let stdin = std::io::stdin();
    let target = {
        // SAFETY: SOCKET_FD is either closed or an inherited fd marked close-on-exec above, which dup2
        // replaces; nothing of this process owns it. No safe API duplicates onto a chosen number.
        #[allow(unsafe_code)]
        let mut fd = unsafe { OwnedFd::from_raw_fd(SOCKET_FD) };
        rustix::io::dup2(stdin.as_fd(), &mut fd).map_err(|e| JailError::step("take the socket")(e.into()))?;
        fd
    };
    let null = std::fs::File::open("/dev/null").map_err(JailError::step("open /dev/null"))?;
    nix::unistd::dup2_stdin(null).map_err(JailError::errno("point stdin at /dev/null"))?;
    Ok(target)
}

/// Builds the jail in `args.root` (system libraries, the server, a /proc of this PID namespace, the shared
/// directory) and makes it this process's root.
fn enter(args: &ShareJailerArgs, source: (u64, u64)) -> Result<(), JailError> {
    let root = &args.root;
    root::prepare(root)?;
    let program = args.exec.first().map(PathBuf::from).ok_or(JailError::NoProgram)?;
    root::JailFiles::new(root).program(&program)?;
    // The server reopens files through /proc/self/fd: a /proc of its own PID namespace, not the host's.
    let proc = root.join("proc");
    std::fs::create_dir_all(&proc).map_err(JailError::step("make a mount point"))?;
    mount("proc", &proc, "proc", MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC, None)
        .map_err(|e| JailError::step("mount /proc")(e.into()))?;
    let shared = root::inside(root, Path::new(JAIL_SOURCE));
    std::fs::create_dir_all(&shared).map_err(JailError::step("make a mount point"))?;
    // Opened again in this mount namespace (a bind takes its source from the caller's own), and only if
    // it is still the directory checked on the host.
    let fd = open_source(args)?;
    if identity(&fd)? != source {
        return Err(JailError::Step("keep the shared directory", std::io::ErrorKind::PermissionDenied.into()));
    }
    let opened = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    rustix::mount::mount_bind(&opened, &shared).map_err(|e| JailError::step("bind the shared directory")(e.into()))?;
    let mut flags = MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV;
    if args.readonly {
        flags |= MountFlags::RDONLY;
    }
    mount_remount(&shared, flags, "").map_err(|e| JailError::step("restrict the shared directory")(e.into()))?;
    root::bind_device(Path::new("/dev/null"), &root.join("dev/null"))?;
    // The server makes no mount from here: without CAP_SYS_ADMIN the read-only bind stays so.
    root::pivot(root)
}

/// Becomes the guest's workload ids inside the namespace, keeping [`KEPT`] only (also across the exec).
fn become_workload(args: &ShareJailerArgs, last_cap: u32) -> Result<(), JailError> {
    creds::limit_bounding_set(last_cap, KEPT)?;
    set_keep_capabilities(true).map_err(|e| JailError::step("keep capabilities")(e.into()))?;
    let (uid, gid) = (Uid::from_raw(args.uid_map.0), Gid::from_raw(args.gid_map.0));
    setresgid(gid, gid, gid).map_err(JailError::errno("set the workload's gid"))?;
    setresuid(uid, uid, uid).map_err(JailError::errno("set the workload's uid"))?;
    set_capabilities(None, CapabilitySets { effective: KEPT, permitted: KEPT, inheritable: KEPT })
        .map_err(|e| JailError::step("limit the capabilities")(e.into()))?;
    for cap in [CapabilitySet::SYS_CHROOT, CapabilitySet::SETPCAP] {
        configure_capability_in_ambient_set(cap, true).map_err(|e| JailError::step("keep a capability")(e.into()))?;
    }
    set_keep_capabilities(false).map_err(|e| JailError::step("keep capabilities")(e.into()))
}
