//! Length-prefixed frames with a hard size limit.
//!
//! ```text
//! +-------------------------+----------------------------------+
//! | body length: u32, LE    | body: one bincode-encoded message |
//! +-------------------------+----------------------------------+
//! ```
//!
//! - The body length is `1..=MAX_FRAME_BYTES`. A longer length is refused from the four header bytes alone,
//!   before any buffer is grown, so a hostile peer cannot make us allocate.
//! - bincode runs with fixed-width little-endian integers, enum tags as `u32`, lengths as `u64`, a byte limit
//!   equal to the body length, and trailing bytes rejected.
//! - Enum tag 0 is reserved in every channel's message type, so an all-zero body never decodes to a message.
//!
//! Decoding never panics on any input; `protocol/tests/decoder_props.rs` holds that claim.

use std::io::{self, Read, Write};

use bincode::Options;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::process::{ProcId, Stream};

/// Bytes in the length prefix.
pub const HEADER_BYTES: usize = 4;

/// Largest frame body: a full [`MAX_DATA_BYTES`] chunk plus room for its envelope.
pub const MAX_FRAME_BYTES: usize = MAX_DATA_BYTES + 64 * 1024;

/// Largest payload of one `Output` or `Stdin` message. Large chunks matter under emulation, where each
/// frame's syscalls and context switches cost more than its bytes.
pub const MAX_DATA_BYTES: usize = 1024 * 1024;

/// Bytes in front of the data of an `Output` frame: body length (4), message tag (4), process message
/// tag (4), process id (4), stream tag (4), data length (8).
pub const OUTPUT_PREFIX_BYTES: usize = 28;

/// The message tag of `Process(_)`, the same in `link::ToHost` and `attach::ToClient`.
const PROCESS_TAG: u32 = 2;

/// The tag of `ProcessEvent::Output` inside it.
const OUTPUT_TAG: u32 = 1;

/// The first [`OUTPUT_PREFIX_BYTES`] of the frame `Process(ProcessEvent::Output { id, stream, data })` for
/// `data_len` bytes of data (the same bytes in `link::ToHost` and `attach::ToClient`), so a sender can move
/// the data itself without copying it through the encoder (the guest agent splices pipe pages straight into
/// the channel). `frame::tests` holds it to the encoder.
pub fn output_prefix(id: ProcId, stream: Stream, data_len: usize) -> [u8; OUTPUT_PREFIX_BYTES] {
    let body_len = OUTPUT_PREFIX_BYTES - HEADER_BYTES + data_len;
    let mut prefix = [0u8; OUTPUT_PREFIX_BYTES];
    prefix[0..4].copy_from_slice(&u32::try_from(body_len).unwrap_or(u32::MAX).to_le_bytes());
    prefix[4..8].copy_from_slice(&PROCESS_TAG.to_le_bytes());
    prefix[8..12].copy_from_slice(&OUTPUT_TAG.to_le_bytes());
    prefix[12..16].copy_from_slice(&id.0.to_le_bytes());
    let stream_tag: u32 = match stream {
        Stream::Stdout => 0,
        Stream::Stderr => 1,
    };
    prefix[16..20].copy_from_slice(&stream_tag.to_le_bytes());
    prefix[20..28].copy_from_slice(&(data_len as u64).to_le_bytes());
    prefix
}

/// The part of [`OUTPUT_PREFIX_BYTES`] after the length: the two tags, process id, stream tag, data length.
pub const OUTPUT_ENVELOPE_BYTES: usize = OUTPUT_PREFIX_BYTES - HEADER_BYTES;

/// Reads the first [`OUTPUT_ENVELOPE_BYTES`] of a frame body of `body_len` bytes as the envelope of a
/// `Process(ProcessEvent::Output { .. })` message: its process, stream and data length. `Some` only where the body can be nothing but
/// that message, with exactly the rest of the body as its data, so a reader can put the data straight into
/// the message's own buffer; for anything else (another message, a bad stream tag, a data length that
/// disagrees with the body) it is `None`, and the whole body goes through [`decode_body`], which decides.
/// `frame::tests` holds it to the decoder.
pub fn output_envelope(envelope: &[u8; OUTPUT_ENVELOPE_BYTES], body_len: usize) -> Option<(ProcId, Stream, usize)> {
    let word = |at: usize| u32::from_le_bytes([envelope[at], envelope[at + 1], envelope[at + 2], envelope[at + 3]]);
    if word(0) != PROCESS_TAG || word(4) != OUTPUT_TAG {
        return None;
    }
    let stream = match word(12) {
        0 => Stream::Stdout,
        1 => Stream::Stderr,
        _ => return None,
    };
    let mut len = [0u8; 8];
    len.copy_from_slice(&envelope[16..24]);
    let data_len = usize::try_from(u64::from_le_bytes(len)).ok()?;
    (body_len.checked_sub(OUTPUT_ENVELOPE_BYTES) == Some(data_len)).then_some((ProcId(word(8)), stream, data_len))
}

