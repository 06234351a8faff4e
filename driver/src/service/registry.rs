//! Every sandbox the driver serves: its public view, its actor's inbox, its current session credentials,
//! and the stream of changes `Watch` follows.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use vm_contract::accel::AccelChoice;
use vm_contract::ids::SandboxId;
use vm_contract::session::{Generation, SessionHello, SessionId};
use vm_protocol::credentials::CredentialRotation;
use vm_protocol::driver_api::{watch_event, PlatformEvent, Sandbox, SandboxState, WatchEvent};

use super::actor::Command;
use super::admission::{self, ExecStreams, Limits, Refused, Usage};
use crate::image::ImageSet;
use crate::state::StateDir;
use crate::telemetry::TelemetryConfig;

/// Changes `Watch` subscribers may lag behind before they miss some.
const WATCH_BUFFER: usize = 1024;

/// What every sandbox actor needs from the driver. Its `Debug` names the collector headers, never their
/// values.
pub struct Context {
    /// The state directory.
    pub state: StateDir,
    /// The session socket supervisors connect to.
    pub sessions_socket: PathBuf,
    /// The supervisor binary.
    pub supervisor: PathBuf,
    /// The guest images.
    pub images: ImageSet,
    /// The accelerator asked for.
    pub accel: AccelChoice,
    /// How VMMs are confined here.
    pub jail: crate::jail::JailConfig,
    /// Telemetry settings for supervisors.
    pub telemetry: TelemetryConfig,
    /// Collector headers, for each sandbox's auth bundle.
    pub otlp_headers: Vec<(String, String)>,
    /// Boot timeout.
    pub boot_timeout: Duration,
    /// Supervisor stop bound.
    pub stop_timeout: Duration,
    /// What may be admitted on this host.
    pub limits: Limits,
    /// Whether a warm pool is configured (`serve --pool`).
    pub pool: bool,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("state", &self.state)
            .field("supervisor", &self.supervisor)
            .field("accel", &self.accel)
            .field("jail", &self.jail)
            .field("otlp_headers", &self.otlp_headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// The session a sandbox's current supervisor must open.
struct Expected {
    generation: Generation,
    session_id: SessionId,
    token: String,
}

struct Entry {
    view: Sandbox,
    inbox: mpsc::Sender<Command>,
    /// What the current supervisor must present.
    session: Option<Expected>,
    /// Credentials rotated since the driver started (in memory only), for the sandbox's later starts.
    rotated: Option<CredentialRotation>,
}

/// Where a new sandbox's share of the host comes from.
#[derive(Debug, Clone, Copy)]
pub enum Share<'a> {
    /// Admitted now, if it fits beside everything held (a create).
    Admit,
    /// Held already (a sandbox restored at start-up was admitted before, and is not refused now).
    Held,
    /// A claimed pool slot's, taken over in the same step, so a claim never needs room a cold boot would.
    FromSlot(&'a SandboxId),
}

/// Why a sandbox could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    /// The id is taken.
    #[error("the id is taken")]
    Taken,
    /// The driver is going down.
    #[error("the driver is shutting down")]
    Closing,
    /// It does not fit.
    #[error(transparent)]
    Refused(#[from] Refused),
}

/// The sandboxes.
pub struct Registry {
    entries: Mutex<HashMap<SandboxId, Entry>>,
    /// The pooled VMs' shares, by slot id: held from the slot's start until its VM is down, or until a
    /// sandbox claims it and holds the share from then on. Locked after `entries`, never before.
    pooled: Mutex<HashMap<SandboxId, vm_contract::shape::SandboxShape>>,
    /// Set (under the `entries` lock) once the driver is going down: no sandbox may be added after.
    closing: AtomicBool,
    events: broadcast::Sender<WatchEvent>,
    /// The Exec streams open.
    pub exec_streams: std::sync::Arc<ExecStreams>,
    /// Each sandbox's attach connection, shared by its Exec streams.
    pub attach: std::sync::Arc<crate::attach_mux::Connections>,
    /// Shared settings.
    pub ctx: Context,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("ctx", &self.ctx).finish_non_exhaustive()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new(ctx: Context) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            pooled: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            events: broadcast::channel(WATCH_BUFFER).0,
            exec_streams: ExecStreams::new(ctx.limits),
            attach: crate::attach_mux::Connections::new(),
            ctx,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_pooled(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, vm_contract::shape::SandboxShape>> {
        self.pooled.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the sandboxes meant to run (but `except`) and the pooled VMs hold; called under the entries lock.
    fn held(&self, entries: &HashMap<SandboxId, Entry>, except: Option<&SandboxId>) -> Usage {
        let mut used = usage(entries, except);
        for shape in self.lock_pooled().values() {
            used.add(*shape);
            used.pooled += 1;
        }
        used
    }

    /// Reserves a pooled VM's share for pool slot `slot`, if it fits beside everything held.
    ///
    /// # Errors
    /// [`InsertError`]: the driver is closing, or it does not fit.
    pub fn reserve_pooled(&self, slot: &SandboxId, shape: vm_contract::shape::SandboxShape) -> Result<(), InsertError> {
        let entries = self.lock();
        if self.is_closing() {
            return Err(InsertError::Closing);
        }
        admission::admit(self.held(&entries, None), &self.ctx.limits, shape)?;
        self.lock_pooled().insert(slot.clone(), shape);
        Ok(())
    }

    /// Gives a pool slot's share back (its VM is down, unclaimed).
    pub fn release_pooled(&self, slot: &SandboxId) {
        let _entries = self.lock();
        self.lock_pooled().remove(slot);
    }

    /// Adds a sandbox, its share of the host coming from `share`.
    ///
    /// # Errors
    /// [`InsertError`]; a slot's share stays the slot's.
    pub fn insert(
        &self,
        id: SandboxId,
        view: Sandbox,
        inbox: mpsc::Sender<Command>,
        share: Share<'_>,
    ) -> Result<(), InsertError> {
        let mut entries = self.lock();
        if self.is_closing() {
            return Err(InsertError::Closing);
        }
        if entries.contains_key(&id) {
            return Err(InsertError::Taken);
        }
        match share {
            Share::Admit if view.running_intent => {
                admission::admit(self.held(&entries, None), &self.ctx.limits, shape(&view))?;
            }
            Share::FromSlot(slot) => {
                self.lock_pooled().remove(slot);
            }
            Share::Admit | Share::Held => {}
        }
        entries.insert(id, Entry { view: view.clone(), inbox, session: None, rotated: None });
        drop(entries);
        self.broadcast(watch_event::Event::Changed(view));
        Ok(())
    }

    /// Admits a stopped sandbox to run again: it holds its share from now on. Only its actor calls this.
    ///
    /// # Errors
    /// [`Refused`] when it no longer fits.
    pub fn admit_start(&self, id: &SandboxId) -> Result<(), Refused> {
        let mut entries = self.lock();
        let used = self.held(&entries, Some(id));
        if let Some(entry) = entries.get_mut(id) {
            if !entry.view.running_intent {
                admission::admit(used, &self.ctx.limits, shape(&entry.view))?;
                entry.view.running_intent = true;
            }
        }
        Ok(())
    }

    /// What the sandboxes meant to run and the pooled VMs hold.
    pub fn usage(&self) -> Usage {
        self.held(&self.lock(), None)
    }

    /// Whether the id is taken.
    pub fn contains(&self, id: &SandboxId) -> bool {
        self.lock().contains_key(id)
    }

    /// Removes a sandbox.
    pub fn remove(&self, id: &SandboxId) {
        self.lock().remove(id);
    }

    /// Publishes a sandbox's new view.
    pub fn publish(&self, id: &SandboxId, view: &Sandbox) {
        if let Some(entry) = self.lock().get_mut(id) {
            entry.view = view.clone();
        }
        self.broadcast(watch_event::Event::Changed(view.clone()));
    }

    /// Publishes a platform event.
    pub fn platform(&self, id: &SandboxId, kind: &str, message: impl Into<String>) {
        let time_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.broadcast(watch_event::Event::Platform(PlatformEvent {
            sandbox_id: id.to_string(),
            kind: kind.into(),
            message: message.into(),
            time_ms,
        }));
    }

    fn broadcast(&self, event: watch_event::Event) {
        // No subscribers is fine.
        let _ = self.events.send(WatchEvent { event: Some(event) });
    }

    /// Changes from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<WatchEvent> {
        self.events.subscribe()
    }

    /// One sandbox's view.
    pub fn get(&self, id: &SandboxId) -> Option<Sandbox> {
        self.lock().get(id).map(|e| e.view.clone())
    }

    /// The sandbox's view, if it can run processes now. Not found, stopped (the client must start it:
    /// `FAILED_PRECONDITION`), or any other state (booting, or its VM is gone: `UNAVAILABLE`) is a status.
    ///
    /// # Errors
    /// The status to answer with.
    pub fn serving(&self, id: &SandboxId) -> Result<Sandbox, tonic::Status> {
        let view = self.get(id).ok_or_else(|| tonic::Status::not_found(format!("no sandbox {id}")))?;
        match SandboxState::try_from(view.state) {
            Ok(SandboxState::Ready) => Ok(view),
            Ok(SandboxState::Stopped) => Err(tonic::Status::failed_precondition(format!("sandbox {id} is stopped"))),
            _ => Err(tonic::Status::unavailable(format!("sandbox {id} is not ready: {}", view.detail))),
        }
    }

    /// Records an applied rotation, merged over earlier ones, for the sandbox's later starts.
    pub fn record_rotation(&self, id: &SandboxId, rotation: CredentialRotation) {
        if let Some(entry) = self.lock().get_mut(id) {
            let merged = entry.rotated.get_or_insert_with(CredentialRotation::default);
            if rotation.headers.is_some() {
                merged.headers = rotation.headers;
            }
            if rotation.ca_path.is_some() {
                merged.ca_path = rotation.ca_path;
            }
        }
    }

    /// The credentials rotated for `id`, if any.
    pub fn rotated(&self, id: &SandboxId) -> Option<CredentialRotation> {
        self.lock().get(id).and_then(|e| e.rotated.clone())
    }

    /// Every sandbox's view, by id.
    pub fn list(&self) -> Vec<Sandbox> {
        let mut all: Vec<Sandbox> = self.lock().values().map(|e| e.view.clone()).collect();
        all.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        all
    }

    /// The actor's inbox.
    pub fn inbox(&self, id: &SandboxId) -> Option<mpsc::Sender<Command>> {
        self.lock().get(id).map(|e| e.inbox.clone())
    }

    /// Refuses new sandboxes from now on and returns every actor's inbox, so each gets its orderly stop.
    pub fn close(&self) -> Vec<mpsc::Sender<Command>> {
        let entries = self.lock();
        self.closing.store(true, Ordering::SeqCst);
        entries.values().map(|e| e.inbox.clone()).collect()
    }

    /// Whether the driver is going down.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Sets what the next supervisor of `id` must present.
    pub fn expect_session(&self, id: &SandboxId, generation: Generation, session_id: SessionId, token: String) {
        if let Some(entry) = self.lock().get_mut(id) {
            entry.session = Some(Expected { generation, session_id, token });
        }
    }

    /// Whether a supervisor presenting these is the one `id` expects.
    pub fn check_session(&self, hello: &SessionHello) -> bool {
        let Ok(id) = SandboxId::parse(&hello.sandbox_id) else { return false };
        self.lock().get(&id).and_then(|e| e.session.as_ref()).is_some_and(|expected| {
            let t = &expected.token;
            expected.generation == hello.generation
                && expected.session_id == hello.session_id
                && t.len() == hello.token.len()
                && t.bytes().zip(hello.token.bytes()).fold(0, |acc, (a, b)| acc | (a ^ b)) == 0
        })
    }
}

/// What the sandboxes meant to run hold, but `except`.
fn usage(entries: &HashMap<SandboxId, Entry>, except: Option<&SandboxId>) -> Usage {
    let mut used = Usage::default();
    for (id, entry) in entries {
        if entry.view.running_intent && Some(id) != except {
            used.add(shape(&entry.view));
        }
    }
    used
}

/// A sandbox's shape, from its public view (the spec was checked when it was accepted).
fn shape(view: &Sandbox) -> vm_contract::shape::SandboxShape {
    let (cpus, memory_mib) = view.spec.as_ref().map_or((0, 0), |s| (s.cpus, s.memory_mib));
    vm_contract::shape::SandboxShape::with_defaults(cpus, memory_mib).unwrap_or_default()
}
