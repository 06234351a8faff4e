//! A sandbox's tamper-evident audit chain: every OCSF event the supervisor emits is appended here, in
//! SQLite (WAL, `synchronous=FULL`), before any sink (console, `events.jsonl`, OTLP) is given it.
//!
//! - [`chain`]: the supervisor's writer: open (checking the tail), append a batch in one transaction, seal.
//! - [`verify`]: the driver's reader: recompute every link from genesis, check the seals, the head kept
//!   outside the sandbox directory ([`Head`], the anchor) and `events.jsonl` against the chain.
//!
//! An entry is `(seq, time_ms, class, event_hash, prev, hash)`. `event_hash` is SHA-256 of the exact bytes
//! the sinks got (the event's JSON, the `events.jsonl` line without its newline), so verification never
//! re-serializes anything. `hash` covers the entry's other fields and `prev`, domain-separated
//! ([`entry_hash`]); the first entry's `prev` is [`genesis`], which binds the chain to its sandbox id, so
//! no other sandbox's chain passes for it.
//!
//! What is stored whole and what as a hash: the chain keeps each event's hash, its class and time, never
//! the event itself. The event is whole in `events.jsonl` and the collector, where it always was; a second
//! copy would double the disk for nothing the hash does not prove, and the chain would then hold the
//! workload's arguments too. `vm-driver audit show` joins the two: each entry, and its line where the file
//! still has it.
#![forbid(unsafe_code)]

pub mod chain;
pub mod verify;

#[cfg(test)]
mod tests_tamper;

use sha2::{Digest as _, Sha256};
pub use vm_contract::audit::{hex, parse_hex, Hash, Head};

/// The format, bound into every hash: a new format never verifies as the old one.
const FORMAT: &[u8] = b"vm-driver audit v1";

/// The `prev` of the first entry: the chain's start, bound to its sandbox.
pub fn genesis(sandbox_id: &str) -> Hash {
    digest(&[FORMAT, b"\0genesis\0", sandbox_id.as_bytes()])
}

/// The hash of an entry. Fixed-width fields, then the two hashes: no two entries encode alike.
pub fn entry_hash(seq: u64, time_ms: u64, class: u32, event_hash: &Hash, prev: &Hash) -> Hash {
    digest(&[FORMAT, b"\0entry\0", &seq.to_be_bytes(), &time_ms.to_be_bytes(), &class.to_be_bytes(), event_hash, prev])
}

/// The hash of a seal over `head`: an orderly stop's mark.
pub fn seal_hash(head: &Head, time_ms: u64) -> Hash {
    digest(&[FORMAT, b"\0seal\0", &head.seq.to_be_bytes(), &head.hash, &time_ms.to_be_bytes()])
}

/// SHA-256 of an event's bytes as the sinks get them.
pub fn event_hash(record: &[u8]) -> Hash {
    Sha256::digest(record).into()
}

fn digest(parts: &[&[u8]]) -> Hash {
    let mut h = Sha256::new();
    for part in parts {
        h.update(part);
    }
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_a_hash() {
        let h = event_hash(b"x");
        assert_eq!(parse_hex(&hex(&h)), Some(h));
        for bad in ["", "zz", &"a".repeat(63), &"é".repeat(32)] {
            assert_eq!(parse_hex(bad), None, "{bad}");
        }
    }

    #[test]
    fn every_field_is_in_the_entry_hash() {
        let (e, p) = (event_hash(b"a"), genesis("box"));
        let base = entry_hash(1, 2, 3, &e, &p);
        assert_ne!(base, entry_hash(2, 2, 3, &e, &p));
        assert_ne!(base, entry_hash(1, 3, 3, &e, &p));
        assert_ne!(base, entry_hash(1, 2, 4, &e, &p));
        assert_ne!(base, entry_hash(1, 2, 3, &event_hash(b"b"), &p));
        assert_ne!(base, entry_hash(1, 2, 3, &e, &genesis("other")));
    }
}