/// Why a frame could not be read, decoded or encoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The header announced more than [`MAX_FRAME_BYTES`].
    #[error("frame of {len} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge {
        /// The announced body length.
        len: u64,
    },
    /// The header announced a zero-length body.
    #[error("frame has an empty body")]
    Empty,
    /// The body is not a valid message.
    #[error("frame body does not decode as a message")]
    Malformed(#[source] bincode::Error),
    /// The message does not encode (or encodes beyond the limit).
    #[error("message does not encode within the frame limit")]
    Encode(#[source] bincode::Error),
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// Reading or writing the underlying stream failed.
    #[error("frame stream I/O failed")]
    Io(#[source] io::Error),
}

/// How a peer's bytes broke the framing: the part of a [`FrameError`] that is the peer's fault, as a plain
/// value to report and compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameViolation {
    /// A header announcing more than [`MAX_FRAME_BYTES`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge(u64),
    /// A header announcing an empty body.
    #[error("frame has an empty body")]
    Empty,
    /// A body that is not exactly one message.
    #[error("frame body does not decode as a message")]
    Malformed,
}

impl FrameError {
    /// The violation, when the peer sent bytes that break the protocol (as opposed to the stream failing or
    /// ending).
    pub fn violation(&self) -> Option<FrameViolation> {
        match self {
            Self::TooLarge { len } => Some(FrameViolation::TooLarge(*len)),
            Self::Empty => Some(FrameViolation::Empty),
            Self::Malformed(_) => Some(FrameViolation::Malformed),
            Self::Encode(_) | Self::Truncated | Self::Io(_) => None,
        }
    }
}

fn options(limit: usize) -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .with_limit(limit as u64)
        .reject_trailing_bytes()
}

/// The body length `msg` encodes to, checked against [`MAX_FRAME_BYTES`].
///
/// # Errors
/// [`FrameError::Encode`] if the message does not serialize within the limit.
pub fn body_size<M: Serialize>(msg: &M) -> Result<u32, FrameError> {
    let size = options(MAX_FRAME_BYTES).serialized_size(msg).map_err(FrameError::Encode)?;
    // The limit bounds `size` to MAX_FRAME_BYTES, which fits in u32.
    u32::try_from(size).map_err(|_| FrameError::TooLarge { len: size })
}

/// Writes `msg` as one frame (header and body) to `out`, which should buffer: it sees several writes.
///
/// # Errors
/// [`FrameError::Encode`] if the message does not serialize within the limit, or the writer fails.
pub fn encode_to<M: Serialize, W: Write>(msg: &M, mut out: W) -> Result<(), FrameError> {
    let len = body_size(msg)?;
    out.write_all(&len.to_le_bytes()).map_err(FrameError::Io)?;
    options(MAX_FRAME_BYTES).serialize_into(out, msg).map_err(FrameError::Encode)
}

/// Appends `msg` as one frame to `out`.
///
/// # Errors
/// [`FrameError::Encode`] if the message does not serialize within [`MAX_FRAME_BYTES`]; `out` is then
/// unchanged.
pub fn encode<M: Serialize>(msg: &M, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let len = body_size(msg)?;
    out.reserve(HEADER_BYTES + len as usize);
    encode_to(msg, out)
}

/// Checks a frame header and returns the body length it announces.
///
/// # Errors
/// [`FrameError::Empty`] or [`FrameError::TooLarge`].
pub fn body_len(header: [u8; HEADER_BYTES]) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(header);
    match usize::try_from(len) {
        Ok(0) => Err(FrameError::Empty),
        Ok(n) if n <= MAX_FRAME_BYTES => Ok(n),
        _ => Err(FrameError::TooLarge { len: u64::from(len) }),
    }
}

