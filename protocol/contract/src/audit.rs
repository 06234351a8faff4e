//! The audit chain's head, as the supervisor reports it at a stop (`SupervisorStatus::Stopped`), the driver
//! keeps it outside the sandbox directory (the anchor) and OTLP records carry it. The chain itself is
//! `vm-audit`'s.

use serde::{Deserialize, Serialize};

/// A SHA-256 value.
pub type Hash = [u8; 32];

/// The chain's head: its last entry's sequence number and hash. Kept outside the sandbox directory at
/// each orderly stop (the anchor), and on every OTLP record as it leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    /// The last entry's sequence number (0: an empty chain).
    pub seq: u64,
    /// Its hash, lowercase hex (`vm_audit::genesis` for an empty chain).
    #[serde(with = "hex_hash")]
    pub hash: Hash,
}

impl Head {
    /// `seq:hex`, as an OTLP attribute carries it.
    pub fn to_attribute(&self) -> String {
        format!("{}:{}", self.seq, hex(&self.hash))
    }
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses 64 hex digits.
pub fn parse_hex(text: &str) -> Option<Hash> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut out = [0; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

mod hex_hash {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(hash: &super::Hash, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::hex(hash))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<super::Hash, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_hex(&text).ok_or_else(|| serde::de::Error::custom("not 64 hex digits"))
    }
}
