//! Each way of changing the record, on a real SQLite chain, and the break `verify` names; with the chain's
//! view alone and with the anchor kept outside.

use std::path::{Path, PathBuf};

use rusqlite::Connection;

use crate::chain::{Chain, NewEntry};
use crate::verify::{verify, Break};
use crate::{event_hash, Head};

const ID: &str = "box-1";

fn event(i: u64) -> Vec<u8> {
    format!("{{\"class_uid\":1007,\"n\":{i}}}").into_bytes()
}

/// A chain of `n` events at `dir/audit.db`, sealed if asked; its head, and the events as `events.jsonl`.
fn chain(dir: &Path, n: u64, seal: bool) -> (PathBuf, Head, Vec<u8>) {
    let path = dir.join("audit.db");
    let mut chain = Chain::open(&path, ID).unwrap();
    let mut jsonl = Vec::new();
    for i in 1..=n {
        chain.append(&[NewEntry { class: 1007, event_hash: event_hash(&event(i)) }]).unwrap();
        jsonl.extend(event(i));
        jsonl.push(b'\n');
    }
    let head = if seal { chain.seal().unwrap() } else { chain.head() };
    (path, head, jsonl)
}

fn sql(path: &Path, statements: &str) {
    Connection::open(path).unwrap().execute_batch(statements).unwrap();
}

#[test]
fn an_untouched_sealed_chain_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let (path, head, jsonl) = chain(dir.path(), 10, true);
    let report = verify(&path, Some(&head), Some(&jsonl)).unwrap();
    assert!(report.intact(), "{report:?}");
    assert_eq!((report.entries, report.sealed, report.unsealed(), report.events_missing), (10, Some(10), 0, Some(0)));
}

#[test]
fn one_byte_of_one_entry_changed_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = chain(dir.path(), 10, true);
    sql(&path, "UPDATE entries SET event_hash = zeroblob(32) WHERE seq = 4");
    assert_eq!(verify(&path, None, None).unwrap().breaks[0], Break::Altered { seq: 4 });
}

#[test]
fn a_deleted_entry_is_named_with_or_without_renumbering() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = chain(dir.path(), 10, true);
    sql(&path, "DELETE FROM entries WHERE seq = 4");
    assert_eq!(verify(&path, None, None).unwrap().breaks[0], Break::Gap { expected: 4, seq: 5 });
    sql(&path, "UPDATE entries SET seq = seq - 1 WHERE seq > 4");
    assert_eq!(verify(&path, None, None).unwrap().breaks[0], Break::Unlinked { seq: 4 });
}

#[test]
fn two_swapped_entries_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = chain(dir.path(), 10, true);
    sql(&path, "UPDATE entries SET seq = -1 WHERE seq = 4; UPDATE entries SET seq = 4 WHERE seq = 5; UPDATE entries SET seq = 5 WHERE seq = -1;");
    assert_eq!(verify(&path, None, None).unwrap().breaks[0], Break::Unlinked { seq: 4 });
}

#[test]
fn a_cut_tail_breaks_the_seal_and_without_the_seal_the_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let (path, head, _) = chain(dir.path(), 10, true);
    sql(&path, "DELETE FROM entries WHERE seq > 7");
    assert_eq!(verify(&path, None, None).unwrap().breaks, vec![Break::BadSeal { seq: 10 }]);
    sql(&path, "DELETE FROM seals");
    let alone = verify(&path, None, None).unwrap();
    assert!(alone.intact() && alone.unsealed() == 7, "the chain alone cannot tell: {alone:?}");
    let anchored = verify(&path, Some(&head), None).unwrap();
    assert_eq!(anchored.breaks, vec![Break::Truncated { anchor: 10, last: 7 }]);
}

#[test]
fn a_chain_recomputed_after_an_edit_is_caught_by_the_anchor_only() {
    let dir = tempfile::tempdir().unwrap();
    let (_, head, _) = chain(dir.path(), 10, true);
    // The forger rebuilds a whole chain for the same sandbox, with one event changed, and seals it.
    let forged = tempfile::tempdir().unwrap();
    let path = forged.path().join("audit.db");
    let mut chain = Chain::open(&path, ID).unwrap();
    for i in 1..=10 {
        let bytes = if i == 4 { b"{\"forged\":true}".to_vec() } else { event(i) };
        chain.append(&[NewEntry { class: 1007, event_hash: event_hash(&bytes) }]).unwrap();
    }
    chain.seal().unwrap();
    drop(chain);
    assert!(verify(&path, None, None).unwrap().intact(), "self-consistent");
    assert_eq!(verify(&path, Some(&head), None).unwrap().breaks, vec![Break::Rewritten { seq: 10 }]);
}

