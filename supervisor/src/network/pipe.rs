//! The state one egress stream shares between the event loop (which hands it the guest's messages) and its
//! task (which talks to the destination). Both windows live here, so the loop can catch a guest that sends
//! past its credit, and the task returns credit only for bytes it has passed on.

use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;
use vm_protocol::policy::network::NetRule;
use vm_protocol::{CreditError, Window};

/// Why a stream is being torn down from outside its task (fixed text, for the close event).
pub type AbortReason = &'static str;

/// One egress stream's shared state.
#[derive(Debug)]
pub struct Pipe {
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Debug)]
struct State {
    /// Guest bytes not yet taken by the task: never more than the receive window.
    inbound: Vec<u8>,
    /// What the guest may still send.
    recv: Window,
    /// What we may still send the guest.
    send: Window,
    guest_eof: bool,
    /// The guest closed the stream, or the loop aborted it.
    ended: Option<End>,
    /// The rule that let it go (its host, ports and `allowed_ips`), once the task decided.
    decided: Option<NetRule>,
}

/// How a stream was ended from outside its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The guest sent `Close`.
    GuestClosed,
    /// The loop tore it down (policy revoked, sandbox stopping).
    Aborted(AbortReason),
}

/// What the task finds when it looks for guest bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum Inbound {
    /// Some bytes (taken out of the pipe).
    Bytes(Vec<u8>),
    /// The guest closed its direction, and everything before it was taken.
    Eof,
    /// The stream ended from outside.
    Ended(End),
}

impl Pipe {
    /// A stream whose guest granted `send_window` and which grants the guest `recv_window`.
    pub fn new(recv_window: u32, send_window: u32) -> Self {
        let state = State {
            inbound: Vec::new(),
            recv: Window::new(recv_window),
            send: Window::new(send_window),
            guest_eof: false,
            ended: None,
            decided: None,
        };
        Self { state: Mutex::new(state), changed: Notify::new() }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn changed(&self, state: MutexGuard<'_, State>) {
        drop(state);
        self.changed.notify_waiters();
    }

    /// Waits until `ready` gives a value, asking it again after every change (registered before the state is
    /// looked at, so no change between the look and the wait is missed).
    async fn until<T>(&self, mut ready: impl FnMut(&mut State) -> Option<T>) -> T {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(value) = ready(&mut self.state()) {
                return value;
            }
            notified.await;
        }
    }

    /// Guest bytes, within the credit it was granted.
    ///
    /// # Errors
    /// The guest sent past its window.
    pub fn push(&self, data: &[u8]) -> Result<(), CreditError> {
        let mut state = self.state();
        state.recv.consume(data.len())?;
        state.inbound.extend_from_slice(data);
        self.changed(state);
        Ok(())
    }

    /// The guest's `Eof`; `false` if it already sent one.
    pub fn guest_eof(&self) -> bool {
        let mut state = self.state();
        let first = !state.guest_eof;
        state.guest_eof = true;
        self.changed(state);
        first
    }

    /// Whether the guest already closed its direction.
    pub fn guest_done(&self) -> bool {
        self.state().guest_eof
    }

    /// Credit from the guest for bytes we sent.
    ///
    /// # Errors
    /// It granted more than was sent.
    pub fn grant(&self, bytes: u32) -> Result<(), CreditError> {
        let mut state = self.state();
        state.send.grant(bytes)?;
        self.changed(state);
        Ok(())
    }

    /// Ends the stream from outside; the first end counts.
    pub fn end(&self, end: End) {
        let mut state = self.state();
        state.ended.get_or_insert(end);
        self.changed(state);
    }

    /// What the guest may still send (for the tombstone the loop keeps after the stream is gone).
    pub fn guest_allowance(&self) -> u64 {
        self.state().recv.available()
    }

    /// A copy of the guest bytes waiting, to read a request from without taking them.
    pub fn peek(&self) -> (Vec<u8>, bool) {
        let state = self.state();
        (state.inbound.clone(), state.guest_eof)
    }

