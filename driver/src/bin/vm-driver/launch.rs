//! `vm-driver launch`: one sandbox for one command, from boot to stop.
//!
//! ```text
//! reap orphans -> resolve image -> sandbox dir -> the sandbox lifecycle's start -> Ready
//!   -> attach: Spawn, stream stdio, forward Ctrl-C -> Exited
//!   -> the lifecycle's stop (SIGTERM, wait, close pipe) and end (reap, sweep, tombstone)
//! ```
//!
//! Ctrl-C is forwarded to the workload as SIGINT; the third one stops the sandbox. SIGTERM and SIGHUP stop it
//! in order, and so does `--timeout` (exit 124). While a stop is under way the workload's remaining output is
//! still written out: the orderly stop loses nothing the workload wrote.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;
use vm_contract::accel::AccelChoice;
use vm_contract::exit::driver::{HANGUP, INTERRUPTED, TERMINATED, TIMEOUT};
use vm_contract::ids::SandboxId;
use vm_contract::shape::SandboxShape;
use vm_contract::tombstone::EndReason;
use vm_driver::attach_client::{self, Attached};
use vm_driver::jail::JailRequest;
use vm_driver::process::local::{LocalClient, Stdin, SIGNAL_QUEUE};
use vm_driver::process::output::{self, Output};
use vm_driver::process::relay::OUTPUT_WINDOW;
use vm_driver::process::terminal::{self, RawMode};
use vm_driver::process::{self, ProcessSession};
use vm_driver::sandbox::supervisor::{describe, Stopped};
use vm_driver::sandbox::{self, Ended, Identity, Running, StartSecrets, Stopping, VmSpec, HUNG_STOP_TIMEOUT};
use vm_driver::state::{self, StateDir};
use vm_driver::telemetry::{self, TelemetryConfig};
use vm_driver::template::{self, Templates};
use vm_driver::{image, reap};
use vm_protocol::files::{FileOp, FileSpawn, TarLayout};
use vm_protocol::message::EnvVar;
use vm_protocol::{Capabilities, ExitStatus, ProcId, ProcessRequest, SignalName, Spawn};

/// How long a template's save may take beyond a boot, after the workload ended.
const TEMPLATE_SAVE_MARGIN: Duration = Duration::from_secs(30);

/// Ctrl-Cs after which `launch` stops the sandbox instead of forwarding.
const INTERRUPTS_TO_STOP: u32 = 3;

/// Everything `launch` needs, already parsed.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// How egress connections resolve and leave.
    pub egress: sandbox::Egress,
    /// How long ended launch sandboxes are kept.
    pub retention: vm_driver::gc::Retention,
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Extra environment for the process.
    pub env: Vec<(String, String)>,
    /// Working directory in the guest.
    pub workdir: Option<String>,
    /// Resource limits for the process.
    pub rlimits: Vec<vm_protocol::rlimit::Rlimit>,
    /// Memory file systems the guest mounts.
    pub tmpfs: Vec<vm_protocol::tmpfs::GuestTmpfs>,
    /// The image root (the built-in root when `None`).
    pub root: Option<vm_contract::root::RootImage>,
    /// Boot image directory (the default when `None`).
    pub boot_image: Option<PathBuf>,
    /// Explicit kernel.
    pub kernel: Option<PathBuf>,
    /// Explicit initramfs.
    pub initrd: Option<PathBuf>,
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// The accelerator asked for.
    pub accel: AccelChoice,
    /// How VMMs are to be confined.
    pub jail: JailRequest,
    /// The sandbox policy.
    pub policy: Option<vm_protocol::policy::SandboxPolicy>,
    /// The test controls (all off but in the causal tests).
    pub controls: vm_driver::controls::Controls,
    /// Stop the sandbox after this long.
    pub timeout: Option<Duration>,
    /// Boot timeout.
    pub boot_timeout: Duration,
    /// Bound on the wait between SIGTERM and SIGKILL of the supervisor.
    pub stop_timeout: Duration,
    /// State directory.
    pub state_dir: Option<PathBuf>,
    /// Sandbox id (random when `None`).
    pub id: Option<SandboxId>,
    /// Keep the sandbox directory after a clean stop.
    pub keep: bool,
    /// Boot, and make no template.
    pub cold: bool,
    /// Telemetry settings for the supervisor.
    pub telemetry: TelemetryConfig,
    /// Host paths copied in before the command: (host path, guest path).
    pub copy_in: Vec<(PathBuf, String)>,
    /// Guest paths copied out after it, whatever its status: (guest path, host path).
    pub copy_out: Vec<(String, PathBuf)>,
    /// Run the command on a pseudo-terminal (`-t`).
    pub tty: bool,
    /// Host directories shared with the guest (`--mount`).
    pub mounts: Vec<vm_contract::share::HostMount>,
    /// Secret credentials (`--credentials-file`), for the auth bundle only.
    pub secrets: Vec<vm_protocol::credentials::SecretCredential>,
}