#[test]
fn an_older_copy_of_the_database_is_caught_by_the_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = chain(dir.path(), 5, true);
    let old = dir.path().join("old.db");
    std::fs::copy(&path, &old).unwrap();
    let mut chain = Chain::open(&path, ID).unwrap();
    for i in 6..=10 {
        chain.append(&[NewEntry { class: 1007, event_hash: event_hash(&event(i)) }]).unwrap();
    }
    let head = chain.seal().unwrap();
    drop(chain);
    std::fs::copy(&old, &path).unwrap();
    let report = verify(&path, Some(&head), None).unwrap();
    assert_eq!(report.breaks, vec![Break::Truncated { anchor: 10, last: 5 }]);
}

#[test]
fn an_unsealed_chain_is_reported_as_unsealed_not_tampered() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = chain(dir.path(), 6, false);
    let report = verify(&path, None, None).unwrap();
    assert!(report.intact());
    assert_eq!((report.sealed, report.unsealed()), (None, 6));
}

#[test]
fn an_edited_reordered_or_added_events_line_is_named_and_a_dropped_one_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, jsonl) = chain(dir.path(), 5, true);
    let lines: Vec<&[u8]> = jsonl.split(|b| *b == b'\n').filter(|l| !l.is_empty()).collect();
    let join = |ls: &[&[u8]]| ls.iter().flat_map(|l| l.iter().copied().chain(*b"\n")).collect::<Vec<u8>>();
    let dropped = join(&[lines[0], lines[1], lines[3], lines[4]]);
    let report = verify(&path, None, Some(&dropped)).unwrap();
    assert!(report.intact());
    assert_eq!(report.events_missing, Some(1));
    let swapped = join(&[lines[0], lines[2], lines[1], lines[3], lines[4]]);
    assert_eq!(verify(&path, None, Some(&swapped)).unwrap().breaks, vec![Break::EventNotInChain { line: 3 }]);
    let edited = String::from_utf8(jsonl.clone()).unwrap().replace("\"n\":2", "\"n\":9");
    assert_eq!(verify(&path, None, Some(edited.as_bytes())).unwrap().breaks, vec![Break::EventNotInChain { line: 2 }]);
}

#[test]
fn a_chain_of_another_sandbox_does_not_open_as_this_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _, _) = chain(dir.path(), 1, false);
    assert!(matches!(Chain::open(&path, "box-2"), Err(crate::chain::ChainError::Foreign)));
}

#[test]
fn a_chain_continues_across_generations_and_refuses_an_edited_tail() {
    let dir = tempfile::tempdir().unwrap();
    let (path, head, _) = chain(dir.path(), 3, true);
    let mut next = Chain::open(&path, ID).unwrap();
    assert_eq!(next.head(), head);
    next.append(&[NewEntry { class: 1007, event_hash: event_hash(b"x") }]).unwrap();
    drop(next);
    assert!(verify(&path, None, None).unwrap().intact());
    sql(&path, "UPDATE entries SET class = 1 WHERE seq = 4");
    assert!(matches!(Chain::open(&path, ID), Err(crate::chain::ChainError::BrokenTail)));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// Any one field of any one entry set to any other value: a break, never an intact report or a panic.
    #[test]
    fn any_changed_field_breaks_the_chain(seq in 1u64..=8, column in 0usize..5, value in proptest::num::i64::ANY) {
        let dir = tempfile::tempdir().unwrap();
        let (path, _, _) = chain(dir.path(), 8, true);
        let columns = ["time_ms", "class", "event_hash", "prev", "hash"];
        let conn = Connection::open(&path).unwrap();
        let set = if column >= 2 { "randomblob(32)".to_owned() } else { value.to_string() };
        let old: i64 = conn.query_row(&format!("SELECT {} FROM entries WHERE seq = {seq}", if column < 2 { columns[column] } else { "0" }), [], |r| r.get(0)).unwrap();
        proptest::prop_assume!(column >= 2 || old != value);
        conn.execute_batch(&format!("UPDATE entries SET {} = {set} WHERE seq = {seq}", columns[column])).unwrap();
        drop(conn);
        let report = verify(&path, None, None).unwrap();
        proptest::prop_assert!(!report.intact(), "{report:?}");
    }
}
