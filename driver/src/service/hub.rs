//! The façade between the API and the sandboxes' actors: a create goes from [`super::api`] through
//! [`Hub::create`] to a new actor, and every other request to the actor's inbox ([`Hub::ask`]). It holds
//! the service's parts, each with one job: the [`Registry`] (which sandboxes exist), the [`Ledger`] (their
//! shares of the host), the [`Events`] bus (`Watch`), the [`SessionTokens`] and the credential
//! [`Rotations`]; and the warm [`Pool`].

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use vm_contract::ids::SandboxId;
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_protocol::credentials::{CredentialRotation, SecretCredential};

use super::actor::{self, Command, Initial};
use super::admission::{ExecStreams, Refused, Usage};
use super::context::Context;
use super::credentials::Rotations;
use super::events::Events;
use super::ledger::Ledger;
use super::pool::{ClaimedVm, Pool};
use super::record::{SandboxRecord, State};
use super::registry::{InsertError, Registry};
use super::store::{self, StoredSpec};
use super::tokens::SessionTokens;
use crate::state::StateError;

/// The service's shared state.
#[derive(Debug)]
pub struct Hub {
    /// Shared settings.
    pub ctx: Arc<Context>,
    /// Which sandboxes exist.
    pub registry: Registry,
    /// What they and the pooled VMs hold of the host.
    pub ledger: Arc<Ledger>,
    /// What `Watch` follows.
    pub events: Events,
    /// The session each current supervisor must open.
    pub tokens: SessionTokens,
    /// Credentials rotated since the driver started.
    pub rotations: Rotations,
    /// The Exec streams open.
    pub exec_streams: Arc<ExecStreams>,
    /// Each sandbox's attach connection, shared by its Exec streams.
    pub attach: Arc<crate::attach_mux::Connections>,
    /// The warm pool.
    pub pool: Arc<Pool>,
}

/// A new sandbox's secrets: never in its spec, never in the guest.
#[derive(Default)]
pub struct CreateSecrets {
    /// Credentials the workload sees as placeholders.
    pub credentials: Vec<SecretCredential>,
    /// The sandbox token of the OpenShell gateway that creates it.
    pub gateway_token: Option<String>,
}

impl std::fmt::Debug for CreateSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreateSecrets")
            .field("credentials", &self.credentials)
            .field("gateway_token", &self.gateway_token.is_some())
            .finish()
    }
}

