//! Boot: from the trusted arguments to a VM whose agent answered, under a live lease, with the attach socket
//! bound.
//!
//! ```text
//! join cgroup -> choose accelerator -> bind vmm/{chan,console}.sock (the jail's ids, 0600) -> start QEMU
//!   through vm-jailer -> QEMU's pid from the jailer -> record pids -> start the watchdog
//!   (ready in 5 s) -> agent hello (boot timeout; pulses flow meanwhile) -> Reseed -> bind attach.sock
//! ```
//!
//! A VM to be saved (`--save-snapshot`) also binds `vmm/{qmp,migrate}.sock` and takes QEMU's monitor
//! connection; a restored one (`--restore-snapshot`) has QEMU started from the saved stream, checks the saved
//! hello in place of a fresh one, and is pinged after its `Reseed` ([`crate::snapshot`]).
//!
//! Nothing is left running when boot fails: QEMU is killed and the watchdog closed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use vm_contract::args::SupervisorArgs;
use vm_contract::jail::{parse_vmm_pid_line, Confinement, JailIds};
use vm_contract::layout::SandboxFile;
use vm_contract::pids::{ProcessRecord, SandboxPids};
use vm_contract::snapshot::SnapshotFile;
use vm_contract::status::SupervisorStatus;
use vm_protocol::handshake::FirstFrameError;

use crate::accel::{self, KvmUnusable};
use crate::guest_link::{self, GuestLink, LinkError};
use crate::guest_logs::{self, Dropped};
use crate::inbox::{Senders, StopRequests};
use crate::lease::{Lease, LeaseStartError};
use crate::status;
use crate::vmm::{self, VmmConfig};
use crate::vmm_process::VmmProcess;

/// After the channel failed during boot, how long to wait for QEMU's own exit before calling it a guest
/// failure.
const VMM_EXIT_GRACE_MS: u64 = 500;

