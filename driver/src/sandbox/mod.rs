//! One sandbox lifecycle, the only one: `vm-driver launch` and every sandbox of `vm-driver serve` go through
//! it.
//!
//! ```text
//! start:  fresh generation (old pids and tombstone gone) -> auth bundle (0600) -> jail uid -> cgroup -> supervisor
//!         (liveness pipe, trusted argv)            any failure: take everything back, tombstone `failed`
//! ready:  the supervisor's verdict, within the boot timeout plus READY_MARGIN
//! run:    until the supervisor exits, or the VMM exits and the supervisor does not say it is stopping
//!         within VMM_GONE_GRACE, or does not exit within stop::after_vmm_exit() after saying so (it is hung:
//!         the watchdog killed the VM under it)
//! stop:   SIGTERM, bounded wait, then close the liveness pipe (supervisor::SupervisorProcess::stop)
//! end:    reap what the supervisor left, sweep the cgroup, take back an unread bundle, release the jail uid,
//!         write the tombstone
//! ```

mod spec;
mod start_files;
pub mod supervisor;

use std::path::PathBuf;
use std::time::Duration;

use vm_contract::accel::AccelChoice;
use vm_contract::args::{IdentityArgs, SupervisorArgs, VmArgs};
use vm_contract::auth::{AuthBundle, BundleError};
use vm_contract::claim::{ClaimSession, Origin};
use vm_contract::descriptor::Backend;
use vm_contract::ids::SandboxId;
use vm_contract::jail::Confinement;
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::root::RootImage;
use vm_contract::session::Generation;
use vm_contract::status::SupervisorStatus;
use vm_contract::tombstone::{EndReason, Tombstone};

pub use self::spec::{Egress, EgressRoute, Identity, SessionSpec, StartSecrets, VmSpec};
use self::start_files::write_start_files;
use self::supervisor::{Followed, Liveness, Ready, Stopped, SupervisorError, SupervisorProcess};
use crate::controls::Controls;
use crate::procs::ExitWatch;
use crate::reap::{self, Leftovers};
use crate::telemetry::TelemetryConfig;

/// Margin on top of the boot timeout for the supervisor's own verdict to arrive.
pub const READY_MARGIN: Duration = Duration::from_secs(10);
/// How long a healthy supervisor takes, at most, to say it is stopping once its VMM is gone; one that does
/// not is hung. It sees the exit as soon as the driver does, so this is scheduling delay on a busy host.
pub const VMM_GONE_GRACE: Duration = Duration::from_secs(2);
/// The stop of a hung supervisor: it cannot answer SIGTERM, so the wait before SIGKILL is short.
pub const HUNG_STOP_TIMEOUT: Duration = Duration::from_millis(500);

/// How a running generation ends on its own.
#[derive(Debug)]
pub enum Ended {
    /// The VMM exited; the supervisor should follow. Said once: the sandbox is not ready from here on.
    VmmGone,
    /// The supervisor exited, with this status.
    Exited(Option<std::process::ExitStatus>),
    /// The VMM is gone and the supervisor did not follow in time: it is hung (frozen, or its loop stuck),
    /// and the watchdog killed the VM under it. Stop it with [`HUNG_STOP_TIMEOUT`].
    Hung,
}

