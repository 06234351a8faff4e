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

use anyhow::{Context, Result};
use tokio::io::AsyncWriteExt;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;
use vm_contract::accel::AccelChoice;
use vm_contract::exit::driver::{HANGUP, INTERRUPTED, TERMINATED, TIMEOUT};
use vm_contract::ids::SandboxId;
use vm_contract::shape::SandboxShape;
use vm_contract::tombstone::EndReason;
use vm_driver::attach_client::{self, AttachError, Attached};
use vm_driver::jail::JailRequest;
use vm_driver::relay::{ProcessRelay, OUTPUT_WINDOW};
use vm_driver::sandbox::supervisor::{describe, Stopped};
use vm_driver::sandbox::{self, Ended, Running, StartSpec, Stopping, HUNG_STOP_TIMEOUT};
use vm_driver::state::{self, StateDir};
use vm_driver::telemetry::{self, TelemetryConfig};
use vm_driver::{image, reap};
use vm_protocol::attach::{Disconnect, SupervisorReply, SupervisorRequest, ToClient};
use vm_protocol::files::{FileOp, FileSpawn, TarLayout};
use vm_protocol::message::{EnvVar, Refusal};
use vm_protocol::{Capabilities, ExitStatus, ProcId, ProcessEvent, ProcessRequest, SignalName, Spawn, Stream};

use crate::copy::{self, Output, OutputError};
use crate::stdin;
use crate::terminal::{self, RawMode};

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
    let spec = StartSpec {
        supervisor,
        id: id.clone(),
        layout: layout.clone(),
        image,
        root: config.root.clone(),
        shape: config.shape,
        accel: config.accel,
        boot_timeout: config.boot_timeout,
        telemetry: config.telemetry.clone(),
        otlp_headers,
        session: None,
        jail,
        policy: config.policy.clone(),
        egress: config.egress.clone(),
        mounts,
        secrets: config.secrets.clone(),
        controls: config.controls,
    };
    let running = match sandbox::start(&spec) {
        Ok(running) => running,
        Err(e) => {
            eprintln!("vm-driver: sandbox directory kept at {}", layout.dir().display());
            return Err(e.into());
        }
    };
    let (code, stopping) = drive(&config, &id, running, &mut signals).await;
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
    let (signal_tx, signal_rx) = mpsc::unbounded_channel();
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
                let code = status.map(exit_code).map_err(anyhow::Error::from);
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
                let _ = signal_tx.send(SignalName::Int);
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

