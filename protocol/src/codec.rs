//! Async framing for tokio users (supervisor, driver): a `tokio_util` codec over [`crate::frame`], and the
//! two halves of the handshake.

use std::marker::PhantomData;

use bytes::{Buf, BufMut, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio_util::codec::{Decoder, Encoder};

use crate::frame::{self, FrameError, HEADER_BYTES, OUTPUT_ENVELOPE_BYTES};
use crate::handshake::{self, FirstFrameError, HelloFrame};
use crate::message::ProcessEvent;
use crate::{Capabilities, Hello};

/// Reads one frame's body.
///
/// # Errors
/// [`FrameError::Truncated`] on EOF, or a header or I/O error.
pub async fn read_body<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    reader.read_exact(&mut header).await.map_err(eof_is_truncation)?;
    let mut body = vec![0u8; frame::body_len(header)?];
    reader.read_exact(&mut body).await.map_err(eof_is_truncation)?;
    Ok(body)
}

/// Writes one frame and flushes.
///
/// # Errors
/// [`FrameError::Encode`] or [`FrameError::Io`].
pub async fn write_frame<W: AsyncWrite + Unpin, M: Serialize>(writer: &mut W, msg: &M) -> Result<(), FrameError> {
    let mut buf = Vec::new();
    frame::encode(msg, &mut buf)?;
    writer.write_all(&buf).await?;
    writer.flush().await?;
    Ok(())
}

fn eof_is_truncation(e: std::io::Error) -> FrameError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        FrameError::Truncated
    } else {
        FrameError::Io(e)
    }
}

/// The host's half of the handshake (the supervisor on the guest link, a client on the attach socket): read
/// the peer's hello, answer with ours (even on a mismatch, so the peer can report it too), then check theirs.
///
/// # Errors
/// [`FirstFrameError`] for a bad first frame or a mismatch.
pub async fn host_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ours: Hello,
    required: Capabilities,
) -> Result<Hello, FirstFrameError> {
    let body = read_body(stream).await?;
    write_frame(stream, &HelloFrame(&ours)).await?;
    handshake::accept_first(&body, required)
}

/// The guest's half (the supervisor plays it on the attach socket): send our hello, then read and check
/// the host's.
///
/// # Errors
/// [`FirstFrameError`] for a bad first frame or a mismatch.
pub async fn guest_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ours: Hello,
    required: Capabilities,
) -> Result<Hello, FirstFrameError> {
    write_frame(stream, &HelloFrame(&ours)).await?;
    let body = read_body(stream).await?;
    handshake::accept_first(&body, required)
}

/// Decodes `In` frames and encodes `Out` frames.
#[derive(Debug)]
pub struct FrameCodec<In, Out> {
    _types: PhantomData<fn(Out) -> In>,
}

impl<In, Out> FrameCodec<In, Out> {
    /// A new codec.
    pub fn new() -> Self {
        Self { _types: PhantomData }
    }
}

impl<In, Out> Default for FrameCodec<In, Out> {
    fn default() -> Self {
        Self::new()
    }
}

impl<In: DeserializeOwned, Out> Decoder for FrameCodec<In, Out> {
    type Item = In;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<In>, FrameError> {
        let Some(header) = src.first_chunk::<HEADER_BYTES>() else {
            return Ok(None);
        };
        let len = frame::body_len(*header)?;
        if src.len() < HEADER_BYTES + len {
            // Reserve only what the (already bounded) frame needs.
            src.reserve(HEADER_BYTES + len - src.len());
            return Ok(None);
        }
        let msg = frame::decode_body(&src[HEADER_BYTES..HEADER_BYTES + len])?;
        src.advance(HEADER_BYTES + len);
        Ok(Some(msg))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<In>, FrameError> {
        match self.decode(src)? {
            Some(msg) => Ok(Some(msg)),
            None if src.is_empty() => Ok(None),
            None => Err(FrameError::Truncated),
        }
    }
}

impl<In, Out: Serialize> Encoder<Out> for FrameCodec<In, Out> {
    type Error = FrameError;

