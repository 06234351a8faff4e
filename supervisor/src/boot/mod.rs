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
//! hello in place of a fresh one, and is pinged after its `Reseed` ([`snapshot`]).
//!
//! Nothing is left running when boot fails: QEMU is killed and the watchdog closed.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use vm_contract::args::VmArgs;
use vm_contract::jail::parse_vmm_pid_line;
use vm_contract::layout::SandboxFile;
use vm_contract::pids::{ProcessRecord, SandboxPids};
use vm_contract::root::RootImage;
use vm_protocol::handshake::FirstFrameError;

use self::guest_link::{GuestLink, LinkError};
use self::guest_logs::Dropped;
use self::host::{bind, Prepared};
use self::lease::Lease;
use self::vmm_process::VmmProcess;
use crate::inbox::{Senders, StopRequests};
use crate::safeguards::Safeguards;

/// The accelerator choice, shared with `vm-driver doctor`.
pub mod accel {
    pub use vm_contract::accel::{AccelChoice, Accelerator, Host, KvmUnusable};
}
pub(crate) mod disks;
mod error;
pub mod guest_link;
pub mod guest_logs;
mod host;
pub mod lease;
mod qmp;
pub(crate) mod shares;
pub mod snapshot;
pub mod vmm;
pub mod vmm_limits;
pub mod vmm_process;

pub use self::error::BootError;

/// After the channel failed during boot, how long to wait for QEMU's own exit before calling it a guest
/// failure.
const VMM_EXIT_GRACE_MS: u64 = 500;

/// A VM whose agent answered, under a live lease, with its attach socket bound. It ends through
/// [`Booted::shut_down`] (or, once it has been served, [`Vm::shut_down`]), never by being dropped.
#[must_use = "a booted VM is ended by shut_down()"]
pub(crate) struct Booted {
    /// QEMU under its lease.
    pub(crate) vm: Vm,
    pub(crate) link: GuestLink,
    pub(crate) attach: UnixListener,
    /// `--save-snapshot`: QEMU's monitor and the socket its migration stream will come to.
    pub(crate) save: Option<snapshot::SaveLine>,
}

impl Booted {
    /// Ends the VM: see [`Vm::shut_down`].
    pub(crate) async fn shut_down(self) -> Option<std::process::ExitStatus> {
        self.vm.shut_down().await
    }
}

/// QEMU, through the jailer, under its lease, and the logs it fills.
#[must_use = "a running VM is ended by shut_down()"]
pub(crate) struct Vm {
    /// QEMU, through the jailer.
    pub(crate) vmm: VmmProcess,
    /// QEMU's own process.
    pub(crate) vmm_record: ProcessRecord,
    pub(crate) lease: Lease,
    pub(crate) logs: GuestLogs,
    /// The host directories' file servers.
    pub(crate) shares: shares::Shares,
}

impl Vm {
    /// The one teardown of a booted VM: QEMU killed and waited for (nothing to kill once it has exited, and
    /// its status is kept), then the lease closed. The watchdog's exit status, or `None` if it had to be
    /// killed.
    pub(crate) async fn shut_down(mut self) -> Option<std::process::ExitStatus> {
        self.vmm.kill().await;
        self.shares.kill().await;
        self.lease.close().await
    }
}

/// What the guest's logs dropped past their caps.
#[derive(Debug, Clone)]
pub(crate) struct GuestLogs {
    pub(crate) console: Arc<Dropped>,
    pub(crate) vmm: Arc<Dropped>,
}

/// The least time QEMU has to connect its console and monitor and have its pid reported after it starts (it
/// does so before anything else); a boot allows its whole timeout when that is longer. A host under load (a
/// burst of starts beside a hundred idle VMs on 2 cores) delays it by seconds, and a VM that never gets
/// there is still bounded by the boot's timeout, where the driver stops waiting.
const VMM_START_MS: u64 = 5_000;

