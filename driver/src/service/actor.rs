//! One task per sandbox: it owns the supervisor, moves the sandbox through its states and answers the API's
//! commands in order.
//!
//! ```text
//! PROVISIONING --supervisor ready + session accepted--> READY --Stop--> STOPPING --> STOPPED --Start--> ...
//!      |                                                  | supervisor exits on its own
//!      `--boot fails--> FAILED <--------------------------'
//! ```
//!
//! Stopping writes the `stopped` marker first, then runs the orderly stop (SIGTERM, bounded wait, close the
//! liveness pipe); whatever the supervisor leaves behind is reaped and its cgroup swept; a tombstone records
//! how it ended. On driver shutdown the sandbox stops without the marker, so it comes back on restart.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use vm_protocol::driver_api::{Sandbox, SandboxState};
use vm_protocol::status::AuthBundle;
use vm_protocol::SandboxId;

use super::registry::Registry;
use super::store::{self, StoredSpec};
use crate::supervisor::{Ready, SupervisorError, SupervisorProcess, SupervisorSpec};
use crate::{cgroup, reap, state, telemetry};

/// How much the boot timeout is padded for the supervisor's own verdict.
const READY_MARGIN: std::time::Duration = std::time::Duration::from_secs(10);

/// What the API (and the session server) ask of a sandbox.
#[derive(Debug)]
pub enum Command {
    /// Stop it on purpose.
    Stop(oneshot::Sender<Sandbox>),
    /// Start it again.
    Start(oneshot::Sender<Sandbox>),
    /// Stop it and remove it.
    Delete(oneshot::Sender<()>),
    /// The driver is going down: stop it but keep the intent to run.
    Shutdown(oneshot::Sender<()>),
    /// The supervisor of `generation` opened its session (with this readiness endpoint) or lost it.
    Session {
        /// Which start it belongs to.
        generation: u64,
        /// Which connection: a late "lost" from an old connection must not end a newer one.
        serial: u64,
        /// `Some(endpoint)` when up, `None` when lost.
        readiness: Option<String>,
    },
}

/// How a sandbox begins its life in this driver process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Initial {
    /// Boot it now.
    Start,
    /// Known, stopped on purpose.
    Stopped,
    /// Known, failed (terminal until started), with why.
    Failed(String),
}

struct Actor {
    id: SandboxId,
    dir: PathBuf,
    spec: StoredSpec,
    reg: Arc<Registry>,
    view: Sandbox,
    sup: Option<SupervisorProcess>,
    cgroup: Option<PathBuf>,
    ready: bool,
    /// The serial of the accepted session connection, while it is up.
    session: Option<u64>,
}

enum Happened {
    Command(Option<Command>),
    Ready(Result<Ready, SupervisorError>),
    Exited(String),
}