/// Why start-up failed. Nothing is left running when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The sandbox directory is unusable.
    #[error("cannot enter the sandbox directory {}", .0.display())]
    SandboxDir(PathBuf, #[source] std::io::Error),
    /// The parent-liveness reader could not be started; without it the VM could outlive the driver.
    #[error("cannot start the parent-liveness reader")]
    Liveness(#[source] std::io::Error),
    /// `--accel kvm` on a host where KVM cannot boot the guest.
    #[error("--accel kvm: KVM cannot be used here")]
    Kvm(#[source] KvmUnusable),
    /// No QEMU.
    #[error("qemu-system-x86_64 not found on PATH; install Debian's qemu-system-x86 package")]
    NoQemu,
    /// A kernel or initramfs is missing.
    #[error("guest {what} {} does not exist", path.display())]
    MissingImage {
        /// `kernel` or `initramfs`.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// A socket could not be bound.
    #[error("cannot bind {}", .0.name())]
    Bind(SandboxFile, #[source] std::io::Error),
    /// QEMU could not be started.
    #[error("cannot start the VMM")]
    SpawnVmm(#[source] std::io::Error),
    /// A guest log could not be set up.
    #[error("cannot set up {}", .0.name())]
    Log(SandboxFile, #[source] std::io::Error),
    /// No watchdog or jailer binary next to the supervisor.
    #[error("{} not found (it is installed next to vm-supervisor)", .0.display())]
    NoSibling(PathBuf),
    /// The approved policy in the sandbox directory is not valid.
    #[error("the sandbox's policy is not valid")]
    Policy(#[source] vm_protocol::policy::PolicyError),
    /// The approved policy in the sandbox directory cannot be read.
    #[error("cannot read the sandbox's policy")]
    PolicyUnreadable(#[source] std::io::Error),
    /// `jail` confinement without an id for the VMM.
    #[error("jail confinement needs --jail-id")]
    NoJailId,
    /// The lease could not be established.
    #[error("the VM was refused: no lease")]
    Lease(#[source] LeaseStartError),
    /// The lease failed during boot.
    #[error("the VM was refused: the lease failed during boot")]
    LeaseLost(#[source] crate::lease::LeaseFailure),
    /// The pids file could not be written; without it the reaper could not find an orphaned VM.
    #[error("cannot record the sandbox's pids")]
    Pids(#[source] std::io::Error),
    /// The jailer did not report a pid that names its QEMU.
    #[error("the jailer did not report QEMU's pid")]
    NoVmmPid,
    /// QEMU exited before the agent answered.
    #[error("the VMM exited during boot ({status})")]
    VmmExitedDuringBoot {
        /// QEMU's exit status.
        status: String,
    },
    /// The agent did not come up.
    #[error("the VM did not boot")]
    Boot(#[source] LinkError),
    /// Told to stop before the VM was ready.
    #[error("stopped during boot")]
    StoppedDuringBoot,
    /// The launch descriptor was not admitted.
    #[error("the launch descriptor was refused")]
    Descriptor(#[source] vm_contract::descriptor::Mismatch),
    /// The auth bundle is unreadable.
    #[error("cannot read the auth bundle")]
    Bundle(#[source] vm_contract::auth::BundleError),
    /// A session socket was given without a session id or token.
    #[error("a session socket was given without a session id, or the auth bundle has no session token")]
    NoSessionToken,
    /// The telemetry settings are unusable.
    #[error("bad telemetry settings")]
    Telemetry(#[source] crate::telemetry::settings::SettingsError),
    /// A telemetry sink could not start.
    #[error("cannot start telemetry")]
    TelemetrySinks(#[source] crate::telemetry::TelemetryError),
    /// The snapshot to restore from is unreadable.
    #[error("cannot read the snapshot to restore")]
    Snapshot(#[source] std::io::Error),
    /// QEMU did not connect its monitor (a VM to be saved needs it).
    #[error("the VMM did not connect its monitor")]
    Monitor(#[source] std::io::Error),
    /// `--save-snapshot`: the save failed.
    #[error("cannot save the VM")]
    Save(#[source] crate::snapshot::SaveError),
    /// `--save-snapshot`: the VM stopped before it was saved.
    #[error("the VM stopped before it was saved ({0})")]
    StoppedBeforeSave(crate::stop::StopReason),
    /// A pooled VM's claim line could not be used.
    #[error("the claim was refused")]
    Claim(#[source] vm_contract::claim::ClaimError),
}

impl StartError {
    /// Whether the guest's handshake was wrong (as opposed to missing): a protocol violation to report.
    pub fn is_bad_handshake(&self) -> bool {
        matches!(self, Self::Boot(LinkError::Handshake(_)))
    }

    /// Whether QEMU's and the guest's logs explain it.
    pub fn concerns_the_guest(&self) -> bool {
        matches!(self, Self::Boot(_) | Self::VmmExitedDuringBoot { .. })
    }
}

/// A VM whose agent answered, under a live lease, with its attach socket bound.
pub(crate) struct Booted {
    /// QEMU, through the jailer.
    pub(crate) vmm: VmmProcess,
    /// QEMU's own process.
    pub(crate) vmm_record: ProcessRecord,
    pub(crate) lease: Lease,
    pub(crate) link: GuestLink,
    pub(crate) attach: UnixListener,
    pub(crate) logs: GuestLogs,
    /// `--save-snapshot`: QEMU's monitor and the socket its migration stream will come to.
    pub(crate) save: Option<crate::snapshot::SaveLine>,
}

/// What the guest's logs dropped past their caps.
#[derive(Debug)]
pub(crate) struct GuestLogs {
    pub(crate) console: Arc<Dropped>,
    pub(crate) vmm: Arc<Dropped>,
}

/// How long QEMU has to connect its console after it starts (it does so before anything else).
const CONSOLE_CONNECT_MS: u64 = 5_000;

/// Boots the VM described by `args`. A stop request arriving meanwhile ends the boot.
pub(crate) async fn boot(
    args: &SupervisorArgs,
    senders: &Senders,
    stop: &mut watch::Receiver<StopRequests>,
) -> Result<Booted, StartError> {
    if let Some(cgroup) = &args.cgroup {
        // Before anything is started, so QEMU and the watchdog inherit it. Not fatal: it is the last sweep,
        // not the first line of defence.
        if std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string()).is_err() {
            tracing::warn!(cgroup = %cgroup.display(), "cannot join the sandbox's cgroup");
        }
    }
    for (what, path) in [("kernel", &args.kernel), ("initramfs", &args.initrd)] {
        if !path.is_file() {
            return Err(StartError::MissingImage { what, path: path.clone() });
        }
    }
    let watchdog = sibling_binary("vm-watchdog")?;
    let (accel, fallback) = accel::Host::default().choose(args.accel).map_err(StartError::Kvm)?;
    if let Some(why) = &fallback {
        tracing::warn!(reason = %why, "KVM unusable; using TCG software emulation");
    }
    status::report(&SupervisorStatus::Accelerator { accel, fallback: fallback.map(|w| w.to_string()) });
    let qemu = match &args.qemu {
        Some(q) => std::path::absolute(q).map_err(|_| StartError::NoQemu)?,
        None => vmm::find_on_path("qemu-system-x86_64").ok_or(StartError::NoQemu)?,
    };
    let ids = args.jail_id.map(|id| JailIds { uid: id, gid: id });
    if args.confinement == Confinement::Jail && ids.is_none() {
        return Err(StartError::NoJailId);
    }
    let root = vmm_root(&args.sandbox_dir)?;
    let channel = bind(SandboxFile::Channel, ids)?;
    let console = bind(SandboxFile::ConsoleSocket, ids)?;
    let saving = args.save_snapshot.is_some();
    let monitor = if saving { Some(bind(SandboxFile::Monitor, ids)?) } else { None };
    let migration = if saving { Some(bind(SandboxFile::Migration, ids)?) } else { None };
    let restored = match &args.restore_snapshot {
        Some(dir) => Some(crate::snapshot::saved_hello(dir).map_err(StartError::Snapshot)?),
        None => None,
    };
    let config = VmmConfig {
        qemu,
        jailer: sibling_binary("vm-jailer")?,
        confinement: args.confinement,
        ids,
        root,
        cgroups: args.vmm_cgroups.clone(),
        kernel: args.kernel.clone(),
        initrd: args.initrd.clone(),
        shape: args.shape,
        accel,
        monitor: saving,
        incoming: args.restore_snapshot.as_deref().map(|dir| SnapshotFile::State.path(dir)),
        tsc_khz: args.tsc_khz,
    };
    // Until QEMU's pid is known, the switch kills the jailer, and QEMU with it (its parent-death signal).
    let mut vmm = VmmProcess::new(config.spawn().map_err(StartError::SpawnVmm)?, senders.vmm_kill.clone());
    let booted = async {
        let logs = guest_logs(&mut vmm, &console, senders).await?;
        let save = match (monitor, migration) {
            (Some(monitor), Some(migration)) => Some(crate::snapshot::SaveLine {
                monitor: accept_from_vmm(&mut vmm, &monitor).await?.map_err(StartError::Monitor)?,
                migration,
            }),
            _ => None,
        };
        let vmm_record = qemu_process(&mut vmm).await?;
        vmm.arm(vmm_record);
        let how = guest_link::LinkStart { saved_hello: restored.as_ref(), settle: saving || restored.is_some() };
        let link = Link { channel: &channel, how };
        let (lease, link, attach) = lease_and_link(args, &mut vmm, vmm_record, link, &watchdog, senders, stop).await?;
        Ok::<_, StartError>((vmm_record, lease, link, attach, logs, save))
    };
    match booted.await {
        Ok((vmm_record, lease, link, attach, logs, save)) => {
            Ok(Booted { vmm, vmm_record, lease, link, attach, logs, save })
        }
        Err(e) => {
            vmm.kill().await;
            Err(e)
        }
    }
}

/// Takes QEMU's console connection and its stderr, and copies each into its capped file.
async fn guest_logs(vmm: &mut VmmProcess, console: &UnixListener, senders: &Senders) -> Result<GuestLogs, StartError> {
    let broken = |what: SandboxFile, e: std::io::Error| StartError::Log(what, e);
    let copy = |from, file: SandboxFile, cap: u64| {
        guest_logs::copy_capped(from, file.as_ref(), guest_logs::cap(cap), file.name(), senders.control.clone())
            .map_err(|e| broken(file, e))
    };
    let stderr =
        vmm.jailer.stderr.take().ok_or_else(|| broken(SandboxFile::VmmLog, std::io::ErrorKind::BrokenPipe.into()))?;
    let vmm_dropped = copy(
        Box::new(stderr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
        SandboxFile::VmmLog,
        guest_logs::VMM_LOG_CAP_BYTES,
    )?;
    let stream = accept_from_vmm(vmm, console).await?.map_err(|e| broken(SandboxFile::ConsoleSocket, e))?;
    let console_dropped = copy(Box::new(stream), SandboxFile::Console, guest_logs::CONSOLE_CAP_BYTES)?;
    Ok(GuestLogs { console: console_dropped, vmm: vmm_dropped })
}

/// QEMU's connection on `listener` (its console or monitor, which it connects at start), within
/// [`CONSOLE_CONNECT_MS`]; QEMU's exit meanwhile is the error.
async fn accept_from_vmm(
    vmm: &mut VmmProcess,
    listener: &UnixListener,
) -> Result<std::io::Result<tokio::net::UnixStream>, StartError> {
    tokio::select! {
        accepted = tokio::time::timeout(Duration::from_millis(CONSOLE_CONNECT_MS), listener.accept()) => {
            Ok(accepted.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())).map(|(stream, _)| stream))
        }
        exit = vmm.wait() => {
            Err(StartError::VmmExitedDuringBoot { status: exit.map_or_else(|e| e.to_string(), |s| s.to_string()) })
        }
    }
}

/// The boundary channel's listener, and how the link starts on it.
#[derive(Clone, Copy)]
struct Link<'a> {
    channel: &'a UnixListener,
    how: guest_link::LinkStart<'a>,
}

/// QEMU's own process: the pid the jailer reports ([`vm_contract::jail::vmm_pid_line`]), taken only if it is
/// the jailer's child, or the jailer itself (which becomes QEMU when there is no PID namespace).
async fn qemu_process(vmm: &mut VmmProcess) -> Result<ProcessRecord, StartError> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let mut line = String::new();
    if let Some(stdout) = vmm.jailer.stdout.take() {
        // One short line; anything longer is not the contract.
        let mut reader = tokio::io::BufReader::new(stdout.take(24));
        let wait = Duration::from_millis(CONSOLE_CONNECT_MS);
        let _ = tokio::time::timeout(wait, reader.read_line(&mut line)).await;
    }
    let jailer = vmm.jailer.id().and_then(|p| i32::try_from(p).ok());
    let reported = parse_vmm_pid_line(&line).and_then(|p| i32::try_from(p).ok());
    let record = match (reported, jailer) {
        (Some(pid), Some(jailer)) if pid == jailer => ProcessRecord::read(pid),
        (Some(pid), Some(jailer)) => ProcessRecord::read_child_of(pid, jailer),
        _ => None,
    };
    match record {
        Some(record) => Ok(record),
        // A jailer that failed says why on vmm.log and exits: its exit is the cause.
        None => Err(vmm_exit_within_grace(vmm).await.unwrap_or(StartError::NoVmmPid)),
    }
}

/// `name` (`vm-watchdog`, `vm-jailer`), next to this binary.
fn sibling_binary(name: &str) -> Result<PathBuf, StartError> {
    let path = std::env::current_exe().map_or_else(|_| PathBuf::from(name), |exe| exe.with_file_name(name));
    if path.is_file() {
        Ok(path)
    } else {
        Err(StartError::NoSibling(path))
    }
}

/// The VMM directory, made (0755: a jailed QEMU must traverse its own root, never write it) if missing.
fn vmm_root(sandbox_dir: &Path) -> Result<PathBuf, StartError> {
    use std::os::unix::fs::PermissionsExt;
    let root = std::path::absolute(sandbox_dir.join(SandboxFile::VmmRoot.name()))
        .map_err(|e| StartError::Bind(SandboxFile::VmmRoot, e))?;
    match std::fs::DirBuilder::new().create(&root) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(StartError::Bind(SandboxFile::VmmRoot, e)),
        // Set, not asked of mkdir: the supervisor's umask would take the search bits away.
        _ => std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))
            .map(|()| root)
            .map_err(|e| StartError::Bind(SandboxFile::VmmRoot, e)),
    }
}

/// Binds one of the sandbox's sockets, replacing one a previous start left behind. A socket QEMU connects
/// to is given to the jail's ids, 0600: only that VMM (and root) may connect.
fn bind(file: SandboxFile, ids: Option<JailIds>) -> Result<UnixListener, StartError> {
    use std::os::unix::fs::PermissionsExt;
    let path = file.relative();
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| StartError::Bind(file, e))?;
    if file.in_vmm_root() {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| StartError::Bind(file, e))?;
        if let Some(ids) = ids {
            std::os::unix::fs::chown(&path, Some(ids.uid), Some(ids.gid)).map_err(|e| StartError::Bind(file, e))?;
        }
    }
    Ok(listener)
}

/// Everything after QEMU started: pids, lease, handshake, the attach socket. The caller kills QEMU on error.
async fn lease_and_link(
    args: &SupervisorArgs,
    vmm: &mut VmmProcess,
    vmm_record: ProcessRecord,
    link: Link<'_>,
    watchdog: &Path,
    senders: &Senders,
    stop: &mut watch::Receiver<StopRequests>,
) -> Result<(Lease, GuestLink, UnixListener), StartError> {
    let here = Path::new(".");
    let mut recorded = SandboxPids {
        supervisor: ProcessRecord::current().ok_or_else(|| StartError::Pids(std::io::ErrorKind::NotFound.into()))?,
        vmm: Some(vmm_record),
        watchdog: None,
    };
    recorded.write(here).map_err(StartError::Pids)?;
    let mut lease = match Lease::start(watchdog, vmm_record, &child_env()).await {
        Ok(lease) => lease,
        // A watchdog has nothing to watch once QEMU is gone: QEMU's exit is the real cause.
        Err(e) => return Err(vmm_exit_within_grace(vmm).await.unwrap_or(StartError::Lease(e))),
    };
    recorded.watchdog = lease.record;
    let linked = match recorded.write(here) {
        Ok(()) => handshake(args, vmm, link, &mut lease, senders, stop).await,
        Err(e) => Err(StartError::Pids(e)),
    };
    match linked.and_then(|link| Ok((link, bind(SandboxFile::Attach, None)?))) {
        Ok((link, attach)) => Ok((lease, link, attach)),
        Err(e) => {
            lease.close().await;
            Err(e)
        }
    }
}

async fn handshake(
    args: &SupervisorArgs,
    vmm: &mut VmmProcess,
    link: Link<'_>,
    lease: &mut Lease,
    senders: &Senders,
    stop: &mut watch::Receiver<StopRequests>,
) -> Result<GuestLink, StartError> {
    let timeout = Duration::from_millis(args.boot_timeout_ms);
    let link = guest_link::connect(link.channel, timeout, senders.clone(), link.how);
    tokio::pin!(link);
    loop {
        tokio::select! {
            result = &mut link => return match result {
                Ok(link) => Ok(link),
                Err(e) => {
                    // QEMU exiting also closes the channel: when the channel merely ended, name the exit, the real
                    // cause. A hello that arrived and did not match is the cause itself.
                    let mismatch = matches!(&e, LinkError::Handshake(FirstFrameError::Handshake(_)))
                        || matches!(&e, LinkError::Handshake(FirstFrameError::Frame(f)) if f.violation().is_some());
                    if !mismatch {
                        if let Some(exited) = vmm_exit_within_grace(vmm).await {
                            return Err(exited);
                        }
                    }
                    Err(StartError::Boot(e))
                }
            },
            exit = vmm.wait() => return Err(StartError::VmmExitedDuringBoot {
                status: exit.map_or_else(|e| e.to_string(), |s| s.to_string()),
            }),
            step = lease.step() => if let Err(e) = step {
                // The watchdog follows a VMM that exited; the exit is the real cause.
                if vmm.has_exited() {
                    if let Some(exited) = vmm_exit_within_grace(vmm).await {
                        return Err(exited);
                    }
                }
                return Err(StartError::LeaseLost(e));
            },
            _ = stop.wait_for(|s| s.terminate || s.driver_gone) => return Err(StartError::StoppedDuringBoot),
        }
    }
}

/// QEMU's exit, if it comes within a short grace: when the channel or the watchdog fails during boot, QEMU
/// having exited is usually why.
async fn vmm_exit_within_grace(vmm: &mut VmmProcess) -> Option<StartError> {
    let exit = tokio::time::timeout(Duration::from_millis(VMM_EXIT_GRACE_MS), vmm.wait()).await.ok()?.ok()?;
    Some(StartError::VmmExitedDuringBoot { status: exit.to_string() })
}

/// The environment of the supervisor's children (the watchdog, the jailer; QEMU gets none at all): nothing,
/// except test switches in test builds.
pub(crate) fn child_env() -> Vec<(&'static str, String)> {
    #[cfg(feature = "test-controls")]
    if let Ok(value) = std::env::var(vm_contract::test_control::VAR) {
        return vec![(vm_contract::test_control::VAR, value)];
    }
    Vec::new()
}
