//! A `vm-driver launch` left running for fault injection, with every process of its sandbox known.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use vm_contract::layout::SandboxFile;

use crate::procs::{ProcInfo, Watcher};
use crate::{sandbox, wait_until, Launch};

/// A `vm-driver launch` left running for fault injection, with every process of its sandbox known.
///
/// Dropping it kills whatever is still alive (driver, supervisor, watchdog, VMM), so a failing test or a
/// control that leaves a VM running cleans up after itself.
#[derive(Debug)]
pub struct Running {
    pub driver: std::process::Child,
    pub stdout: std::io::BufReader<std::process::ChildStdout>,
    pub stderr: Option<std::process::ChildStderr>,
    pub watcher: Option<Watcher>,
    pub sandbox_dir: PathBuf,
}

/// The processes of one sandbox, as seen in /proc.
#[derive(Debug, Clone)]
pub struct SandboxProcs {
    pub supervisor: ProcInfo,
    pub watchdog: ProcInfo,
    pub vmm: ProcInfo,
}

impl Running {
    /// Starts `launch` with `env` added (test switches) and waits for `canary` as the first stdout line.
    pub fn start(launch: Launch<'_>, env: &[(&str, &str)], canary: &str) -> Self {
        let scratch_dir = launch.scratch.dir.clone();
        let scratch = launch.scratch;
        let mut cmd = launch.command();
        cmd.envs(env.iter().copied()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let watcher = Watcher::start(&scratch_dir);
        let mut driver = cmd.spawn().expect("cannot start vm-driver");
        let stdout = std::io::BufReader::new(driver.stdout.take().unwrap());
        let stderr = driver.stderr.take();
        let mut running = Self { driver, stdout, stderr, watcher: Some(watcher), sandbox_dir: PathBuf::new() };
        if !canary.is_empty() {
            scratch.waiting_for("the workload's canary line from inside the VM");
            let mut line = String::new();
            std::io::BufRead::read_line(&mut running.stdout, &mut line).unwrap();
            assert_eq!(line.trim_end(), canary, "the workload's canary line from inside the VM");
            eprintln!("e2e: canary arrived from the guest");
        }
        running.sandbox_dir = Self::find_sandbox(&scratch_dir);
        running
    }

    fn find_sandbox(scratch: &Path) -> PathBuf {
        let first = || std::fs::read_dir(scratch.join("state/sandboxes")).ok()?.flatten().next().map(|e| e.path());
        assert!(wait_until(Duration::from_secs(30), || first().is_some()), "the driver created its sandbox");
        first().unwrap()
    }

    /// The driver's pid, to signal it.
    pub fn driver_pid(&self) -> i32 {
        i32::try_from(self.driver.id()).unwrap()
    }

    /// Waits until the supervisor, watchdog and VMM are all seen, and returns them.
    pub fn procs(&self) -> SandboxProcs {
        let watcher = self.watcher.as_ref().unwrap();
        let mut found = None;
        wait_until(Duration::from_secs(60), || {
            let seen = watcher.seen();
            let pick = |f: &dyn Fn(&ProcInfo) -> bool| seen.iter().find(|p| f(p) && p.is_alive()).cloned();
            found = match (pick(&ProcInfo::is_supervisor), pick(&ProcInfo::is_watchdog), pick(&ProcInfo::is_qemu)) {
                (Some(supervisor), Some(watchdog), Some(vmm)) => Some(SandboxProcs { supervisor, watchdog, vmm }),
                _ => None,
            };
            found.is_some()
        });
        let procs = found.expect("supervisor, watchdog and VMM all running");
        eprintln!("e2e: accelerator used: {}", procs.vmm.accel().unwrap_or_default());
        procs
    }

    /// Asserts that the guest's console shows `text` within a minute: the word of a guest that prints no
    /// canary on stdout (a script as PID 1, or a workload whose stdout is queued).
    pub fn assert_console_shows(&self, text: &str) {
        let shown = wait_until(Duration::from_secs(60), || {
            sandbox::read(&self.sandbox_dir, SandboxFile::Console).contains(text)
        });
        assert!(shown, "{text:?} on the guest console");
        eprintln!("e2e: {text:?} arrived on the guest console");
    }

    /// The driver's stderr so far (after it exited).
    pub fn stderr_text(&mut self) -> String {
        let mut text = String::new();
        if let Some(mut e) = self.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut text);
        }
        text
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        if let Some(w) = self.watcher.take() {
            w.kill_survivors();
        }
    }
}