/// The signals that end a launch, watched from before the supervisor starts.
struct Signals {
    terminate: Signal,
    hangup: Signal,
    interrupt: Signal,
}

/// Runs one command in a new sandbox; returns the exit code.
///
/// # Errors
/// Anything that kept the workload from producing an exit status.
pub async fn run(config: LaunchConfig) -> Result<u8> {
    let image = image::resolve(config.boot_image.as_deref(), config.kernel.as_deref(), config.initrd.as_deref())?;
    let supervisor = sandbox::supervisor::locate()?;
    let jail = config.jail.resolve(&supervisor)?;
    let mounts = vm_driver::mounts::resolve(&config.mounts, jail.confinement)?;
    let root = config.state_dir.clone().unwrap_or_else(state::default_root);
    let state = StateDir::open(&root)?;
    for reaped in reap::reap_all(&state.sandboxes_dir(), config.controls.reaper) {
        if reaped.killed() {
            eprintln!("vm-driver: reaped orphaned sandbox {} (its supervisor was gone)", reaped.sandbox);
        }
    }
    vm_driver::gc::collect(&state.sandboxes_dir(), config.retention);
    let id = match &config.id {
        Some(id) => id.clone(),
        None => state::random_id("launch").context("cannot make a sandbox id")?,
    };
    // Read before anything is made, so a malformed value fails fast and leaves nothing behind.
    let otlp_headers = telemetry::headers_from_env()?;
    let mut signals = Signals {
        terminate: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
        hangup: signal(SignalKind::hangup()).context("cannot watch SIGHUP")?,
        interrupt: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
    };
    let layout = state.create_sandbox(&id)?;
    let vm = VmSpec {
        supervisor,
        layout: layout.clone(),
        image,
        root: config.root.clone(),
        shape: config.shape,
        accel: config.accel,
        boot_timeout: config.boot_timeout,
        jail,
        egress: config.egress.route(),
        mounts,
        tmpfs: config.tmpfs.clone(),
        controls: config.controls,
    };
    let who = Identity {
        id: id.clone(),
        session: None,
        telemetry: config.telemetry.clone(),
        policy: config.policy.clone(),
        secrets: StartSecrets {
            otlp_headers,
            egress_proxy_authorization: config.egress.proxy_authorization.clone(),
            credentials: config.secrets.clone(),
            gateway_token: None,
        },
        gateway: None,
    };
    let templates = Templates::new(&state);
    let key = if config.cold { None } else { template::key::of(&vm).ok() };
    let template = key.as_ref().and_then(|key| match templates.load(key, u64::from(vm.shape.memory_mib()) << 20) {
        Ok(found) => found,
        Err(e) => {
            eprintln!("vm-driver: template refused: {e}; booting");
            None
        }
    });
    let restored = match &template {
        Some(template) => match template::restore(&vm, &who, template).await {
            Ok(running) => {
                eprintln!("vm-driver: restored from a template (a saved boot; --cold boots)");
                Some(running)
            }
            Err(e) if e.template_refused() => {
                eprintln!("vm-driver: cannot restore from the template ({e}); booting and making it again");
                if let Some(key) = &key {
                    templates.remove(key);
                }
                None
            }
            Err(e) => {
                eprintln!("vm-driver: cannot restore from the template ({e}); booting");
                None
            }
        },
        None => None,
    };
    let running_restored = restored.is_some();
    let running = match restored {
        Some(running) => running,
        None => match sandbox::start(&vm, &who) {
            Ok(running) => running,
            Err(e) => {
                eprintln!("vm-driver: sandbox directory kept at {}", layout.dir().display());
                return Err(e.into());
            }
        },
    };
    // The next launch of this spec restores: its template is made beside this sandbox.
    let making = match (&key, running_restored) {
        (Some(key), false) => {
            let (templates, key, vm, state) = (templates.clone(), key.clone(), vm.clone(), state.clone());
            Some(tokio::spawn(async move { templates.make(&key, &vm, &state).await }))
        }
        _ => None,
    };
    let (code, stopping) = drive(&config, &id, running, &mut signals).await;
    if let Some(making) = making {
        match tokio::time::timeout(config.boot_timeout + TEMPLATE_SAVE_MARGIN, making).await {
            Ok(Ok(Ok(_))) => {}
            Ok(Ok(Err(e))) => eprintln!("vm-driver: no template made: {e}"),
            Ok(Err(_)) | Err(_) => eprintln!("vm-driver: no template made: it took too long"),
        }
    }
    drop(template);
    let clean = code.is_ok() && stopping.stopped.in_order();
    report(&stopping);
    let left = stopping.end(if clean { EndReason::Stopped } else { EndReason::Failed }).await;
    if left.vm {
        eprintln!("vm-driver: the supervisor died; killed the VM it left behind");
    }
    if left.cgroup {
        eprintln!("vm-driver: the cgroup sweep found processes after the stop and killed them");
    }
    if clean && !config.keep {
        let _ = std::fs::remove_dir_all(layout.dir());
    } else if !clean {
        eprintln!("vm-driver: sandbox directory kept at {}", layout.dir().display());
    }
    code
}

