//! The driver's end: recompute a chain from genesis and say where it first breaks, whether its last
//! generation was sealed, whether it still holds the head kept outside (the anchor), and whether each line
//! of `events.jsonl` is one of its entries, in order.

use std::fmt;
use std::path::Path;

use rusqlite::{Connection, OpenFlags, OptionalExtension as _};

use crate::chain::Entry;
use crate::{event_hash, genesis, hex, seal_hash, Hash, Head};

/// Most entries a verification reads: far beyond what a sandbox's rate limit lets it write.
pub const MAX_ENTRIES: u64 = 50_000_000;

/// A break in the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Break {
    /// Entry `seq`'s stored hash is not the hash of its fields: the entry was edited.
    Altered { seq: u64 },
    /// Entry `seq` does not name the entry before it: one was removed, swapped or inserted.
    Unlinked { seq: u64 },
    /// The entries skip or repeat a number: `expected` was next, `seq` came.
    Gap { expected: u64, seq: u64 },
    /// A seal does not verify, or names an entry the chain does not hold as sealed.
    BadSeal { seq: u64 },
    /// The anchor kept outside names entry `anchor`, past this chain's last (`last`): the tail was cut, or
    /// the database replaced by an older copy.
    Truncated { anchor: u64, last: u64 },
    /// The chain's entry `seq` is not the one the anchor kept outside names: the chain was rebuilt.
    Rewritten { seq: u64 },
    /// Line `line` of `events.jsonl` is no entry of the chain after the line before it: edited,
    /// reordered or added.
    EventNotInChain { line: u64 },
}

impl fmt::Display for Break {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Altered { seq } => write!(f, "entry {seq} was altered: its hash is not the hash of its fields"),
            Self::Unlinked { seq } => {
                write!(f, "entry {seq} does not follow entry {}: an entry was removed, swapped or inserted", seq - 1)
            }
            Self::Gap { expected, seq } => write!(f, "entry {expected} is missing: the next entry is {seq}"),
            Self::BadSeal { seq } => write!(f, "the seal at entry {seq} does not verify"),
            Self::Truncated { anchor, last } => write!(
                f,
                "the head kept outside the sandbox is entry {anchor}, but the chain ends at {last}: cut, or replaced by an older copy"
            ),
            Self::Rewritten { seq } => {
                write!(f, "entry {seq} differs from the head kept outside the sandbox: the chain was rebuilt")
            }
            Self::EventNotInChain { line } => {
                write!(f, "line {line} of events.jsonl is not in the chain (edited, reordered or added)")
            }
        }
    }
}

/// What a verification found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// Entries read up to the first break (all of them when there is none).
    pub entries: u64,
    /// The last entry read.
    pub head: Head,
    /// The last seal's entry, if any generation was sealed.
    pub sealed: Option<u64>,
    /// The first break of the chain, then any of the anchor and of `events.jsonl`.
    pub breaks: Vec<Break>,
    /// With `events.jsonl`: entries no line matched (lines its cap or queue dropped, or removed).
    pub events_missing: Option<u64>,
}

impl Report {
    /// No break.
    pub fn intact(&self) -> bool {
        self.breaks.is_empty()
    }

    /// Entries written after the last seal: a supervisor that did not stop in order, or one still running.
    pub fn unsealed(&self) -> u64 {
        self.entries - self.sealed.unwrap_or(0)
    }
}

/// Why a chain could not be read at all.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// SQLite cannot read it.
    #[error("cannot read the audit database")]
    Sql(#[from] rusqlite::Error),
    /// It has no sandbox id: not an audit chain.
    #[error("not an audit chain")]
    NotAChain,
    /// More entries than [`MAX_ENTRIES`].
    #[error("more than {MAX_ENTRIES} entries")]
    TooLong,
}

/// Opens a chain for reading only.
fn open(path: &Path) -> Result<(Connection, String), VerifyError> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)?;
    let id: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE key = 'sandbox'", [], |r| r.get(0))
        .optional()
        .map_err(|_| VerifyError::NotAChain)?;
    Ok((conn, id.ok_or(VerifyError::NotAChain)?))
}

/// Every entry, in order, as stored (unchecked): for `vm-driver audit show`.
///
/// # Errors
/// [`VerifyError`].
pub fn entries(path: &Path) -> Result<Vec<Entry>, VerifyError> {
    let (conn, _) = open(path)?;
    let mut stmt = conn.prepare("SELECT seq, time_ms, class, event_hash, prev, hash FROM entries ORDER BY seq")?;
    let rows = stmt.query_map([], Entry::read)?;
    let mut out = Vec::new();
    for row in rows {
        if out.len() as u64 >= MAX_ENTRIES {
            return Err(VerifyError::TooLong);
        }
        out.push(row?);
    }
    Ok(out)
}

/// The chain's last entry as stored, for `GetAuditHead` (unchecked; `verify` checks).
///
/// # Errors
/// [`VerifyError`].
pub fn head(path: &Path) -> Result<(Head, Option<u64>), VerifyError> {
    let (conn, id) = open(path)?;
    let head = conn
        .query_row(
            "SELECT seq, time_ms, class, event_hash, prev, hash FROM entries ORDER BY seq DESC LIMIT 1",
            [],
            Entry::read,
        )
        .optional()?
        .map_or(Head { seq: 0, hash: genesis(&id) }, |e| Head { seq: e.seq, hash: e.hash });
    let sealed: Option<i64> = conn.query_row("SELECT max(seq) FROM seals", [], |r| r.get(0))?;
    Ok((head, sealed.and_then(|s| u64::try_from(s).ok())))
}