/// Why the process could not run to its exit.
#[derive(Debug, thiserror::Error)]
enum RunError {
    /// The connection failed.
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// The sandbox went away before the process exited.
    #[error("the sandbox stopped before the process exited")]
    SandboxEnded,
    /// The supervisor cut this client off, and said why.
    #[error("the sandbox cut the attach connection: {}", .0.describe())]
    Disconnected(Disconnect),
    /// The sandbox refused to start the process.
    #[error("the sandbox refused to start the process ({0:?})")]
    Refused(Refusal),
    /// Writing the process's output locally failed.
    #[error("cannot write the process's output")]
    Output(#[source] std::io::Error),
    /// The sandbox broke the credit rules.
    #[error("the sandbox broke the stdin credit rules")]
    Credit,
    /// A `--copy-in` or `--copy-out` failed, or the guest cannot do what the job asks (`-t`, copies).
    #[error("{0:#}")]
    Job(anyhow::Error),
}

/// The job: each `--copy-in`, the command, then each `--copy-out` (whatever the command's status), as
/// processes on one attach connection. The command's status is the job's.
async fn run_job(
    config: &LaunchConfig,
    mut attached: Attached,
    mut signals: mpsc::UnboundedReceiver<SignalName>,
) -> Result<ExitStatus, RunError> {
    let mut ids = (1..).map(ProcId);
    let mut next = || ids.next().unwrap_or(ProcId(u32::MAX));
    let confined = !config.controls.files.unchecked_extract;
    if config.tty && !attached.capabilities.contains(Capabilities::PTY) {
        return Err(RunError::Job(anyhow::anyhow!("the sandbox's agent offers no terminals for -t")));
    }
    let copies = !config.copy_in.is_empty() || !config.copy_out.is_empty();
    if copies && !attached.capabilities.contains(Capabilities::FILES) {
        return Err(RunError::Job(anyhow::anyhow!("the sandbox's agent offers no files API for --copy-in/--copy-out")));
    }
    for (host, guest) in &config.copy_in {
        let (chunks, packing) = copy::pack(host).map_err(RunError::Job)?;
        let op = FileOp::CopyIn { path: guest.clone(), layout: TarLayout::Named };
        let files = ProcessRequest::Files(FileSpawn { id: next(), op, output_window: OUTPUT_WINDOW });
        let status = run_local(&mut attached, files, Some(chunks), Output::stdout(), &mut signals).await?;
        packing.finish().await.map_err(RunError::Job)?;
        if status != ExitStatus::Code(0) {
            return Err(RunError::Job(anyhow::anyhow!("--copy-in {} failed in the sandbox", host.display())));
        }
    }
    let spawn = Spawn {
        id: next(),
        argv: config.argv.clone(),
        env: config.env.iter().map(|(key, value)| EnvVar { key: key.clone(), value: value.clone() }).collect(),
        cwd: config.workdir.clone(),
        pty: config.tty.then(terminal::pty_size),
        output_window: OUTPUT_WINDOW,
    };
    let status = {
        // Restored when the command ends, on every path (the guard drops with this block or the future).
        let _raw = if config.tty { RawMode::enter() } else { None };
        run_local(&mut attached, ProcessRequest::Spawn(spawn), Some(stdin::chunks()), Output::stdout(), &mut signals)
            .await?
    };
    for (guest, host) in &config.copy_out {
        let output = Output::unpack(guest, host, confined).map_err(RunError::Job)?;
        let op = FileOp::CopyOut { path: guest.clone() };
        let files = ProcessRequest::Files(FileSpawn { id: next(), op, output_window: OUTPUT_WINDOW });
        let copied = run_local(&mut attached, files, None, output, &mut signals).await?;
        if copied != ExitStatus::Code(0) {
            return Err(RunError::Job(anyhow::anyhow!("--copy-out {guest} failed in the sandbox")));
        }
    }
    Ok(status)
}

/// Runs one process (a `Spawn` or a file operation), through the relay: `input` as its stdin within the
/// guest's credit (none: EOF at once), its stdout handed to `output` and its stderr written here before
/// their credit goes back, signals as messages.
async fn run_local(
    attached: &mut Attached,
    opening: ProcessRequest,
    input: Option<copy::Input>,
    mut output: Output,
    signals: &mut mpsc::UnboundedReceiver<SignalName>,
) -> Result<ExitStatus, RunError> {
    let id = match &opening {
        ProcessRequest::Files(files) => files.id,
        ProcessRequest::Spawn(spawn) => spawn.id,
        _ => ProcId(0),
    };
    let tty = matches!(&opening, ProcessRequest::Spawn(Spawn { pty: Some(_), .. }));
    let mut winch = signal(SignalKind::window_change()).map_err(RunError::Output)?;
    let mut relay = ProcessRelay::new(id);
    let mut stderr = tokio::io::stderr();
    let mut stdin_open = input.is_some();
    let mut stdin = input.unwrap_or_else(|| mpsc::channel(1).1);
    if !stdin_open {
        relay.stdin_eof();
    }
    attached.send(opening.clone()).await?;
    loop {
        tokio::select! {
            frame = attached.recv() => match frame {
                Some(Ok(ToClient::Process(ProcessEvent::Started { stdin_window, output_window, .. }))) => relay.started(stdin_window, output_window),
                Some(Ok(ToClient::Process(ProcessEvent::Output { stream, data, .. }))) => {
                    match stream {
                        Stream::Stdout => {
                            if let Err(e) = output.write(&data).await {
                                return Err(refused(attached, &opening, e).await);
                            }
                        }
                        Stream::Stderr => {
                            stderr.write_all(&data).await.map_err(RunError::Output)?;
                            stderr.flush().await.map_err(RunError::Output)?;
                        }
                    }
                    if let Some(credit) = relay.output_handed_on(data.len()) {
                        attached.send(credit).await?;
                    }
                }
                Some(Ok(ToClient::Process(ProcessEvent::StdinCredit { bytes, .. }))) => relay.stdin_credit(bytes).map_err(|_| RunError::Credit)?,
                Some(Ok(ToClient::Process(ProcessEvent::Exited { status, .. }))) => {
                    stderr.flush().await.map_err(RunError::Output)?;
                    // The extractor's verdict while the supervisor still knows the operation (for its finding).
                    if let Err(e) = output.finish(status == ExitStatus::Code(0)).await {
                        return Err(refused(attached, &opening, e).await);
                    }
                    // Everything is written: tell the supervisor, which keeps undelivered output.
                    if let Some(credit) = relay.finish() {
                        let _ = attached.send(credit).await;
                    }
                    return Ok(status);
                }
                // As a shell shows it: the message on stderr, then the status.
                Some(Ok(ToClient::Process(ProcessEvent::SpawnFailed { status, message, .. }))) => {
                    stderr.write_all(format!("{message}\n").as_bytes()).await.map_err(RunError::Output)?;
                    stderr.flush().await.map_err(RunError::Output)?;
                    return Ok(status);
                }
                Some(Ok(ToClient::Process(ProcessEvent::Refused { reason, .. }))) => return Err(RunError::Refused(reason)),
                Some(Ok(ToClient::Supervisor(SupervisorReply::Disconnected { reason }))) => {
                    return Err(RunError::Disconnected(reason))
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(AttachError::Frame(e).into()),
                None => return Err(RunError::SandboxEnded),
            },
            chunk = stdin.recv(), if stdin_open && relay.wants_stdin() => match chunk {
                // Our own stdin is never stdin after EOF.
                Some(bytes) => relay.push_stdin(&bytes).map_err(|_| RunError::Credit)?,
                None => {
                    stdin_open = false;
                    relay.stdin_eof();
                }
            },
            Some(signal) = signals.recv() => attached.send(ProcessRequest::Signal { id: relay.id(), signal }).await?,
            _ = winch.recv(), if tty => attached.send(ProcessRequest::Resize { id, size: terminal::pty_size() }).await?,
            () = output.ended_early() => {
                if let Err(e) = output.write(&[]).await {
                    return Err(refused(attached, &opening, e).await);
                }
            }
        }
        while let Some(msg) = relay.next_stdin() {
            attached.send(msg).await?;
        }
    }
}

/// A copy whose tar the extractor refused: the supervisor is told (for its finding, and to end the operation).
async fn refused(attached: &mut Attached, opening: &ProcessRequest, e: OutputError) -> RunError {
    match e {
        OutputError::Refused(reason, why) => {
            if let ProcessRequest::Files(FileSpawn { id, op: FileOp::CopyOut { path }, .. }) = opening {
                let _ = attached.send(SupervisorRequest::TarRefused { id: *id, path: path.clone(), reason }).await;
            }
            RunError::Job(why)
        }
        OutputError::Failed(why) => RunError::Job(why),
    }
}

/// The process's status as our exit code: the code, or 128 + signal.
fn exit_code(status: ExitStatus) -> u8 {
    u8::try_from(status.shell_code().rem_euclid(256)).unwrap_or(u8::MAX)
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
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::Code(7)), 7);
        assert_eq!(exit_code(ExitStatus::Signaled(9)), 137);
        assert_eq!(exit_code(ExitStatus::Code(256 + 3)), 3);
    }

    #[test]
    fn env_pairs_parse() {
        assert_eq!(parse_env("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(parse_env("A=").unwrap(), ("A".into(), String::new()));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("novalue").is_err());
    }
}
