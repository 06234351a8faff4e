//! `vm-driver launch`: one sandbox for one command, from boot to stop.
//!
//! ```text
//! resolve image -> create sandbox dir -> start supervisor (liveness pipe) -> wait Ready
//!   -> attach: Spawn, stream stdio, forward Ctrl-C -> Exited
//!   -> stop: SIGTERM, wait (bounded), close pipe -> remove the sandbox dir (kept on failure or --keep)
//! ```
//!
//! Ctrl-C is forwarded to the workload as SIGINT; the third one stops the sandbox. SIGTERM and SIGHUP
//! stop the sandbox in order. `--timeout` stops it and exits 124.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use vm_protocol::{ExitStatus, SandboxId, SignalName};

use crate::attach::{self, ProcessIo};
use crate::image;
use crate::state::{self, StateDir};
use crate::supervisor::{self, SupervisorProcess, SupervisorSpec, DEFAULT_STOP_TIMEOUT};
use crate::EXIT_TIMEOUT;

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
    /// State directory.
    pub state_dir: Option<PathBuf>,
    /// Sandbox id (random when `None`).
    pub id: Option<SandboxId>,
    /// Keep the sandbox directory after a clean stop.
    pub keep: bool,
}

/// How `launch` ended, as an exit code.
pub async fn run(config: LaunchConfig) -> Result<u8> {
    let image = image::resolve(
        config.image.as_deref(),
        config.kernel.as_deref(),
        config.initrd.as_deref(),
    )?;
    let binary = supervisor::locate()?;
    let root = config.state_dir.clone().unwrap_or_else(state::default_root);
    let state = StateDir::open(&root)?;
    let id = match &config.id {
        Some(id) => id.clone(),
        None => state::random_id("launch").context("cannot make a sandbox id")?,
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
        stop_grace: Duration::from_secs(3),
    };

    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;

    let mut sup = SupervisorProcess::spawn(&spec)?;
    let ready = tokio::select! {
        ready = sup.ready(config.boot_timeout + READY_MARGIN) => ready,
        _ = terminate.recv() => return stop_early(sup, &dir, 143).await,
        _ = hangup.recv() => return stop_early(sup, &dir, 129).await,
        _ = interrupt.recv() => return stop_early(sup, &dir, 130).await,
    };
    let ready = match ready {
        Ok(ready) => ready,
        Err(e) => {
            sup.stop(DEFAULT_STOP_TIMEOUT).await;
            return Err(anyhow::Error::new(e).context(format!("sandbox {id} failed to start (kept {})", dir.display())));
        }
    };
    if let Some(why) = &ready.fallback {
        eprintln!("vm-driver: using TCG software emulation: {why}");
    }

    let attached = match attach::connect(&dir, &ready.attach_socket).await {
        Ok(a) => a,
        Err(e) => {
            sup.stop(DEFAULT_STOP_TIMEOUT).await;
            return Err(e.into());
        }
    };
    let (signal_tx, signals) = mpsc::unbounded_channel();
    let io = ProcessIo {
        stdin: attach::stdin_chunks(),
        stdout: Box::new(tokio::io::stdout()),
        stderr: Box::new(tokio::io::stderr()),
        signals,
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
    let outcome: Result<u8> = loop {
        tokio::select! {
            status = &mut process => break status.map(exit_code).map_err(anyhow::Error::from),
            () = &mut deadline => {
                eprintln!("vm-driver: --timeout expired; stopping the sandbox");
                break Ok(EXIT_TIMEOUT);
            }
            _ = interrupt.recv() => {
                interrupts += 1;
                if interrupts >= INTERRUPTS_TO_STOP {
                    eprintln!("vm-driver: interrupted {interrupts} times; stopping the sandbox");
                    break Ok(130);
                }
                let _ = signal_tx.send(SignalName::Int);
            }
            _ = terminate.recv() => break Ok(143),
            _ = hangup.recv() => break Ok(129),
        }
    };
    let stopped = sup.stop(DEFAULT_STOP_TIMEOUT).await;
    let clean = outcome.is_ok() && matches!(stopped, supervisor::Stopped::Exited(s) if s.success());
    if clean && !config.keep {
        let _ = std::fs::remove_dir_all(&dir);
    } else if !clean {
        eprintln!("vm-driver: sandbox directory kept at {}", dir.display());
    }
    outcome
}

async fn stop_early(sup: SupervisorProcess, dir: &std::path::Path, code: u8) -> Result<u8> {
    sup.stop(DEFAULT_STOP_TIMEOUT).await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(code)
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
    let Some((key, value)) = text.split_once('=') else {
        bail!("--env wants KEY=VALUE, got {text:?}")
    };
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