/// Decodes one message body (the bytes after the header).
///
/// # Errors
/// [`FrameError::Malformed`] if the bytes are not exactly one message.
pub fn decode_body<M: DeserializeOwned>(body: &[u8]) -> Result<M, FrameError> {
    options(body.len()).deserialize(body).map_err(FrameError::Malformed)
}

/// Decodes the first frame in `buf`.
///
/// Returns `Ok(None)` when `buf` holds only part of a frame, or `Ok(Some((message, bytes_used)))`.
///
/// # Errors
/// Any header or body error; the stream is unusable after one.
pub fn decode<M: DeserializeOwned>(buf: &[u8]) -> Result<Option<(M, usize)>, FrameError> {
    let Some(header) = buf.first_chunk::<HEADER_BYTES>() else {
        return Ok(None);
    };
    let len = body_len(*header)?;
    let Some(body) = buf.get(HEADER_BYTES..HEADER_BYTES + len) else {
        return Ok(None);
    };
    Ok(Some((decode_body(body)?, HEADER_BYTES + len)))
}

/// Reads one frame's body from a blocking stream into `scratch`. `Ok(false)` is a clean end of stream at a
/// frame boundary.
///
/// `scratch` is reused between calls; it never grows beyond [`MAX_FRAME_BYTES`].
///
/// # Errors
/// [`FrameError::Truncated`] if the stream ends inside a frame, or a header or I/O error.
pub fn read_body<R: Read>(reader: &mut R, scratch: &mut Vec<u8>) -> Result<bool, FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut filled = 0;
    while filled < HEADER_BYTES {
        match reader.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = body_len(header)?;
    scratch.clear();
    scratch.resize(len, 0);
    reader.read_exact(scratch).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => FrameError::Truncated,
        _ => FrameError::Io(e),
    })?;
    Ok(true)
}

/// Reads and decodes one frame from a blocking stream. `Ok(None)` is a clean end of stream at a frame
/// boundary.
///
/// # Errors
/// As [`read_body`], plus [`FrameError::Malformed`].
pub fn read<M: DeserializeOwned, R: Read>(reader: &mut R, scratch: &mut Vec<u8>) -> Result<Option<M>, FrameError> {
    if read_body(reader, scratch)? {
        decode_body(scratch).map(Some)
    } else {
        Ok(None)
    }
}

