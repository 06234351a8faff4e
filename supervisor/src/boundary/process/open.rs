//! Opening a client's process on the guest: a spawn or a file operation gets a guest-wide id, a route and
//! an output window within the sandbox's budget, or its refusal.

use vm_protocol::files::FileSpawn;
use vm_protocol::flow::MAX_WINDOW_BYTES;
use vm_protocol::message::Refusal;
use vm_protocol::{ProcId, ProcessEvent, ProcessRequest};

use super::route::Route;
use super::{Action, ClientId, ProcessRouter, MAX_PROCESSES, MIN_WINDOW_BYTES, OUTPUT_BUDGET_BYTES};

impl ProcessRouter {
    pub(super) fn spawn(&mut self, client: ClientId, mut spawn: vm_protocol::Spawn) -> Vec<Action> {
        let valid = !spawn.argv.is_empty();
        let (argv, tty) = (spawn.argv.clone(), spawn.pty.is_some());
        let route = |window| Route::new(client, spawn.id, &argv, window, tty);
        match self.open(client, spawn.id, spawn.output_window, valid, route) {
            Ok((guest_id, window)) => {
                (spawn.id, spawn.output_window) = (guest_id, window);
                vec![Action::ToGuest(ProcessRequest::Spawn(spawn).into())]
            }
            Err(refused) => refused,
        }
    }

    pub(super) fn files(&mut self, client: ClientId, mut files: FileSpawn) -> Vec<Action> {
        let valid = files.op.validate().is_ok();
        let op = files.op.clone();
        let route = |window| Route::for_file(client, files.id, op, window);
        match self.open(client, files.id, files.output_window, valid, route) {
            Ok((guest_id, window)) => {
                (files.id, files.output_window) = (guest_id, window);
                vec![Action::ToGuest(ProcessRequest::Files(files).into())]
            }
            Err(refused) => refused,
        }
    }

    /// Opens a route for a client's process `id` (a spawn or a file operation): its guest-wide id and its
    /// output window, or the refusal to send.
    fn open(
        &mut self,
        client: ClientId,
        id: ProcId,
        output_window: u32,
        valid: bool,
        route: impl FnOnce(u32) -> Route,
    ) -> Result<(ProcId, u32), Vec<Action>> {
        let refuse = |reason| vec![Action::ToClient(client, ProcessEvent::Refused { id, reason }.into())];
        let left = OUTPUT_BUDGET_BYTES.saturating_sub(self.output_in_use()).max(u64::from(MIN_WINDOW_BYTES));
        let state = self.clients.entry(client).or_default();
        if !self.accepting {
            return Err(refuse(Refusal::ShuttingDown));
        }
        if state.highest.is_some_and(|h| id <= h) {
            return Err(refuse(Refusal::IdNotIncreasing));
        }
        state.highest = Some(id);
        if output_window > MAX_WINDOW_BYTES || !valid {
            return Err(refuse(Refusal::Invalid));
        }
        if self.routes.len() >= MAX_PROCESSES {
            return Err(refuse(Refusal::TooManyProcesses));
        }
        // Within the budget: the window shrinks (the client credits only what it gets, so it need not know).
        let window = u32::try_from(u64::from(output_window).min(left)).unwrap_or(MIN_WINDOW_BYTES);
        let guest_id = ProcId(self.next_guest_id);
        self.next_guest_id = self.next_guest_id.saturating_add(1);
        state.procs.insert(id, guest_id);
        self.routes.insert(guest_id, route(window));
        Ok((guest_id, window))
    }
}
