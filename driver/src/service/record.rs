//! The sandbox as the service knows it: a plain record its actor owns and publishes. The API's message is
//! made from it in [`super::api`], and nowhere else.

use vm_contract::accel::Accelerator;
use vm_contract::claim::Origin;
use vm_contract::ids::SandboxId;
use vm_contract::jail::Confinement;
use vm_contract::session::Generation;

use super::store::StoredSpec;

/// Where a sandbox is in its life (the actor's diagram, `super::actor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Booting, or waiting for its session.
    Provisioning,
    /// Its VM is up, its agent answered and its session is accepted.
    Ready,
    /// An orderly stop is under way.
    Stopping,
    /// Stopped on purpose.
    Stopped,
    /// Its start failed or its VM ended on its own; terminal until started.
    Failed,
}

/// One sandbox: its accepted spec, identity, state and generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRecord {
    /// Its id.
    pub id: SandboxId,
    /// The spec accepted at create.
    pub spec: StoredSpec,
    /// Its state.
    pub state: State,
    /// Progress, or why it failed or stopped.
    pub detail: String,
    /// The current (or last) start.
    pub generation: Generation,
    /// Whether a restarted driver brings it back (and whether it holds its share of the host).
    pub running_intent: bool,
    /// How its VMM is confined.
    pub confinement: Confinement,
    /// How the current generation's VM came up.
    pub origin: Option<Origin>,
    /// The accelerator, once the supervisor reported it.
    pub accelerator: Option<Accelerator>,
    /// `127.0.0.1:PORT` while ready and the supervisor's session is up; empty otherwise.
    pub readiness_endpoint: String,
}
