//! The output credit of one process, shared by its stdout and stderr pumps.

use std::sync::{Condvar, Mutex, PoisonError};

/// Bytes the guest may still send for one process. Pumps block here when the host stops granting.
#[derive(Debug, Default)]
pub(crate) struct Credit {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    available: u64,
    closed: bool,
}

impl Credit {
    pub(crate) fn new(initial: u32) -> Self {
        Self { state: Mutex::new(State { available: u64::from(initial), closed: false }), changed: Condvar::new() }
    }

    /// Blocks until some credit is available, then reserves up to `max` bytes of it. `None` once closed.
    pub(crate) fn reserve(&self, max: usize) -> Option<usize> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if state.closed {
                return None;
            }
            if state.available > 0 {
                let n = usize::try_from(state.available).unwrap_or(usize::MAX).min(max);
                state.available -= n as u64;
                return Some(n);
            }
            state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Takes up to `max` bytes of credit without waiting; 0 when none is left or the credit is closed.
    pub(crate) fn try_reserve(&self, max: usize) -> usize {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.closed {
            return 0;
        }
        let n = usize::try_from(state.available).unwrap_or(usize::MAX).min(max);
        state.available -= n as u64;
        n
    }

    /// Adds credit granted by the host.
    pub(crate) fn grant(&self, bytes: u32) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.available = state.available.saturating_add(u64::from(bytes));
        self.changed.notify_all();
    }

    /// Wakes every blocked pump and makes it stop: used when the VM is going down.
    pub(crate) fn close(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
        self.changed.notify_all();
    }
}
