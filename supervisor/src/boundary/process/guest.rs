//! The guest's half of the multiplexer: every message of the guest is checked against the protocol's rules
//! and passed on to the process's client under the client's own id.

use vm_protocol::flow::MAX_WINDOW_BYTES;
use vm_protocol::link::ToHost;
use vm_protocol::message::{Refusal, MAX_FAILURE_MESSAGE_BYTES};
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, Stream};

use super::route::{Phase, Route};
use super::{Action, ProcessRouter};
use crate::boundary::violation::GuestViolation;

impl ProcessRouter {
    /// Handles one message from the guest.
    ///
    /// # Errors
    /// A [`GuestViolation`]; the caller stops the VM.
    pub fn from_guest(&mut self, msg: ToHost) -> Result<Vec<Action>, GuestViolation> {
        match msg {
            ToHost::Process(event) => self.process_event(event),
            ToHost::Pong { .. } => Err(GuestViolation::Unexpected("an unsolicited Pong")),
            ToHost::Hello(_) => Err(GuestViolation::Unexpected("a second Hello")),
            ToHost::Net(_) => Err(GuestViolation::Unexpected("a network stream")),
        }
    }

    fn process_event(&mut self, event: ProcessEvent) -> Result<Vec<Action>, GuestViolation> {
        match event {
            ProcessEvent::Started { id, pid, stdin_window, output_window } => {
                self.started(id, pid, stdin_window, output_window)
            }
            ProcessEvent::Output { id, stream, data } => self.output(id, stream, data),
            ProcessEvent::StdinCredit { id, bytes } => self.stdin_credit(id, bytes),
            ProcessEvent::Exited { id, status } => self.exited(id, status),
            ProcessEvent::SpawnFailed { id, status, message } => self.spawn_failed(id, status, message),
            ProcessEvent::Refused { id, reason } => self.refused(id, reason),
        }
    }

    fn started(
        &mut self,
        id: ProcId,
        pid: u32,
        stdin_window: u32,
        output_window: u32,
    ) -> Result<Vec<Action>, GuestViolation> {
        let enforce = self.enforce;
        let route = self.live_route(id)?;
        if enforce && route.phase != Phase::Spawned {
            return Err(GuestViolation::StartedTwice(id));
        }
        if enforce && (stdin_window > MAX_WINDOW_BYTES || output_window != route.output_window()) {
            return Err(GuestViolation::WindowTooLarge(id));
        }
        let output_window = route.output_window();
        route.started(pid, stdin_window);
        // A file operation's one event comes at its end, with what it moved.
        let mut actions = match route.file {
            None => vec![Action::Started { guest_id: id, pid, argv: route.argv.clone() }],
            Some(_) => Vec::new(),
        };
        if !route.detached {
            let msg = ProcessEvent::Started { id: route.client_id, pid, stdin_window, output_window };
            actions.push(Action::ToClient(route.client, msg.into()));
        }
        Ok(actions)
    }

    fn output(
        &mut self,
        id: ProcId,
        stream: Stream,
        data: serde_bytes::ByteBuf,
    ) -> Result<Vec<Action>, GuestViolation> {
        let enforce = self.enforce;
        let route = self.live_route(id)?;
        if enforce && data.is_empty() {
            return Err(GuestViolation::Empty(id));
        }
        if enforce && route.phase != Phase::Running {
            return Err(GuestViolation::OutOfOrder(id));
        }
        route.output(stream, data.clone()).map_err(|source| GuestViolation::Credit { id, source })?;
        if route.detached {
            return Ok(Vec::new());
        }
        let output = ProcessEvent::Output { id: route.client_id, stream, data };
        Ok(vec![Action::ToClient(route.client, output.into())])
    }

    fn stdin_credit(&mut self, id: ProcId, bytes: u32) -> Result<Vec<Action>, GuestViolation> {
        if self.enforce && bytes == 0 {
            return Err(GuestViolation::Empty(id));
        }
        match self.routes.get_mut(&id).filter(|r| r.phase == Phase::Running) {
            Some(route) => {
                let passed = route.stdin_credit(bytes).map_err(|source| GuestViolation::Credit { id, source })?;
                if route.detached || passed == 0 {
                    return Ok(Vec::new());
                }
                let msg = ProcessEvent::StdinCredit { id: route.client_id, bytes: passed };
                Ok(vec![Action::ToClient(route.client, msg.into())])
            }
            // The agent credits stdin it wrote just before the process exited: a benign race.
            None if id.0 < self.next_guest_id => Ok(Vec::new()),
            None => Err(GuestViolation::UnknownProcess(id)),
        }
    }

    fn exited(&mut self, id: ProcId, status: ExitStatus) -> Result<Vec<Action>, GuestViolation> {
        let enforce = self.enforce;
        let route = self.live_route(id)?;
        if enforce && route.phase != Phase::Running {
            return Err(GuestViolation::OutOfOrder(id));
        }
        if enforce && !status.is_plausible() {
            return Err(GuestViolation::ImplausibleStatus(id));
        }
        route.phase = Phase::Exited(status);
        let mut actions = vec![route.ended(id, status)];
        if !route.detached {
            let exited = ProcessEvent::Exited { id: route.client_id, status };
            actions.push(Action::ToClient(route.client, exited.into()));
            if route.delivered() {
                self.end_route(id);
            }
        } else {
            self.forget_old_finished();
        }
        Ok(actions)
    }

    fn spawn_failed(&mut self, id: ProcId, status: ExitStatus, message: String) -> Result<Vec<Action>, GuestViolation> {
        let enforce = self.enforce;
        let route = self.live_route(id)?;
        if enforce && route.phase != Phase::Spawned {
            return Err(GuestViolation::OutOfOrder(id));
        }
        if enforce && !status.is_plausible() {
            return Err(GuestViolation::ImplausibleStatus(id));
        }
        if enforce && message.len() > MAX_FAILURE_MESSAGE_BYTES {
            return Err(GuestViolation::MessageTooLong(id));
        }
        let (client, client_id, detached) = (route.client, route.client_id, route.detached);
        let mut actions = vec![route.ended(id, status)];
        self.end_route(id);
        if !detached {
            let failed = ProcessEvent::SpawnFailed { id: client_id, status, message };
            actions.push(Action::ToClient(client, failed.into()));
        }
        Ok(actions)
    }

    fn refused(&mut self, id: ProcId, reason: Refusal) -> Result<Vec<Action>, GuestViolation> {
        let enforce = self.enforce;
        let route = self.live_route(id)?;
        if enforce && route.phase != Phase::Spawned {
            return Err(GuestViolation::OutOfOrder(id));
        }
        let (client, client_id, detached) = (route.client, route.client_id, route.detached);
        self.end_route(id);
        Ok(if detached {
            Vec::new()
        } else {
            vec![Action::ToClient(client, ProcessEvent::Refused { id: client_id, reason }.into())]
        })
    }

    /// The route of a process that has not exited.
    fn live_route(&mut self, id: ProcId) -> Result<&mut Route, GuestViolation> {
        self.routes
            .get_mut(&id)
            .filter(|r| !matches!(r.phase, Phase::Exited(_)))
            .ok_or(GuestViolation::UnknownProcess(id))
    }
}
