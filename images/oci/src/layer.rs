//! A stored layer blob opened as the tar stream it holds: decompressed by its media type, bounded in bytes,
//! its tar framing watched so that no metadata entry (a long name, a PAX header) can make the tar reader
//! hold more than [`MAX_META_BYTES`], and hashed on the way, so [`Uncompressed::finish`] can check the
//! config's `diff_id` once the tree has read it.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
use ruzstd::decoding::{BlockDecodingStrategy, FrameDecoder};
use sha2::{Digest as _, Sha256};

use crate::digest::{Digest, DigestMismatch};
use crate::manifest::{Compression, Layer};

/// Largest GNU long name, long link or PAX header entry.
pub const MAX_META_BYTES: u64 = 1024 * 1024;
/// What may follow the end of the archive (zero padding) before the stream must end.
const MAX_TRAILER_BYTES: u64 = 1024 * 1024;

/// Why a layer stream was refused. Carried as the source of an `io::Error` (the tar reader's error type).
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// The uncompressed stream passed its bound.
    #[error("layer unpacks to more than {0} bytes")]
    TooLarge(u64),
    /// A metadata entry passed [`MAX_META_BYTES`].
    #[error("tar metadata entry of {0} bytes (at most {MAX_META_BYTES})")]
    MetaTooLarge(u64),
    /// A header's size field is not a number.
    #[error("malformed tar header size")]
    BadSize,
    /// More than padding after the archive's end.
    #[error("more than {MAX_TRAILER_BYTES} bytes after the archive's end")]
    Trailer,
}

fn refuse(e: LayerError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// The uncompressed tar stream of one layer.
pub struct Uncompressed {
    inner: Box<dyn Read>,
    hash: Sha256,
    read: u64,
    limit: u64,
    diff_id: Digest,
    frame: Frame,
}

impl std::fmt::Debug for Uncompressed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uncompressed").field("read", &self.read).field("diff_id", &self.diff_id).finish_non_exhaustive()
    }
}

/// Opens the blob at `path` (already verified against `layer.digest`) as its tar stream, at most `limit`
/// bytes uncompressed.
///
/// # Errors
/// The blob cannot be opened.
pub fn open(path: &Path, layer: &Layer, limit: u64) -> io::Result<Uncompressed> {
    let file = BufReader::new(File::open(path)?);
    let inner: Box<dyn Read> = match layer.compression {
        Compression::None => Box::new(file),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(file)),
        Compression::Zstd => Box::new(ZstdFrames::new(file)),
    };
    Ok(Uncompressed::new(inner, layer.diff_id.clone(), limit))
}

impl Uncompressed {
    /// Wraps an already decompressed stream.
    pub fn new(inner: Box<dyn Read>, diff_id: Digest, limit: u64) -> Self {
        Self { inner, hash: Sha256::new(), read: 0, limit, diff_id, frame: Frame::default() }
    }

    /// Reads what the tar reader left (padding) and checks the `diff_id`.
    ///
    /// # Errors
    /// More than padding is left, the stream is broken, or the digest differs.
    pub fn finish(mut self) -> io::Result<()> {
        let mut rest = Vec::new();
        let trailer = (&mut self).take(MAX_TRAILER_BYTES + 1).read_to_end(&mut rest)?;
        if trailer as u64 > MAX_TRAILER_BYTES {
            return Err(refuse(LayerError::Trailer));
        }
        let got = Digest::of_hash(self.hash.finalize().as_slice());
        if got != self.diff_id {
            return Err(io::Error::new(io::ErrorKind::InvalidData, DigestMismatch { expected: self.diff_id, got }));
        }
        Ok(())
    }
}

impl Read for Uncompressed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.limit {
            return Err(refuse(LayerError::TooLarge(self.limit)));
        }
        self.hash.update(&buf[..n]);
        self.frame.watch(&buf[..n]).map_err(refuse)?;
        Ok(n)
    }
}

/// Largest zstd window accepted: what `zstd --long=27` uses, and what a decoder must hold in memory.
const MAX_ZSTD_WINDOW: u64 = 128 * 1024 * 1024;

