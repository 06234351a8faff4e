//! The output credit of one process, shared by its stdout and stderr pumps: a [`Window`] the pumps block on.

use std::sync::{Condvar, Mutex, PoisonError};

use vm_protocol::{CreditError, Window};

/// Bytes the guest may still send for one process. Pumps block here when the host stops granting.
#[derive(Debug)]
pub(crate) struct Credit {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    window: Window,
    closed: bool,
}

impl Credit {
    pub(crate) fn new(initial: u32) -> Self {
        Self { state: Mutex::new(State { window: Window::new(initial), closed: false }), changed: Condvar::new() }
    }

    /// Blocks until some credit is available, then reserves up to `max` bytes of it. `None` once closed.
    pub(crate) fn reserve(&self, max: usize) -> Option<usize> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if state.closed {
                return None;
            }
            let n = state.take(max);
            if n > 0 {
                return Some(n);
            }
            state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Adds credit granted by the host.
    ///
    /// # Errors
    /// [`CreditError::TooLarge`] when the host grants past the window cap: a protocol violation.
    pub(crate) fn grant(&self, bytes: u32) -> Result<(), CreditError> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.window.grant(bytes)?;
        self.changed.notify_all();
        Ok(())
    }

    /// Returns credit reserved and not used.
    pub(crate) fn give_back(&self, bytes: usize) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        // Within what was reserved by construction, so within the capacity.
        let _ = state.window.grant(u32::try_from(bytes).unwrap_or(u32::MAX));
        self.changed.notify_all();
    }

    /// Wakes every blocked pump and makes it stop: used when the VM is going down.
    pub(crate) fn close(&self) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
        self.changed.notify_all();
    }
}

impl State {
    fn take(&mut self, max: usize) -> usize {
        let n = usize::try_from(self.window.available()).unwrap_or(usize::MAX).min(max);
        // Within what is available by construction.
        if self.window.consume(n).is_err() {
            return 0;
        }
        n
    }
}
