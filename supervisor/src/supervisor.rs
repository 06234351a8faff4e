//! Booting a sandbox: from the trusted arguments to a VM whose agent answered, under a live lease.
//!
//! ```text
//! choose accelerator -> bind chan.sock -> start QEMU -> record pids -> start the watchdog (ready in 5 s)
//!   -> agent hello (boot timeout; pulses flow meanwhile) -> bind attach.sock -> Ready -> serve
//! ```
//!
//! Nothing is left running when boot fails: QEMU is killed and the watchdog closed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tokio::net::UnixListener;
use tokio::process::Child;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use vm_protocol::status::{ProcessRecord, SandboxPids, SessionHello, SupervisorStatus};

use crate::accel::{self, KvmUnusable};
use crate::attach::{self, ATTACH_SOCKET};
use crate::config::SupervisorConfig;
use crate::diagnostics::{chain, tails};
use crate::guest::{self, AttachError};
use crate::lease::{Lease, LeaseError};
use crate::session::SessionConfig;
use crate::telemetry::console::Console;
use crate::telemetry::settings::{SettingsError, TelemetrySettings};
use crate::telemetry::{Telemetry, TelemetryError};
use crate::vmm::{self, files, VmmConfig};
use crate::Event;
use crate::{pids, status};
use vm_ocsf::{AppInfo, Finding, Lifecycle, Status};
use vm_protocol::handshake::FirstFrameError;

/// After the channel failed during boot, how long to wait for QEMU's own exit before calling it a guest
/// failure.
const VMM_EXIT_GRACE_MS: u64 = 500;

