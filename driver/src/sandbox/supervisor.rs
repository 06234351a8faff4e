//! Starting a supervisor, waiting for its VM, and stopping it in the one safe order.
//!
//! **Parent liveness.** The driver makes a pipe with both ends close-on-exec. The read end becomes the
//! supervisor's stdin through `Stdio` (so no raw descriptor number is passed), and the supervisor runs with
//! `--parent-liveness-stdin`. The write end stays in this process only: close-on-exec keeps it out of every
//! child, and [`SupervisorProcess`] holds it until the stop is over. If the driver dies, the kernel closes it
//! and the supervisor sees EOF.
//!
//! **Stop ordering.** SIGTERM, then wait (bounded) for the supervisor to exit, and only then close the pipe;
//! on timeout, SIGKILL and then close. Closing the pipe first would make the supervisor take its "driver
//! gone" path while it is still flushing what SIGTERM asked it to flush.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use vm_contract::accel::Accelerator;
use vm_contract::args::SupervisorArgs;
use vm_contract::exit::SupervisorExit;
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::pids::ProcessRecord;
use vm_contract::status::SupervisorStatus;

use crate::telemetry::TelemetryConfig;

/// How long to wait for the supervisor's last status lines after it exited.
const REPORT_WAIT_MS: u64 = 500;

/// Environment variables a supervisor may inherit; everything else is cleared.
fn passed_env() -> &'static [&'static str] {
    #[cfg(feature = "test-controls")]
    return &["PATH", "RUST_LOG", vm_contract::test_control::VAR];
    #[cfg(not(feature = "test-controls"))]
    &["PATH", "RUST_LOG"]
}

/// Why a supervisor did not start or its VM did not come up.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// No supervisor binary next to the driver.
    #[error("vm-supervisor not found at {}", .0.display())]
    NotFound(PathBuf),
    /// The liveness pipe or the log could not be made.
    #[error("cannot prepare the supervisor's stdio")]
    Stdio(#[source] std::io::Error),
    /// The process could not be started.
    #[error("cannot start vm-supervisor")]
    Spawn(#[source] std::io::Error),
    /// The supervisor reported a failed start.
    #[error("{0}")]
    StartFailed(String),
    /// The supervisor reported a failed restore, on its saved state itself.
    #[error("{0}")]
    SavedStateRefused(String),
    /// The supervisor exited without a verdict.
    #[error("vm-supervisor exited during start-up ({}); see {}", describe(.status), log.display())]
    Died {
        /// Its exit status.
        status: Option<std::process::ExitStatus>,
        /// Its log.
        log: PathBuf,
    },
    /// No verdict in time.
    #[error("the sandbox was not ready within {} s", .0.as_secs())]
    Timeout(Duration),
}

/// A supervisor's exit status in words, with what it means when it is one of ours.
pub fn describe(status: &Option<std::process::ExitStatus>) -> String {
    match status {
        Some(s) => match s.code().and_then(SupervisorExit::from_code) {
            Some(exit) => format!("{s}: {}", exit.meaning()),
            None => s.to_string(),
        },
        None => "exit status unknown".into(),
    }
}

/// The VM is up and the attach socket accepts connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    /// The accelerator used.
    pub accel: Accelerator,
    /// Why `auto` did not use KVM, if it did not.
    pub fallback: Option<String>,
    /// The VMM, as it was when the supervisor reported ready.
    pub vmm: Option<ProcessRecord>,
    /// A pooled supervisor's VM is booted and waits for its claim (`vm_contract::claim`).
    pub pooled: bool,
    /// A supervisor that saved its VM (`--save-snapshot`): the stream's bytes. It serves nothing, and exits.
    pub saved: Option<u64>,
}

/// How a stop ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// It exited within the bound, with this status.
    Exited(std::process::ExitStatus),
    /// It had to be killed.
    Killed,
}

impl Stopped {
    /// Whether it stopped in order (exit 0 within the bound).
    pub fn in_order(&self) -> bool {
        matches!(self, Self::Exited(s) if s.success())
    }
}