/// Everything between the supervisor's start and its exit. Always ends with the supervisor stopped.
async fn drive(
    config: &LaunchConfig,
    id: &SandboxId,
    mut running: Running,
    signals: &mut Signals,
) -> (Result<u8>, Stopping) {
    let ready = tokio::select! {
        ready = running.ready() => ready,
        _ = signals.terminate.recv() => return (Ok(TERMINATED), running.stop(config.stop_timeout).await),
        _ = signals.hangup.recv() => return (Ok(HANGUP), running.stop(config.stop_timeout).await),
        _ = signals.interrupt.recv() => return (Ok(INTERRUPTED), running.stop(config.stop_timeout).await),
    };
    let ready = match ready {
        Ok(ready) => ready,
        Err(e) => {
            let stopping = running.stop(config.stop_timeout).await;
            return (Err(anyhow::Error::new(e).context(format!("sandbox {id} failed to start"))), stopping);
        }
    };
    if let Some(why) = &ready.fallback {
        eprintln!("vm-driver: using TCG software emulation: {why}");
    }
    let attached = match attach_client::connect(&running.layout().clone()).await {
        Ok(a) => a,
        Err(e) => return (Err(e.into()), running.stop(config.stop_timeout).await),
    };
    let (signal_tx, signal_rx) = mpsc::channel(SIGNAL_QUEUE);
    let process = run_job(config, attached, signal_rx);
    tokio::pin!(process);
    let deadline = async {
        match config.timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);

    let mut interrupts = 0;
    // Once the supervisor has exited, the relay ends on its own and says why.
    let mut supervisor_alive = true;
    let stop_code = loop {
        tokio::select! {
            status = &mut process => {
                let code = status.map(ExitStatus::exit_code);
                return (code, running.stop(config.stop_timeout).await);
            }
            ended = running.ended(), if supervisor_alive => match ended {
                // The workload's stream ends with the VM; the supervisor's exit is awaited next.
                Ended::VmmGone => {}
                Ended::Exited(_) => supervisor_alive = false,
                Ended::Hung => {
                    let why = anyhow::anyhow!("the VM stopped and vm-supervisor did not follow (hung); it was killed");
                    return (Err(why), running.stop(HUNG_STOP_TIMEOUT).await);
                }
            },
            () = &mut deadline => {
                eprintln!("vm-driver: --timeout expired; stopping the sandbox");
                break TIMEOUT;
            }
            _ = signals.interrupt.recv() => {
                interrupts += 1;
                if interrupts >= INTERRUPTS_TO_STOP {
                    eprintln!("vm-driver: interrupted {interrupts} times; stopping the sandbox");
                    break INTERRUPTED;
                }
                let _ = signal_tx.try_send(SignalName::Int);
            }
            _ = signals.terminate.recv() => break TERMINATED,
            _ = signals.hangup.recv() => break HANGUP,
        }
    };
    // Stop in order while still writing out what the workload already produced.
    let (stopping, _) = tokio::join!(running.stop(config.stop_timeout), &mut process);
    (Ok(stop_code), stopping)
}

/// What the supervisor's end says, when it says anything.
fn report(stopping: &Stopping) {
    if let Some(vm_contract::status::SupervisorStatus::Stopped { otlp_dropped, console_dropped, .. }) = &stopping.report
    {
        if *otlp_dropped > 0 || *console_dropped > 0 {
            eprintln!("vm-driver: telemetry: {otlp_dropped} OCSF records not exported, {console_dropped} console lines dropped");
        }
    }
    match &stopping.stopped {
        Stopped::Exited(s) if !s.success() => {
            eprintln!("vm-driver: vm-supervisor ended with {} (see supervisor.log)", describe(&Some(*s)));
        }
        Stopped::Killed => eprintln!("vm-driver: vm-supervisor did not stop in time and was killed"),
        Stopped::Exited(_) => {}
    }
}