/// Why start-up failed. Nothing is left running when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The sandbox directory is unusable.
    #[error("cannot enter the sandbox directory {}", .0.display())]
    SandboxDir(PathBuf, #[source] std::io::Error),
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
    #[error("cannot bind {0}")]
    Bind(&'static str, #[source] std::io::Error),
    /// QEMU could not be started.
    #[error("cannot start the VMM")]
    SpawnVmm(#[source] std::io::Error),
    /// No watchdog binary next to the supervisor.
    #[error("vm-watchdog not found at {}", .0.display())]
    NoWatchdog(PathBuf),
    /// The lease could not be established or was lost during boot.
    #[error("the VM was refused: no lease")]
    Lease(#[source] LeaseError),
    /// The pids file could not be written; without it the reaper could not find an orphaned VM.
    #[error("cannot record the sandbox's pids")]
    Pids(#[source] std::io::Error),
    /// QEMU exited before the agent answered.
    #[error("the VMM exited during boot ({status})")]
    VmmExitedDuringBoot {
        /// QEMU's exit status.
        status: String,
    },
    /// The agent did not come up.
    #[error("the VM did not boot")]
    Boot(#[source] AttachError),
    /// Told to stop before the VM was ready.
    #[error("stopped during boot")]
    StoppedDuringBoot,
    /// The auth bundle is unreadable.
    #[error("cannot read the auth bundle")]
    Bundle(#[source] crate::auth::BundleError),
    /// A session socket was given without a session token.
    #[error("a session socket was given but the auth bundle has no session token")]
    NoSessionToken,
    /// The telemetry settings are unusable.
    #[error("bad telemetry settings")]
    Telemetry(#[source] SettingsError),
    /// A telemetry sink could not start.
    #[error("cannot start telemetry")]
    TelemetrySinks(#[source] TelemetryError),
}

/// How a supervised VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// SIGTERM (or SIGINT/SIGHUP): an orderly stop.
    Terminated,
    /// The liveness pipe closed: the VM was killed at once.
    DriverGone,
    /// The watchdog stopped answering: the VM was killed at once.
    LeaseLost(String),
    /// QEMU exited without being asked (guest crash or power-off).
    VmmExited(String),
    /// The guest broke the protocol; the VM was stopped.
    GuestViolation(String),
    /// The guest channel closed while QEMU kept running; the VM was stopped.
    ChannelClosed,
    /// The driver refused this supervisor's session; the VM was stopped.
    SessionRefused,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Terminated => f.write_str("stopped on request"),
            Self::DriverGone => f.write_str("the driver is gone; the VM was killed"),
            Self::LeaseLost(why) => write!(f, "the lease with the watchdog was lost ({why}); the VM was killed"),
            Self::VmmExited(status) => write!(f, "the VMM exited on its own ({status})"),
            Self::GuestViolation(what) => {
                write!(f, "the guest broke the boundary protocol ({what}); the VM was stopped")
            }
            Self::ChannelClosed => f.write_str("the guest closed the boundary channel; the VM was stopped"),
            Self::SessionRefused => f.write_str("the driver refused this supervisor's session; the VM was stopped"),
        }
    }
}

impl StopReason {
    /// The supervisor's exit status for this ending (documented in `main.rs`).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Terminated => 0,
            Self::VmmExited(_) | Self::GuestViolation(_) | Self::ChannelClosed => 3,
            Self::DriverGone => 4,
            Self::LeaseLost(_) => 5,
            Self::SessionRefused => 6,
        }
    }
}

/// The OTLP flush budget at an orderly stop.
const FLUSH_BUDGET_MS: u64 = 5_000;

/// The OTLP flush budget when the driver is gone: an unsupervised process holding collector credentials
/// must not linger, so whatever a slow collector has not taken by then is dropped (and counted).
const DRIVER_GONE_FLUSH_MS: u64 = 250;

/// Runs one VM from boot to stop, reporting to `console` and the telemetry sinks.
///
/// # Errors
/// A [`StartError`] if the VM never became ready; the failure is also reported as a status line and an
/// OCSF event.
pub async fn run(config: SupervisorConfig, console: Console) -> Result<StopReason, StartError> {
    // First: every file the supervisor and QEMU write (events.jsonl, sockets, logs) is relative to it.
    if let Err(e) = std::env::set_current_dir(&config.sandbox_dir) {
        let e = StartError::SandboxDir(config.sandbox_dir.clone(), e);
        status::report(&SupervisorStatus::Failed { error: chain(&e) });
        console.shutdown(std::time::Instant::now() + Duration::from_secs(1));
        return Err(e);
    }
    let bundle = crate::auth::take(&config.sandbox_dir).map_err(StartError::Bundle);
    let token = bundle.as_ref().ok().and_then(|b| b.session_token.clone());
    let settings = bundle.and_then(|b| TelemetrySettings::load(b.otlp_headers).map_err(StartError::Telemetry));
    let telemetry = settings.and_then(|s| {
        Telemetry::start(console.handle(), config.sandbox_id.as_str(), &s).map_err(StartError::TelemetrySinks)
    });
    let mut telemetry = match telemetry {
        Ok(t) => t,
        Err(e) => {
            status::report(&SupervisorStatus::Failed { error: chain(&e) });
            console.shutdown(std::time::Instant::now() + Duration::from_secs(1));
            return Err(e);
        }
    };
    #[cfg(feature = "test-controls")]
    {
        let event = telemetry.source().config_change(&vm_contract::test_control::announcement("vm-supervisor"));
        telemetry.emit(event);
    }
    let outcome = supervise_sandbox(&config, token, &mut telemetry).await;
    if let Err(e) = &outcome {
        // Logged here, while the console still runs.
        tracing::error!(error = %chain(e), "start-up failed");
    }
    let budget = match &outcome {
        Ok(StopReason::DriverGone) => DRIVER_GONE_FLUSH_MS,
        _ => FLUSH_BUDGET_MS,
    };
    let report = telemetry.shutdown(Duration::from_millis(budget), console).await;
    status::report(&SupervisorStatus::Stopped {
        events: report.events,
        otlp_exported: report.otlp.exported,
        otlp_dropped: report.otlp.dropped,
        console_dropped: report.console_dropped,
    });
    outcome
}

/// Boot, serve, stop; with the lifecycle events around them.
async fn supervise_sandbox(
    config: &SupervisorConfig,
    token: Option<String>,
    telemetry: &mut Telemetry,
) -> Result<StopReason, StartError> {
    let session = match (&config.session_socket, token) {
        (Some(socket), Some(token)) => Some(SessionConfig {
            socket: socket.clone(),
            hello: SessionHello { sandbox_id: config.sandbox_id.to_string(), generation: config.generation, token },
        }),
        (Some(_), None) => return Err(StartError::NoSessionToken),
        (None, _) => None,
    };
    let sandbox = AppInfo { name: "sandbox".into(), version: env!("CARGO_PKG_VERSION").into() };
    let (events, mut rx) = mpsc::unbounded_channel();
    watch_signals(events.clone());
    if config.parent_liveness_stdin {
        // Without the liveness thread the VM could outlive the driver; refuse to run.
        crate::liveness::watch_stdin(events.clone())
            .map_err(|e| StartError::SandboxDir(config.sandbox_dir.clone(), e))?;
    }
    let Booted { mut vmm, mut lease, link } = match boot(config, &events, &mut rx).await {
        Ok(booted) => booted,
        Err(e) => {
            let mut error = chain(&e);
            if matches!(e, StartError::Boot(_) | StartError::VmmExitedDuringBoot { .. }) {
                error.push_str(&tails(&[files::VMM_LOG, files::CONSOLE_LOG]));
            }
            if matches!(e, StartError::Boot(AttachError::Handshake(_))) {
                let event =
                    telemetry.source().finding(Finding::GuestProtocolViolation, "the guest agent's handshake failed");
                telemetry.emit(event);
            }
            let event = telemetry.source().lifecycle(Lifecycle::Start, &sandbox, Status::Failure, Some(chain(&e)));
            telemetry.emit(event);
            status::report(&SupervisorStatus::Failed { error });
            return Err(e);
        }
    };
    let vm = AppInfo { name: "microvm".into(), version: link.hello.software_label() };
    // A previous start of this sandbox may have left its socket behind.
    let _ = std::fs::remove_file(ATTACH_SOCKET);
    let listener = match UnixListener::bind(ATTACH_SOCKET) {
        Ok(l) => l,
        Err(e) => {
            kill(&mut vmm).await;
            lease.close().await;
            let e = StartError::Bind(ATTACH_SOCKET, e);
            status::report(&SupervisorStatus::Failed { error: chain(&e) });
            return Err(e);
        }
    };
    attach::serve(listener, link.hello.capabilities, events.clone());
    for app in [&vm, &sandbox] {
        let event = telemetry.source().lifecycle(Lifecycle::Start, app, Status::Success, None);
        telemetry.emit(event);
    }
    status::report(&SupervisorStatus::Ready {
        attach_socket: ATTACH_SOCKET.into(),
        vmm_pid: vmm.id().unwrap_or(0),
        agent: vm.version.clone(),
    });
    tracing::info!(sandbox = %config.sandbox_id, agent = %vm.version, "sandbox ready");
    let session = session.map(|s| tokio::spawn(crate::session::run(s, events.clone())).abort_handle());
    let reason = crate::serve::serve(config, &mut vmm, &mut lease, link.tx, &mut rx, telemetry, session).await;
    if lease.close().await.is_none() {
        tracing::warn!("the lease watchdog did not exit after the VM stopped; killed it");
    }
    let (status, detail) = match &reason {
        StopReason::Terminated => (Status::Success, None),
        other => (Status::Failure, Some(other.to_string())),
    };
    for app in [&vm, &sandbox] {
        let event = telemetry.source().lifecycle(Lifecycle::Stop, app, status, detail.clone());
        telemetry.emit(event);
    }
    Ok(reason)
}

/// A VM whose agent answered, under a live lease.
struct Booted {
    vmm: Child,
    lease: Lease,
    link: guest::GuestLink,
}

async fn boot(
    config: &SupervisorConfig,
    events: &UnboundedSender<Event>,
    rx: &mut UnboundedReceiver<Event>,
) -> Result<Booted, StartError> {
    if let Some(cgroup) = &config.cgroup {
        // Before anything is started, so QEMU and the watchdog inherit it. Not fatal: it is the last sweep,
        // not the first line of defence.
        if std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string()).is_err() {
            tracing::warn!(cgroup = %cgroup.display(), "cannot join the sandbox's cgroup");
        }
    }
    for (what, path) in [("kernel", &config.kernel), ("initramfs", &config.initrd)] {
        if !path.is_file() {
            return Err(StartError::MissingImage { what, path: path.clone() });
        }
    }
    let watchdog = std::env::current_exe()
        .map(|exe| exe.with_file_name("vm-watchdog"))
        .map_err(|e| StartError::SandboxDir(config.sandbox_dir.clone(), e))?;
    if !watchdog.is_file() {
        return Err(StartError::NoWatchdog(watchdog));
    }
    let (accel, fallback) = accel::Host::default().choose(config.accel).map_err(StartError::Kvm)?;
    if let Some(why) = &fallback {
        tracing::warn!(reason = %why, "KVM unusable; using TCG software emulation");
    }
    status::report(&SupervisorStatus::Accelerator { accel, fallback: fallback.map(|w| w.to_string()) });
    let qemu = match &config.qemu {
        Some(q) => q.clone(),
        None => vmm::find_qemu().ok_or(StartError::NoQemu)?,
    };
    let _ = std::fs::remove_file(files::CHANNEL_SOCKET);
    let channel = UnixListener::bind(files::CHANNEL_SOCKET).map_err(|e| StartError::Bind(files::CHANNEL_SOCKET, e))?;
    let vmm_config = VmmConfig {
        qemu,
        kernel: config.kernel.clone(),
        initrd: config.initrd.clone(),
        cpus: config.cpus,
        memory_mib: config.memory_mib,
        accel,
    };
    let mut vmm = vmm_config.spawn().map_err(StartError::SpawnVmm)?;
    match supervise(config, &mut vmm, &channel, &watchdog, events, rx).await {
        Ok((lease, link)) => Ok(Booted { vmm, lease, link }),
        Err(e) => {
            kill(&mut vmm).await;
            Err(e)
        }
    }
}

/// Everything after QEMU started: pids, lease, handshake. The caller kills QEMU on error.
async fn supervise(
    config: &SupervisorConfig,
    vmm: &mut Child,
    channel: &UnixListener,
    watchdog: &Path,
    events: &UnboundedSender<Event>,
    rx: &mut UnboundedReceiver<Event>,
) -> Result<(Lease, guest::GuestLink), StartError> {
    let vmm_record = vmm.id().and_then(|p| ProcessRecord::read(i32::try_from(p).ok()?));
    let mut recorded = SandboxPids {
        supervisor: ProcessRecord::read(i32::try_from(std::process::id()).unwrap_or(0))
            .ok_or_else(|| StartError::Pids(std::io::ErrorKind::NotFound.into()))?,
        vmm: vmm_record,
        watchdog: None,
    };
    pids::write(&recorded).map_err(StartError::Pids)?;
    let Some(vmm_record) = vmm_record else {
        return Err(StartError::VmmExitedDuringBoot { status: "before it could be recorded".into() });
    };
    let mut lease = Lease::start(watchdog, vmm_record, &child_env()).await.map_err(StartError::Lease)?;
    recorded.watchdog = lease.record;
    if let Err(e) = pids::write(&recorded) {
        lease.close().await;
        return Err(StartError::Pids(e));
    }
    let result = handshake(config, vmm, channel, &mut lease, events, rx).await;
    match result {
        Ok(link) => Ok((lease, link)),
        Err(e) => {
            lease.close().await;
            Err(e)
        }
    }
}

async fn handshake(
    config: &SupervisorConfig,
    vmm: &mut Child,
    channel: &UnixListener,
    lease: &mut Lease,
    events: &UnboundedSender<Event>,
    rx: &mut UnboundedReceiver<Event>,
) -> Result<guest::GuestLink, StartError> {
    let attach = guest::attach(channel, config.boot_timeout(), events.clone());
    tokio::pin!(attach);
    loop {
        tokio::select! {
            link = &mut attach => return match link {
                Ok(link) => Ok(link),
                Err(e) => {
                    // QEMU exiting also closes the channel: when the channel merely ended, name the exit, the real
                    // cause. A hello that arrived and did not match is the cause itself.
                    let mismatch = matches!(&e, AttachError::Handshake(FirstFrameError::Handshake(_)))
                        || matches!(&e, AttachError::Handshake(FirstFrameError::Frame(f)) if f.is_violation());
                    if !mismatch {
                        if let Ok(Ok(exit)) = tokio::time::timeout(Duration::from_millis(VMM_EXIT_GRACE_MS), vmm.wait()).await {
                            return Err(StartError::VmmExitedDuringBoot { status: exit.to_string() });
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
                return Err(match vmm.try_wait() {
                    Ok(Some(exit)) => StartError::VmmExitedDuringBoot { status: exit.to_string() },
                    _ => StartError::Lease(e),
                });
            },
            () = stop_requested(rx) => return Err(StartError::StoppedDuringBoot),
        }
    }
}

/// The environment of the supervisor's children: nothing, except test switches in test builds.
fn child_env() -> Vec<(&'static str, String)> {
    #[cfg(feature = "test-controls")]
    if let Ok(value) = std::env::var(vm_contract::test_control::VAR) {
        return vec![(vm_contract::test_control::VAR, value)];
    }
    Vec::new()
}

async fn stop_requested(rx: &mut UnboundedReceiver<Event>) {
    while let Some(event) = rx.recv().await {
        if matches!(event, Event::Terminate | Event::DriverGone) {
            return;
        }
    }
}

async fn kill(vmm: &mut Child) {
    let _ = vmm.start_kill();
    let _ = vmm.wait().await;
}

fn watch_signals(events: UnboundedSender<Event>) {
    match Signals::new([SIGTERM, SIGINT, SIGHUP]) {
        Ok(mut signals) => {
            let spawned = std::thread::Builder::new().name("signals".into()).spawn(move || {
                for _ in signals.forever() {
                    if events.send(Event::Terminate).is_err() {
                        return;
                    }
                }
            });
            if spawned.is_err() {
                tracing::error!("cannot start the signal thread; SIGTERM will kill without an orderly stop");
            }
        }
        Err(_) => tracing::error!("cannot register signal handlers; SIGTERM will kill without an orderly stop"),
    }
}
