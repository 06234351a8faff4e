//! `vm-jailer`: started by the supervisor in place of QEMU; confines itself, then forks QEMU into its own
//! PID namespace and stays as its parent (with `none` confinement it execs QEMU instead), so the
//! confinement holds from QEMU's first instruction and nothing of it depends on QEMU's cooperation.
//!
//! - [`fds`]: every inherited fd beyond 0–2 closed at exec; a snapshot to restore from, and the guest's RAM
//!   memfd, opened for QEMU.
//! - [`root`]: new mount namespace, the jail's files bound read-only, `pivot_root` into it.
//! - [`closure`]: the objects QEMU's loader opens, read from the ELF headers.
//! - [`chroot`]: a host that is a chroot gets a namespace whose root is the chroot's, and a mount point, first.
//! - [`creds`]: rlimits, the capability bounding set emptied, the jail's uid and gid, no new privileges.
//! - [`pidns`]: QEMU becomes the first process of its own PID namespace; the jailer stays as its parent and
//!   reports its pid on stdout (always, with or without a namespace).
//!
//! The order matters: mounts need privilege, so they come first; ids change last but one, which clears
//! every capability; `PR_SET_NO_NEW_PRIVS` then lets QEMU install its seccomp filter unprivileged. The fork
//! comes last, so QEMU's parent is as confined as QEMU.
#![deny(unsafe_code)]

vm_contract::test_controls!();

mod chroot;
mod closure;
mod creds;
mod fds;
mod pidns;
mod root;
mod setid;
mod share;
mod userns;

use std::convert::Infallible;
use std::ffi::{CString, OsString};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::process::ExitCode;

use clap::Parser;
use nix::sched::{unshare, CloneFlags};
use vm_contract::jail::{Confinement, JailerArgs, PROBE_USERNS};
use vm_contract::share::ShareJailerArgs;

/// The namespaces every jail gets: mounts (the jail root), IPC, host name, network (QEMU has no network
/// device, and without its own network namespace an escaped QEMU could reach loopback services, such as the
/// OTLP collector, and every abstract Unix socket on the host), and processes (it sees and signals no other).
pub(crate) const JAIL_NAMESPACES: CloneFlags = CloneFlags::CLONE_NEWNS
    .union(CloneFlags::CLONE_NEWIPC)
    .union(CloneFlags::CLONE_NEWUTS)
    .union(CloneFlags::CLONE_NEWNET)
    .union(CloneFlags::CLONE_NEWPID);

