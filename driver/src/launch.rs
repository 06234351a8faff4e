//! `vm-driver launch`: one sandbox for one command, from boot to stop.
//!
//! ```text
//! reap orphans -> resolve image -> sandbox dir + cgroup -> start supervisor (liveness pipe) -> Ready
//!   -> attach: Spawn, stream stdio, forward Ctrl-C -> Exited
//!   -> stop: SIGTERM, wait (bounded), close pipe; cgroup sweep; tombstone
//! ```
//!
//! Ctrl-C is forwarded to the workload as SIGINT; the third one stops the sandbox. SIGTERM and SIGHUP stop
//! it in order, and so does `--timeout` (exit 124). While a stop is under way the workload's remaining
//! output is still written out: the orderly stop loses nothing the workload wrote.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;
use vm_protocol::{ExitStatus, SandboxId, SignalName};

use crate::attach::{self, ProcessIo};
use crate::state::{self, StateDir};
use crate::supervisor::{self, Stopped, SupervisorProcess, SupervisorSpec};
use crate::telemetry::{self, TelemetryConfig};
use crate::{cgroup, image, reap, EXIT_TIMEOUT};
use vm_protocol::status::{AuthBundle, SupervisorStatus};

/// Ctrl-Cs after which `launch` stops the sandbox instead of forwarding.
const INTERRUPTS_TO_STOP: u32 = 3;

/// Margin on top of the boot timeout for the supervisor's own verdict to arrive.
const READY_MARGIN: Duration = Duration::from_secs(10);

/// Everything `launch` needs, already parsed.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Extra environment for the process.
    pub env: Vec<(String, String)>,
    /// Working directory in the guest.
    pub workdir: Option<String>,
    /// Image directory (default image when `None`).
    pub image: Option<PathBuf>,
    /// Explicit kernel.
    pub kernel: Option<PathBuf>,
    /// Explicit initramfs.
    pub initrd: Option<PathBuf>,
    /// vCPUs.
    pub cpus: u8,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// `auto`, `kvm` or `tcg`.
    pub accel: String,
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
    let image = image::resolve(config.image.as_deref(), config.kernel.as_deref(), config.initrd.as_deref())?;
    let binary = supervisor::locate()?;
    let root = config.state_dir.clone().unwrap_or_else(state::default_root);
    let state = StateDir::open(&root)?;
    for reaped in reap::reap_all(&state.sandboxes_dir()) {
        if reaped.killed() {
            eprintln!("vm-driver: reaped orphaned sandbox {} (its supervisor was gone)", reaped.sandbox);
        }
    }
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
    let dir = state.create_sandbox(&id)?;
    let spec = SupervisorSpec {
        binary,
        sandbox_id: id.clone(),
        sandbox_dir: dir.clone(),
        image,
        cpus: config.cpus,
        memory_mib: config.memory_mib,
        accel: config.accel.clone(),
        boot_timeout: config.boot_timeout,
        stop_grace: supervisor::STOP_GRACE,
        cgroup: cgroup::create(&id, &dir),
        telemetry: config.telemetry.clone(),
        session: None,
    };
    let started = telemetry::write_bundle(&dir, &AuthBundle { otlp_headers, session_token: None })
        .map_err(anyhow::Error::from)
        .and_then(|()| Ok(SupervisorProcess::spawn(&spec)?));
    let sup = match started {
        Ok(sup) => sup,
        Err(e) => {
            reap::end_generation(&dir, spec.cgroup.as_deref(), "failed");
            eprintln!("vm-driver: sandbox directory kept at {}", dir.display());
            return Err(e);
        }
    };
    let (code, stopped) = drive(&config, &dir, sup, &mut signals).await;
    finish(&dir, &spec, code.is_ok(), &stopped, config.keep);
    code
}

/// How the supervisor ended and what it reported.
type Ended = (Stopped, Option<SupervisorStatus>);

