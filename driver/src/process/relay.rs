//! The flow-control state of one process, as the host sees it: stdin goes out only within the credit the
//! guest granted, EOF is sent once the buffered stdin is out, and output credit goes back in batches once the
//! output was handed on. The process session ([`super::ProcessSession`]) is its one user.

use std::collections::VecDeque;

use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::{CreditError, ProcId, ProcessRequest, Window};

/// The output window every process is spawned with.
pub const OUTPUT_WINDOW: u32 = DEFAULT_WINDOW_BYTES;

/// Output credit goes back once this much was handed on (or a quarter of a smaller window): a quarter of the
/// window keeps the guest streaming while the credit travels back, with one small frame per batch instead of
/// one per chunk.
pub const CREDIT_BATCH_BYTES: u64 = OUTPUT_WINDOW as u64 / 4;

/// Stdin taken from the local side before it stops being read (the guest's credit drains it).
pub const STDIN_BUFFER_BYTES: usize = 2 * MAX_DATA_BYTES;

/// The local side broke the stdin rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RelayError {
    /// Stdin after its EOF.
    #[error("stdin after stdin EOF")]
    StdinAfterEof,
    /// The guest granted credit past the window cap.
    #[error("the guest granted stdin credit past the window limit")]
    Credit(#[from] CreditError),
}

/// Flow-control state of one process.
#[derive(Debug)]
pub struct ProcessRelay {
    id: ProcId,
    pending: VecDeque<u8>,
    credit: Window,
    started: bool,
    eof_requested: bool,
    eof_sent: bool,
    uncredited: u64,
    /// Output credit goes back once this much was handed on: a quarter of the output window in force.
    batch: u64,
}

impl ProcessRelay {
    /// A process known on the connection as `id`, not started yet.
    pub fn new(id: ProcId) -> Self {
        Self {
            id,
            pending: VecDeque::new(),
            credit: Window::new(0),
            started: false,
            eof_requested: false,
            eof_sent: false,
            uncredited: 0,
            batch: CREDIT_BATCH_BYTES,
        }
    }

    /// The process's id on the connection.
    pub fn id(&self) -> ProcId {
        self.id
    }

    /// `Started`: the guest's initial stdin credit, and the output window in force (the supervisor may have
    /// made it smaller than asked, so the credit batches follow it).
    pub fn started(&mut self, stdin_window: u32, output_window: u32) {
        self.started = true;
        self.credit = Window::new(stdin_window);
        self.batch = (u64::from(output_window) / 4).clamp(1, CREDIT_BATCH_BYTES);
    }

    /// `StdinCredit`.
    ///
    /// # Errors
    /// [`RelayError::Credit`] when the grant would pass the window cap.
    pub fn stdin_credit(&mut self, bytes: u32) -> Result<(), RelayError> {
        Ok(self.credit.grant(bytes)?)
    }

    /// Stdin from the local side.
    ///
    /// # Errors
    /// [`RelayError::StdinAfterEof`].
    pub fn push_stdin(&mut self, bytes: &[u8]) -> Result<(), RelayError> {
        if self.eof_requested {
            return Err(RelayError::StdinAfterEof);
        }
        self.pending.extend(bytes);
        Ok(())
    }

    /// The local side's stdin ended; EOF follows the bytes still buffered.
    pub fn stdin_eof(&mut self) {
        self.eof_requested = true;
    }

    /// The next stdin frame the credit allows: data first, then `StdinEof` once everything is out.
    pub fn next_stdin(&mut self) -> Option<ProcessRequest> {
        if !self.started {
            return None;
        }
        let credit = usize::try_from(self.credit.available()).unwrap_or(usize::MAX);
        let n = self.pending.len().min(MAX_DATA_BYTES).min(credit);
        if n > 0 {
            self.credit.consume(n).ok()?;
            let data: Vec<u8> = self.pending.drain(..n).collect();
            return Some(ProcessRequest::Stdin { id: self.id, data: data.into() });
        }
        if self.eof_requested && self.pending.is_empty() && !self.eof_sent {
            self.eof_sent = true;
            return Some(ProcessRequest::StdinEof { id: self.id });
        }
        None
    }