/// Writes one frame to a blocking stream in a single `write_all`, so concurrent writers that share a lock
/// never interleave frames.
///
/// # Errors
/// [`FrameError::Encode`] or [`FrameError::Io`].
pub fn write<M: Serialize, W: Write>(writer: &mut W, msg: &M, scratch: &mut Vec<u8>) -> Result<(), FrameError> {
    scratch.clear();
    encode(msg, scratch)?;
    writer.write_all(scratch).map_err(FrameError::Io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::ToClient;
    use crate::link::{ToGuest, ToHost};
    use crate::message::{ProcessEvent, ProcessRequest};

    #[test]
    fn output_prefix_matches_the_encoder() {
        for (stream, len) in [(Stream::Stdout, 0), (Stream::Stderr, 5), (Stream::Stdout, MAX_DATA_BYTES)] {
            let data = vec![0xAB; len];
            let mut wire = Vec::new();
            let output = ProcessEvent::Output { id: ProcId(0x0102_0304), stream, data: data.clone().into() };
            encode(&ToHost::Process(output.clone()), &mut wire).unwrap();
            let mut manual = output_prefix(ProcId(0x0102_0304), stream, len).to_vec();
            manual.extend_from_slice(&data);
            assert_eq!(manual, wire);
            let mut attach = Vec::new();
            encode(&ToClient::Process(output), &mut attach).unwrap();
            assert_eq!(attach, wire, "the same bytes on both channels");
        }
    }

    #[test]
    fn output_envelope_agrees_with_the_decoder() {
        let body = |prefix: [u8; OUTPUT_PREFIX_BYTES], data_len: usize| {
            let mut body = prefix[HEADER_BYTES..].to_vec();
            body.resize(OUTPUT_ENVELOPE_BYTES + data_len, 0x5A);
            body
        };
        let envelope =
            |body: &[u8]| -> [u8; OUTPUT_ENVELOPE_BYTES] { body[..OUTPUT_ENVELOPE_BYTES].try_into().unwrap() };
        for (stream, len) in [(Stream::Stdout, 0), (Stream::Stderr, 7), (Stream::Stdout, MAX_DATA_BYTES)] {
            let b = body(output_prefix(ProcId(9), stream, len), len);
            assert_eq!(output_envelope(&envelope(&b), b.len()), Some((ProcId(9), stream, len)));
            let Ok(ToHost::Process(ProcessEvent::Output { id, stream: s, data })) = decode_body::<ToHost>(&b) else {
                panic!("not output")
            };
            assert_eq!((id, s, data.len()), (ProcId(9), stream, len));
        }
        // A data length that disagrees with the body, a bad stream tag, another message: left to the decoder,
        // which refuses the first two.
        let mut b = body(output_prefix(ProcId(1), Stream::Stdout, 5), 4);
        assert_eq!(output_envelope(&envelope(&b), b.len()), None);
        assert!(decode_body::<ToHost>(&b).is_err());
        b = body(output_prefix(ProcId(1), Stream::Stdout, 4), 4);
        b[12] = 2;
        assert_eq!(output_envelope(&envelope(&b), b.len()), None);
        assert!(decode_body::<ToHost>(&b).is_err());
        let started = ProcessEvent::Started { id: ProcId(1), pid: 1, stdin_window: 1, output_window: 24 };
        let mut wire = Vec::new();
        encode(&ToHost::Process(started), &mut wire).unwrap();
        let b = &wire[HEADER_BYTES..];
        assert_eq!(output_envelope(&envelope(b), b.len()), None);
    }

    #[test]
    fn rejects_oversized_length_from_header_alone() {
        let header = u32::try_from(MAX_FRAME_BYTES + 1).unwrap().to_le_bytes();
        assert!(matches!(decode::<ToHost>(&header), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn rejects_empty_body() {
        assert!(matches!(decode::<ToHost>(&[0, 0, 0, 0]), Err(FrameError::Empty)));
    }

    #[test]
    fn all_zero_body_is_not_a_message() {
        let mut wire = 8u32.to_le_bytes().to_vec();
        wire.extend_from_slice(&[0; 8]);
        assert!(matches!(decode::<ToGuest>(&wire), Err(FrameError::Malformed(_))));
        assert!(matches!(decode::<ToHost>(&wire), Err(FrameError::Malformed(_))));
    }

    #[test]
    fn partial_frames_ask_for_more() {
        let mut wire = Vec::new();
        encode(&ToGuest::Process(ProcessRequest::StdinEof { id: ProcId(3) }), &mut wire).unwrap();
        for cut in 0..wire.len() {
            assert!(decode::<ToGuest>(&wire[..cut]).unwrap().is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn rejects_trailing_bytes_inside_a_frame() {
        let mut wire = Vec::new();
        encode(&ToGuest::Process(ProcessRequest::StdinEof { id: ProcId(3) }), &mut wire).unwrap();
        wire.push(0);
        let len = u32::try_from(wire.len() - HEADER_BYTES).unwrap();
        wire[..HEADER_BYTES].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(decode::<ToGuest>(&wire), Err(FrameError::Malformed(_))));
    }

    #[test]
    fn refuses_to_encode_beyond_the_limit() {
        let msg = ToHost::Process(ProcessEvent::Output {
            id: ProcId(1),
            stream: Stream::Stdout,
            data: vec![7; MAX_FRAME_BYTES].into(),
        });
        let mut out = b"keep".to_vec();
        assert!(matches!(encode(&msg, &mut out), Err(FrameError::Encode(_))));
        assert_eq!(out, b"keep", "a failed encode leaves the buffer as it was");
    }

    #[test]
    fn blocking_read_reports_truncation_and_clean_eof() {
        let mut wire = Vec::new();
        encode(&ToGuest::Ping { nonce: 9 }, &mut wire).unwrap();
        let mut scratch = Vec::new();
        let mut whole = &wire[..];
        assert_eq!(read::<ToGuest, _>(&mut whole, &mut scratch).unwrap(), Some(ToGuest::Ping { nonce: 9 }));
        assert_eq!(read::<ToGuest, _>(&mut whole, &mut scratch).unwrap(), None);
        let mut cut = &wire[..wire.len() - 1];
        assert!(matches!(read::<ToGuest, _>(&mut cut, &mut scratch), Err(FrameError::Truncated)));
    }
}