/// Boots the VM described by `vm` (which has no identity), with the safeguards `safeguards` leaves on. A stop request arriving
/// meanwhile ends the boot.
///
/// # Errors
/// A [`BootError`]; nothing it started is left running.
pub(crate) async fn boot(
    vm: &VmArgs,
    root: Option<&RootImage>,
    safeguards: &Safeguards,
    senders: &Senders,
    stop: &mut watch::Receiver<StopRequests>,
) -> Result<Booted, BootError> {
    let Prepared { config, watchdog, channel, console, monitor, migration, restored, deferred } =
        host::prepare(vm, root)?;
    let saving = migration.is_some();
    let mut shares =
        shares::start(&config.jailer, &vm.mounts, config.confinement, config.ids, &config.cgroups, safeguards, senders)
            .await
            .map_err(BootError::Shares)?;
    // Until QEMU's pid is known, the switch kills the jailer, and QEMU with it (its parent-death signal).
    let jailer = match config.spawn(&safeguards.child_env) {
        Ok(jailer) => jailer,
        Err(e) => {
            shares.kill().await;
            return Err(BootError::SpawnVmm(e));
        }
    };
    let mut vmm = VmmProcess::new(jailer, senders.vmm_kill.clone());
    let booted = async {
        let start_wait = Duration::from_millis(vm.boot_timeout_ms.max(VMM_START_MS));
        let logs = guest_logs(&mut vmm, &console, senders, safeguards, start_wait).await?;
        // QEMU's own pid first: from here on the kill switch names QEMU, whatever its monitor does.
        let vmm_record = qemu_process(&mut vmm, start_wait).await?;
        vmm.arm(vmm_record);
        let monitor = match &monitor {
            Some(listener) => Some(accept_from_vmm(&mut vmm, listener, start_wait).await?.map_err(BootError::Monitor)?),
            None => None,
        };
        let save = match (monitor, migration, &deferred) {
            (Some(monitor), Some(migration), _) => {
                Some(snapshot::SaveLine { monitor, migration, ram_in_file: config.ram.is_some() })
            }
            (Some(monitor), None, Some(state)) => {
                snapshot::restore_deferred(monitor, state).await.map_err(BootError::Restore)?;
                // Its one use is over: no listener, and no socket left in the jail.
                let _ = std::fs::remove_file(SandboxFile::Monitor.relative());
                None
            }
            _ => None,
        };
        let how = guest_link::LinkStart {
            saved_hello: restored.as_ref(),
            settle: saving || restored.is_some(),
            reseed_restored: safeguards.reseed_restored,
        };
        let link = Link { channel: &channel, how, timeout: Duration::from_millis(vm.boot_timeout_ms) };
        let (lease, link, attach) =
            lease_and_link(safeguards, &mut vmm, vmm_record, link, &watchdog, senders, stop).await?;
        Ok::<_, BootError>((vmm_record, lease, link, attach, logs, save))
    };
    match booted.await {
        Ok((vmm_record, lease, link, attach, logs, save)) => {
            Ok(Booted { vm: Vm { vmm, vmm_record, lease, logs, shares }, link, attach, save })
        }
        Err(e) => {
            vmm.kill().await;
            shares.kill().await;
            Err(e)
        }
    }
}

/// Takes QEMU's console connection and its stderr, and copies each into its capped file.
async fn guest_logs(
    vmm: &mut VmmProcess,
    console: &UnixListener,
    senders: &Senders,
    safeguards: &Safeguards,
    wait: Duration,
) -> Result<GuestLogs, BootError> {
    let broken = |what: SandboxFile, e: std::io::Error| BootError::Log(what, e);
    let copy = |from, file: SandboxFile, cap: u64| {
        guest_logs::copy_capped(from, file.as_ref(), safeguards.log_cap(cap), file.name(), senders.notices.clone())
            .map_err(|e| broken(file, e))
    };
    let stderr =
        vmm.jailer.stderr.take().ok_or_else(|| broken(SandboxFile::VmmLog, std::io::ErrorKind::BrokenPipe.into()))?;
    let vmm_dropped = copy(
        Box::new(stderr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
        SandboxFile::VmmLog,
        guest_logs::VMM_LOG_CAP_BYTES,
    )?;
    let stream = accept_from_vmm(vmm, console, wait).await?.map_err(|e| broken(SandboxFile::ConsoleSocket, e))?;
    let console_dropped = copy(Box::new(stream), SandboxFile::Console, guest_logs::CONSOLE_CAP_BYTES)?;
    Ok(GuestLogs { console: console_dropped, vmm: vmm_dropped })
}

/// QEMU's connection on `listener` (its console or monitor, which it connects at start), within `wait`;
/// QEMU's exit meanwhile is the error.
async fn accept_from_vmm(
    vmm: &mut VmmProcess,
    listener: &UnixListener,
    wait: Duration,
) -> Result<std::io::Result<tokio::net::UnixStream>, BootError> {
    tokio::select! {
        accepted = tokio::time::timeout(wait, listener.accept()) => {
            Ok(accepted.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())).map(|(stream, _)| stream))
        }
        exit = vmm.wait() => {
            Err(BootError::VmmExitedDuringBoot { status: exit.map_or_else(|e| e.to_string(), |s| s.to_string()) })
        }
    }
}

