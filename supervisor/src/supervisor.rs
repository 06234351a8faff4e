//! The supervisor's event loop: boot, serve, and the orderly stop.
//!
//! ```text
//! choose accelerator -> bind chan.sock -> start QEMU -> agent hello (boot timeout) -> bind attach.sock
//!   -> Ready -> loop { guest frames, client frames, signals, liveness, VMM exit }
//! stop (SIGTERM, driver gone, guest violation): refuse new processes, Shutdown{grace} to the agent (which
//!   SIGTERMs, waits, SIGKILLs, powers off), forward the last Exited frames, wait for QEMU to exit
//!   (SIGKILL after grace + STOP_MARGIN_MS), let client writers drain, return.
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tokio::net::UnixListener;
use tokio::process::Child;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::time::Instant;
use vm_protocol::status::SupervisorStatus;
use vm_protocol::ToGuest;

use crate::accel::{self, KvmUnusable};
use crate::attach::{self, ClientHandle, ATTACH_SOCKET};
use crate::config::SupervisorConfig;
use crate::guest::{self, AttachError};
use crate::mux::{Action, ClientId, Mux};
use crate::status;
use crate::vmm::{self, files, VmmConfig};
use crate::Event;

/// After the agent's grace period, how long QEMU gets to exit on its own before SIGKILL.
const STOP_MARGIN_MS: u64 = 5_000;

/// How long client writers get to deliver their last frames after the VM is gone.
const CLIENT_DRAIN_MS: u64 = 2_000;

/// After the channel failed during boot, how long to wait for QEMU's own exit before calling it a guest
/// failure.
const VMM_EXIT_GRACE_MS: u64 = 500;

/// Lines of `vmm.log` and `console.log` quoted in a boot failure.
const LOG_TAIL_LINES: usize = 12;

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
}

/// How a supervised VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// SIGTERM (or SIGINT/SIGHUP): an orderly stop.
    Terminated,
    /// The liveness pipe closed.
    DriverGone,
    /// QEMU exited without being asked (guest crash or power-off).
    VmmExited(String),
    /// The guest broke the protocol; the VM was stopped.
    GuestViolation(String),
}

impl StopReason {
    /// Whether this was a stop the driver asked for (directly or by going away).
    pub fn is_orderly(&self) -> bool {
        matches!(self, Self::Terminated | Self::DriverGone)
    }
}

/// Runs one VM from boot to stop.
///
/// # Errors
/// A [`StartError`] if the VM never became ready; the failure is also reported as a status line.
pub async fn run(config: SupervisorConfig) -> Result<StopReason, StartError> {
    let (events, mut rx) = mpsc::unbounded_channel();
    watch_signals(events.clone());
    if config.parent_liveness_stdin {
        // Without the liveness thread the VM could outlive the driver; refuse to run.
        crate::liveness::watch_stdin(events.clone())
            .map_err(|e| StartError::SandboxDir(config.sandbox_dir.clone(), e))?;
    }
    let (mut vmm, link) = match boot(&config, &events, &mut rx).await {
        Ok(ready) => ready,
        Err(e) => {
            let mut error = chain(&e);
            if matches!(e, StartError::Boot(_) | StartError::VmmExitedDuringBoot { .. }) {
                error.push_str(&tails());
            }
            status::report(&SupervisorStatus::Failed { error });
            return Err(e);
        }
    };
    let listener = UnixListener::bind(ATTACH_SOCKET).map_err(|e| StartError::Bind(ATTACH_SOCKET, e))?;
    attach::serve(listener, link.hello.capabilities, events.clone());
    status::report(&SupervisorStatus::Ready {
        attach_socket: ATTACH_SOCKET.into(),
        vmm_pid: vmm.id().unwrap_or(0),
        agent: link.hello.software.clone(),
    });
    tracing::info!(sandbox = %config.sandbox_id, agent = %link.hello.software, "sandbox ready");
    Ok(serve(&config, &mut vmm, link.tx, &mut rx).await)
}

async fn boot(
    config: &SupervisorConfig,
    events: &UnboundedSender<Event>,
    rx: &mut UnboundedReceiver<Event>,
) -> Result<(Child, guest::GuestLink), StartError> {
    std::env::set_current_dir(&config.sandbox_dir)
        .map_err(|e| StartError::SandboxDir(config.sandbox_dir.clone(), e))?;
    for (what, path) in [("kernel", &config.kernel), ("initramfs", &config.initrd)] {
        if !path.is_file() {
            return Err(StartError::MissingImage {
                what,
                path: path.clone(),
            });
        }
    }
    let (accel, fallback) = accel::Host::default().choose(config.accel).map_err(StartError::Kvm)?;
    if let Some(why) = &fallback {
        tracing::warn!(reason = %why, "KVM unusable; using TCG software emulation");
    }
    status::report(&SupervisorStatus::Accelerator {
        accel,
        fallback: fallback.map(|w| w.to_string()),
    });
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
    tokio::select! {
        link = guest::attach(&channel, config.boot_timeout(), events.clone()) => match link {
            Ok(link) => Ok((vmm, link)),
            Err(e) => {
                // QEMU exiting also closes the channel; name the exit, the real cause, when that is what happened.
                if let Ok(Ok(exit)) = tokio::time::timeout(Duration::from_millis(VMM_EXIT_GRACE_MS), vmm.wait()).await {
                    return Err(StartError::VmmExitedDuringBoot { status: exit.to_string() });
                }
                kill(&mut vmm).await;
                Err(StartError::Boot(e))
            }
        },
        exit = vmm.wait() => Err(StartError::VmmExitedDuringBoot {
            status: exit.map_or_else(|e| e.to_string(), |s| s.to_string()),
        }),
        () = stop_requested(rx) => {
            kill(&mut vmm).await;
            Err(StartError::StoppedDuringBoot)
        }
    }
}

