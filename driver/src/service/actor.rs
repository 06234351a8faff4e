//! One task per sandbox: it owns the sandbox's running generation, moves it through its states and answers
//! the API's commands in order.
//!
//! ```text
//! PROVISIONING --supervisor ready + session accepted--> READY --Stop--> STOPPING --> STOPPED --Start--> ...
//!      |                                                  | supervisor exits on its own
//!      `--boot fails--> FAILED <--------------------------'
//! ```
//!
//! Starting and stopping are the one lifecycle of [`crate::sandbox`]. Stopping writes the `stopped` marker
//! first; on driver shutdown the sandbox stops without it, so it comes back on restart.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxLayout;
use vm_contract::session::{Generation, SessionId};
use vm_contract::tombstone::EndReason;
use vm_protocol::driver_api::{Sandbox, SandboxState};

use super::pool::ClaimedVm;
use super::registry::{InsertError, Registry, Share};
use super::store::{self, StoredSpec};
use crate::sandbox::supervisor::{describe, Ready, SupervisorError};
use crate::sandbox::{self, Ended, Running, SessionSpec, StartSpec, HUNG_STOP_TIMEOUT};
use crate::state;

/// What the API (and the session server) ask of a sandbox.
#[derive(Debug)]
pub enum Command {
    /// Stop it on purpose.
    Stop(oneshot::Sender<Sandbox>),
    /// Start it again, if it is admitted.
    Start(oneshot::Sender<Result<Sandbox, tonic::Status>>),
    /// Stop it and remove it.
    Delete(oneshot::Sender<()>),
    /// The driver is going down: stop it but keep the intent to run.
    Shutdown(oneshot::Sender<()>),
    /// The supervisor of `generation` opened its session (with this readiness endpoint) or lost it.
    Session {
        /// Which start it belongs to.
        generation: Generation,
        /// Which connection: a late "lost" from an old connection must not end a newer one.
        serial: u64,
        /// `Some(endpoint)` when up, `None` when lost.
        readiness: Option<String>,
    },
}

/// How a sandbox begins its life in this driver process.
#[derive(Debug)]
pub enum Initial {
    /// Boot it now.
    Start,
    /// Hand it this pooled VM, claimed for it (its directory is already the sandbox's).
    Claimed(Box<ClaimedVm>),
    /// Known, stopped on purpose.
    Stopped,
    /// Known, failed (terminal until started), with why.
    Failed(String),
}

struct Actor {
    id: SandboxId,
    layout: SandboxLayout,
    spec: StoredSpec,
    reg: Arc<Registry>,
    view: Sandbox,
    running: Option<Running>,
    ready: bool,
    /// The serial of the accepted session connection, while it is up.
    session: Option<u64>,
}

enum Happened {
    Command(Option<Command>),
    Ready(Result<Ready, SupervisorError>),
    Ended(Ended),
}

/// Registers the sandbox and starts its actor; with `admit`, only if it fits (see [`Registry::insert`]).
///
/// # Errors
/// [`InsertError`], with `initial` given back (a claimed VM is still the caller's to dispose of).
pub fn spawn(
    reg: &Arc<Registry>,
    id: SandboxId,
    layout: SandboxLayout,
    spec: StoredSpec,
    initial: Initial,
    admit: bool,
) -> Result<(), (InsertError, Initial)> {
    let (tx, rx) = mpsc::channel(16);
    let starts = matches!(initial, Initial::Start | Initial::Claimed(_));
    let view = Sandbox {
        sandbox_id: id.to_string(),
        state: if starts { SandboxState::Provisioning } else { SandboxState::Stopped }.into(),
        spec: Some(spec.to_api()),
        generation: store::generation(&layout).0,
        running_intent: starts,
        confinement: reg.ctx.jail.confinement.as_str().into(),
        origin: match &initial {
            Initial::Start => "cold",
            Initial::Claimed(_) => "pool",
            _ => "",
        }
        .into(),
        detail: match &initial {
            Initial::Start => cold_detail(reg).into(),
            _ => String::new(),
        },
        ..Sandbox::default()
    };
    let share = match (&initial, admit) {
        (Initial::Claimed(claimed), _) => Share::FromSlot(&claimed.slot),
        (_, true) => Share::Admit,
        (_, false) => Share::Held,
    };
    let inserted = reg.insert(id.clone(), view.clone(), tx, share);
    if let Err(e) = inserted {
        return Err((e, initial));
    }
    let mut actor = Actor { id, layout, spec, reg: Arc::clone(reg), view, running: None, ready: false, session: None };
    tokio::spawn(async move {
        match initial {
            Initial::Start => actor.start(),
            Initial::Claimed(claimed) => actor.claim(claimed.running).await,
            Initial::Stopped => {}
            Initial::Failed(detail) => actor.set(SandboxState::Failed, detail),
        }
        actor.run(rx).await;
    });
    Ok(())
}

