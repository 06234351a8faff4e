//! A `vm-driver serve` started by a test, and the CLI pointed at it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use vm_protocol::driver_api::GetCapabilitiesRequest;

use crate::output::{ok, stdout};
use crate::procs::{self, Watcher};
use crate::{control_env, harness, wait_until, Scratch, TestControl};

/// How long a sandbox of a test's `serve` may take to become ready, or to reach another state.
pub const STATE_WAIT: Duration = Duration::from_secs(120);

/// A running service. Dropping it stops it and kills whatever it left.
#[derive(Debug)]
pub struct Serve {
    pub child: Child,
    controls: Vec<TestControl>,
    args: Vec<String>,
    pub socket: PathBuf,
    pub state: PathBuf,
    /// The test's scratch directory, where the policies it creates sandboxes with are written.
    dir: PathBuf,
    env: Vec<(String, String)>,
    /// Where its stderr goes, when not inherited.
    log: Option<PathBuf>,
    watcher: Option<Watcher>,
}

impl Serve {
    /// Starts the shipped build in `scratch` and waits until its socket answers.
    pub fn start(scratch: &Scratch) -> Self {
        Self::with_controls(scratch, &[])
    }

    /// Starts it with `controls` switched on (the controls build, when there are any).
    pub fn with_controls(scratch: &Scratch, controls: &[TestControl]) -> Self {
        Self::with(scratch, controls, &[])
    }

    /// Starts it with `controls` switched on and `args` added to `vm-driver serve`.
    pub fn with(scratch: &Scratch, controls: &[TestControl], args: &[&str]) -> Self {
        Self::with_env(scratch, controls, args, &[], None)
    }

    /// As [`Serve::with`], with templates (`docs/templates.md`): every other `serve` of the tests is `--cold`.
    pub fn with_templates(scratch: &Scratch, controls: &[TestControl], args: &[&str]) -> Self {
        Self::start_with(scratch, controls, args, &[], None, true)
    }

    /// As [`Serve::with`], with `extra_env` set too and its stderr written to `log` instead of inherited.
    pub fn with_env(
        scratch: &Scratch,
        controls: &[TestControl],
        args: &[&str],
        extra_env: &[(&str, &str)],
        log: Option<&Path>,
    ) -> Self {
        Self::start_with(scratch, controls, args, extra_env, log, false)
    }

    fn start_with(
        scratch: &Scratch,
        controls: &[TestControl],
        args: &[&str],
        extra_env: &[(&str, &str)],
        log: Option<&Path>,
        templates: bool,
    ) -> Self {
        let state = scratch.state();
        let mut env: Vec<(&str, String)> = control_env(controls).into_iter().collect();
        env.extend(extra_env.iter().map(|(k, v)| (*k, (*v).to_owned())));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        if !templates {
            // Each test counts and times its own boots: no template is made or used beside them.
            args.push("--cold".into());
        }
        scratch.waiting_for("vm-driver serve to listen");
        let mut serve = Self {
            child: Self::spawn(&state, controls, &env, &args, log),
            controls: controls.to_vec(),
            args,
            socket: state.join("driver.sock"),
            state,
            dir: scratch.dir.clone(),
            env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            log: log.map(Path::to_owned),
            watcher: Some(Watcher::start(&scratch.dir)),
        };
        serve.wait_listening();
        let (rt, mut client) = serve.grpc();
        let caps = rt.block_on(client.get_capabilities(GetCapabilitiesRequest {})).unwrap().into_inner();
        eprintln!("e2e: accelerator used: {} (requested {})", caps.accelerator, harness().accel);
        serve
    }

    fn spawn(
        state: &Path,
        controls: &[TestControl],
        env: &[(&str, &str)],
        args: &[String],
        log: Option<&Path>,
    ) -> Child {
        let h = harness();
        let stderr = match log {
            Some(path) => Stdio::from(
                std::fs::OpenOptions::new().create(true).append(true).open(path).expect("cannot open the serve log"),
            ),
            None => Stdio::inherit(),
        };
        Command::new(&h.build(controls).driver)
            .arg("serve")
            .arg("--state-dir")
            .arg(state)
            .arg("--boot-image")
            .arg(&h.image)
            .args(["--accel", &h.accel])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("cannot start vm-driver serve")
    }

    fn wait_listening(&mut self) {
        let socket = self.socket.clone();
        assert!(
            wait_until(Duration::from_secs(30), || std::os::unix::net::UnixStream::connect(&socket).is_ok()),
            "vm-driver serve did not listen on {}",
            socket.display()
        );
    }

    /// Runs `vm-driver SUBCOMMAND --socket SOCKET ARGS...`.
    pub fn cli(&self, subcommand: &str, args: &[&str]) -> Output {
        self.cli_command(subcommand, args).output().expect("cannot run vm-driver")
    }

