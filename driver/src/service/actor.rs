//! One task per sandbox: it owns the sandbox's record and running generation, moves it through its states
//! and answers the API's commands in order.
//!
//! ```text
//! PROVISIONING --supervisor ready + session accepted--> READY --Stop--> STOPPING --> STOPPED --Start--> ...
//!      |                                                  | supervisor exits on its own
//!      `--boot fails--> FAILED <--------------------------'
//! ```
//!
//! Starting and stopping are the one lifecycle of [`crate::sandbox`]; the blocking part of a start (locks,
//! files, the supervisor's fork and exec) runs off the async workers. Stopping writes the `stopped` marker
//! first, and a stop whose marker cannot be written is refused (a restarted driver would bring the sandbox
//! back); on driver shutdown the sandbox stops without it, so it comes back on restart. The actor holds its
//! share of the host ([`Share`]) while the sandbox is meant to run, and a [`BootTurn`] while its VM boots: a
//! start waits for its turn (answering commands meanwhile), so that many creates at once all boot.
//!
//! How a generation begins (from a template, a cold boot, a claimed pooled VM) is in [`begin`]; its image
//! root in [`image`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use vm_contract::claim::Origin;
use vm_contract::ids::SandboxId;
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::root::RootImage;
use vm_contract::session::Generation;
use vm_contract::tombstone::EndReason;

mod begin;
mod errors;
mod image;
#[cfg(test)]
mod tests;

use self::begin::cold_detail;
pub use self::errors::{StartError, StopError};
use super::hub::Hub;
use super::ledger::{BootTurn, Share};
use super::pool::ClaimedVm;
use super::record::{SandboxRecord, State};
use super::registry::InsertError;
use super::store::{self, StoredSpec};
use crate::sandbox::supervisor::{describe, Ready, SupervisorError};
use crate::sandbox::{Ended, Running, HUNG_STOP_TIMEOUT};

/// What the API (and the session server) ask of a sandbox.
#[derive(Debug)]
pub enum Command {
    /// Stop it on purpose.
    Stop(oneshot::Sender<Result<SandboxRecord, StopError>>),
    /// Start it again, if it is admitted.
    Start(oneshot::Sender<Result<SandboxRecord, StartError>>),
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
    layout: SandboxLayout,
    hub: Arc<Hub>,
    record: SandboxRecord,
    /// Held while the sandbox is meant to run.
    share: Option<Share>,
    running: Option<Running>,
    ready: bool,
    /// The serial of the accepted session connection, while it is up.
    session: Option<u64>,
    /// A start waiting for its turn to boot, with the root it boots on.
    queued: Option<(Option<RootImage>, TurnWait)>,
    /// Held while its VM boots: from the start until the guest answered or the boot failed.
    turn: Option<BootTurn>,
}

/// A wait for a turn to boot, kept across loop turns so that it keeps its place.
type TurnWait = Pin<Box<dyn Future<Output = BootTurn> + Send>>;

enum Happened {
    Command(Option<Command>),
    Turn(BootTurn),
    Ready(Result<Ready, SupervisorError>),
    Ended(Ended),
}

