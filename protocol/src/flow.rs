//! Credit windows: the flow control that keeps either side from buffering without bound.
//!
//! The receiver of a byte stream grants credit; the sender may have at most that many bytes outstanding.
//! Output: the host grants `Spawn::output_window` and then `Credit` as it hands bytes on. Stdin: the guest
//! grants `Started::stdin_window` and then `StdinCredit` as it writes bytes into the process.
//!
//! Both ends keep a [`Window`]: the sender to know how much it may send, the receiver to catch a peer that
//! sends more than it was granted (a protocol violation, never silently buffered). A window's capacity is its
//! initial size: credit only ever returns bytes that were sent, so a grant that would take the window past its
//! capacity is a violation too. Initial windows are at most [`MAX_WINDOW_BYTES`].

/// Default window per process and direction. Large enough to keep the channel busy across one credit round
/// trip, small enough that a hundred stalled processes cost little memory.
pub const DEFAULT_WINDOW_BYTES: u32 = 4 * 1024 * 1024;

/// Largest initial window a peer may ask for; more is a protocol violation.
pub const MAX_WINDOW_BYTES: u32 = 16 * 1024 * 1024;

/// Credit that may still be used, within a fixed capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    available: u64,
    capacity: u64,
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
    /// It granted credit past the window's capacity (more than was ever sent).
    #[error("peer granted credit past the window's capacity of {capacity} bytes")]
    TooLarge {
        /// The window's capacity.
        capacity: u64,
    },
}

impl Window {
    /// A full window of `capacity` bytes.
    pub fn new(capacity: u32) -> Self {
        Self { available: u64::from(capacity), capacity: u64::from(capacity) }
    }

    /// Credit left, in bytes.
    pub fn available(&self) -> u64 {
        self.available
    }

    /// Bytes sent and not yet credited back.
    pub fn outstanding(&self) -> u64 {
        self.capacity - self.available
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

    /// Returns `bytes` of credit.
    ///
    /// # Errors
    /// [`CreditError::TooLarge`] if that would pass the capacity; the window is unchanged.
    pub fn grant(&mut self, bytes: u32) -> Result<(), CreditError> {
        let next = self.available + u64::from(bytes);
        if next > self.capacity {
            return Err(CreditError::TooLarge { capacity: self.capacity });
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
        assert_eq!((w.available(), w.outstanding()), (5, 5));
    }

    #[test]
    fn credit_never_passes_the_capacity() {
        let mut w = Window::new(8);
        assert_eq!(w.grant(1), Err(CreditError::TooLarge { capacity: 8 }), "nothing was sent");
        w.consume(3).unwrap();
        w.grant(3).unwrap();
        assert_eq!(w.grant(1), Err(CreditError::TooLarge { capacity: 8 }));
        assert_eq!(w.available(), 8);
    }
}
