//! The end-to-end harness: real `vm-driver` binaries, the real guest image, real QEMU.
//!
//! Every launch gets a scratch state directory of its own. While the driver runs, a watcher thread polls
//! `/proc` for every process whose working directory or command line lies inside that scratch directory
//! (the supervisor, QEMU, later the watchdog), recording pid and start time. From that record, and not from
//! anything the code under test reports, the harness learns the accelerator QEMU really ran with and checks
//! that nothing it started is left once the driver has exited. A failing test keeps its scratch directory
//! (console.log, vmm.log, supervisor.log) and prints where it is.
//!
//! The binaries must be built first (`scripts/test` does it); a missing binary or image fails the test.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a test harness fails loudly")]

pub mod attach;
pub mod image;
pub mod net;
pub mod ocsf_schema;
pub mod otlp_receiver;
pub mod procs;
pub mod registry;
pub mod serve;
pub mod test_image;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use procs::{ProcInfo, Watcher};
use vm_contract::descriptor::{LaunchDescriptor, MicrovmPayload};
pub use vm_contract::test_control::TestControl;

/// The binaries of one build.
#[derive(Debug)]
pub struct Binaries {
    pub driver: PathBuf,
    pub supervisor: PathBuf,
}

impl Binaries {
    fn at(dir: &Path, what: &str) -> Self {
        let bins = Self { driver: dir.join("vm-driver"), supervisor: dir.join("vm-supervisor") };
        for bin in [&bins.driver, &bins.supervisor, &dir.join("vm-watchdog"), &dir.join("vm-jailer")] {
            assert!(bin.is_file(), "{} ({what}) is missing: run scripts/test, which builds it first", bin.display());
        }
        bins
    }

    /// A copy of this build in `dir` (created, mode 0755 like the binaries), for a test that runs it as
    /// another user: the build may lie where that user cannot reach it (root's home is 0700). The driver
    /// finds its supervisor, and the supervisor its watchdog and jailer, next to itself, so all four go.
    pub fn copied_to(&self, dir: &Path) -> Self {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let from = self.driver.parent().unwrap();
        for name in ["vm-driver", "vm-supervisor", "vm-watchdog", "vm-jailer"] {
            std::fs::copy(from.join(name), dir.join(name)).unwrap();
            std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Self { driver: dir.join("vm-driver"), supervisor: dir.join("vm-supervisor") }
    }
}

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
        .args(["--accel", &h.accel, "--keep"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    cmd
}

/// Where the binaries and the image are, and which accelerator the tests ask for.
#[derive(Debug)]
pub struct Harness {
    /// `cargo build --release`: exactly what `scripts/install` ships. Every test runs these, unless it is
    /// a control or injects a fault.
    pub shipped: Binaries,
    /// The debug build with the `test-controls` features (`target/debug`), which announces itself at every
    /// start: only for the causal tests' controls and for fault injection.
    pub controls: Binaries,
    pub image: PathBuf,
    /// `auto`, `kvm` or `tcg`, from `VM_TEST_ACCEL` (default `auto`). CI on KVM runners sets `kvm`.
    pub accel: String,
}

impl Harness {
    /// The build that runs with `controls` set: the shipped one when there are none.
    pub fn build(&self, controls: &[TestControl]) -> &Binaries {
        if controls.is_empty() {
            &self.shipped
        } else {
            &self.controls
        }
    }
}

/// The shared harness; the first call checks that everything exists.
pub fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        // target/<profile>/deps/<test-binary> -> target/
        let exe = std::env::current_exe().unwrap();
        let target = exe.ancestors().nth(3).unwrap().to_owned();
        let shipped = Binaries::at(&target.join("release"), "the release build");
        let controls = Binaries::at(&target.join("debug"), "the test-controls build");
        // Where the driver itself looks by default (VM_DRIVER_IMAGE, else the build-image cache).
        let image = vm_driver::image::default_dir().expect("no default image directory: set HOME or VM_DRIVER_IMAGE");
        for file in ["vmlinuz", "initramfs.cpio"] {
            assert!(
                image.join(file).is_file(),
                "guest image {} is missing {file}: run scripts/build-image (scripts/test does)",
                image.display()
            );
        }
        let accel = std::env::var("VM_TEST_ACCEL").unwrap_or_else(|_| "auto".into());
        assert!(["auto", "kvm", "tcg"].contains(&accel.as_str()), "VM_TEST_ACCEL must be auto, kvm or tcg");
        Harness { shipped, controls, image, accel }
    })
}

