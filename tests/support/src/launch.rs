//! One `vm-driver launch`, built by a test, run to its end, and what the watcher saw of it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::procs::{ProcInfo, Watcher};
use crate::{control_env, harness, Scratch, TestControl};

/// The driver's exit status when the workload produced none (it failed before or around the workload).
pub const DRIVER_ERROR: i32 = vm_contract::exit::driver::DRIVER_ERROR as i32;

/// The line the tests' guests and workloads print to say they run (see [`Launch::sleeper`]).
pub const CANARY: &str = "canary-from-the-guest";

/// The uid and gid of `nobody`, which the unprivileged tests run the driver as.
pub const NOBODY: u32 = 65_534;

/// `vm-driver launch` as `nobody` (`setpriv`, no supplementary groups, a bare environment), on copies of the
/// build and the image that user can reach and a state directory of its own, in the scratch directory; the
/// caller adds flags, then `--` and the command.
pub fn launch_as_nobody(scratch: &Scratch) -> Command {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&scratch.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let h = harness();
    let image = scratch.dir.join("image");
    std::fs::create_dir_all(&image).unwrap();
    for file in ["vmlinuz", "initramfs.cpio"] {
        std::fs::copy(h.image.join(file), image.join(file)).unwrap();
    }
    let state = scratch.state();
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&state, Some(NOBODY), Some(NOBODY)).unwrap();
    let shipped = h.shipped.copied_to(&scratch.dir.join("bin"));
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", &NOBODY.to_string(), "--regid", &NOBODY.to_string(), "--clear-groups", "--"])
        .arg(&shipped.driver)
        .args(["launch", "--state-dir"])
        .arg(&state)
        .arg("--boot-image")
        .arg(&image)
        .args(["--accel", &h.accel, "--keep", "--cold"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    cmd
}

/// One finished `vm-driver` run, with what the watcher saw.
#[derive(Debug)]
pub struct Outcome {
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub elapsed: Duration,
    /// Every process seen inside the scratch directory while the driver ran.
    pub seen: Vec<ProcInfo>,
}

impl Outcome {
    /// Stderr without the driver's own `vm-driver: ` lines (what the workload wrote).
    pub fn workload_stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr)
            .lines()
            .filter(|l| !l.starts_with("vm-driver: "))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// The accelerator QEMU ran with, read from its command line.
    pub fn accel(&self) -> Option<String> {
        self.seen.iter().find(|p| p.is_qemu()).and_then(ProcInfo::accel)
    }

    /// Asserts that nothing this run started is still alive.
    pub fn assert_nothing_left(&self) {
        let alive: Vec<_> = self.seen.iter().filter(|p| p.is_alive()).collect();
        assert!(alive.is_empty(), "processes left behind: {alive:#?}");
    }

    /// Asserts that the workload exited 0 and that nothing was left running; its stdout.
    pub fn succeeded(&self) -> String {
        assert_eq!(self.code, Some(0), "stdout: {}\nstderr: {}", self.stdout_text(), self.workload_stderr());
        self.assert_nothing_left();
        self.stdout_text()
    }
}

/// Builder for one `vm-driver launch`.
#[derive(Debug)]
pub struct Launch<'a> {
    pub(crate) scratch: &'a Scratch,
    flags: Vec<String>,
    cmd: Vec<String>,
    stdin: Option<Vec<u8>>,
    accel: Option<String>,
    image: Option<PathBuf>,
    controls: Vec<TestControl>,
    templates: bool,
}

impl<'a> Launch<'a> {
    pub fn new(scratch: &'a Scratch, cmd: &[&str]) -> Self {
        Self {
            scratch,
            flags: Vec::new(),
            cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
            stdin: None,
            accel: None,
            image: None,
            controls: Vec::new(),
            templates: false,
        }
    }

    /// A workload that prints [`CANARY`] and sleeps until it is stopped: a sandbox to inject faults into.
    pub fn sleeper(scratch: &'a Scratch) -> Self {
        Self::new(scratch, &["/bin/sh", "-c", &format!("echo {CANARY}; exec sleep 1000")])
    }