    fn encode(&mut self, item: Out, dst: &mut BytesMut) -> Result<(), FrameError> {
        let len = frame::body_size(&item)?;
        dst.reserve(HEADER_BYTES + len as usize);
        frame::encode_to(&item, dst.writer())
    }
}

/// Bytes a [`HostFrameReader`] buffers for small frames and prefixes.
const READ_BUFFER_BYTES: usize = 64 * 1024;

/// A body buffer larger than this is dropped after its frame, so one large control frame is not kept.
const KEPT_SCRATCH_BYTES: usize = 64 * 1024;

/// Reads frames towards a host (`link::ToHost` by default, or `attach::ToClient`) from a stream: the messages
/// and errors [`FrameCodec`] would give over `FramedRead`, without its growing read buffer. An `Output` frame's data is read straight into the buffer
/// the message keeps (one allocation of exactly its size; only what the read buffer already held is
/// copied); other bodies go through a small scratch buffer and the decoder. Memory: the read buffer, the scratch, and the message being read, whose size the
/// header bounds by [`frame::MAX_FRAME_BYTES`] before anything is allocated.
///
/// Not cancel-safe: a frame read half way is lost if `next` is dropped.
#[derive(Debug)]
pub struct HostFrameReader<R, M = crate::link::ToHost> {
    reader: BufReader<R>,
    scratch: Vec<u8>,
    _message: PhantomData<fn() -> M>,
}

impl<R: AsyncRead + Unpin, M: DeserializeOwned + From<ProcessEvent>> HostFrameReader<R, M> {
    /// A reader of `reader`'s frames.
    pub fn new(reader: R) -> Self {
        Self { reader: BufReader::with_capacity(READ_BUFFER_BYTES, reader), scratch: Vec::new(), _message: PhantomData }
    }

    /// The next message; `None` at a clean end of stream (on a frame boundary).
    ///
    /// # Errors
    /// As [`FrameCodec`]: [`FrameError::Truncated`] for an end inside a frame, a header or body error, or
    /// an I/O error. The stream is unusable after one.
    pub async fn next(&mut self) -> Option<Result<M, FrameError>> {
        self.read_frame().await.transpose()
    }

    async fn read_frame(&mut self) -> Result<Option<M>, FrameError> {
        let mut header = [0u8; HEADER_BYTES];
        let mut filled = 0;
        while filled < HEADER_BYTES {
            match self.reader.read(&mut header[filled..]).await? {
                0 if filled == 0 => return Ok(None),
                0 => return Err(FrameError::Truncated),
                n => filled += n,
            }
        }
        let len = frame::body_len(header)?;
        self.scratch.clear();
        if len >= OUTPUT_ENVELOPE_BYTES {
            let mut envelope = [0u8; OUTPUT_ENVELOPE_BYTES];
            self.reader.read_exact(&mut envelope).await.map_err(eof_is_truncation)?;
            if let Some((id, stream, data_len)) = frame::output_envelope(&envelope, len) {
                let mut data = vec![0u8; data_len];
                self.reader.read_exact(&mut data).await.map_err(eof_is_truncation)?;
                return Ok(Some(ProcessEvent::Output { id, stream, data: data.into() }.into()));
            }
            self.scratch.extend_from_slice(&envelope);
        }
        let start = self.scratch.len();
        self.scratch.resize(len, 0);
        self.reader.read_exact(&mut self.scratch[start..]).await.map_err(eof_is_truncation)?;
        let msg = frame::decode_body(&self.scratch);
        if self.scratch.capacity() > KEPT_SCRATCH_BYTES {
            self.scratch = Vec::new();
        }
        msg.map(Some)
    }
}

impl From<std::io::Error> for FrameError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::HandshakeError;

    #[tokio::test]
    async fn both_halves_agree_and_both_report_a_mismatch() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let guest = tokio::spawn(async move {
            guest_handshake(&mut b, Hello::ours(Capabilities::EXEC, "g"), Capabilities::NONE).await
        });
        let host = host_handshake(&mut a, Hello::ours(Capabilities::NONE, "h"), Capabilities::EXEC).await.unwrap();
        assert_eq!(host.software, "g");
        assert_eq!(guest.await.unwrap().unwrap().software, "h");

        let (mut a, mut b) = tokio::io::duplex(1024);
        let guest = tokio::spawn(async move {
            guest_handshake(&mut b, Hello::ours(Capabilities::NONE, "g"), Capabilities::NONE).await
        });
        let mut old = Hello::ours(Capabilities::NONE, "h");
        old.version = 0;
        let host = host_handshake(&mut a, old, Capabilities::EXEC).await;
        assert!(matches!(host, Err(FirstFrameError::Handshake(HandshakeError::MissingCapabilities { .. }))));
        assert!(matches!(
            guest.await.unwrap(),
            Err(FirstFrameError::Handshake(HandshakeError::VersionMismatch { theirs: 0, .. }))
        ));
    }
}
