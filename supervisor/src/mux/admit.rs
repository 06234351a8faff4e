//! What the gate decides about a client's message: which operation it is, and what a denial sends.

use vm_protocol::attach::{SupervisorRequest, ToSupervisor};
use vm_protocol::message::Refusal;
use vm_protocol::net::{ForwardEvent, ForwardRequest};
use vm_protocol::policy::Operation;
use vm_protocol::{ProcId, ProcessEvent, ProcessRequest};

use super::{Action, ClientId, Mux};
use crate::policy::Denial;

/// The policy operation a client message is, if it is one (credit, pings and policy updates are not).
fn operation(msg: &ToSupervisor) -> Option<Operation> {
    Some(match msg {
        ToSupervisor::Process(ProcessRequest::Spawn(_)) => Operation::Exec,
        ToSupervisor::Process(ProcessRequest::Files(files)) => files.op.operation(),
        ToSupervisor::Process(ProcessRequest::Stdin { .. } | ProcessRequest::StdinEof { .. }) => Operation::Stdin,
        ToSupervisor::Process(ProcessRequest::Signal { .. }) => Operation::Signal,
        ToSupervisor::Process(ProcessRequest::Resize { .. }) => Operation::Resize,
        ToSupervisor::Supervisor(SupervisorRequest::Reattach { .. }) => Operation::Reattach,
        ToSupervisor::Supervisor(SupervisorRequest::ListProcesses) => Operation::ListProcesses,
        ToSupervisor::Forward(ForwardRequest::Connect { .. }) => Operation::PortForward,
        _ => return None,
    })
}

impl Mux {
    /// `None` when the gate admits `msg` (or it is no operation); otherwise what its denial sends.
    pub(super) fn admit(&self, client: ClientId, msg: &ToSupervisor) -> Option<Vec<Action>> {
        let op = operation(msg)?;
        let admitted = match msg {
            ToSupervisor::Process(ProcessRequest::Spawn(spawn)) => self.gate.admit_spawn(spawn, self.running()),
            ToSupervisor::Process(ProcessRequest::Files(_)) => self.gate.admit_counted(op, self.running()),
            _ => self.gate.admit(op, None),
        };
        admitted.err().map(|denial| self.deny(client, msg, op, denial))
    }

    /// A denied operation: a finding, and for a request that expects an answer, a refusal. Stdin, signals and
    /// resizes are dropped (the client sees no effect).
    fn deny(&self, client: ClientId, msg: &ToSupervisor, op: Operation, denial: Denial) -> Vec<Action> {
        let mut actions = vec![Action::Denied { op, revision: self.gate.revision(), denial }];
        let refused = |id| Action::ToClient(client, ProcessEvent::Refused { id, reason: Refusal::Denied }.into());
        match msg {
            ToSupervisor::Process(ProcessRequest::Spawn(spawn)) => actions.push(refused(spawn.id)),
            ToSupervisor::Process(ProcessRequest::Files(files)) => actions.push(refused(files.id)),
            ToSupervisor::Supervisor(SupervisorRequest::Reattach { id, .. }) => actions.push(refused(*id)),
            ToSupervisor::Supervisor(SupervisorRequest::ListProcesses) => actions.push(refused(ProcId(0))),
            ToSupervisor::Forward(ForwardRequest::Connect { id, .. }) => {
                let refusal = ForwardEvent::Refused { id: *id, reason: Refusal::Denied };
                actions.push(Action::ToClient(client, refusal.into()));
            }
            _ => {}
        }
        actions
    }
}
