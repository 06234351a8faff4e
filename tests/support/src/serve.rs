//! A `vm-driver serve` started by a test, and the CLI pointed at it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use vm_protocol::driver_api::GetCapabilitiesRequest;

use crate::procs::{self, Watcher};
use crate::{control_env, harness, wait_until, Scratch, TestControl};

/// A running service. Dropping it stops it and kills whatever it left.
#[derive(Debug)]
pub struct Serve {
    pub child: Child,
    controls: Vec<TestControl>,
    args: Vec<String>,
    pub socket: PathBuf,
    pub state: PathBuf,
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

    /// As [`Serve::with`], with `extra_env` set too and its stderr written to `log` instead of inherited.
    pub fn with_env(
        scratch: &Scratch,
        controls: &[TestControl],
        args: &[&str],
        extra_env: &[(&str, &str)],
        log: Option<&Path>,
    ) -> Self {
        let state = scratch.state();
        let mut env: Vec<(&str, String)> = control_env(controls).into_iter().collect();
        env.extend(extra_env.iter().map(|(k, v)| (*k, (*v).to_owned())));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        scratch.waiting_for("vm-driver serve to listen");
        let mut serve = Self {
            child: Self::spawn(&state, controls, &env, &args, log),
            controls: controls.to_vec(),
            args,
            socket: state.join("driver.sock"),
            state,
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

    /// The command, for callers that need its stdio.
    pub fn cli_command(&self, subcommand: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(&harness().build(&self.controls).driver);
        cmd.arg(subcommand).arg("--socket").arg(&self.socket).args(args);
        cmd
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
        procs::signal(i32::try_from(self.child.id()).unwrap(), signal);
    }

    /// Every QEMU seen so far under this test.
    pub fn vmms(&self) -> Vec<procs::ProcInfo> {
        self.seen().into_iter().filter(procs::ProcInfo::is_qemu).collect()
    }

    /// Every process seen so far under this test.
    pub fn seen(&self) -> Vec<procs::ProcInfo> {
        self.watcher.as_ref().map(Watcher::seen).unwrap_or_default()
    }

    /// A tokio runtime and a connected API client, for tests that speak gRPC themselves.
    pub fn grpc(
        &self,
    ) -> (tokio::runtime::Runtime, vm_protocol::driver_api::driver_client::DriverClient<tonic::transport::Channel>)
    {
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
