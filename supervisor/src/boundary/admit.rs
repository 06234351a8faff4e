//! The policy gate at the boundary: which operation a client's message is, and what a denial sends.

use vm_protocol::attach::{SupervisorRequest, ToSupervisor};
use vm_protocol::message::Refusal;
use vm_protocol::net::{ForwardEvent, ForwardRequest};
use vm_protocol::policy::Operation;
use vm_protocol::{ProcId, ProcessEvent, ProcessRequest};

use super::{ClientId, Note, Outgoing, Output};
use crate::policy::{Denial, Gate};

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

/// Whether `gate` admits `msg` with `running` processes in the sandbox; a denial goes into `out` (a note,
/// and for a request that expects an answer, its refusal) and `false` comes back. Stdin, signals and resizes
/// are dropped (the client sees no effect).
pub(super) fn admit(gate: &Gate, running: usize, client: ClientId, msg: &ToSupervisor, out: &mut Output) -> bool {
    let Some(op) = operation(msg) else { return true };
    let admitted = match msg {
        ToSupervisor::Process(ProcessRequest::Spawn(spawn)) => gate.admit_spawn(spawn, running),
        ToSupervisor::Process(ProcessRequest::Files(_)) => gate.admit_counted(op, running),
        _ => gate.admit(op, None),
    };
    let Err(denial) = admitted else { return true };
    deny(client, msg, op, denial, gate.revision(), out);
    false
}

fn deny(client: ClientId, msg: &ToSupervisor, op: Operation, denial: Denial, revision: u64, out: &mut Output) {
    out.notes.push(Note::Denied { op, revision, denial });
    let refused = |id| Outgoing::ToClient(client, ProcessEvent::Refused { id, reason: Refusal::Denied }.into());
    match msg {
        ToSupervisor::Process(ProcessRequest::Spawn(spawn)) => out.sends.push(refused(spawn.id)),
        ToSupervisor::Process(ProcessRequest::Files(files)) => out.sends.push(refused(files.id)),
        ToSupervisor::Supervisor(SupervisorRequest::Reattach { id, .. }) => out.sends.push(refused(*id)),
        ToSupervisor::Supervisor(SupervisorRequest::ListProcesses) => out.sends.push(refused(ProcId(0))),
        ToSupervisor::Forward(ForwardRequest::Connect { id, .. }) => {
            let refusal = ForwardEvent::Refused { id: *id, reason: Refusal::Denied };
            out.sends.push(Outgoing::ToClient(client, refusal.into()));
        }
        _ => {}
    }
}