/// Why a create failed. Nothing of it is left: a claimed VM is stopped, a directory made for it removed.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The driver is going down.
    #[error("the driver is shutting down")]
    Closing,
    /// The id is taken.
    #[error("sandbox {0} exists")]
    Exists(SandboxId),
    /// It does not fit.
    #[error(transparent)]
    Refused(#[from] Refused),
    /// Its image cannot be used.
    #[error(transparent)]
    Image(#[from] crate::image::NamedImageError),
    /// The task that tried the pool ended abnormally.
    #[error("the claim failed")]
    ClaimTask,
    /// The claimed VM's directory could not become the sandbox's.
    #[error("cannot move the pooled VM's directory")]
    MoveSlot(#[source] std::io::Error),
    /// The sandbox directory could not be made.
    #[error("cannot create the sandbox directory")]
    CreateDir(#[source] StateError),
    /// The spec could not be recorded.
    #[error("cannot record the spec")]
    SaveSpec(#[source] std::io::Error),
    /// It was deleted before its create answered.
    #[error("the sandbox vanished")]
    Vanished,
}

/// Why a sandbox cannot run processes now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServingError {
    /// No such sandbox.
    #[error("no sandbox {0}")]
    NotFound(SandboxId),
    /// Stopped: the client must start it.
    #[error("sandbox {0} is stopped")]
    Stopped(SandboxId),
    /// Booting, or its VM is gone.
    #[error("sandbox {id} is not ready: {detail}")]
    NotReady {
        /// The sandbox.
        id: SandboxId,
        /// Its record's detail.
        detail: String,
    },
}

/// Why a command did not reach a sandbox's actor, or got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    /// No such sandbox.
    #[error("no sandbox {0}")]
    NotFound(SandboxId),
    /// Its actor is ending.
    #[error("sandbox {0} is being removed")]
    Removing(SandboxId),
    /// Its actor ended before it answered (delete or shutdown).
    #[error("sandbox {0} was removed")]
    Removed(SandboxId),
}

impl Hub {
    /// The service over `ctx`, `ledger` and `pool`, with no sandbox yet.
    pub fn new(ctx: Arc<Context>, ledger: Arc<Ledger>, pool: Arc<Pool>) -> Arc<Self> {
        Arc::new(Self {
            exec_streams: ExecStreams::new(ctx.limits),
            attach: crate::attach_mux::Connections::new(ctx.controls.service.exec_mux_head_of_line),
            registry: Registry::default(),
            events: Events::default(),
            tokens: SessionTokens::default(),
            rotations: Rotations::default(),
            ledger,
            pool,
            ctx,
        })
    }

    /// Creates sandbox `id`: on a claimed pooled VM of its shape and image if one is free, else booted cold.
    /// Its credentials are held in memory only, with the rotations, for every start; a gateway's token is kept
    /// in the sandbox directory (0600), for every start after a driver restart too.
    ///
    /// # Errors
    /// [`CreateError`].
    pub async fn create(
        self: &Arc<Self>,
        id: SandboxId,
        spec: StoredSpec,
        secrets: CreateSecrets,
    ) -> Result<SandboxRecord, CreateError> {
        if self.registry.is_closing() {
            return Err(CreateError::Closing);
        }
        if self.registry.contains(&id) {
            return Err(CreateError::Exists(id));
        }
        let image = self.ctx.images.resolve(&spec.boot_image)?;
        // A pooled VM read its auth bundle at its own start: one with credentials always boots.
        let poolable = spec.mounts.is_empty() && secrets.credentials.is_empty() && secrets.gateway_token.is_none();
        if !secrets.credentials.is_empty() {
            let rotation = CredentialRotation { secrets: Some(secrets.credentials), ..CredentialRotation::default() };
            self.rotations.record(&id, rotation);
        }
        let created = self.create_with(&id, spec, image, poolable, secrets.gateway_token).await;
        if created.is_err() {
            self.rotations.forget(&id);
        }
        created
    }

    async fn create_with(
        self: &Arc<Self>,
        id: &SandboxId,
        spec: StoredSpec,
        image: crate::image::Image,
        poolable: bool,
        gateway_token: Option<String>,
    ) -> Result<SandboxRecord, CreateError> {
        let id = id.clone();
        // In a task of its own: a client that goes away mid-claim must not drop a VM in hand.
        let (hub, claim_id) = (Arc::clone(self), id.clone());
        let attempt = tokio::spawn(async move {
            // Only a VM of the same root, with the default writable layer, can serve it.
            // A pooled VM has no file servers: a sandbox with mounts always boots.
            let claimed = match super::pool::root_key(spec.image.as_deref(), spec.disk_mib) {
                Some(root) if poolable => hub.pool.claim(spec.shape, &image, root.as_deref()).await,
                _ => None,
            };
            match claimed {
                Some(claimed) => Ok(hub.create_claimed(claim_id, spec, claimed).await),
                None => Err(spec),
            }
        });
        let how = match attempt.await.map_err(|_| CreateError::ClaimTask)? {
            Ok(created) => created.map(|()| "accepted; claimed a pooled VM")?,
            Err(spec) => self.create_cold(&id, spec, gateway_token.as_deref()).map(|()| "accepted; booting")?,
        };
        self.events.platform(&id, "provisioning", how);
        self.registry.get(&id).ok_or(CreateError::Vanished)
    }

    /// Creates sandbox `id` on a claimed pooled VM: its slot's directory becomes the sandbox's, then the
    /// actor hands the VM its identity. On any failure the VM is stopped, never returned to the pool.
    async fn create_claimed(
        self: &Arc<Self>,
        id: SandboxId,
        spec: StoredSpec,
        mut claimed: ClaimedVm,
    ) -> Result<(), CreateError> {
        let target = self.ctx.state.layout(&id);
        let layout = match crate::jail::move_sandbox(claimed.running.layout(), target.dir()) {
            Ok(layout) => layout,
            Err(e) => {
                self.discard(claimed);
                return Err(if e.kind() == std::io::ErrorKind::AlreadyExists {
                    CreateError::Exists(id)
                } else {
                    CreateError::MoveSlot(e)
                });
            }
        };
        claimed.running.moved_to(layout.clone());
        if let Err(e) = store::save_spec(&layout, &spec) {
            self.discard(claimed);
            return Err(CreateError::SaveSpec(e));
        }
        let initial = Initial::Claimed(Box::new(claimed));
        actor::spawn(self, id.clone(), layout.clone(), spec, initial, true).map_err(|(e, initial)| {
            // Before the answer: a driver going down must not restore a sandbox it refused.
            let _ = std::fs::remove_file(layout.path(SandboxFile::Spec));
            if let Initial::Claimed(claimed) = initial {
                self.discard(*claimed);
            }
            match e {
                InsertError::Taken => CreateError::Exists(id),
                _ => CreateError::Closing,
            }
        })
    }

    /// Creates sandbox `id` in a new directory, with its gateway's token, and boots it.
    fn create_cold(self: &Arc<Self>, id: &SandboxId, spec: StoredSpec, token: Option<&str>) -> Result<(), CreateError> {
        let layout = self.ctx.state.create_sandbox(id).map_err(|e| match e {
            StateError::Exists(_) => CreateError::Exists(id.clone()),
            e => CreateError::CreateDir(e),
        })?;
        let saved = token.map_or(Ok(()), |t| store::save_gateway_token(&layout, t));
        if let Err(e) = saved.and_then(|()| store::save_spec(&layout, &spec)) {
            let _ = std::fs::remove_dir_all(layout.dir());
            return Err(CreateError::SaveSpec(e));
        }
        match actor::spawn(self, id.clone(), layout.clone(), spec, Initial::Start, true) {
            Ok(()) => Ok(()),
            Err((InsertError::Taken, _)) => Err(CreateError::Exists(id.clone())),
            Err((e, _)) => {
                let _ = std::fs::remove_dir_all(layout.dir());
                Err(match e {
                    InsertError::Refused(why) => CreateError::Refused(why),
                    _ => CreateError::Closing,
                })
            }
        }
    }

    /// Stops a claimed VM that no sandbox took, in the background.
    fn discard(&self, claimed: ClaimedVm) {
        let pool = Arc::clone(&self.pool);
        tokio::spawn(async move { pool.discard(claimed).await });
    }

    /// Brings back a sandbox found in the state directory; it was admitted before, so it is not refused now.
    pub fn restore(self: &Arc<Self>, id: SandboxId, layout: SandboxLayout, spec: StoredSpec, initial: Initial) {
        let _ = actor::spawn(self, id, layout, spec, initial, false);
    }

    /// The sandbox's record, if it can run processes now.
    ///
    /// # Errors
    /// [`ServingError`]: not found, stopped, or not ready.
    pub fn serving(&self, id: &SandboxId) -> Result<SandboxRecord, ServingError> {
        let record = self.registry.get(id).ok_or_else(|| ServingError::NotFound(id.clone()))?;
        match record.state {
            State::Ready => Ok(record),
            State::Stopped => Err(ServingError::Stopped(id.clone())),
            _ => Err(ServingError::NotReady { id: id.clone(), detail: record.detail }),
        }
    }

    /// Sends `id`'s actor the command `make` builds and waits for its answer.
    ///
    /// # Errors
    /// [`AskError`].
    pub async fn ask<T>(
        &self,
        id: &SandboxId,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, AskError> {
        let inbox = self.registry.inbox(id).ok_or_else(|| AskError::NotFound(id.clone()))?;
        let (tx, rx) = oneshot::channel();
        inbox.send(make(tx)).await.map_err(|_| AskError::Removing(id.clone()))?;
        // The actor ends only on delete or shutdown: either way the sandbox is gone for this request.
        rx.await.map_err(|_| AskError::Removed(id.clone()))
    }

    /// What the sandboxes meant to run and the pooled VMs hold.
    pub fn usage(&self) -> Usage {
        self.ledger.usage()
    }

    /// Publishes a sandbox's new record: kept in the registry and sent to `Watch`.
    pub fn publish(&self, record: &SandboxRecord) {
        self.registry.update(record);
        self.events.changed(record);
    }

    /// Records an applied rotation for the sandbox's later starts, while it exists.
    pub fn record_rotation(&self, id: &SandboxId, rotation: CredentialRotation) {
        if self.registry.contains(id) {
            self.rotations.record(id, rotation);
        }
    }

    /// Refuses new sandboxes from now on and returns every actor's inbox, so each gets its orderly stop.
    pub fn close(&self) -> Vec<mpsc::Sender<Command>> {
        self.registry.close()
    }
}