/// Registers the sandbox and starts its actor; with `admit`, only if it fits (else its share is held
/// already: a restored sandbox). A claimed VM's share becomes the sandbox's.
///
/// # Errors
/// [`InsertError`], with `initial` given back (a claimed VM is still the caller's to dispose of).
pub fn spawn(
    hub: &Arc<Hub>,
    id: SandboxId,
    layout: SandboxLayout,
    spec: StoredSpec,
    mut initial: Initial,
    admit: bool,
) -> Result<(), (InsertError, Initial)> {
    let (tx, rx) = mpsc::channel(16);
    let starts = matches!(initial, Initial::Start | Initial::Claimed(_));
    let (origin, detail) = match &initial {
        Initial::Start => (Some(Origin::Cold), cold_detail(hub).to_owned()),
        Initial::Claimed(_) => (Some(Origin::Pool), String::new()),
        _ => (None, String::new()),
    };
    let record = SandboxRecord {
        id,
        state: if starts { State::Provisioning } else { State::Stopped },
        generation: store::generation(&layout),
        running_intent: starts,
        confinement: hub.ctx.jail.confinement,
        origin,
        detail,
        accelerator: None,
        readiness_endpoint: String::new(),
        spec,
    };
    let (ledger, shape) = (&hub.ledger, record.spec.shape);
    let inserted = hub.registry.insert(record.clone(), tx, || match &mut initial {
        Initial::Claimed(claimed) => Ok(claimed.share.take().map(Share::claimed)),
        Initial::Start if admit => ledger.admit(shape).map(Some),
        Initial::Start => Ok(Some(ledger.hold(shape))),
        Initial::Stopped | Initial::Failed(_) => Ok(None),
    });
    let share = match inserted {
        Ok(share) => share,
        Err(e) => return Err((e, initial)),
    };
    hub.events.changed(&record);
    let hub = Arc::clone(hub);
    let mut actor =
        Actor { layout, hub, record, share, running: None, ready: false, session: None, queued: None, turn: None };
    tokio::spawn(async move {
        match initial {
            Initial::Start => actor.start().await,
            Initial::Claimed(claimed) => actor.claim(claimed.running).await,
            Initial::Stopped => {}
            Initial::Failed(detail) => actor.set(State::Failed, detail),
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
                None => match self.queued.as_mut() {
                    Some((_, turn)) => tokio::select! {
                        cmd = rx.recv() => Happened::Command(cmd),
                        turn = turn => Happened::Turn(turn),
                    },
                    None => Happened::Command(rx.recv().await),
                },
            };
            match happened {
                Happened::Command(None) => return,
                Happened::Command(Some(cmd)) => {
                    if !self.command(cmd).await {
                        return;
                    }
                }
                Happened::Turn(turn) => {
                    if let Some((root, _)) = self.queued.take() {
                        self.turn = Some(turn);
                        self.boot(root).await;
                    }
                }
                Happened::Ready(ready) => self.on_ready(ready).await,
                Happened::Ended(ended) => self.on_ended(ended).await,
            }
        }
    }

    async fn on_ready(&mut self, ready: Result<Ready, SupervisorError>) {
        drop(self.turn.take());
        match ready {
            Ok(ready) => {
                self.ready = true;
                self.record.accelerator = Some(ready.accel);
                if let Some(why) = ready.fallback {
                    let note = format!("using TCG software emulation: {why}");
                    self.hub.events.platform(&self.record.id, "accelerator", note);
                }
                self.settle();
            }
            Err(e) => {
                let detail = format!("start failed: {}", vm_contract::logs::chain(&e));
                self.finish(EndReason::Failed, self.hub.ctx.stop_timeout).await;
                self.set(State::Failed, detail);
            }
        }
    }

    async fn on_ended(&mut self, ended: Ended) {
        match ended {
            Ended::VmmGone => {
                let detail = "the VM stopped on its own; vm-supervisor is finishing its record";
                self.set(State::Failed, detail.into());
            }
            Ended::Exited(status) => {
                let what = format!("vm-supervisor ended with {}", describe(&status));
                self.ended_on_its_own("supervisor-exited", what, self.hub.ctx.stop_timeout).await;
            }
            Ended::Hung => {
                let what = "the VM stopped and vm-supervisor did not follow (hung); it was killed".to_string();
                self.ended_on_its_own("supervisor-hung", what, HUNG_STOP_TIMEOUT).await;
            }
        }
    }

    /// Handles one command; `false` ends the actor.
    async fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Stop(reply) => {
                let _ = reply.send(self.stop().await);
            }
            Command::Start(reply) => {
                let _ = reply.send(self.start_again().await);
            }
            Command::Delete(reply) => {
                self.finish(EndReason::Deleted, self.hub.ctx.stop_timeout).await;
                let _ = std::fs::remove_dir_all(self.layout.dir());
                crate::audit::forget(self.layout.dir());
                let id = &self.record.id;
                drop(self.share.take());
                self.hub.registry.remove(id);
                self.hub.tokens.forget(id);
                self.hub.rotations.forget(id);
                self.hub.events.platform(id, "deleted", "sandbox deleted");
                let _ = reply.send(());
                return false;
            }
            Command::Shutdown(reply) => {
                self.finish(EndReason::DriverShutdown, self.hub.ctx.stop_timeout).await;
                let _ = reply.send(());
                return false;
            }
            Command::Session { generation, serial, readiness }
                if generation == self.record.generation && self.running.is_some() =>
            {
                match readiness {
                    Some(endpoint) => {
                        self.session = Some(serial);
                        self.record.readiness_endpoint = endpoint;
                    }
                    None if self.session == Some(serial) => {
                        self.session = None;
                        self.record.readiness_endpoint.clear();
                        if self.record.state == State::Ready {
                            self.set(State::Provisioning, "supervisor session lost; reconnecting".into());
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

    /// A stop on purpose: the marker first (or nothing), then the orderly stop.
    async fn stop(&mut self) -> Result<SandboxRecord, StopError> {
        store::set_stopped(&self.layout, true)
            .map_err(|e| StopError::Marker(self.layout.path(SandboxFile::Stopped), e))?;
        self.queued = None;
        if let Some(running) = &self.running {
            // A VM that had already died is recorded as the failure it was.
            let reason = if running.vmm_gone() { EndReason::Failed } else { EndReason::Stopped };
            self.set(State::Stopping, String::new());
            self.finish(reason, self.hub.ctx.stop_timeout).await;
        }
        // Its share of the host is given back once the VM is down.
        drop(self.share.take());
        self.record.running_intent = false;
        self.set(State::Stopped, String::new());
        Ok(self.record.clone())
    }

    /// A start on request: admitted here, in order with this sandbox's stops, so a start queued behind a
    /// stop is admitted after the stop gave the share back.
    async fn start_again(&mut self) -> Result<SandboxRecord, StartError> {
        if self.running.as_ref().is_some_and(Running::vmm_gone) {
            return Err(StartError::CleaningUp);
        }
        if self.running.is_none() && self.queued.is_none() {
            if self.share.is_none() {
                self.share = Some(self.hub.ledger.admit(self.record.spec.shape)?);
            }
            if let Err(e) = store::set_stopped(&self.layout, false) {
                if !self.record.running_intent {
                    drop(self.share.take());
                }
                return Err(StartError::Marker(self.layout.path(SandboxFile::Stopped), e));
            }
            self.start().await;
        }
        Ok(self.record.clone())
    }

    /// Ready only when the VM is up, the agent answered and the session is accepted; never again once its
    /// VMM has exited (a session that reconnects in that instant does not bring it back).
    fn settle(&mut self) {
        let vmm_gone = self.running.as_ref().is_some_and(Running::vmm_gone);
        if self.ready && self.session.is_some() && !vmm_gone {
            self.set(State::Ready, String::new());
        } else {
            self.hub.publish(&self.record);
        }
    }

    fn set(&mut self, state: State, detail: String) {
        self.record.state = state;
        self.record.detail = detail;
        if state != State::Ready {
            self.record.readiness_endpoint.clear();
        }
        self.hub.publish(&self.record);
    }

    /// The generation ended without being asked to: not ready from this moment (the cleanup takes time),
    /// then cleaned up and reported on `Watch` as `kind`.
    async fn ended_on_its_own(&mut self, kind: &str, what: String, timeout: Duration) {
        self.set(State::Failed, format!("the sandbox stopped on its own ({what})"));
        self.finish(EndReason::Failed, timeout).await;
        self.hub.events.platform(&self.record.id, kind, what);
    }

    /// Ends the running generation, if any: the orderly stop (up to `timeout`), then reap, sweep and
    /// tombstone.
    async fn finish(&mut self, reason: EndReason, timeout: Duration) {
        (self.queued, self.turn) = (None, None);
        if let Some(running) = self.running.take() {
            running.stop(timeout).await.end(reason).await;
        }
        (self.ready, self.session) = (false, None);
    }
}