/// Recomputes the chain at `path` from genesis; checks its seals, the `anchor` kept outside (if any), and
/// the lines of `events` (the bytes of `events.jsonl`, if given).
///
/// # Errors
/// [`VerifyError`] when the database cannot be read as a chain; a readable chain's breaks are in the
/// [`Report`].
pub fn verify(path: &Path, anchor: Option<&Head>, events: Option<&[u8]>) -> Result<Report, VerifyError> {
    let (_, id) = open(path)?;
    let all = entries(path)?;
    let mut head = Head { seq: 0, hash: genesis(&id) };
    let mut breaks = Vec::new();
    let mut good: Vec<&Entry> = Vec::with_capacity(all.len());
    for entry in &all {
        let expected = head.seq + 1;
        let problem = if entry.seq != expected {
            Some(Break::Gap { expected, seq: entry.seq })
        } else if entry.prev != head.hash {
            Some(Break::Unlinked { seq: entry.seq })
        } else if entry.clone().checked().is_none() {
            Some(Break::Altered { seq: entry.seq })
        } else {
            None
        };
        if let Some(problem) = problem {
            breaks.push(problem);
            break;
        }
        head = Head { seq: entry.seq, hash: entry.hash };
        good.push(entry);
    }
    let hash_at = |seq: u64| -> Option<Hash> { good.get(usize::try_from(seq.checked_sub(1)?).ok()?).map(|e| e.hash) };
    let sealed = seals(path, &hash_at, &mut breaks)?;
    if let Some(anchor) = anchor.filter(|a| a.seq > 0) {
        match hash_at(anchor.seq) {
            None => breaks.push(Break::Truncated { anchor: anchor.seq, last: head.seq }),
            Some(hash) if hash != anchor.hash => breaks.push(Break::Rewritten { seq: anchor.seq }),
            Some(_) => {}
        }
    }
    let events_missing = events.map(|bytes| match_events(bytes, &good, &mut breaks));
    Ok(Report { entries: head.seq, head, sealed, breaks, events_missing })
}

/// Checks every seal; returns the last sealed entry.
fn seals(
    path: &Path,
    hash_at: &dyn Fn(u64) -> Option<Hash>,
    breaks: &mut Vec<Break>,
) -> Result<Option<u64>, VerifyError> {
    let (conn, _) = open(path)?;
    let mut stmt = conn.prepare("SELECT seq, hash, time_ms, seal FROM seals ORDER BY rowid")?;
    let rows = stmt.query_map([], |r| {
        let blob = |i: usize| -> rusqlite::Result<Hash> { Ok(r.get::<_, Vec<u8>>(i)?.try_into().unwrap_or([0; 32])) };
        Ok((r.get::<_, i64>(0)?, blob(1)?, r.get::<_, i64>(2)?, blob(3)?))
    })?;
    let mut last = None;
    for row in rows {
        let (seq, hash, time_ms, seal) = row?;
        let (seq, time_ms) = (u64::try_from(seq).unwrap_or(u64::MAX), u64::try_from(time_ms).unwrap_or(u64::MAX));
        let head = Head { seq, hash };
        let holds = seq == 0 || hash_at(seq) == Some(hash);
        if seal != seal_hash(&head, time_ms) || !holds {
            if !breaks.iter().any(|b| matches!(b, Break::BadSeal { .. })) {
                breaks.push(Break::BadSeal { seq });
            }
            continue;
        }
        last = last.max(Some(seq));
    }
    Ok(last)
}

/// Matches each line of `events` to the next entry with its hash; returns how many entries no line
/// matched.
fn match_events(events: &[u8], chain: &[&Entry], breaks: &mut Vec<Break>) -> u64 {
    let mut next = 0;
    let mut matched = 0u64;
    for (index, line) in events.split(|b| *b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        let hash = event_hash(line);
        match chain.iter().skip(next).position(|e| e.event_hash == hash) {
            Some(offset) => {
                next += offset + 1;
                matched += 1;
            }
            None => {
                breaks.push(Break::EventNotInChain { line: index as u64 + 1 });
                return chain.len() as u64 - matched;
            }
        }
    }
    chain.len() as u64 - matched
}

/// The report as `vm-driver audit verify` prints it.
pub fn describe(report: &Report) -> String {
    let mut out = format!("{} entries, head {}:{}\n", report.entries, report.head.seq, hex(&report.head.hash));
    match report.sealed {
        Some(seq) if report.unsealed() == 0 => out.push_str(&format!("sealed at entry {seq}\n")),
        Some(seq) => out.push_str(&format!(
            "unsealed: {} entries after the seal at entry {seq} (a supervisor that did not stop in order, or one still running)\n",
            report.unsealed()
        )),
        None => out.push_str("unsealed: never sealed (a supervisor that did not stop in order, or one still running)\n"),
    }
    let lines_broken = report.breaks.iter().any(|b| matches!(b, Break::EventNotInChain { .. }));
    if let Some(missing) = report.events_missing.filter(|_| !lines_broken) {
        out.push_str(&format!("events.jsonl: {missing} entries have no line there (its cap or queue dropped them)\n"));
    }
    for b in &report.breaks {
        out.push_str(&format!("BROKEN: {b}\n"));
    }
    out
}