    /// Waits until something changes (bytes, credit, an end); call [`Pipe::peek`] again after.
    pub async fn wait_change(&self, seen: usize) {
        let notified = self.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let state = self.state();
            if state.inbound.len() != seen || state.guest_eof || state.ended.is_some() {
                return;
            }
        }
        notified.await;
    }

    /// Records the rule that let the stream go, for a policy update's re-check.
    pub fn decide(&self, rule: &NetRule) {
        self.state().decided = Some(rule.clone());
    }

    /// The rule that let the stream go, once decided.
    pub fn decided(&self) -> Option<NetRule> {
        self.state().decided.clone()
    }

    /// Resolves once the stream is ended from outside.
    pub async fn wait_ended(&self) -> End {
        self.until(|state| state.ended).await
    }

    /// The end from outside, if any.
    pub fn ended(&self) -> Option<End> {
        self.state().ended
    }

    /// Drops the first `n` waiting bytes (a request that was read) and returns their credit to the window;
    /// the caller sends the guest the `Credit`.
    pub fn discard(&self, n: usize) -> usize {
        let mut state = self.state();
        let n = n.min(state.inbound.len());
        state.inbound.drain(..n);
        let _ = state.recv.grant(u32::try_from(n).unwrap_or(u32::MAX));
        n
    }

    /// Waits for guest bytes (at most `max`), the guest's EOF, or an end. Taking bytes does not return
    /// their credit: [`Pipe::credit_back`] does, once they are written on.
    pub async fn take(&self, max: usize) -> Inbound {
        self.until(|state| {
            if let Some(end) = state.ended {
                return Some(Inbound::Ended(end));
            }
            if !state.inbound.is_empty() {
                let n = max.min(state.inbound.len());
                return Some(Inbound::Bytes(state.inbound.drain(..n).collect()));
            }
            state.guest_eof.then_some(Inbound::Eof)
        })
        .await
    }

    /// Returns the credit of `n` bytes that were passed on.
    pub fn credit_back(&self, n: usize) {
        let mut state = self.state();
        // At most what was consumed, so within the capacity.
        let _ = state.recv.grant(u32::try_from(n).unwrap_or(u32::MAX));
    }

    /// Waits for credit to send the guest up to `max` bytes and reserves it; `Err` once the stream ended.
    pub async fn reserve(&self, max: usize) -> Result<usize, End> {
        self.until(|state| {
            if let Some(end) = state.ended {
                return Some(Err(end));
            }
            let n = usize::try_from(state.send.available()).unwrap_or(usize::MAX).min(max);
            (n > 0 && state.send.consume(n).is_ok()).then_some(Ok(n))
        })
        .await
    }

    /// Gives back reserved credit that was not used.
    pub fn unreserve(&self, n: usize) {
        let mut state = self.state();
        let _ = state.send.grant(u32::try_from(n).unwrap_or(u32::MAX));
        self.changed(state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_flow_within_the_windows() {
        let pipe = Pipe::new(4, 3);
        pipe.push(b"ab").unwrap();
        assert!(pipe.push(b"cde").is_err(), "past the receive window");
        assert_eq!(pipe.take(1).await, Inbound::Bytes(b"a".to_vec()));
        pipe.push(b"cd").unwrap();
        assert!(pipe.push(b"e").is_err(), "credit comes back only when passed on");
        pipe.credit_back(1);
        pipe.push(b"e").unwrap();
        assert_eq!(pipe.reserve(5).await, Ok(3));
        assert!(pipe.grant(4).is_err(), "more than was sent");
        pipe.grant(3).unwrap();
        assert!(pipe.guest_eof() && !pipe.guest_eof());
        assert_eq!(pipe.take(10).await, Inbound::Bytes(b"bcde".to_vec()));
        assert_eq!(pipe.take(10).await, Inbound::Eof);
        pipe.end(End::Aborted("test"));
        assert_eq!(pipe.reserve(1).await, Err(End::Aborted("test")));
    }
}
