//! How a sandbox's generation begins: restored from its kind's template, booted cold on its turn, or on a
//! claimed pooled VM; and what each is given (the VM, the identity, the session's token).

use std::path::PathBuf;

use vm_contract::claim::Origin;
use vm_contract::gateway::GatewayBinding;
use vm_contract::root::RootImage;
use vm_contract::session::{Generation, SessionId};
use vm_contract::tombstone::EndReason;

use super::errors::BeginError;
use super::{Actor, State};
use crate::sandbox::{self, Identity, Running, SessionSpec, StartSecrets, VmSpec};
use crate::service::hub::Hub;
use crate::service::store;
use crate::{state, template};

impl Actor {
    /// A new generation, on its image root if it has one: the root is made ready now, and the boot begins
    /// ([`Self::boot`]) when it has a turn: at once, or when the boots before it are done.
    pub(super) async fn start(&mut self) {
        self.next_generation(Origin::Cold);
        let root = match self.image_root().await {
            Ok(root) => root,
            Err(detail) => return self.set(State::Failed, detail),
        };
        if let Some(turn) = self.hub.ledger.try_boot_turn() {
            self.turn = Some(turn);
            return self.boot(root).await;
        }
        let why = if self.hub.ctx.pool { "cold boot: no free pooled VM of this shape and image; " } else { "" };
        let detail = format!("waiting for a turn to boot ({why}at most {} boot at once)", self.hub.ctx.limits.boots);
        self.set(State::Provisioning, detail);
        self.queued = Some((root, Box::pin(self.hub.ledger.boot_turn())));
    }

    /// Boots the generation [`Self::start`] began, on its turn; the lifecycle's blocking start runs on a
    /// blocking thread.
    pub(super) async fn boot(&mut self, root: Option<RootImage>) {
        let started = match self.start_spec(self.record.generation, root) {
            Ok((vm, who)) => {
                if let Some(running) = self.restore_from_template(&vm, &who).await {
                    self.record.origin = Some(Origin::Template);
                    self.running = Some(running);
                    return self.set(State::Provisioning, "restored from a template".into());
                }
                match tokio::task::spawn_blocking(move || sandbox::start(&vm, &who)).await {
                    Ok(started) => started.map_err(BeginError::from),
                    Err(_) => Err(BeginError::Task),
                }
            }
            Err(e) => Err(e),
        };
        match started {
            Ok(running) => {
                self.running = Some(running);
                self.set(State::Provisioning, cold_detail(&self.hub).into());
            }
            Err(e) => {
                drop(self.turn.take());
                self.set(State::Failed, format!("cannot start: {}", vm_contract::logs::chain(&e)));
            }
        }
    }

    /// The start restored from the template of `vm`'s kind, when there is one (`serve --cold`: never). When
    /// there is none, it is made in the background, within the host's capacity, for the next start.
    async fn restore_from_template(&mut self, vm: &VmSpec, who: &Identity) -> Option<Running> {
        let templates = self.hub.ctx.templates.clone()?;
        let key = template::key::of(vm).ok()?;
        // Its files' digests are read (and the first time, its RAM copied) off the async workers.
        let (loader, wanted, bytes) = (templates.clone(), key.clone(), u64::from(vm.shape.memory_mib()) << 20);
        let loaded = tokio::task::spawn_blocking(move || loader.load(&wanted, bytes)).await.ok()?;
        match loaded {
            Ok(Some(found)) => match template::restore(vm, who, &found).await {
                Ok(running) => return Some(running),
                Err(e) if e.template_refused() => {
                    tracing::warn!(sandbox = %who.id, error = %vm_contract::logs::chain(&e), "the template's restore failed; booting and making it again");
                    templates.remove(&key);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %who.id, error = %vm_contract::logs::chain(&e), "restore from a template failed; booting");
                }
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(sandbox = %who.id, error = %e, "template refused; booting and making it again"),
        }
        crate::service::templates::make(&self.hub.ctx, &self.hub.ledger, key, vm.clone());
        None
    }