/// The environment that switches `controls` on.
pub fn control_env(controls: &[TestControl]) -> Option<(&'static str, String)> {
    (!controls.is_empty())
        .then(|| (vm_contract::test_control::VAR, controls.iter().map(|c| c.name()).collect::<Vec<_>>().join(",")))
}

/// A per-test scratch directory, removed when the test passes and kept (and printed) when it fails; and the
/// test's deadline.
///
/// No end-to-end test may hang the suite: when the deadline passes, the test's processes (everything whose
/// working directory or command line is inside the scratch directory: driver, supervisor, watchdog, VMM)
/// are killed, which ends whatever the test waits on, and the test fails saying what it was waiting for. A
/// test still stuck a minute later ends the test binary.
#[derive(Debug)]
pub struct Scratch {
    pub dir: PathBuf,
    deadline: Arc<(Mutex<Progress>, Condvar)>,
}

#[derive(Debug)]
struct Progress {
    done: bool,
    expired: bool,
    waiting_for: String,
}

/// The deadline of a test that does not choose its own.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(240);

impl Scratch {
    pub fn new(name: &str) -> Self {
        Self::with_deadline(name, DEFAULT_DEADLINE)
    }

    pub fn with_deadline(name: &str, limit: Duration) -> Self {
        // Short, so socket paths stay well inside sun_path.
        let dir = std::env::temp_dir().join(format!("e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let progress = Progress { done: false, expired: false, waiting_for: "the test to start".into() };
        let deadline = Arc::new((Mutex::new(progress), Condvar::new()));
        let (watched, test, scratch) = (Arc::clone(&deadline), name.to_owned(), dir.clone());
        std::thread::spawn(move || enforce(&watched, &test, &scratch, limit));
        Self { dir, deadline }
    }

    /// The state directory to pass to the driver.
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Records what the test waits for now, for the deadline's report.
    pub fn waiting_for(&self, what: &str) {
        let mut p = self.deadline.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        what.clone_into(&mut p.waiting_for);
    }

    /// Whether the deadline passed (its processes were killed).
    pub fn expired(&self) -> bool {
        self.deadline.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).expired
    }
}

fn enforce(deadline: &(Mutex<Progress>, Condvar), test: &str, dir: &Path, limit: Duration) {
    let (lock, cvar) = deadline;
    let guard = lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (mut progress, timeout) =
        cvar.wait_timeout_while(guard, limit, |p| !p.done).unwrap_or_else(std::sync::PoisonError::into_inner);
    if !timeout.timed_out() {
        return;
    }
    progress.expired = true;
    eprintln!(
        "e2e: DEADLINE: {test} did not finish within {} s; it was waiting for {}; killing its processes",
        limit.as_secs(),
        progress.waiting_for
    );
    drop(progress);
    for _ in 0..50 {
        for p in procs::inside(dir) {
            procs::signal(p.pid, nix::sys::signal::Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let guard = lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (guard, stuck) = cvar
        .wait_timeout_while(guard, Duration::from_secs(60), |p| !p.done)
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    drop(guard);
    if stuck.timed_out() {
        eprintln!("e2e: DEADLINE: {test} is still stuck a minute after its processes were killed; ending the run");
        std::process::exit(101);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let expired = {
            let mut p = self.deadline.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            p.done = true;
            p.expired
        };
        self.deadline.1.notify_all();
        if std::thread::panicking() || expired {
            eprintln!("e2e: kept {} for inspection (console.log, vmm.log, supervisor.log)", self.dir.display());
            assert!(!expired || std::thread::panicking(), "the test passed its deadline");
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
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
}

/// Builder for one `vm-driver launch`.
#[derive(Debug)]
pub struct Launch<'a> {
    scratch: &'a Scratch,
    flags: Vec<String>,
    cmd: Vec<String>,
    stdin: Option<Vec<u8>>,
    accel: Option<String>,
    image: Option<PathBuf>,
    controls: Vec<TestControl>,
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
        }
    }

    /// Runs the controls build with `control` switched on.
    pub fn control(mut self, control: TestControl) -> Self {
        self.controls.push(control);
        self
    }

    pub fn flag(mut self, flag: &str) -> Self {
        self.flags.push(flag.to_owned());
        self
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

/// Polls `check` every 10 ms until it holds or `limit` passes.
pub fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    check()
}

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

/// Whether `p` exits within `limit` (polled from /proc).
pub fn gone_within(p: &ProcInfo, limit: Duration) -> bool {
    wait_until(limit, || !p.is_alive())
}

/// Whether `p` stays alive for all of `span`.
pub fn survives(p: &ProcInfo, span: Duration) -> bool {
    !wait_until(span, || !p.is_alive())
}

/// A `vm-supervisor` started by the test itself (no driver), with `stderr` as given: for testing the
/// supervisor's own behaviour, such as its console writer against a stderr nobody reads.
#[derive(Debug)]
pub struct DirectSupervisor {
    pub child: std::process::Child,
    pub status: std::io::BufReader<std::process::ChildStdout>,
    pub sandbox_dir: PathBuf,
    watcher: Option<Watcher>,
}

impl DirectSupervisor {
    /// Starts it in a fresh 0700 sandbox directory under `scratch` and waits for its `ready` line.
    pub fn start(scratch: &Scratch, stderr: Stdio) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let h = harness();
        let dir = scratch.dir.join("direct");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // What the driver writes at every start, for the supervisor's startup admission.
        let payload = MicrovmPayload { sandbox_id: "direct".into(), session_id: None, generation: 0 };
        LaunchDescriptor::microvm(&payload).write(&dir).unwrap();
        let watcher = Watcher::start(&scratch.dir);
        let mut child = Command::new(&h.shipped.supervisor)
            .args(["--sandbox-id", "direct", "--sandbox-dir"])
            .arg(&dir)
            .arg("--kernel")
            .arg(h.image.join("vmlinuz"))
            .arg("--initrd")
            .arg(h.image.join("initramfs.cpio"))
            .args(["--accel", &h.accel])
            // No driver claims a uid here: the VMM runs unconfined (the supervisor's events say so).
            .args(["--confinement", "none"])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("cannot start vm-supervisor");
        let mut status = std::io::BufReader::new(child.stdout.take().unwrap());
        scratch.waiting_for("the directly started supervisor to report ready");
        loop {
            let mut line = String::new();
            assert!(std::io::BufRead::read_line(&mut status, &mut line).unwrap() > 0, "supervisor exited before ready");
            if line.contains("\"status\":\"ready\"") {
                break;
            }
            assert!(!line.contains("\"status\":\"failed\""), "{line}");
        }
        Self { child, status, sandbox_dir: dir, watcher: Some(watcher) }
    }

    /// SIGTERM, then its remaining status lines (the last is `stopped`) and its exit status.
    pub fn stop(&mut self) -> (Vec<String>, std::process::ExitStatus) {
        procs::signal(i32::try_from(self.child.id()).unwrap(), nix::sys::signal::Signal::SIGTERM);
        let lines: Vec<String> = std::io::BufRead::lines(&mut self.status).map_while(Result::ok).collect();
        (lines, self.child.wait().unwrap())
    }
}

impl Drop for DirectSupervisor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(w) = self.watcher.take() {
            w.kill_survivors();
        }
    }
}