    /// As [`Self::cli`], with `input` on its stdin (`--headers-file -`, `cp - ...`), written from a thread of
    /// its own so that a command that answers before it has read everything cannot stall.
    pub fn cli_with_stdin(&self, subcommand: &str, args: &[&str], input: &[u8]) -> Output {
        crate::output::with_stdin(&mut self.cli_command(subcommand, args), input)
    }

    /// The command, for callers that need its stdio.
    pub fn cli_command(&self, subcommand: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(&harness().build(&self.controls).driver);
        cmd.arg(subcommand).arg("--socket").arg(&self.socket).args(args);
        cmd
    }

    /// `vm-driver create --memory 128 [--policy FILE] ID` (a small guest), which must succeed; `policy`
    /// (JSON) is written to `ID.policy.json` in the scratch directory first.
    pub fn create_small(&self, id: &str, policy: Option<&str>) {
        let file = self.dir.join(format!("{id}.policy.json"));
        let mut args = vec!["--memory", "128"];
        if let Some(policy) = policy {
            std::fs::write(&file, policy).unwrap();
            args.extend(["--policy", file.to_str().unwrap()]);
        }
        args.push(id);
        ok(self.cli("create", &args));
    }

    /// `vm-driver policy ID --revision REVISION --allow ALLOW [--network RULES]`: a live policy update.
    pub fn update_policy(&self, id: &str, revision: u64, allow: &str, network: Option<&str>) -> Output {
        let revision = revision.to_string();
        let mut args = vec![id, "--revision", &revision, "--allow", allow];
        if let Some(rules) = network {
            args.extend(["--network", rules]);
        }
        self.cli("policy", &args)
    }

    /// The directory of sandbox `id`.
    pub fn sandbox(&self, id: &str) -> PathBuf {
        self.state.join("sandboxes").join(id)
    }

    /// The STATE column of `vm-driver get ID` (`ready`, `stopped`, `failed`, ...; `missing` without one).
    pub fn sandbox_state(&self, id: &str) -> String {
        let out = stdout(&self.cli("get", &[id]));
        out.lines().nth(1).and_then(|l| l.split_whitespace().nth(1)).unwrap_or("missing").to_owned()
    }

    /// Waits until sandbox `id` is `wanted` (see [`Self::sandbox_state`]), for at most `limit`.
    ///
    /// # Panics
    ///
    /// If it is not by then.
    pub fn wait_state(&self, id: &str, wanted: &str, limit: Duration) {
        let mut last = String::new();
        let reached = wait_until(limit, || {
            last = self.sandbox_state(id);
            last == wanted
        });
        assert!(reached, "{id} never became {wanted} within {limit:?} (it is {last})");
    }

    /// Waits until sandbox `id` is ready, for at most [`STATE_WAIT`].
    pub fn wait_ready(&self, id: &str) {
        self.wait_state(id, "ready", STATE_WAIT);
    }

    /// How many sandboxes `vm-driver list` shows as ready.
    pub fn ready_count(&self) -> usize {
        stdout(&self.cli("list", &[])).lines().filter(|l| l.contains(" ready ")).count()
    }

    /// The service's pid.
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same state directory.
    pub fn restart(&mut self) {
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.child = Self::spawn(&self.state, &self.controls, &env, &self.args, self.log.as_deref());
        self.wait_listening();
    }

    /// Sends `signal` to the service process.
    pub fn signal(&self, signal: Signal) {
        procs::signal(self.pid(), signal);
    }

    /// Every QEMU seen so far under this test.
    pub fn vmms(&self) -> Vec<procs::ProcInfo> {
        self.seen().into_iter().filter(procs::ProcInfo::is_qemu).collect()
    }

    /// Waits until this service has made a whole template: a directory named by its key, which the driver
    /// renames into place once its `digests` are written (`docs/templates.md`; a half-made one's name starts
    /// with a dot).
    ///
    /// # Panics
    ///
    /// If none is made within `limit`.
    pub fn wait_template(&self, limit: Duration) {
        let is_key = |name: &std::ffi::OsStr| name.len() == 64;
        let made = || {
            std::fs::read_dir(self.state.join("templates")).is_ok_and(|mut d| {
                d.any(|e| e.is_ok_and(|e| is_key(&e.file_name()) && e.path().join("digests").is_file()))
            })
        };
        assert!(wait_until(limit, made), "no template was made");
    }

    /// Every process seen so far under this test.
    pub fn seen(&self) -> Vec<procs::ProcInfo> {
        self.watcher.as_ref().map(Watcher::seen).unwrap_or_default()
    }

    /// A tokio runtime and a connected API client, for tests that speak gRPC themselves.
    pub fn grpc(&self) -> (tokio::runtime::Runtime, crate::api::Client) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let client = rt.block_on(vm_driver::service::client::connect(&self.socket)).unwrap();
        (rt, client)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.signal(Signal::SIGTERM);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline && self.child.try_wait().ok().flatten().is_none() {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(w) = self.watcher.take() {
            w.kill_survivors();
        }
    }
}