/// Registers the sandbox and starts its actor. `false` if the id is taken.
pub fn spawn(reg: &Arc<Registry>, id: SandboxId, dir: PathBuf, spec: StoredSpec, initial: Initial) -> bool {
    let (tx, rx) = mpsc::channel(16);
    let view = Sandbox {
        sandbox_id: id.to_string(),
        state: if initial == Initial::Start { SandboxState::Provisioning } else { SandboxState::Stopped }.into(),
        spec: Some(spec.to_api()),
        generation: store::generation(&dir),
        running_intent: initial == Initial::Start,
        ..Sandbox::default()
    };
    if !reg.insert(id.clone(), view.clone(), tx) {
        return false;
    }
    let mut actor =
        Actor { id, dir, spec, reg: Arc::clone(reg), view, sup: None, cgroup: None, ready: false, session: None };
    tokio::spawn(async move {
        match initial {
            Initial::Start => actor.start(),
            Initial::Stopped => {}
            Initial::Failed(detail) => actor.set(SandboxState::Failed, detail),
        }
        actor.run(rx).await;
    });
    true
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            let happened = match self.sup.as_mut() {
                Some(sup) if !self.ready => tokio::select! {
                    cmd = rx.recv() => Happened::Command(cmd),
                    ready = sup.ready(self.reg.ctx.boot_timeout + READY_MARGIN) => Happened::Ready(ready),
                },
                Some(sup) => tokio::select! {
                    cmd = rx.recv() => Happened::Command(cmd),
                    status = sup.exited() => Happened::Exited(status),
                },
                None => Happened::Command(rx.recv().await),
            };
            match happened {
                Happened::Command(None) => return,
                Happened::Command(Some(cmd)) => {
                    if !self.command(cmd).await {
                        return;
                    }
                }
                Happened::Ready(Ok(ready)) => {
                    self.ready = true;
                    self.view.accelerator = ready.accel.as_str().into();
                    if let Some(why) = ready.fallback {
                        self.reg.platform(&self.id, "accelerator", format!("using TCG software emulation: {why}"));
                    }
                    self.settle();
                }
                Happened::Ready(Err(e)) => {
                    let detail = format!("start failed: {:#}", anyhow::Error::new(e));
                    self.finish("failed").await;
                    self.set(SandboxState::Failed, detail);
                }
                Happened::Exited(status) => {
                    self.finish("failed").await;
                    self.reg.platform(&self.id, "supervisor-exited", format!("vm-supervisor ended with {status}"));
                    self.set(
                        SandboxState::Failed,
                        format!("the sandbox stopped on its own (vm-supervisor ended with {status})"),
                    );
                }
            }
        }
    }

    /// Handles one command; `false` ends the actor.
    async fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Stop(reply) => {
                let _ = store::set_stopped(&self.dir, true);
                self.view.running_intent = false;
                if self.sup.is_some() {
                    self.set(SandboxState::Stopping, String::new());
                    self.stop_supervisor("stopped").await;
                }
                self.set(SandboxState::Stopped, String::new());
                let _ = reply.send(self.view.clone());
            }
            Command::Start(reply) => {
                if self.sup.is_none() {
                    let _ = store::set_stopped(&self.dir, false);
                    self.start();
                }
                let _ = reply.send(self.view.clone());
            }
            Command::Delete(reply) => {
                self.stop_supervisor("deleted").await;
                let _ = std::fs::remove_dir_all(&self.dir);
                self.reg.remove(&self.id);
                self.reg.platform(&self.id, "deleted", "sandbox deleted");
                let _ = reply.send(());
                return false;
            }
            Command::Shutdown(reply) => {
                self.stop_supervisor("driver shutdown").await;
                let _ = reply.send(());
                return false;
            }
            Command::Session { generation, serial, readiness }
                if generation == self.view.generation && self.sup.is_some() =>
            {
                match readiness {
                    Some(endpoint) => {
                        self.session = Some(serial);
                        self.view.readiness_endpoint = endpoint;
                    }
                    None if self.session == Some(serial) => {
                        self.session = None;
                        self.view.readiness_endpoint.clear();
                        if self.view.state == i32::from(SandboxState::Ready) {
                            self.set(SandboxState::Provisioning, "supervisor session lost; reconnecting".into());
                        }
                    }
                    None => return true,
                }
                self.settle();
            }
            Command::Session { .. } => {}
        }
        true
    }

    /// Ready only when the VM is up, the agent answered and the session is accepted.
    fn settle(&mut self) {
        if self.ready && self.session.is_some() {
            self.set(SandboxState::Ready, String::new());
        } else {
            self.reg.publish(&self.id, &self.view);
        }
    }

    fn set(&mut self, state: SandboxState, detail: String) {
        self.view.state = state.into();
        self.view.detail = detail;
        if state != SandboxState::Ready {
            self.view.readiness_endpoint.clear();
        }
        self.reg.publish(&self.id, &self.view);
    }

    /// Boots a new generation.
    fn start(&mut self) {
        let generation = store::generation(&self.dir).saturating_add(1);
        self.view.generation = generation;
        self.view.running_intent = true;
        self.view.accelerator.clear();
        (self.ready, self.session) = (false, None);
        match self.spawn_supervisor(generation) {
            Ok(sup) => {
                self.sup = Some(sup);
                self.set(SandboxState::Provisioning, "booting".into());
            }
            Err(e) => {
                // Nothing runs: take back the credentials and the cgroup made for it.
                reap::end_generation(&self.dir, self.cgroup.take().as_deref(), "failed");
                self.set(SandboxState::Failed, format!("cannot start: {e:#}"));
            }
        }
    }

    fn spawn_supervisor(&mut self, generation: u64) -> anyhow::Result<SupervisorProcess> {
        let ctx = &self.reg.ctx;
        store::set_generation(&self.dir, generation)?;
        // The last generation's pids go before its tombstone: a reaper must never see dead pids and no
        // tombstone, and sweep the cgroup this generation is about to use.
        let _ = std::fs::remove_file(self.dir.join(vm_protocol::status::PIDS_FILE));
        store::clear_tombstone(&self.dir);
        // 256 bits: the session's only credential.
        let token = state::random_hex::<32>()?;
        self.reg.expect_session(&self.id, generation, token.clone());
        let _ = std::fs::remove_file(self.dir.join(vm_protocol::status::AUTH_BUNDLE_FILE));
        let bundle = AuthBundle { otlp_headers: ctx.otlp_headers.clone(), session_token: Some(token) };
        telemetry::write_bundle(&self.dir, &bundle)?;
        self.cgroup = cgroup::create(&self.id, &self.dir);
        let spec = SupervisorSpec {
            binary: ctx.supervisor.clone(),
            sandbox_id: self.id.clone(),
            sandbox_dir: self.dir.clone(),
            image: ctx.image.clone(),
            cpus: u8::try_from(self.spec.cpus).unwrap_or(1),
            memory_mib: self.spec.memory_mib,
            accel: ctx.accel.clone(),
            boot_timeout: ctx.boot_timeout,
            stop_grace: crate::supervisor::STOP_GRACE,
            cgroup: self.cgroup.clone(),
            telemetry: ctx.telemetry.clone(),
            session: Some((ctx.sessions_socket.clone(), generation)),
        };
        Ok(SupervisorProcess::spawn(&spec)?)
    }

    /// Stops a running supervisor (orderly) and finishes; nothing to do when none runs.
    async fn stop_supervisor(&mut self, reason: &str) {
        if self.sup.is_some() {
            self.finish(reason).await;
        }
    }

    /// Ends this generation: stops the supervisor if it still runs, then reaps what it left, sweeps the
    /// cgroup and writes the tombstone. Those may block (waiting on pidfds and the cgroup), so they run off
    /// the async workers, which serve every other sandbox and the API.
    async fn finish(&mut self, reason: &str) {
        if let Some(sup) = self.sup.take() {
            sup.stop(self.reg.ctx.stop_timeout).await;
        }
        let (dir, cgroup, reason) = (self.dir.clone(), self.cgroup.take(), reason.to_owned());
        let _ = tokio::task::spawn_blocking(move || reap::end_generation(&dir, cgroup.as_deref(), &reason)).await;
        (self.ready, self.session) = (false, None);
    }
}