impl Actor {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            let happened = match self.running.as_mut() {
                Some(running) if !self.ready => tokio::select! {
                    cmd = rx.recv() => Happened::Command(cmd),
                    ready = running.ready() => Happened::Ready(ready),
                },
                Some(running) => tokio::select! {
                    cmd = rx.recv() => Happened::Command(cmd),
                    ended = running.ended() => Happened::Ended(ended),
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
                    let detail = format!("start failed: {}", vm_contract::logs::chain(&e));
                    self.finish(EndReason::Failed, self.reg.ctx.stop_timeout).await;
                    self.set(SandboxState::Failed, detail);
                }
                Happened::Ended(Ended::VmmGone) => {
                    let detail = "the VM stopped on its own; vm-supervisor is finishing its record";
                    self.set(SandboxState::Failed, detail.into());
                }
                Happened::Ended(Ended::Exited(status)) => {
                    let what = format!("vm-supervisor ended with {}", describe(&status));
                    self.ended_on_its_own("supervisor-exited", what, self.reg.ctx.stop_timeout).await;
                }
                Happened::Ended(Ended::Hung) => {
                    let what = "the VM stopped and vm-supervisor did not follow (hung); it was killed".to_string();
                    self.ended_on_its_own("supervisor-hung", what, HUNG_STOP_TIMEOUT).await;
                }
            }
        }
    }

    /// Handles one command; `false` ends the actor.
    async fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Stop(reply) => {
                let _ = store::set_stopped(&self.layout, true);
                if let Some(running) = &self.running {
                    // A VM that had already died is recorded as the failure it was.
                    let reason = if running.vmm_gone() { EndReason::Failed } else { EndReason::Stopped };
                    self.set(SandboxState::Stopping, String::new());
                    self.finish(reason, self.reg.ctx.stop_timeout).await;
                }
                // Its share of the host is given back once the VM is down.
                self.view.running_intent = false;
                self.set(SandboxState::Stopped, String::new());
                let _ = reply.send(self.view.clone());
            }
            Command::Start(reply) => {
                if self.running.as_ref().is_some_and(Running::vmm_gone) {
                    let busy = tonic::Status::unavailable("the sandbox's last VM is still being cleaned up; try again");
                    let _ = reply.send(Err(busy));
                    return true;
                }
                if self.running.is_none() {
                    // Admitted here, in order with this sandbox's stops: a start queued behind a stop is
                    // admitted after the stop gave the share back.
                    if let Err(why) = self.reg.admit_start(&self.id) {
                        let _ = reply.send(Err(tonic::Status::resource_exhausted(why.to_string())));
                        return true;
                    }
                    let _ = store::set_stopped(&self.layout, false);
                    self.start();
                }
                let _ = reply.send(Ok(self.view.clone()));
            }
            Command::Delete(reply) => {
                self.finish(EndReason::Deleted, self.reg.ctx.stop_timeout).await;
                let _ = std::fs::remove_dir_all(self.layout.dir());
                self.reg.remove(&self.id);
                self.reg.platform(&self.id, "deleted", "sandbox deleted");
                let _ = reply.send(());
                return false;
            }
            Command::Shutdown(reply) => {
                self.finish(EndReason::DriverShutdown, self.reg.ctx.stop_timeout).await;
                let _ = reply.send(());
                return false;
            }
            Command::Session { generation, serial, readiness }
                if generation.0 == self.view.generation && self.running.is_some() =>
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

    /// Ready only when the VM is up, the agent answered and the session is accepted; never again once its
    /// VMM has exited (a session that reconnects in that instant does not bring it back).
    fn settle(&mut self) {
        let vmm_gone = self.running.as_ref().is_some_and(Running::vmm_gone);
        if self.ready && self.session.is_some() && !vmm_gone {
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

    /// The generation ended without being asked to: not ready from this moment (the cleanup takes time),
    /// then cleaned up and reported on `Watch` as `kind`.
    async fn ended_on_its_own(&mut self, kind: &str, what: String, timeout: Duration) {
        self.set(SandboxState::Failed, format!("the sandbox stopped on its own ({what})"));
        self.finish(EndReason::Failed, timeout).await;
        self.reg.platform(&self.id, kind, what);
    }

    /// Boots a new generation.
    fn start(&mut self) {
        let generation = self.next_generation("cold");
        let started = self.start_spec(generation).and_then(|spec| sandbox::start(&spec).map_err(|e| text(&e)));
        match started {
            Ok(running) => {
                self.running = Some(running);
                self.set(SandboxState::Provisioning, cold_detail(&self.reg).into());
            }
            Err(e) => self.set(SandboxState::Failed, format!("cannot start: {e}")),
        }
    }

    /// Starts the first generation on a claimed pooled VM: its identity, credentials and policy go to the
    /// waiting supervisor, which then reports ready like any start.
    async fn claim(&mut self, mut running: Running) {
        let generation = self.next_generation("pool");
        let claimed = self.start_spec(generation).and_then(|spec| running.claim(&spec).map_err(|e| text(&e)));
        match claimed {
            Ok(()) => {
                self.running = Some(running);
                self.set(SandboxState::Provisioning, "claimed a pooled VM".into());
            }
            Err(e) => {
                // Nothing of it is used again: the generation ends like a failed start.
                running.stop(self.reg.ctx.stop_timeout).await.end(EndReason::Failed).await;
                self.set(SandboxState::Failed, format!("cannot start: {e}"));
            }
        }
    }

    fn next_generation(&mut self, origin: &str) -> Generation {
        let generation = store::generation(&self.layout).next();
        self.view.generation = generation.0;
        self.view.running_intent = true;
        self.view.accelerator.clear();
        self.view.origin = origin.into();
        (self.ready, self.session) = (false, None);
        generation
    }

    /// What a start of `generation` needs: its session is expected from here on.
    fn start_spec(&mut self, generation: Generation) -> Result<StartSpec, String> {
        let ctx = &self.reg.ctx;
        store::set_generation(&self.layout, generation).map_err(|e| text(&e))?;
        // 256 bits: the session's only credential.
        let token = state::random_hex::<32>().map_err(|e| text(&e))?;
        let id = SessionId::from_bytes(state::random_bytes::<16>().map_err(|e| text(&e))?);
        self.reg.expect_session(&self.id, generation, id.clone(), token.clone());
        // A rotation outlives the supervisor it was sent to.
        let (mut telemetry, mut otlp_headers) = (ctx.telemetry.clone(), ctx.otlp_headers.clone());
        if let Some(rotated) = self.reg.rotated(&self.id) {
            otlp_headers = rotated.headers.unwrap_or(otlp_headers);
            telemetry.otlp_ca = rotated.ca_path.map(PathBuf::from).or(telemetry.otlp_ca);
        }
        Ok(StartSpec {
            supervisor: ctx.supervisor.clone(),
            id: self.id.clone(),
            layout: self.layout.clone(),
            image: ctx.images.resolve(&self.spec.image).map_err(|e| text(&e))?,
            shape: self.spec.shape,
            accel: ctx.accel,
            boot_timeout: ctx.boot_timeout,
            telemetry,
            otlp_headers,
            session: Some(SessionSpec { socket: ctx.sessions_socket.clone(), generation, id, token }),
            jail: ctx.jail,
            policy: self.spec.policy.clone(),
        })
    }

    /// Ends the running generation, if any: the orderly stop (up to `timeout`), then reap, sweep and
    /// tombstone.
    async fn finish(&mut self, reason: EndReason, timeout: Duration) {
        if let Some(running) = self.running.take() {
            running.stop(timeout).await.end(reason).await;
        }
        (self.ready, self.session) = (false, None);
    }
}

fn text(e: &dyn std::error::Error) -> String {
    vm_contract::logs::chain(e)
}

/// What a cold start says while it boots: with a pool, that none of its VMs could serve it.
fn cold_detail(reg: &Registry) -> &'static str {
    if reg.ctx.pool {
        "booting (cold boot: no free pooled VM of this shape and image)"
    } else {
        "booting"
    }
}
