//! The single writer of frames towards the host. Every thread that sends holds the lock for exactly one
//! frame, so frames never interleave and the order of sends is the order on the wire.
//!
//! Output data is read straight into a frame buffer behind its prefix and written with the prefix in one
//! go: one copy out of the pipe and one into the channel, the same as `cat` would make. (Splicing pipe
//! pages into the port would save a copy, but virtio_console drops spliced data when the queue lacks free
//! descriptors, so it is not used.)

use std::fs::File;
use std::io::{self, Read, Write};
use std::sync::{Mutex, PoisonError};

use vm_protocol::frame::{self, MAX_DATA_BYTES, OUTPUT_PREFIX_BYTES};
use vm_protocol::{FrameError, ProcId, Stream, ToHost};

/// Serialized access to the channel's write half.
#[derive(Debug)]
pub(crate) struct Outbox {
    writer: Mutex<File>,
}

/// A reusable buffer for one output frame: prefix, then data. It grows to the largest chunk the stream has
/// needed, so a quiet process costs a few bytes and only a busy one holds up to [`MAX_DATA_BYTES`].
#[derive(Debug, Default)]
pub(crate) struct OutputFrame(Vec<u8>);

impl Outbox {
    pub(crate) fn new(writer: File) -> Self {
        Self { writer: Mutex::new(writer) }
    }

    /// Encodes `msg` into `scratch`, then writes it as one frame.
    pub(crate) fn send_with(&self, msg: &ToHost, scratch: &mut Vec<u8>) -> Result<(), FrameError> {
        scratch.clear();
        frame::encode(msg, scratch)?;
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.write_all(scratch).map_err(FrameError::Io)
    }

    /// Sends a small control message.
    pub(crate) fn send(&self, msg: &ToHost) -> Result<(), FrameError> {
        self.send_with(msg, &mut Vec::new())
    }

    /// Reads exactly `len` bytes (at most [`MAX_DATA_BYTES`]) from `src` and sends them as one `Output`
    /// frame. The caller guarantees `len` bytes are waiting in `src` and that nobody else reads it.
    pub(crate) fn send_output(
        &self,
        id: ProcId,
        stream: Stream,
        mut src: impl Read,
        len: usize,
        frame: &mut OutputFrame,
    ) -> io::Result<()> {
        let len = len.min(MAX_DATA_BYTES);
        if frame.0.len() < OUTPUT_PREFIX_BYTES + len {
            frame.0.resize(OUTPUT_PREFIX_BYTES + len, 0);
        }
        let buf = &mut frame.0[..OUTPUT_PREFIX_BYTES + len];
        buf[..OUTPUT_PREFIX_BYTES].copy_from_slice(&frame::output_prefix(id, stream, len));
        src.read_exact(&mut buf[OUTPUT_PREFIX_BYTES..])?;
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.write_all(buf)
    }
}