/// Everything between the supervisor's start and its exit. Always ends with the supervisor stopped.
async fn drive(
    config: &LaunchConfig,
    dir: &Path,
    mut sup: SupervisorProcess,
    signals: &mut Signals,
) -> (Result<u8>, Ended) {
    let ready = tokio::select! {
        ready = sup.ready(config.boot_timeout + READY_MARGIN) => ready,
        _ = signals.terminate.recv() => return (Ok(143), sup.stop(config.stop_timeout).await),
        _ = signals.hangup.recv() => return (Ok(129), sup.stop(config.stop_timeout).await),
        _ = signals.interrupt.recv() => return (Ok(130), sup.stop(config.stop_timeout).await),
    };
    let ready = match ready {
        Ok(ready) => ready,
        Err(e) => {
            let stopped = sup.stop(config.stop_timeout).await;
            let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            return (Err(anyhow::Error::new(e).context(format!("sandbox {id} failed to start"))), stopped);
        }
    };
    if let Some(why) = &ready.fallback {
        eprintln!("vm-driver: using TCG software emulation: {why}");
    }
    let attached = match attach::connect(dir, &ready.attach_socket).await {
        Ok(a) => a,
        Err(e) => return (Err(e.into()), sup.stop(config.stop_timeout).await),
    };
    let (signal_tx, signal_rx) = mpsc::unbounded_channel();
    let io = ProcessIo {
        stdin: attach::stdin_chunks(),
        stdout: Box::new(tokio::io::stdout()),
        stderr: Box::new(tokio::io::stderr()),
        signals: signal_rx,
    };
    let process = attached.run(config.argv.clone(), config.env.clone(), config.workdir.clone(), io);
    tokio::pin!(process);
    let deadline = async {
        match config.timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);

    let mut interrupts = 0;
    let stop_code = loop {
        tokio::select! {
            status = &mut process => {
                let code = status.map(exit_code).map_err(anyhow::Error::from);
                return (code, sup.stop(config.stop_timeout).await);
            }
            () = &mut deadline => {
                eprintln!("vm-driver: --timeout expired; stopping the sandbox");
                break EXIT_TIMEOUT;
            }
            _ = signals.interrupt.recv() => {
                interrupts += 1;
                if interrupts >= INTERRUPTS_TO_STOP {
                    eprintln!("vm-driver: interrupted {interrupts} times; stopping the sandbox");
                    break 130;
                }
                let _ = signal_tx.send(SignalName::Int);
            }
            _ = signals.terminate.recv() => break 143,
            _ = signals.hangup.recv() => break 129,
        }
    };
    // Stop in order while still writing out what the workload already produced.
    let (stopped, _) = tokio::join!(sup.stop(config.stop_timeout), &mut process);
    (Ok(stop_code), stopped)
}

/// After the supervisor exited: reap whatever it left (it may have been killed), sweep the cgroup, mark the
/// sandbox terminated, and remove its directory unless it should be kept.
fn finish(dir: &Path, spec: &SupervisorSpec, ok: bool, (stopped, report): &Ended, keep: bool) {
    let clean = ok && matches!(stopped, Stopped::Exited(s) if s.success());
    if let Some(SupervisorStatus::Stopped { otlp_dropped, console_dropped, .. }) = report {
        if *otlp_dropped > 0 || *console_dropped > 0 {
            eprintln!("vm-driver: telemetry: {otlp_dropped} OCSF records not exported, {console_dropped} console lines dropped");
        }
    }
    match stopped {
        Stopped::Exited(s) if !s.success() => eprintln!("vm-driver: vm-supervisor ended with {s} (see supervisor.log)"),
        Stopped::Killed => eprintln!("vm-driver: vm-supervisor did not stop in time and was killed"),
        Stopped::Exited(_) => {}
    }
    let left = reap::end_generation(dir, spec.cgroup.as_deref(), if clean { "stopped" } else { "failed" });
    if left.vm {
        eprintln!("vm-driver: the supervisor died; killed the VM it left behind");
    }
    if left.cgroup {
        eprintln!("vm-driver: the cgroup sweep found processes after the stop and killed them");
    }
    if clean && !keep {
        let _ = std::fs::remove_dir_all(dir);
    } else if !clean {
        eprintln!("vm-driver: sandbox directory kept at {}", dir.display());
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
    let Some((key, value)) = text.split_once('=') else { bail!("--env wants KEY=VALUE, got {text:?}") };
    if key.is_empty() || text.contains('\0') {
        bail!("--env wants KEY=VALUE with a non-empty key and no NUL byte");
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