/// The job: each `--copy-in`, the command, then each `--copy-out` (whatever the command's status), as
/// processes on one attach connection, one after another. The command's status is the job's.
async fn run_job(
    config: &LaunchConfig,
    mut attached: Attached,
    mut signals: mpsc::Receiver<SignalName>,
) -> Result<ExitStatus> {
    let mut ids = (1..).map(ProcId);
    let mut next = || ids.next().unwrap_or(ProcId(u32::MAX));
    let confined = !config.controls.files.unchecked_extract;
    if config.tty && !attached.capabilities.contains(Capabilities::PTY) {
        bail!("the sandbox's agent offers no terminals for -t");
    }
    let copies = !config.copy_in.is_empty() || !config.copy_out.is_empty();
    if copies && !attached.capabilities.contains(Capabilities::FILES) {
        bail!("the sandbox's agent offers no files API for --copy-in/--copy-out");
    }
    for (host, guest) in &config.copy_in {
        let (chunks, packing) = output::pack(host)?;
        let op = FileOp::CopyIn { path: guest.clone(), layout: TarLayout::Named };
        let files = ProcessRequest::Files(FileSpawn { id: next(), op, output_window: OUTPUT_WINDOW });
        let status = run_local(&mut attached, files, Stdin::Stream(chunks), Output::stdout(), &mut signals).await?;
        packing.finish().await?;
        if status != ExitStatus::Code(0) {
            bail!("--copy-in {} failed in the sandbox", host.display());
        }
    }
    let spawn = Spawn {
        id: next(),
        argv: config.argv.clone(),
        env: config.env.iter().map(|(key, value)| EnvVar { key: key.clone(), value: value.clone() }).collect(),
        cwd: config.workdir.clone(),
        pty: config.tty.then(terminal::pty_size),
        output_window: OUTPUT_WINDOW,
        rlimits: config.rlimits.clone(),
        root: None,
    };
    let status = {
        // Restored when the command ends, on every path (the guard drops with this block or the future).
        let _raw = if config.tty { RawMode::enter() } else { None };
        let stdin = Stdin::Stream(terminal::stdin_chunks());
        run_local(&mut attached, ProcessRequest::Spawn(spawn), stdin, Output::stdout(), &mut signals).await?
    };
    for (guest, host) in &config.copy_out {
        let output = Output::unpack(guest, host, confined)?;
        let op = FileOp::CopyOut { path: guest.clone() };
        let files = ProcessRequest::Files(FileSpawn { id: next(), op, output_window: OUTPUT_WINDOW });
        let copied = run_local(&mut attached, files, Stdin::Empty, output, &mut signals).await?;
        if copied != ExitStatus::Code(0) {
            bail!("--copy-out {guest} failed in the sandbox");
        }
    }
    Ok(status)
}

/// Runs one process (a `Spawn` or a file operation) through the process session, with this terminal as its
/// client.
async fn run_local(
    attached: &mut Attached,
    opening: ProcessRequest,
    stdin: Stdin,
    output: Output,
    signals: &mut mpsc::Receiver<SignalName>,
) -> Result<ExitStatus> {
    let (id, tty, copy_out) = match &opening {
        ProcessRequest::Spawn(spawn) => (spawn.id, spawn.pty.is_some(), None),
        ProcessRequest::Files(FileSpawn { id, op: FileOp::CopyOut { path }, .. }) => (*id, false, Some(path.clone())),
        other => (other.id(), false, None),
    };
    let mut local = LocalClient::new(stdin, output, signals, tty)?;
    let mut process = attached.open(opening).await?;
    let outcome = process::run(ProcessSession::new(id, false, copy_out), &mut process, &mut local).await;
    let why = process.why();
    local.finish(&outcome, why)
}

/// Parses `KEY=VALUE`.
///
/// # Errors
/// No `=`, an empty key, or a NUL byte.
pub fn parse_env(text: &str) -> Result<(String, String)> {
    let Some((key, value)) = text.split_once('=') else { anyhow::bail!("--env wants KEY=VALUE, got {text:?}") };
    if key.is_empty() || text.contains('\0') {
        anyhow::bail!("--env wants KEY=VALUE with a non-empty key and no NUL byte");
    }
    Ok((key.to_owned(), value.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_pairs_parse() {
        assert_eq!(parse_env("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(parse_env("A=").unwrap(), ("A".into(), String::new()));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("novalue").is_err());
    }
}
