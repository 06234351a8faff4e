//! Credit windows: the flow control that keeps either side from buffering without bound.
//!
//! The receiver of a byte stream grants credit; the sender may have at most that many bytes outstanding.
//! Output: the host grants `Spawn::output_window` and then `Credit` as it hands bytes on. Stdin: the guest
//! grants `Started::stdin_window` and then `StdinCredit` as it writes bytes into the process.
//!
//! Both ends keep a [`Window`]: the sender to know how much it may send, the receiver to catch a peer that
//! sends more than it was granted (a protocol violation, never silently buffered).

/// Default window per process and direction. Large enough to keep the channel busy across one credit round
/// trip, small enough that a hundred stalled processes cost little memory.
pub const DEFAULT_WINDOW_BYTES: u32 = 4 * 1024 * 1024;

/// Largest window a peer may build up by granting credit; more is a protocol violation.
pub const MAX_WINDOW_BYTES: u64 = 64 * 1024 * 1024;

/// Credit that may still be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    available: u64,
}

/// A peer broke the credit rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CreditError {
    /// It sent more than it had credit for.
    #[error("peer sent {sent} bytes with only {available} bytes of credit")]
    Overrun {
        /// Bytes in the offending message.
        sent: u64,
        /// Credit left before it.
        available: u64,
    },
    /// It granted credit beyond [`MAX_WINDOW_BYTES`].
    #[error("peer granted credit beyond the {MAX_WINDOW_BYTES}-byte window limit")]
    TooLarge,
}

impl Window {
    /// A window with `initial` bytes of credit.
    pub fn new(initial: u32) -> Self {
        Self { available: u64::from(initial) }
    }

    /// Credit left, in bytes.
    pub fn available(&self) -> u64 {
        self.available
    }

    /// Uses `bytes` of credit.
    ///
    /// # Errors
    /// [`CreditError::Overrun`] if fewer than `bytes` remain; the window is unchanged.
    pub fn consume(&mut self, bytes: usize) -> Result<(), CreditError> {
        let sent = bytes as u64;
        if sent > self.available {
            return Err(CreditError::Overrun { sent, available: self.available });
        }
        self.available -= sent;
        Ok(())
    }

    /// Adds `bytes` of credit.
    ///
    /// # Errors
    /// [`CreditError::TooLarge`] if the window would exceed [`MAX_WINDOW_BYTES`]; the window is unchanged.
    pub fn grant(&mut self, bytes: u32) -> Result<(), CreditError> {
        let next = self.available + u64::from(bytes);
        if next > MAX_WINDOW_BYTES {
            return Err(CreditError::TooLarge);
        }
        self.available = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consume_within_credit_then_overrun() {
        let mut w = Window::new(10);
        w.consume(4).unwrap();
        w.consume(6).unwrap();
        assert_eq!(w.consume(1), Err(CreditError::Overrun { sent: 1, available: 0 }));
        w.grant(5).unwrap();
        assert_eq!(w.available(), 5);
    }

    #[test]
    fn refuses_unbounded_grants() {
        let mut w = Window::new(0);
        let step = 16 * 1024 * 1024;
        let mut granted = 0u64;
        while granted + u64::from(step) <= MAX_WINDOW_BYTES {
            w.grant(step).unwrap();
            granted += u64::from(step);
        }
        assert_eq!(w.grant(step), Err(CreditError::TooLarge));
        assert_eq!(w.available(), granted);
    }
}