/// The liveness pipe's test controls (both off but in their causal tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Liveness {
    /// `leak-liveness-write-end`: the write end is inherited by the supervisor.
    pub leak_write_end: bool,
    /// `close-liveness-first`: a stop closes the pipe before SIGTERM (the wrong order).
    pub close_first: bool,
}

/// A running supervisor and the write end of its liveness pipe.
#[derive(Debug)]
pub struct SupervisorProcess {
    child: Child,
    /// Whether a stop closes the pipe first (the `close-liveness-first` control).
    close_first: bool,
    /// Held, never written: its closing is the message.
    liveness: Option<OwnedFd>,
    status: mpsc::UnboundedReceiver<SupervisorStatus>,
    /// Its final report, when [`Self::follow`] read it first.
    report: Option<SupervisorStatus>,
    log: PathBuf,
    /// The accelerator it reported, kept here so a caller may drop and re-poll [`Self::ready`].
    accel: (Accelerator, Option<String>),
}

/// The `vm-supervisor` next to this executable.
///
/// # Errors
/// [`SupervisorError::NotFound`].
pub fn locate() -> Result<PathBuf, SupervisorError> {
    let exe = std::env::current_exe().map_err(SupervisorError::Stdio)?;
    let path = exe.with_file_name("vm-supervisor");
    if path.is_file() {
        Ok(path)
    } else {
        Err(SupervisorError::NotFound(path))
    }
}