/// What went wrong, as fixed text and the OS error.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// A setup step failed.
    #[error("cannot {0}")]
    Step(&'static str, #[source] std::io::Error),
    /// `jail` confinement without ids.
    #[error("jail confinement needs --uid and --gid")]
    NoIds,
    /// An argument holds a NUL byte.
    #[error("an argument holds a NUL byte")]
    Nul,
    /// No program to exec.
    #[error("no command line after --")]
    NoProgram,
    /// QEMU's dependency closure could not be read.
    #[error(transparent)]
    Closure(#[from] closure::ClosureError),
    /// Guest RAM from a memfd under `userns` confinement, whose jail can mount no `/proc`.
    #[error("guest RAM from a template needs jail or no confinement")]
    RamNeedsJail,
    /// The guest RAM memfd was refused.
    #[error(transparent)]
    Ram(#[from] vm_contract::guest_ram::RamError),
    /// A file server without namespaces.
    #[error("host directories need jail or userns confinement")]
    NoShareConfinement,
}

impl JailError {
    fn step(what: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |e| Self::Step(what, e)
    }
    fn errno(what: &'static str) -> impl FnOnce(nix::Error) -> Self {
        move |e| Self::Step(what, e.into())
    }
}

/// The safety mechanisms a test build's controls can switch off, read once, in [`main`].
#[derive(Debug, Clone, Copy)]
pub struct Safeguards {
    /// QEMU gets SIGKILL when the jailer dies (off: `jailer-no-death-signal`).
    pub parent_death_signal: bool,
    /// A file server's jailer gets SIGKILL when the supervisor dies (off: `share-no-death-signal`).
    pub share_death_signal: bool,
    /// A file server may not make set-id files or devices (off: `share-allows-setid`).
    pub share_setid_filter: bool,
    /// In a chroot, every mount is made private before the chroot is made a mount point (off:
    /// `jail-chroot-shared-mounts`).
    pub chroot_private: bool,
    /// A template clone's `/proc` shows QEMU its own processes only (off: `jail-proc-shows-all`).
    pub proc_own_only: bool,
}

impl Safeguards {
    /// The switches of this process's environment; in a release build, every safeguard on.
    fn read() -> Self {
        use vm_contract::test_control::TestControl;
        Self {
            parent_death_signal: !control(TestControl::JailerNoDeathSignal),
            share_death_signal: !control(TestControl::ShareNoDeathSignal),
            share_setid_filter: !control(TestControl::ShareAllowsSetId),
            chroot_private: !control(TestControl::JailChrootSharedMounts),
            proc_own_only: !control(TestControl::JailProcShowsAll),
        }
    }
}

fn main() -> ExitCode {
    if std::env::args_os().nth(1).is_some_and(|a| a == PROBE_USERNS) {
        return probe_userns();
    }
    #[cfg(feature = "test-controls")]
    eprintln!("{}", vm_contract::test_control::announcement("vm-jailer"));
    let outcome = if std::env::args_os().nth(1).is_some_and(|a| a == vm_contract::share::SUBCOMMAND) {
        let args = ShareJailerArgs::parse_from(std::env::args_os().skip(1));
        share::confine_and_exec(&args, Safeguards::read())
    } else {
        confine_and_exec(&JailerArgs::parse(), Safeguards::read())
    };
    let Err(e) = outcome;
    // QEMU's stderr is the supervisor's vmm.log pipe: the reason lands there and in the boot error.
    let mut message = format!("vm-jailer: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    eprintln!("{message}");
    ExitCode::from(vm_contract::exit::JAILER_FAILED)
}

fn confine_and_exec(args: &JailerArgs, safeguards: Safeguards) -> Result<Infallible, JailError> {
    // First, while root: QEMU's limits hold from its first allocation.
    for cgroup in &args.cgroups {
        std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
            .map_err(JailError::step("join the VMM's cgroup"))?;
    }
    let inherited = fds::close_on_exec_beyond_stdio()?;
    // Opened here, while the host's files are still in view; the jail has none of them.
    let mut qemu = args.exec.clone();
    let mut for_qemu = Vec::new();
    if let Some(snapshot) = args.incoming.as_deref().map(fds::open_for_exec).transpose()? {
        qemu.extend([OsString::from("-incoming"), format!("fd:{}", snapshot.as_raw_fd()).into()]);
        for_qemu.push(snapshot);
    }
    if let Some(ram) = fds::guest_ram(args)? {
        qemu.extend(["-object".into(), ram.backend.into()]);
        for_qemu.push(ram.fd);
    }
    // Read while /proc is still there: the jail has none.
    let last_cap = creds::last_capability();
    let fsize = creds::file_size_limit(args.writable_disk.as_deref())?
        .max(args.shared_memory_mib.map_or(0, |mib| u64::from(mib) << 20));
    rustix::process::setpriority_process(None, i32::from(args.nice))
        .map_err(|e| JailError::step("set the niceness")(e.into()))?;
    match args.confinement {
        Confinement::Jail => {
            let ids = args.ids().ok_or(JailError::NoIds)?;
            let kvm_group = if args.kvm { creds::kvm_group()? } else { None };
            let chrooted = chroot::may_be_chrooted();
            unshare(JAIL_NAMESPACES).map_err(JailError::errno("create the namespaces"))?;
            if chrooted {
                chroot::rebase(&args.root, safeguards.chroot_private)?;
            }
            root::enter(args, safeguards)?;
            creds::limit(true, fsize)?;
            creds::drop_to(ids, kvm_group, last_cap)?;
        }
        Confinement::Userns if args.guest_ram_fd.is_some() => return Err(JailError::RamNeedsJail),
        Confinement::Userns => {
            let (uid, gid) = (rustix::process::getuid(), rustix::process::getgid());
            unshare(CloneFlags::CLONE_NEWUSER | JAIL_NAMESPACES).map_err(JailError::errno("create the namespaces"))?;
            creds::map_self(uid.as_raw(), gid.as_raw())?;
            root::enter(args, safeguards)?;
            creds::limit(false, fsize)?;
            creds::drop_capabilities(last_cap)?;
        }
        Confinement::None => {
            rustix::process::chdir(&args.root).map_err(|e| JailError::step("enter the VMM directory")(e.into()))?;
            creds::limit(false, fsize)?;
        }
    }
    rustix::thread::set_no_new_privs(true).map_err(|e| JailError::step("set no-new-privileges")(e.into()))?;
    if args.confinement.has_pid_namespace() {
        pidns::split(&inherited, for_qemu, safeguards)?;
    } else {
        pidns::report_pid(std::process::id())?;
    }
    exec(&qemu)
}

/// Execs QEMU (or the file server) with an empty environment.
pub(crate) fn exec(argv: &[OsString]) -> Result<Infallible, JailError> {
    let argv: Vec<CString> =
        argv.iter().map(|a| CString::new(a.as_bytes()).map_err(|_| JailError::Nul)).collect::<Result<_, _>>()?;
    let program = argv.first().ok_or(JailError::NoProgram)?;
    let env: [CString; 0] = [];
    let Err(e) = nix::unistd::execve(program, &argv, &env);
    Err(JailError::errno("execute the program")(e))
}

/// Whether an unprivileged user namespace with a mount namespace can be made here.
fn probe_userns() -> ExitCode {
    let made = unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS).is_ok();
    ExitCode::from(u8::from(!made))
}
