//! The single writer of frames towards the host. Every thread that sends holds the lock for exactly one
//! frame, so frames never interleave and the order of sends is the order on the wire.
//!
//! Output of piped processes is spliced, from 32 KiB a chunk: the pump moves the waiting bytes' pipe pages
//! into a staging pipe of its own (`splice`, no copy), writes the frame prefix, and splices the staging pipe
//! into the channel, where `virtio_console` hands the pages to the host as they are. Under emulation every
//! guest copy is expensive, and this path has none; reading into a buffer and writing it makes two.
//!
//! `virtio_console`'s `splice_write` (guest kernel 6.1) has a trap, shown by the experiment in
//! `tests/experiments/splice-into-port`: it sizes and terminates its scatterlist by the number of buffers in
//! the source pipe, but fills only the entries for the bytes it takes. A splice that leaves anything in the
//! pipe queues zero-length (and, with indirect descriptors, out-of-bounds) descriptors; QEMU then marks the
//! device broken and nothing more arrives. So the staging pipe holds exactly one frame's data and nothing
//! else, and every splice out of it asks for all of it. (The driver also drops the bytes, and returns 0,
//! when the queue lacks descriptors for them; with indirect descriptors, which QEMU offers, one frame needs
//! one descriptor and the driver waits for a free one first, so that takes a failed atomic allocation. A 0
//! here is reported as lost bytes, never retried as if nothing had gone.)
//!
//! PTY output, and a channel that cannot splice, go the copying way: read into a frame buffer behind its
//! prefix, written with the prefix in one go.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use rustix::io::{ioctl_fionread, Errno};
use rustix::pipe::{fcntl_setpipe_size, pipe_with, splice, PipeFlags, SpliceFlags};
use vm_protocol::frame::{self, MAX_DATA_BYTES, OUTPUT_PREFIX_BYTES};
use vm_protocol::link::ToHost;
use vm_protocol::{FrameError, ProcId, Stream};

/// Serialized access to the channel's write half.
#[derive(Debug)]
pub(crate) struct Outbox {
    writer: Mutex<File>,
    /// Cleared the first time the channel refuses a splice (a kernel without `splice_write` for it).
    splices: AtomicBool,
}

/// A reusable buffer for one output frame: prefix, then data. It grows to the largest chunk the stream has
/// needed, so a quiet process costs a few bytes and only a busy one holds up to [`MAX_DATA_BYTES`].
#[derive(Debug, Default)]
pub(crate) struct OutputFrame(Vec<u8>);

/// One stream's staging pipe: empty between frames, exactly one frame's data during one.
#[derive(Debug)]
pub(crate) struct Staging {
    read: OwnedFd,
    write: OwnedFd,
}

impl Staging {
    /// A staging pipe as large as a frame's data, where the kernel allows it. A smaller one still works: a
    /// frame then carries what fits.
    pub(crate) fn new() -> io::Result<Self> {
        let (read, write) = pipe_with(PipeFlags::CLOEXEC)?;
        let _ = fcntl_setpipe_size(&write, MAX_DATA_BYTES);
        Ok(Self { read, write })
    }
}

impl Outbox {
    pub(crate) fn new(writer: File) -> Self {
        Self { writer: Mutex::new(writer), splices: AtomicBool::new(true) }
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

    /// Whether output may be spliced into the channel.
    pub(crate) fn splices(&self) -> bool {
        self.splices.load(Ordering::Relaxed)
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

    /// Moves up to `len` bytes (at most [`MAX_DATA_BYTES`]) waiting in the pipe `src` through `staging` into
    /// the channel as one `Output` frame, without copying them. Returns how many went: fewer than `len` when
    /// the staging pipe ran out of slots (the rest stays in `src`). The caller guarantees `len` bytes are
    /// waiting in `src` and that nobody else reads it.
    ///
    /// After an error the staging pipe may hold bytes: the stream must not send again.
    pub(crate) fn splice_output(
        &self,
        id: ProcId,
        stream: Stream,
        src: impl AsFd,
        len: usize,
        staging: &Staging,
        frame: &mut OutputFrame,
    ) -> io::Result<usize> {
        let len = len.min(MAX_DATA_BYTES);
        // The data first, so the prefix can announce exactly what is staged. The staging pipe is empty, so
        // the first splice moves something; after that, a full staging pipe ends the frame.
        let mut staged = 0;
        while staged < len {
            let flags = if staged == 0 { SpliceFlags::empty() } else { SpliceFlags::NONBLOCK };
            match splice(&src, None, &staging.write, None, len - staged, flags) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => staged += n,
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) if staged > 0 => break,
                Err(e) => return Err(e.into()),
            }
        }
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        writer.write_all(&frame::output_prefix(id, stream, staged))?;
        // Every splice asks for everything staged (see the module's note on `virtio_console`).
        let mut left = staged;
        let sent = self.splice_staged(&mut writer, staging, staged, &mut left, frame);
        if sent.is_err() && left > 0 {
            // The prefix announced `staged` bytes: zeros stand in for the ones that did not go, so the frames
            // after this one stay in step. The stream ends on the error and the guest log says why.
            if frame.0.len() < left {
                frame.0.resize(left, 0);
            }
            frame.0[..left].fill(0);
            writer.write_all(&frame.0[..left])?;
        }
        sent?;
        Ok(staged)
    }

    /// Splices the staging pipe's `staged` bytes into the channel, counting down `left`.
    fn splice_staged(
        &self,
        writer: &mut File,
        staging: &Staging,
        staged: usize,
        left: &mut usize,
        frame: &mut OutputFrame,
    ) -> io::Result<()> {
        while *left > 0 {
            match splice(&staging.read, None, &*writer, None, *left, SpliceFlags::empty()) {
                Ok(0) => {
                    let kept = ioctl_fionread(&staging.read).unwrap_or(0);
                    return Err(io::Error::other(format!(
                        "the channel took {} spliced bytes and sent none ({kept} still staged)",
                        *left
                    )));
                }
                Ok(n) => *left -= n,
                Err(Errno::INTR) => {}
                Err(Errno::INVAL) if *left == staged => {
                    // This channel cannot splice: copy this frame's data out of the staging pipe, and copy
                    // from now on.
                    self.splices.store(false, Ordering::Relaxed);
                    if frame.0.len() < staged {
                        frame.0.resize(staged, 0);
                    }
                    (&File::from(staging.read.try_clone()?)).read_exact(&mut frame.0[..staged])?;
                    writer.write_all(&frame.0[..staged])?;
                    *left = 0;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