impl SupervisorProcess {
    /// Starts `binary` with `args`, the liveness pipe as its stdin, its status on a pipe, and its stderr in
    /// `supervisor.log`. It starts its own session (`vm-supervisor` calls `setsid`), so a Ctrl-C at the terminal
    /// reaches only the driver, which decides what to do with it.
    ///
    /// # Errors
    /// [`SupervisorError`] when the pipe, the log or the process cannot be made.
    pub fn spawn(
        binary: &Path,
        args: &SupervisorArgs,
        telemetry: &TelemetryConfig,
        liveness: Liveness,
    ) -> Result<Self, SupervisorError> {
        let (read_end, write_end) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| SupervisorError::Stdio(e.into()))?;
        if liveness.leak_write_end {
            // Control: the write end leaks into the supervisor, and from there into QEMU.
            let _ = rustix::io::fcntl_setfd(&write_end, rustix::io::FdFlags::empty());
        }
        let layout = SandboxLayout::new(&args.vm.sandbox_dir);
        let log = layout.path(SandboxFile::SupervisorLog);
        let stderr = std::fs::File::create(&log).map_err(SupervisorError::Stdio)?;
        let mut cmd = Command::new(binary);
        cmd.args(args.to_argv())
            .env_clear()
            .envs(passed_env().iter().filter_map(|k| std::env::var_os(k).map(|v| (k, v))))
            .envs(telemetry.to_env())
            .current_dir(layout.dir())
            .stdin(Stdio::from(read_end))
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = cmd.spawn().map_err(SupervisorError::Spawn)?;
        // Drop our copy of the read end now (it lives in `cmd`): only the supervisor may hold it.
        drop(cmd);
        let stdout =
            child.stdout.take().ok_or_else(|| SupervisorError::Stdio(std::io::ErrorKind::BrokenPipe.into()))?;
        let (tx, status) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match SupervisorStatus::from_line(&line) {
                    Ok(s) => {
                        if tx.send(s).is_err() {
                            return;
                        }
                    }
                    Err(_) => tracing::warn!("unreadable status line from vm-supervisor"),
                }
            }
        });
        let accel = (Accelerator::Tcg, None);
        let close_first = liveness.close_first;
        Ok(Self { child, close_first, liveness: Some(write_end), status, report: None, log, accel })
    }

    /// Waits until the VM is ready or the start failed, at most until `deadline` (reported as `timeout`).
    /// Safe to cancel and call again.
    ///
    /// # Errors
    /// [`SupervisorError`] with the supervisor's own explanation where it gave one.
    pub async fn ready(&mut self, deadline: tokio::time::Instant, timeout: Duration) -> Result<Ready, SupervisorError> {
        let verdict = async {
            loop {
                match self.status.recv().await {
                    Some(SupervisorStatus::Accelerator { accel, fallback }) => self.accel = (accel, fallback),
                    Some(
                        status @ (SupervisorStatus::Ready { vmm_pid, .. } | SupervisorStatus::Pooled { vmm_pid, .. }),
                    ) => {
                        let (accel, fallback) = self.accel.clone();
                        let vmm = i32::try_from(vmm_pid).ok().and_then(ProcessRecord::read);
                        let pooled = matches!(status, SupervisorStatus::Pooled { .. });
                        return Ok(Ready { accel, fallback, vmm, pooled, saved: None });
                    }
                    Some(SupervisorStatus::Saved { bytes }) => {
                        let (accel, fallback) = self.accel.clone();
                        return Ok(Ready { accel, fallback, vmm: None, pooled: true, saved: Some(bytes) });
                    }
                    Some(SupervisorStatus::Failed { error, saved_state_refused: false }) => {
                        return Err(SupervisorError::StartFailed(error))
                    }
                    Some(SupervisorStatus::Failed { error, saved_state_refused: true }) => {
                        return Err(SupervisorError::SavedStateRefused(error))
                    }
                    Some(SupervisorStatus::Stopping) => {}
                    Some(SupervisorStatus::Stopped { .. }) | None => {
                        let status = self.child.wait().await.ok();
                        return Err(SupervisorError::Died { status, log: self.log.clone() });
                    }
                }
            }
        };
        tokio::time::timeout_at(deadline, verdict).await.map_err(|_| SupervisorError::Timeout(timeout))?
    }

    /// Writes a pooled supervisor's claim line on its liveness pipe (far below the pipe's capacity, so this
    /// does not block on a live supervisor).
    ///
    /// # Errors
    /// The pipe is closed or the write failed.
    pub fn claim(&self, line: &str) -> std::io::Result<()> {
        let fd = self.liveness.as_ref().ok_or(std::io::ErrorKind::BrokenPipe)?;
        let mut rest = line.as_bytes();
        while !rest.is_empty() {
            match rustix::io::write(fd, rest) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => rest = &rest[n..],
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// The supervisor's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Stops the supervisor: SIGTERM, wait up to `timeout`, and only then close the liveness pipe; SIGKILL
    /// (then close) if it does not exit in time. Returns how it ended and its final report, if it gave one.
    pub async fn stop(mut self, timeout: Duration) -> (Stopped, Option<SupervisorStatus>) {
        if self.close_first {
            // Control: the wrong order, which makes the supervisor take its "driver gone" path.
            drop(self.liveness.take());
        }
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let outcome = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(Ok(status)) => Stopped::Exited(status),
            Ok(Err(_)) | Err(_) => {
                let _ = self.child.start_kill();
                let _ = self.child.wait().await;
                Stopped::Killed
            }
        };
        drop(self.liveness.take());
        // Its stdout is closed now; collect the last lines the reader task still holds.
        let mut report = self.report.take();
        let collect = async {
            while let Some(status) = self.status.recv().await {
                if matches!(status, SupervisorStatus::Stopped { .. }) {
                    report = Some(status);
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_millis(REPORT_WAIT_MS), collect).await;
        (outcome, report)
    }

    /// Waits until the supervisor exits on its own (the caller did not ask it to).
    pub async fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.wait().await.ok()
    }

    /// After its VMM exited: waits until the supervisor exits or, unless it already did, says it is
    /// stopping. Safe to cancel and call again; the final report stays queued for [`Self::stop`].
    pub async fn follow(&mut self, said_stopping: bool) -> Followed {
        let mut reading = !said_stopping;
        loop {
            tokio::select! {
                status = self.child.wait() => return Followed::Exited(status.ok()),
                line = self.status.recv(), if reading => match line {
                    Some(SupervisorStatus::Stopping) => return Followed::Stopping,
                    Some(report @ SupervisorStatus::Stopped { .. }) => {
                        // Kept for `stop`, which returns it.
                        self.report = Some(report);
                        return Followed::Stopping;
                    }
                    Some(_) => {}
                    None => reading = false,
                },
            }
        }
    }
}

/// What a supervisor did after its VMM exited.
#[derive(Debug)]
pub enum Followed {
    /// It exited, with this status.
    Exited(Option<std::process::ExitStatus>),
    /// It said it is stopping: draining clients and flushing telemetry.
    Stopping,
}