    /// Runs the controls build with `control` switched on.
    pub fn control(mut self, control: TestControl) -> Self {
        self.controls.push(control);
        self
    }

    /// Runs the controls build with each of `controls` switched on (the shipped build when there are none).
    pub fn controls(mut self, controls: &[TestControl]) -> Self {
        self.controls.extend_from_slice(controls);
        self
    }

    pub fn flag(mut self, flag: &str) -> Self {
        self.flags.push(flag.to_owned());
        self
    }

    /// `--policy FILE`.
    pub fn policy(self, file: &Path) -> Self {
        self.flag("--policy").flag(&file.display().to_string())
    }

    /// `--initrd FILE`: the harness kernel with another initramfs (see [`crate::image`]).
    pub fn initrd(self, file: &Path) -> Self {
        self.flag("--initrd").flag(&file.display().to_string())
    }

    /// `--image REFERENCE --image-cache STORE`: the sandbox's root is an OCI image from `store`.
    pub fn root_image(self, reference: &str, store: &Path) -> Self {
        self.flag("--image").flag(reference).flag("--image-cache").flag(&store.display().to_string())
    }

    pub fn stdin(mut self, bytes: Vec<u8>) -> Self {
        self.stdin = Some(bytes);
        self
    }

    /// Overrides the harness image directory.
    pub fn image(mut self, dir: &Path) -> Self {
        self.image = Some(dir.to_owned());
        self
    }

    /// Lets the launch restore from, and make, a template (`docs/templates.md`); every other launch of the
    /// tests is `--cold`, so each test counts and times its own boots.
    pub fn templates(mut self) -> Self {
        self.templates = true;
        self
    }

    /// Overrides the accelerator the harness would ask for.
    pub fn accel(mut self, accel: &str) -> Self {
        self.accel = Some(accel.to_owned());
        self
    }

    pub fn command(&self) -> Command {
        let h = harness();
        let mut cmd = Command::new(&h.build(&self.controls).driver);
        cmd.envs(control_env(&self.controls));
        cmd.arg("launch")
            .arg("--state-dir")
            .arg(self.scratch.state())
            .arg("--boot-image")
            .arg(self.image.as_deref().unwrap_or(&h.image))
            .arg("--accel")
            .arg(self.accel.as_deref().unwrap_or(&h.accel))
            .arg("--keep")
            .args((!self.templates).then_some("--cold"))
            .args(&self.flags)
            .arg("--")
            .args(&self.cmd);
        cmd
    }

    /// Runs the driver to completion.
    pub fn run(self) -> Outcome {
        let mut cmd = self.command();
        cmd.stdin(if self.stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let watcher = Watcher::start(&self.scratch.dir);
        let start = Instant::now();
        self.scratch.waiting_for("vm-driver launch to exit");
        let mut child = cmd.spawn().expect("cannot start vm-driver");
        if let Some(bytes) = self.stdin {
            let mut stdin = child.stdin.take().unwrap();
            std::thread::spawn(move || {
                let _ = stdin.write_all(&bytes);
            });
        }
        let out = child.wait_with_output().expect("vm-driver did not finish");
        let elapsed = start.elapsed();
        let seen = watcher.stop();
        let outcome = Outcome { code: out.status.code(), stdout: out.stdout, stderr: out.stderr, elapsed, seen };
        report_accel(&outcome);
        outcome
    }
}

/// Says which accelerator a test's VM used, as the tests must.
pub fn report_accel(outcome: &Outcome) {
    match outcome.accel() {
        Some(accel) => eprintln!("e2e: accelerator used: {accel} (requested {})", harness().accel),
        None => eprintln!(
            "e2e: no VM was started in this run (saw: {:?})",
            outcome.seen.iter().map(|p| (p.pid, p.comm.as_str())).collect::<Vec<_>>()
        ),
    }
}