async fn stop_requested(rx: &mut UnboundedReceiver<Event>) {
    while let Some(event) = rx.recv().await {
        if matches!(event, Event::Terminate | Event::DriverGone) {
            return;
        }
    }
}

/// The state of a running sandbox.
struct Serving<'a> {
    config: &'a SupervisorConfig,
    mux: Mux,
    guest: UnboundedSender<ToGuest>,
    clients: HashMap<ClientId, ClientHandle>,
    /// Why we are stopping, and when QEMU gets SIGKILL if it has not exited.
    stopping: Option<(StopReason, Instant)>,
}

async fn serve(
    config: &SupervisorConfig,
    vmm: &mut Child,
    guest: UnboundedSender<ToGuest>,
    rx: &mut UnboundedReceiver<Event>,
) -> StopReason {
    let mut state = Serving {
        config,
        mux: Mux::default(),
        guest,
        clients: HashMap::new(),
        stopping: None,
    };
    let mut killed = false;
    let reason = loop {
        let kill_at = state.stopping.as_ref().map(|(_, at)| *at);
        tokio::select! {
            exit = vmm.wait() => {
                let status = exit.map_or_else(|e| e.to_string(), |s| s.to_string());
                break state.stopping.take().map_or(StopReason::VmmExited(status), |(reason, _)| reason);
            }
            () = sleep_until_some(kill_at), if !killed => {
                tracing::warn!("the VM did not power off in time; killing the VMM");
                let _ = vmm.start_kill();
                killed = true;
            }
            event = rx.recv() => state.handle(event),
        }
    };
    // Closing each client's queue lets its writer deliver what is queued (the last `Exited` frames), then end.
    let writers: Vec<_> = state.clients.into_values().map(|c| c.writer).collect();
    let _ = tokio::time::timeout(
        Duration::from_millis(CLIENT_DRAIN_MS),
        futures_util::future::join_all(writers),
    )
    .await;
    reason
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Serving<'_> {
    fn handle(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Guest(msg)) => match self.mux.from_guest(msg) {
                Ok(actions) => self.apply(actions),
                Err(violation) => {
                    tracing::error!(error = %violation, "protocol violation by the guest");
                    self.stop(StopReason::GuestViolation(violation.to_string()));
                }
            },
            Some(Event::Client(id, msg)) => match self.mux.from_client(id, msg) {
                Ok(actions) => self.apply(actions),
                Err(violation) => {
                    tracing::warn!(error = %violation, "protocol violation by an attach client; disconnected");
                    self.drop_client(id);
                }
            },
            Some(Event::ClientConnected(id, handle)) => {
                self.mux.add_client(id);
                self.clients.insert(id, handle);
            }
            Some(Event::ClientClosed(id)) => self.drop_client(id),
            Some(Event::GuestClosed(error)) => {
                if self.stopping.is_none() {
                    tracing::warn!(error = ?error.map(|e| e.to_string()), "the guest channel closed unexpectedly");
                }
            }
            Some(Event::Terminate) => self.stop(StopReason::Terminated),
            Some(Event::DriverGone) => self.stop(StopReason::DriverGone),
            // Senders live as long as the loop; unreachable, but never spin on a closed queue.
            None => self.stop(StopReason::Terminated),
        }
    }

    /// Begins the orderly stop once; later requests only keep the first reason.
    fn stop(&mut self, reason: StopReason) {
        if self.stopping.is_some() {
            return;
        }
        tracing::info!(?reason, "stopping the sandbox");
        self.mux.stop_accepting();
        let grace = self.config.stop_grace_ms;
        let _ = self.guest.send(ToGuest::Shutdown { grace_ms: grace });
        let kill_at = Instant::now() + Duration::from_millis(u64::from(grace) + STOP_MARGIN_MS);
        self.stopping = Some((reason, kill_at));
    }

    fn drop_client(&mut self, id: ClientId) {
        self.clients.remove(&id);
        let actions = self.mux.remove_client(id);
        self.apply(actions);
    }

    fn apply(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::ToGuest(msg) => {
                    let _ = self.guest.send(msg);
                }
                Action::ToClient(id, msg) => {
                    if let Some(client) = self.clients.get(&id) {
                        let _ = client.tx.send(msg);
                    }
                }
                Action::Started { guest_id, pid, argv } => {
                    tracing::info!(process = %guest_id, pid, argv0 = argv.first().map(String::as_str), "process started");
                }
                Action::Exited { guest_id, status, .. } => {
                    tracing::info!(process = %guest_id, exit = status.shell_code(), "process exited");
                }
            }
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

/// The error and its causes, outermost first.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// The last lines of QEMU's and the guest's logs, for a boot failure message.
fn tails() -> String {
    let mut text = String::new();
    for file in [files::VMM_LOG, files::CONSOLE_LOG] {
        let tail = tail(Path::new(file));
        if !tail.is_empty() {
            text.push_str(&format!("\n--- last lines of {file} ---\n{tail}"));
        }
    }
    text
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}
