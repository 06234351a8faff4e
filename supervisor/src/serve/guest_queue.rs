//! The guest link's queue as the event loop sends on it: every message the boundary sends the guest waits,
//! in order, for room in the link writer's queue (which the egress tasks share), behind a bounded backlog.
//!
//! What waits is credit-bound (stdin, port forwards' data) or small and few per act (a `Close` per refused
//! stream, a spawn per admitted exec); only a guest that stops reading its link while a client floods it with
//! signals or resizes, or opens streams without end, gets past [`BACKLOG_ITEMS`]: then messages are dropped
//! and the reporter told.

use std::collections::VecDeque;

use tokio::sync::mpsc::{self, error::TrySendError};
use vm_protocol::link::ToGuest;

use crate::boot::guest_link::Queued;

/// Messages waiting for room in the link writer's queue.
pub const BACKLOG_ITEMS: usize = 8192;

/// The loop's end of the guest link.
#[derive(Debug)]
pub(super) struct GuestQueue {
    tx: mpsc::Sender<Queued>,
    backlog: VecDeque<ToGuest>,
}

impl GuestQueue {
    pub(super) fn new(tx: mpsc::Sender<Queued>) -> Self {
        Self { tx, backlog: VecDeque::new() }
    }

    /// Sends `msg` behind what waits; gives it back when the backlog is full (it is dropped).
    pub(super) fn push(&mut self, msg: ToGuest) -> Option<ToGuest> {
        if !self.backlog.is_empty() {
            if self.backlog.len() >= BACKLOG_ITEMS {
                return Some(msg);
            }
            self.backlog.push_back(msg);
            return None;
        }
        match self.tx.try_send(msg.into()) {
            Err(TrySendError::Full(queued)) => self.backlog.push_back(queued.msg),
            Ok(()) | Err(TrySendError::Closed(_)) => {}
        }
        None
    }

    /// Sends `msg` ahead of what waits, if there is room now (a stop's shutdown: its deadline covers a guest
    /// that does not read).
    pub(super) fn push_first(&mut self, msg: ToGuest) {
        let _ = self.tx.try_send(msg.into());
    }

    /// Whether messages wait for room.
    pub(super) fn waiting(&self) -> bool {
        !self.backlog.is_empty()
    }

    /// Room came in the writer's queue: the backlog goes, as much as fits.
    pub(super) fn flush(&mut self, permit: mpsc::Permit<'_, Queued>) {
        let Some(first) = self.backlog.pop_front() else { return };
        permit.send(first.into());
        while let Some(msg) = self.backlog.pop_front() {
            match self.tx.try_send(msg.into()) {
                Ok(()) => {}
                Err(TrySendError::Full(queued)) => {
                    self.backlog.push_front(queued.msg);
                    return;
                }
                Err(TrySendError::Closed(_)) => {
                    self.backlog.clear();
                    return;
                }
            }
        }
    }
}
