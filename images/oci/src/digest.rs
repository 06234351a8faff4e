//! Content digests. Only `sha256` is accepted (what every registry and `docker save` writes); the hex is
//! checked to be 64 lowercase digits before a digest becomes a file name, so `sha256:../..` never names a path.

use std::fmt;
use std::io::{self, Read};
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// A `sha256:<64 lowercase hex>` digest. In JSON it is its text, checked when read.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl TryFrom<String> for Digest {
    type Error = DigestError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> Self {
        d.0
    }
}

/// Why a string is not a digest we accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    /// Not `sha256:`.
    #[error("unsupported digest algorithm in {0:?} (only sha256)")]
    Algorithm(String),
    /// The hex part is not 64 lowercase hex digits.
    #[error("malformed digest {0:?}")]
    Malformed(String),
}

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self::of_hash(Sha256::digest(bytes).as_slice())
    }

    /// The digest whose sha256 is `hash`.
    pub(crate) fn of_hash(hash: &[u8]) -> Self {
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        Self(format!("sha256:{hex}"))
    }

    /// The 64 hex digits, safe as one path component.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// The whole `sha256:...` text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((algorithm, hex)) = s.split_once(':') else {
            return Err(DigestError::Malformed(s.to_owned()));
        };
        if algorithm != "sha256" {
            return Err(DigestError::Algorithm(s.to_owned()));
        }
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(DigestError::Malformed(s.to_owned()));
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads a blob that must be exactly `size` bytes with digest `expected`. Never reads more than
/// `size + 1` bytes from the source; the last read that ends the blob fails unless both match, so a
/// consumer that reads to the end has read verified bytes only.
#[derive(Debug)]
pub struct Verified<R> {
    inner: R,
    expected: Digest,
    size: u64,
    read: u64,
    hash: Sha256,
    done: bool,
}

impl<R: Read> Verified<R> {
    /// Wraps `inner`, expected to hold `size` bytes with digest `expected`.
    pub fn new(inner: R, expected: Digest, size: u64) -> Self {
        Self { inner, expected, size, read: 0, hash: Sha256::new(), done: false }
    }

    fn check_end(&mut self) -> io::Result<()> {
        if self.read != self.size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                SizeMismatch { expected: self.size, got: self.read },
            ));
        }
        let got = Digest::of_hash(self.hash.clone().finalize().as_slice());
        if got != self.expected {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                DigestMismatch { expected: self.expected.clone(), got },
            ));
        }
        self.done = true;
        Ok(())
    }
}

impl<R: Read> Read for Verified<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        // One byte past the size is allowed in, to see that the blob is longer than its descriptor says.
        let room = self.size.saturating_sub(self.read).saturating_add(1);
        let want = usize::try_from(room).map_or(buf.len(), |room| room.min(buf.len()));
        let n = self.inner.read(&mut buf[..want])?;
        self.read += n as u64;
        if n == 0 || self.read > self.size {
            self.check_end()?;
            return Ok(0);
        }
        self.hash.update(&buf[..n]);
        if self.read == self.size {
            // The bytes are all here: check now, so a reader that stops at `size` still gets the verdict.
            self.check_end()?;
        }
        Ok(n)
    }
}

/// A blob's size differs from its descriptor's.
#[derive(Debug, thiserror::Error)]
#[error("blob size differs from its descriptor: expected {expected} bytes, got {got}{}", if *got > *expected { " or more" } else { "" })]
pub struct SizeMismatch {
    /// The descriptor's size.
    pub expected: u64,
    /// What arrived (size + 1 means "longer").
    pub got: u64,
}

/// A blob's digest differs from its descriptor's.
#[derive(Debug, thiserror::Error)]
#[error("blob digest mismatch: expected {expected}, got {got}")]
pub struct DigestMismatch {
    /// The descriptor's digest.
    pub expected: Digest,
    /// What the bytes hash to.
    pub got: Digest,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(bytes: &[u8], digest: &Digest, size: u64) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        Verified::new(bytes, digest.clone(), size).read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn only_well_formed_sha256_digests_parse() {
        let good = Digest::of(b"x");
        assert_eq!(good.as_str().parse::<Digest>().unwrap(), good);
        for bad in ["sha256:../../etc", "sha512:00", "sha256:ABCD", "", "sha256", &format!("{good}0")] {
            assert!(bad.parse::<Digest>().is_err(), "{bad:?}");
        }
        assert_eq!(good.hex().len(), 64);
    }

    #[test]
    fn a_blob_is_verified_against_digest_and_size() {
        let data = b"hello, layer";
        let digest = Digest::of(data);
        assert_eq!(read_all(data, &digest, data.len() as u64).unwrap(), data);
        let flipped = b"hello, layeR";
        assert!(read_all(flipped, &digest, data.len() as u64).is_err(), "flipped byte");
        assert!(read_all(&data[..5], &digest, data.len() as u64).is_err(), "truncated");
        let longer = b"hello, layer and more";
        let err = read_all(longer, &digest, data.len() as u64).unwrap_err();
        assert!(err.to_string().contains("or more"), "{err}");
    }

    #[test]
    fn a_longer_blob_is_cut_at_size_plus_one() {
        struct Counting<'a>(&'a [u8], usize);
        impl Read for Counting<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = self.0.read(buf)?;
                self.1 += n;
                Ok(n)
            }
        }
        let huge = vec![0u8; 1 << 20];
        let mut source = Counting(&huge, 0);
        let mut sink = Vec::new();
        let digest = Digest::of(&huge[..10]);
        assert!(Verified::new(&mut source, digest, 10).read_to_end(&mut sink).is_err());
        assert!(source.1 <= 11, "read {} bytes of a 10-byte blob", source.1);
    }
}
