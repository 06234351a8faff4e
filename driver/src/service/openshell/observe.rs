//! Our sandboxes as a gateway observes them: a record becomes a `DriverSandbox` whose conditions the
//! gateway composes its phase from (`architecture/compute-runtimes.md` upstream). Readiness is the
//! gateway's: it calls a sandbox Ready once our supervisor's session with it is live; we report only the
//! backend's part.
//!
//! | our state | conditions | the gateway reads |
//! |---|---|---|
//! | provisioning | `Ready=False Starting` | Provisioning (transient) |
//! | ready | `Ready=True VmReady` | Ready once the supervisor's session is live |
//! | stopping | `Suspended=False PodTerminating`, `Ready=False DependenciesNotReady` | Stopping confirmed |
//! | stopped | `Suspended=True ContainerStopped`, `Ready=False ContainerStopped` | Stopped |
//! | failed | `Ready=False ProvisioningFailed` | Error (terminal until started) |
//!
//! A delete answers once the sandbox is gone, and is then a `deleted` watch event; our other platform notes
//! (pulling an image, the accelerator) are platform events.

use vm_protocol::openshell::compute::v1::{
    watch_sandboxes_event::Payload, DriverCondition, DriverPlatformEvent, DriverSandbox, DriverSandboxStatus,
    WatchSandboxesDeletedEvent, WatchSandboxesEvent, WatchSandboxesPlatformEvent, WatchSandboxesSandboxEvent,
};

use crate::service::events::{Event, PlatformNote};
use crate::service::record::{SandboxRecord, State};

/// Where our platform events say they come from.
const SOURCE: &str = "vm-driver";

fn condition(kind: &str, status: bool, reason: &str, message: &str) -> DriverCondition {
    DriverCondition {
        r#type: kind.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: String::new(),
    }
}

/// The conditions of a sandbox in `state`, with our `detail` as their message.
fn conditions(state: State, detail: &str) -> Vec<DriverCondition> {
    match state {
        State::Provisioning => vec![condition("Ready", false, "Starting", detail)],
        State::Ready => vec![condition("Ready", true, "VmReady", detail)],
        State::Stopping => vec![
            condition("Suspended", false, "PodTerminating", detail),
            condition("Ready", false, "DependenciesNotReady", detail),
        ],
        State::Stopped => vec![
            condition("Suspended", true, "ContainerStopped", detail),
            condition("Ready", false, "ContainerStopped", detail),
        ],
        State::Failed => vec![condition("Ready", false, "ProvisioningFailed", detail)],
    }
}

/// A record, as the gateway observes it (without the spec it sent: the gateway keeps its own).
pub fn sandbox(record: &SandboxRecord) -> DriverSandbox {
    let name = record.spec.gateway.as_ref().map(|g| g.sandbox_name.clone()).unwrap_or_default();
    DriverSandbox {
        id: record.id.to_string(),
        name: name.clone(),
        namespace: String::new(),
        spec: None,
        status: Some(DriverSandboxStatus {
            sandbox_name: name,
            // The supervisor reports the main process's own instance id to the gateway; the VM's is its
            // generation.
            instance_id: format!("{}-{}", record.id, record.generation.0),
            agent_fd: String::new(),
            sandbox_fd: String::new(),
            conditions: conditions(record.state, &record.detail),
            deleting: false,
        }),
        workspace: String::new(),
    }
}

/// One of our events as a watch event, for sandboxes a gateway created (`gateway` says whether one did).
pub fn watch_event(
    event: &Event,
    gateway: impl Fn(&vm_contract::ids::SandboxId) -> bool,
) -> Option<WatchSandboxesEvent> {
    let payload = match event {
        Event::Changed(record) if record.spec.gateway.is_some() => {
            Payload::Sandbox(WatchSandboxesSandboxEvent { sandbox: Some(sandbox(record)) })
        }
        Event::Changed(_) => return None,
        Event::Platform(note) if !gateway(&note.sandbox) && note.kind != "deleted" => return None,
        Event::Platform(PlatformNote { sandbox, kind, .. }) if kind == "deleted" => {
            Payload::Deleted(WatchSandboxesDeletedEvent { sandbox_id: sandbox.to_string() })
        }
        Event::Platform(note) => Payload::PlatformEvent(WatchSandboxesPlatformEvent {
            sandbox_id: note.sandbox.to_string(),
            event: Some(DriverPlatformEvent {
                timestamp_ms: note.time_ms,
                source: SOURCE.into(),
                r#type: "Normal".into(),
                reason: note.kind.clone(),
                message: note.message.clone(),
                metadata: std::collections::HashMap::default(),
            }),
        }),
    };
    Some(WatchSandboxesEvent { payload: Some(payload) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_reads_to_the_gateway_as_the_phase_it_means() {
        // The gateway's reading (derive_phase upstream): deleting, then Suspended=True, then the first
        // Ready condition, whose False reasons split into transient and terminal.
        let transient = ["Starting", "DependenciesNotReady"];
        let phase = |c: &[DriverCondition]| {
            if c.iter().any(|c| c.r#type == "Suspended" && c.status == "True") {
                return "stopped";
            }
            match c.iter().find(|c| c.r#type == "Ready") {
                Some(r) if r.status == "True" => "ready",
                Some(r) if transient.contains(&r.reason.as_str()) => "provisioning",
                Some(_) => "error",
                None => "provisioning",
            }
        };
        assert_eq!(phase(&conditions(State::Provisioning, "")), "provisioning");
        assert_eq!(phase(&conditions(State::Ready, "")), "ready");
        assert_eq!(phase(&conditions(State::Stopping, "")), "provisioning");
        assert_eq!(phase(&conditions(State::Stopped, "")), "stopped");
        assert_eq!(phase(&conditions(State::Failed, "")), "error");
        let stopped = conditions(State::Stopped, "");
        assert!(stopped.iter().any(|c| c.status == "False" && c.reason.eq_ignore_ascii_case("containerstopped")));
    }
}
