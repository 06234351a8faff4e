//! The single writer of frames towards the host. Every thread that sends holds the lock for exactly one
//! frame, so frames never interleave and the order of sends is the order on the wire.

use std::io::Write;
use std::sync::{Mutex, PoisonError};

use vm_protocol::{frame, FrameError, ToHost};

/// Serialized access to the channel's write half.
pub(crate) struct Outbox {
    writer: Mutex<Box<dyn Write + Send>>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").finish_non_exhaustive()
    }
}

impl Outbox {
    pub(crate) fn new(writer: Box<dyn Write + Send>) -> Self {
        Self {
            writer: Mutex::new(writer),
        }
    }

    /// Encodes `msg` into `scratch`, then writes it as one frame.
    pub(crate) fn send_with(&self, msg: &ToHost, scratch: &mut Vec<u8>) -> Result<(), FrameError> {
        scratch.clear();
        frame::encode(msg, scratch)?;
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.write_all(scratch).map_err(FrameError::Io)?;
        writer.flush().map_err(FrameError::Io)
    }

    /// Sends a small control message.
    pub(crate) fn send(&self, msg: &ToHost) -> Result<(), FrameError> {
        self.send_with(msg, &mut Vec::new())
    }
}