/// Why a start failed before the supervisor ran. Everything made for it was taken back.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The auth bundle could not be written.
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// The supervisor could not be started.
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    /// The VMM's cgroup limits could not be set up.
    #[error("cannot set up the VMM's cgroup limits")]
    Limits(#[source] std::io::Error),
    /// The policy could not be written for the supervisor.
    #[error("cannot write the sandbox's policy")]
    Policy(#[source] std::io::Error),
    /// The image root could not be written for the supervisor.
    #[error("cannot write the sandbox's image root")]
    Root(#[source] vm_contract::root::RootFileError),
    /// The launch descriptor could not be written for the supervisor.
    #[error("cannot write the launch descriptor")]
    Descriptor(#[source] std::io::Error),
    /// The gateway binding could not be written for the supervisor.
    #[error(transparent)]
    Gateway(#[from] vm_contract::gateway::BindingError),
    /// No uid could be reserved for the jailed VMM.
    #[error(transparent)]
    Jail(#[from] crate::jail::JailSetupError),
    /// The claim line cannot be made.
    #[error("cannot make the claim")]
    Claim(#[source] vm_contract::claim::ClaimError),
    /// The claim line could not be written to the pooled supervisor.
    #[error("cannot hand the claim to the pooled supervisor")]
    ClaimWrite(#[source] std::io::Error),
}

/// A running generation of a sandbox.
#[derive(Debug)]
pub struct Running {
    sup: SupervisorProcess,
    layout: SandboxLayout,
    cgroup: Option<PathBuf>,
    controls: Controls,
    boot_timeout: Duration,
    ready_by: tokio::time::Instant,
    /// The VMM, watched from the ready verdict on.
    vmm: ExitWatch,
    /// Once the VMM is gone: when the supervisor must have followed, and whether it said it is stopping.
    after_vmm: Option<(tokio::time::Instant, bool)>,
}

/// A generation whose supervisor has exited, not yet cleaned up.
#[derive(Debug)]
#[must_use = "call `end` to reap, sweep and write the tombstone"]
pub struct Stopping {
    /// How the supervisor ended.
    pub stopped: Stopped,
    /// Its final report, when it gave one.
    pub report: Option<SupervisorStatus>,
    layout: SandboxLayout,
    cgroup: Option<PathBuf>,
    controls: Controls,
}

/// Starts a generation. On failure nothing is left: the bundle is taken back, the cgroup swept, and the
/// tombstone says `failed`.
///
/// # Errors
/// [`StartError`].
pub fn start(vm: &VmSpec, who: &Identity) -> Result<Running, StartError> {
    clear_last_generation(&vm.layout);
    if let Err(e) = write_start_files(vm, who) {
        reap::end_generation(&vm.layout, None, EndReason::Failed, vm.controls.reaper);
        return Err(e);
    }
    launch(vm, Spawned::Sandbox(who))
}

/// How a pooled VM comes up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PooledStart {
    /// Booted.
    Boot,
    /// Booted, then saved into this snapshot directory; it serves nothing ([`Ready::saved`]).
    Save(PathBuf),
    /// Restored from the snapshot in this directory.
    Restore(PathBuf),
}

/// Starts a pooled VM in the pool slot `slot` (its directory is `vm`'s): with no identity, waiting for
/// [`Running::claim`] (or, [`PooledStart::Save`], saved and gone). `vm` holds no credential, policy,
/// session or telemetry setting to give it; `control_telemetry` reaches it only under the
/// `pool-identity-at-boot` control.
///
/// # Errors
/// [`StartError`]; nothing is left, as for [`start`].
pub fn start_pooled(
    vm: &VmSpec,
    slot: &SandboxId,
    how: &PooledStart,
    ram: Option<std::os::fd::BorrowedFd<'_>>,
    control_telemetry: &TelemetryConfig,
) -> Result<Running, StartError> {
    clear_last_generation(&vm.layout);
    // The one start file a pooled VM has: the root it boots (no identity, credentials or policy yet).
    RootImage::write(vm.root.as_ref(), &vm.layout).map_err(StartError::Root)?;
    // A pooled VM learns its telemetry settings at its claim, never at spawn (but in the control).
    let telemetry = if vm.controls.lifecycle.pool_identity_at_boot {
        control_telemetry.clone()
    } else {
        TelemetryConfig::default()
    };
    launch(vm, Spawned::Pooled { slot, how, telemetry, ram })
}

/// The last generation's pids go before its tombstone: a reaper must never see dead pids and no tombstone,
/// and sweep the cgroup this generation is about to use.
fn clear_last_generation(layout: &SandboxLayout) {
    let _ = std::fs::remove_file(layout.path(SandboxFile::Pids));
    Tombstone::clear(layout.dir());
    AuthBundle::remove(layout.dir());
}

/// Who a spawned supervisor is: a sandbox (its identity), or a pooled VM (its slot's id only).
enum Spawned<'a> {
    Sandbox(&'a Identity),
    Pooled {
        slot: &'a SandboxId,
        how: &'a PooledStart,
        telemetry: TelemetryConfig,
        ram: Option<std::os::fd::BorrowedFd<'a>>,
    },
}

/// Reserves the jail id, makes the cgroups, and starts the supervisor.
fn launch(vm: &VmSpec, who: Spawned<'_>) -> Result<Running, StartError> {
    let dir = vm.layout.dir();
    let (identity, telemetry, pooled, ram) = match &who {
        Spawned::Sandbox(who) => {
            let session = who.session.as_ref();
            let identity = IdentityArgs {
                sandbox_id: who.id.clone(),
                session_id: session.map(|s| s.id.clone()),
                generation: session.map_or(Generation(0), |s| s.generation),
                session_socket: session.map(|s| s.socket.clone()),
            };
            (identity, who.telemetry.clone(), None, None)
        }
        Spawned::Pooled { slot, how, telemetry, ram } => {
            let identity = IdentityArgs {
                sandbox_id: (*slot).clone(),
                session_id: None,
                generation: Generation(0),
                session_socket: None,
            };
            (identity, telemetry.clone(), Some(*how), *ram)
        }
    };
    let jail_id = match vm.jail.confinement {
        Confinement::Jail => match crate::jail::reserve(vm.jail.ids, &vm.layout) {
            Ok(id) => Some(id),
            Err(e) => {
                reap::end_generation(&vm.layout, None, EndReason::Failed, vm.controls.reaper);
                return Err(e.into());
            }
        },
        _ => None,
    };
    let cgroup = crate::cgroup::create(&identity.sandbox_id, dir);
    let vmm_cgroups = if vm.jail.confinement == Confinement::Jail {
        // Named like the sandbox's cgroup, always with a fresh random part (v1 keeps a stale one's counters).
        let name = format!("{}-{}", identity.sandbox_id, crate::state::random_hex::<4>().unwrap_or_default());
        match crate::cgroup::limits::create(&name, dir, vm.jail.limits(u64::from(vm.shape.memory_mib()))) {
            Ok(made) => made,
            Err(e) => {
                reap::end_generation(&vm.layout, cgroup.as_deref(), EndReason::Failed, vm.controls.reaper);
                return Err(StartError::Limits(e));
            }
        }
    } else {
        Vec::new()
    };
    let args = SupervisorArgs {
        identity,
        vm: VmArgs {
            sandbox_dir: dir.to_owned(),
            kernel: vm.image.kernel.clone(),
            initrd: vm.image.initrd.clone(),
            shape: vm.shape,
            accel: vm.accel,
            boot_timeout_ms: u64::try_from(vm.boot_timeout.as_millis()).unwrap_or(u64::MAX),
            stop_grace_ms: u32::try_from(vm_contract::stop::GRACE.as_millis()).unwrap_or(u32::MAX),
            // Only a TCG guest needs it; `--accel kvm` never measures.
            tsc_khz: (vm.accel != AccelChoice::Kvm).then(crate::tsc::khz).flatten(),
            qemu: None,
            cgroup: cgroup.clone(),
            confinement: vm.jail.confinement,
            jail_id,
            vmm_cgroups,
            parent_liveness_stdin: true,
            pooled: pooled.is_some(),
            save_snapshot: match pooled {
                Some(PooledStart::Save(dir)) => Some(dir.clone()),
                _ => None,
            },
            restore_snapshot: match pooled {
                Some(PooledStart::Restore(dir)) => Some(dir.clone()),
                _ => None,
            },
            guest_ram_fd: ram.and_then(|fd| u32::try_from(std::os::fd::AsRawFd::as_raw_fd(&fd)).ok()),
            backend: Backend::Microvm,
            egress_resolver: vm.egress.resolver,
            egress_proxy: vm.egress.proxy.clone(),
            egress_ca: vm.egress.ca.clone(),
            mounts: vm.mounts.clone(),
            tmpfs: vm.tmpfs.clone(),
        },
    };
    let liveness = Liveness {
        leak_write_end: vm.controls.lifecycle.leak_liveness_write_end,
        close_first: vm.controls.lifecycle.close_liveness_first,
    };
    match SupervisorProcess::spawn(&vm.supervisor, &args, &telemetry, liveness) {
        Ok(sup) => Ok(Running {
            sup,
            layout: vm.layout.clone(),
            cgroup,
            controls: vm.controls,
            boot_timeout: vm.boot_timeout,
            ready_by: tokio::time::Instant::now() + vm.boot_timeout + READY_MARGIN,
            vmm: ExitWatch::Unwatched,
            after_vmm: None,
        }),
        Err(e) => {
            // Nothing runs: take back the credentials and the cgroup made for it.
            reap::end_generation(&vm.layout, cgroup.as_deref(), EndReason::Failed, vm.controls.reaper);
            Err(e.into())
        }
    }
}

impl Running {
    /// Hands this pooled VM (ready as pooled) to the sandbox `spec` describes, whose directory the pool slot's
    /// has become ([`Self::moved_to`] first): writes its start files, then the claim line. [`Self::ready`] then waits for the claimed
    /// sandbox's verdict. On error the caller stops this generation, which takes the files back.
    ///
    /// # Errors
    /// [`StartError`].
    pub fn claim(&mut self, vm: &VmSpec, who: &Identity, origin: Origin) -> Result<(), StartError> {
        write_start_files(vm, who)?;
        let session = who.session.as_ref();
        let claim = vm_contract::claim::Claim {
            sandbox_id: who.id.clone(),
            session: session.map(|s| ClaimSession { id: s.id.clone(), socket: s.socket.clone() }),
            generation: session.map_or(Generation(0), |s| s.generation),
            telemetry: who.telemetry.clone(),
            origin,
        };
        let line = claim.to_line().map_err(StartError::Claim)?;
        self.sup.claim(&line).map_err(StartError::ClaimWrite)?;
        self.ready_by = tokio::time::Instant::now() + self.boot_timeout + READY_MARGIN;
        Ok(())
    }

    /// Its directory was moved to `layout` (a claimed pool slot's, before [`Self::claim`]).
    pub fn moved_to(&mut self, layout: SandboxLayout) {
        self.layout = layout;
    }

    /// The supervisor's pid, while it runs.
    pub fn supervisor_pid(&self) -> Option<u32> {
        self.sup.pid()
    }

    /// The sandbox's directory.
    pub fn layout(&self) -> &SandboxLayout {
        &self.layout
    }

    /// Waits for the supervisor's verdict on the boot. Safe to cancel and call again: the bound is fixed at
    /// the start.
    ///
    /// # Errors
    /// [`SupervisorError`] with the supervisor's own explanation where it gave one.
    pub async fn ready(&mut self) -> Result<Ready, SupervisorError> {
        let ready = self.sup.ready(self.ready_by, self.boot_timeout).await?;
        self.vmm = if self.controls.lifecycle.no_vmm_watch {
            ExitWatch::unwatched()
        } else {
            ExitWatch::new(ready.vmm.as_ref())
        };
        Ok(ready)
    }

    /// Waits until the generation ends on its own: the supervisor exits, or it is found hung. Safe to cancel
    /// and call again.
    pub async fn ended(&mut self) -> Ended {
        let Some(mut after) = self.after_vmm else {
            tokio::select! {
                status = self.sup.exited() => return Ended::Exited(status),
                () = self.vmm.exited() => {}
            }
            self.after_vmm = Some((tokio::time::Instant::now() + VMM_GONE_GRACE, false));
            return Ended::VmmGone;
        };
        // The deadlines are kept in `self`, so a cancelled call does not restart them.
        loop {
            let (due, said_stopping) = after;
            match tokio::time::timeout_at(due, self.sup.follow(said_stopping)).await {
                Ok(Followed::Exited(status)) => return Ended::Exited(status),
                Ok(Followed::Stopping) => {
                    after = (tokio::time::Instant::now() + vm_contract::stop::after_vmm_exit(), true);
                    self.after_vmm = Some(after);
                }
                Err(_) => return Ended::Hung,
            }
        }
    }

    /// Whether its VMM has exited (once [`Ended::VmmGone`] was said): it can never be ready again.
    pub fn vmm_gone(&self) -> bool {
        self.after_vmm.is_some()
    }

    /// The orderly stop: SIGTERM, wait up to `timeout`, then close the liveness pipe (SIGKILL first when it
    /// did not exit).
    pub async fn stop(self, timeout: Duration) -> Stopping {
        let (stopped, report) = self.sup.stop(timeout).await;
        Stopping { stopped, report, layout: self.layout, cgroup: self.cgroup, controls: self.controls }
    }
}

impl Stopping {
    /// Ends the generation: reaps what the supervisor left, sweeps the cgroup, takes back an unread bundle
    /// and writes the tombstone. The waits on pidfds and the cgroup run off the async workers.
    pub async fn end(self, reason: EndReason) -> Leftovers {
        if let Some(SupervisorStatus::Stopped { audit: Some(head), .. }) = &self.report {
            crate::audit::keep_anchor(self.layout.dir(), head);
        }
        let (layout, cgroup, controls) = (self.layout, self.cgroup, self.controls.reaper);
        tokio::task::spawn_blocking(move || reap::end_generation(&layout, cgroup.as_deref(), reason, controls))
            .await
            .unwrap_or(Leftovers { vm: false, cgroup: false })
    }
}