/// The boundary channel's listener, how the link starts on it, and how long the agent has to answer.
#[derive(Clone, Copy)]
struct Link<'a> {
    channel: &'a UnixListener,
    how: guest_link::LinkStart<'a>,
    timeout: Duration,
}

/// QEMU's own process: the pid the jailer reports ([`vm_contract::jail::vmm_pid_line`]), taken only if it is
/// the jailer's child, or the jailer itself (which becomes QEMU when there is no PID namespace).
async fn qemu_process(vmm: &mut VmmProcess, wait: Duration) -> Result<ProcessRecord, BootError> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let mut line = String::new();
    if let Some(stdout) = vmm.jailer.stdout.take() {
        // One short line; anything longer is not the contract.
        let mut reader = tokio::io::BufReader::new(stdout.take(24));
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
        None => Err(vmm_exit_within_grace(vmm).await.unwrap_or(BootError::NoVmmPid)),
    }
}

/// Everything after QEMU started: pids, lease, handshake, the attach socket. The caller kills QEMU on error.
async fn lease_and_link(
    safeguards: &Safeguards,
    vmm: &mut VmmProcess,
    vmm_record: ProcessRecord,
    link: Link<'_>,
    watchdog: &Path,
    senders: &Senders,
    stop: &mut watch::Receiver<StopRequests>,
) -> Result<(Lease, GuestLink, UnixListener), BootError> {
    let here = Path::new(".");
    let mut recorded = SandboxPids {
        supervisor: ProcessRecord::current().ok_or_else(|| BootError::Pids(std::io::ErrorKind::NotFound.into()))?,
        vmm: Some(vmm_record),
        watchdog: None,
    };
    recorded.write(here).map_err(BootError::Pids)?;
    let mut lease = match Lease::start(watchdog, vmm_record, &safeguards.child_env, safeguards.require_echo).await {
        Ok(lease) => lease,
        // A watchdog has nothing to watch once QEMU is gone: QEMU's exit is the real cause.
        Err(e) => return Err(vmm_exit_within_grace(vmm).await.unwrap_or(BootError::Lease(e))),
    };
    recorded.watchdog = lease.record;
    let linked = match recorded.write(here) {
        Ok(()) => handshake(vmm, link, &mut lease, senders, stop).await,
        Err(e) => Err(BootError::Pids(e)),
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
    vmm: &mut VmmProcess,
    link: Link<'_>,
    lease: &mut Lease,
    senders: &Senders,
    stop: &mut watch::Receiver<StopRequests>,
) -> Result<GuestLink, BootError> {
    let link = guest_link::connect(link.channel, link.timeout, senders.clone(), link.how);
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
                    Err(BootError::Link(e))
                }
            },
            exit = vmm.wait() => return Err(BootError::VmmExitedDuringBoot {
                status: exit.map_or_else(|e| e.to_string(), |s| s.to_string()),
            }),
            step = lease.step() => if let Err(e) = step {
                // The watchdog follows a VMM that exited; the exit is the real cause.
                if vmm.has_exited() {
                    if let Some(exited) = vmm_exit_within_grace(vmm).await {
                        return Err(exited);
                    }
                }
                return Err(BootError::LeaseLost(e));
            },
            _ = stop.wait_for(|s| s.terminate || s.driver_gone) => return Err(BootError::StoppedDuringBoot),
        }
    }
}

/// QEMU's exit, if it comes within a short grace: when the channel or the watchdog fails during boot, QEMU
/// having exited is usually why.
async fn vmm_exit_within_grace(vmm: &mut VmmProcess) -> Option<BootError> {
    let exit = tokio::time::timeout(Duration::from_millis(VMM_EXIT_GRACE_MS), vmm.wait()).await.ok()?.ok()?;
    Some(BootError::VmmExitedDuringBoot { status: exit.to_string() })
}