    /// The process ended and everything it wrote was handed on: the credit for the rest of the batch, which
    /// tells the supervisor the output was delivered (it keeps undelivered output for a re-attach).
    pub fn finish(&mut self) -> Option<ProcessRequest> {
        let bytes = u32::try_from(std::mem::take(&mut self.uncredited)).unwrap_or(u32::MAX);
        (bytes > 0).then_some(ProcessRequest::Credit { id: self.id, bytes })
    }

    /// `bytes` of output were handed on, to be credited only by [`ProcessRelay::finish`].
    pub fn output_held(&mut self, bytes: usize) {
        self.uncredited += bytes as u64;
    }

    /// Whether the stdin buffer is full: the local side is not read until the guest's credit drains it.
    pub fn stdin_full(&self) -> bool {
        self.pending.len() >= STDIN_BUFFER_BYTES
    }

    /// `bytes` of output were handed on; the credit to return, once a batch is complete.
    pub fn output_handed_on(&mut self, bytes: usize) -> Option<ProcessRequest> {
        self.uncredited += bytes as u64;
        if self.uncredited < self.batch {
            return None;
        }
        let bytes = u32::try_from(self.uncredited).unwrap_or(u32::MAX);
        self.uncredited -= u64::from(bytes);
        Some(ProcessRequest::Credit { id: self.id, bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(relay: &mut ProcessRelay) -> Vec<ProcessRequest> {
        std::iter::from_fn(|| relay.next_stdin()).collect()
    }

    #[test]
    fn stdin_waits_for_start_and_credit_and_eof_follows_the_data() {
        let mut r = ProcessRelay::new(ProcId(1));
        r.push_stdin(b"hello").unwrap();
        r.stdin_eof();
        assert!(drain(&mut r).is_empty(), "nothing before Started");
        r.started(3, OUTPUT_WINDOW);
        assert_eq!(drain(&mut r), [ProcessRequest::Stdin { id: ProcId(1), data: b"hel".to_vec().into() }]);
        r.stdin_credit(3).unwrap();
        assert_eq!(
            drain(&mut r),
            [
                ProcessRequest::Stdin { id: ProcId(1), data: b"lo".to_vec().into() },
                ProcessRequest::StdinEof { id: ProcId(1) }
            ]
        );
        assert_eq!(r.push_stdin(b"late"), Err(RelayError::StdinAfterEof));
        assert!(drain(&mut r).is_empty(), "EOF once");
    }

    #[test]
    fn output_credit_goes_back_in_batches() {
        let mut r = ProcessRelay::new(ProcId(2));
        let chunk = usize::try_from(CREDIT_BATCH_BYTES / 2).unwrap();
        assert_eq!(r.output_handed_on(chunk), None);
        let credit = r.output_handed_on(chunk + 1);
        assert_eq!(
            credit,
            Some(ProcessRequest::Credit { id: ProcId(2), bytes: u32::try_from(2 * chunk + 1).unwrap() })
        );
        assert_eq!(r.output_handed_on(5), None);
        assert_eq!(r.finish(), Some(ProcessRequest::Credit { id: ProcId(2), bytes: 5 }), "the rest at the end");
        assert_eq!(r.finish(), None);
    }

    #[test]
    fn stdin_is_bounded_and_credit_capped() {
        let mut r = ProcessRelay::new(ProcId(3));
        r.push_stdin(&vec![0; STDIN_BUFFER_BYTES]).unwrap();
        assert!(r.stdin_full());
        r.started(4, OUTPUT_WINDOW);
        assert!(matches!(r.stdin_credit(1), Err(RelayError::Credit(_))), "credit for bytes never sent");
        assert!(r.next_stdin().is_some());
        r.stdin_credit(4).unwrap();
    }
}