    /// Starts the first generation on a claimed pooled VM: its identity, credentials and policy go to the
    /// waiting supervisor, which then reports ready like any start.
    pub(super) async fn claim(&mut self, mut running: Running) {
        let generation = self.next_generation(Origin::Pool);
        // The root the pooled VM booted, which its slot's directory (now the sandbox's) recorded.
        let root = self.hub.ctx.oci.pinned(&self.layout);
        let claimed =
            self.start_spec(generation, root).and_then(|(vm, who)| Ok(running.claim(&vm, &who, Origin::Pool)?));
        match claimed {
            Ok(()) => {
                self.running = Some(running);
                self.set(State::Provisioning, "claimed a pooled VM".into());
            }
            Err(e) => {
                // Nothing of it is used again: the generation ends like a failed start.
                running.stop(self.hub.ctx.stop_timeout).await.end(EndReason::Failed).await;
                self.set(State::Failed, format!("cannot start: {}", vm_contract::logs::chain(&e)));
            }
        }
    }

    fn next_generation(&mut self, origin: Origin) -> Generation {
        (self.queued, self.turn) = (None, None);
        let generation = store::generation(&self.layout).next();
        self.record.generation = generation;
        self.record.running_intent = true;
        self.record.accelerator = None;
        self.record.origin = Some(origin);
        (self.ready, self.session) = (false, None);
        generation
    }

    /// What a start of `generation` on `root` needs: the VM, and the identity it is bound to (its session is
    /// expected from here on).
    fn start_spec(
        &mut self,
        generation: Generation,
        root: Option<RootImage>,
    ) -> Result<(VmSpec, Identity), BeginError> {
        let (ctx, id) = (&self.hub.ctx, &self.record.id);
        store::set_generation(&self.layout, generation).map_err(BeginError::Generation)?;
        // 256 bits: the session's only credential.
        let token = state::random_hex::<32>().map_err(BeginError::Random)?;
        let session_id = SessionId::from_bytes(state::random_bytes::<16>().map_err(BeginError::Random)?);
        self.hub.tokens.expect(id, generation, session_id.clone(), token.clone());
        // A rotation outlives the supervisor it was sent to.
        let (mut telemetry, mut otlp_headers) = (ctx.telemetry.clone(), ctx.otlp_headers.clone());
        let mut credentials = Vec::new();
        if let Some(rotated) = self.hub.rotations.get(id) {
            otlp_headers = rotated.headers.unwrap_or(otlp_headers);
            telemetry.otlp_ca = rotated.ca_path.map(PathBuf::from).or(telemetry.otlp_ca);
            credentials = rotated.secrets.unwrap_or_default();
        }
        let spec = &self.record.spec;
        let image = ctx.images.resolve(&spec.boot_image)?;
        let vm = ctx.vm_spec(self.layout.clone(), image, spec.shape, root, spec.mounts.clone());
        let (gateway, gateway_token) = match &spec.gateway {
            None => (None, None),
            Some(sandbox) => {
                let endpoint = ctx.gateway.clone().ok_or(BeginError::NoGateway)?;
                let token = store::gateway_token(&self.layout).ok_or(BeginError::NoGatewayToken)?;
                let env = spec.env.clone().into_iter().collect();
                (Some(GatewayBinding { endpoint, sandbox: sandbox.clone(), env }), Some(token))
            }
        };
        let who = Identity {
            id: id.clone(),
            session: Some(SessionSpec { socket: ctx.sessions_socket.clone(), generation, id: session_id, token }),
            telemetry,
            policy: spec.policy.clone(),
            secrets: StartSecrets {
                otlp_headers,
                egress_proxy_authorization: ctx.egress.proxy_authorization.clone(),
                credentials,
                gateway_token,
            },
            gateway,
        };
        Ok((vm, who))
    }
}

/// What a cold start says while it boots: with a pool, that none of its VMs could serve it.
pub(super) fn cold_detail(hub: &Hub) -> &'static str {
    if hub.ctx.pool {
        "booting (cold boot: no free pooled VM of this shape and image)"
    } else {
        "booting"
    }
}
