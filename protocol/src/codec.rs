//! A `tokio_util` codec over [`crate::frame`], for async users.

use std::marker::PhantomData;

use bytes::{Buf, BufMut, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_util::codec::{Decoder, Encoder};

use crate::frame::{self, FrameError, HEADER_BYTES};

/// Decodes `In` frames and encodes `Out` frames.
#[derive(Debug)]
pub struct FrameCodec<In, Out> {
    _types: PhantomData<fn(Out) -> In>,
}

impl<In, Out> FrameCodec<In, Out> {
    /// A new codec.
    pub fn new() -> Self {
        Self {
            _types: PhantomData,
        }
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

impl From<std::io::Error> for FrameError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}