/// A zstd stream of any number of frames, skippable ones (as zstd:chunked writes) skipped.
struct ZstdFrames<R> {
    source: R,
    decoder: FrameDecoder,
    in_frame: bool,
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(source: R) -> Self {
        let mut decoder = FrameDecoder::new();
        decoder.set_max_window_size(MAX_ZSTD_WINDOW);
        Self { source, decoder, in_frame: false }
    }
}

fn zstd_error(e: FrameDecoderError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.in_frame {
                while self.decoder.can_collect() == 0 && !self.decoder.is_finished() {
                    self.decoder
                        .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBlocks(1))
                        .map_err(zstd_error)?;
                }
                let n = self.decoder.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                self.in_frame = false;
            }
            if self.source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            match self.decoder.reset(&mut self.source) {
                Ok(()) => self.in_frame = true,
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame { length, .. })) => {
                    let skipped = io::copy(&mut (&mut self.source).take(u64::from(length)), &mut io::sink())?;
                    if skipped != u64::from(length) {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                }
                Err(e) => return Err(zstd_error(e)),
            }
        }
    }
}

/// Where the stream is in the tar framing: in a header, or in an entry's data (with how much is left, and
/// the bytes of a PAX header kept to learn a `size` override of the next entry).
#[derive(Debug, Default)]
struct Frame {
    header: Vec<u8>,
    data_left: u64,
    pax: Option<Vec<u8>>,
    next_size: Option<u64>,
    /// A zero block was seen: the tar reader stops there, and so does the watch.
    ended: bool,
}

impl Frame {
    fn watch(&mut self, mut bytes: &[u8]) -> Result<(), LayerError> {
        while !bytes.is_empty() && !self.ended {
            if self.data_left > 0 {
                let n = usize::try_from(self.data_left).map_or(bytes.len(), |left| left.min(bytes.len()));
                if let Some(pax) = &mut self.pax {
                    pax.extend_from_slice(&bytes[..n]);
                }
                self.data_left -= n as u64;
                bytes = &bytes[n..];
                if self.data_left == 0 {
                    if let Some(pax) = self.pax.take() {
                        self.next_size = pax_size(&pax);
                    }
                }
                continue;
            }
            let n = (512 - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() == 512 {
                let header = std::mem::take(&mut self.header);
                self.start_entry(&header)?;
            }
        }
        Ok(())
    }

    fn start_entry(&mut self, header: &[u8]) -> Result<(), LayerError> {
        if header.iter().all(|b| *b == 0) {
            self.ended = true;
            return Ok(());
        }
        let kind = header[156];
        let size = header_size(&header[124..136]).ok_or(LayerError::BadSize)?;
        let meta = matches!(kind, b'L' | b'K' | b'x' | b'g');
        let size = if meta { size } else { self.next_size.take().unwrap_or(size) };
        if meta && size > MAX_META_BYTES {
            return Err(LayerError::MetaTooLarge(size));
        }
        self.pax = (kind == b'x').then(Vec::new);
        // As the tar reader frames it: every entry type is followed by `size` bytes, padded to whole blocks.
        self.data_left = size.div_ceil(512).checked_mul(512).ok_or(LayerError::BadSize)?;
        if self.data_left == 0 {
            if let Some(pax) = self.pax.take() {
                self.next_size = pax_size(&pax);
            }
        }
        Ok(())
    }
}

/// A header's size field: octal digits, or GNU's base-256 (high bit set).
fn header_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        let mut v: u64 = u64::from(field[0] & 0x7f);
        for b in &field[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(*b))?;
        }
        return Some(v);
    }
    let text = std::str::from_utf8(field).ok()?;
    let digits = text.trim_matches(|c: char| c == '\0' || c == ' ');
    if digits.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(digits, 8).ok()
}

/// The `size` record of a PAX header (`<len> size=<n>\n`).
fn pax_size(pax: &[u8]) -> Option<u64> {
    pax.split(|b| *b == b'\n').find_map(|record| {
        let (_, kv) = record.split_at(record.iter().position(|b| *b == b' ')? + 1);
        std::str::from_utf8(kv.strip_prefix(b"size=")?).ok()?.parse().ok()
    })
}

#[cfg(test)]
mod tests;
