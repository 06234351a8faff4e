//! The supervisor's end: open a sandbox's chain (checking its last entry), append batches, seal.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension as _, TransactionBehavior};

use crate::{entry_hash, genesis, seal_hash, Hash, Head};

/// The tables. `STRICT`: a value of the wrong type is refused, not stored.
pub(crate) const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT;
    CREATE TABLE IF NOT EXISTS entries (
        seq INTEGER PRIMARY KEY, time_ms INTEGER NOT NULL, class INTEGER NOT NULL,
        event_hash BLOB NOT NULL, prev BLOB NOT NULL, hash BLOB NOT NULL) STRICT;
    CREATE TABLE IF NOT EXISTS seals (
        seq INTEGER NOT NULL, hash BLOB NOT NULL, time_ms INTEGER NOT NULL, seal BLOB NOT NULL) STRICT;
";

/// Why the chain cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// SQLite refused an open, a read or a write.
    #[error("the audit database failed")]
    Sql(#[from] rusqlite::Error),
    /// The database names another sandbox.
    #[error("the audit database belongs to another sandbox")]
    Foreign,
    /// The last entry's hash is not the hash of its fields: the chain was edited while stopped.
    #[error("the audit chain's last entry does not verify")]
    BrokenTail,
    /// A number does not fit SQLite's integers.
    #[error("an audit value is out of range")]
    Range,
}

/// One event to append: its OCSF class and the hash of its bytes.
#[derive(Debug, Clone, Copy)]
pub struct NewEntry {
    /// `class_uid`.
    pub class: u32,
    /// [`crate::event_hash`] of the bytes the sinks get.
    pub event_hash: Hash,
}

/// An open chain, owned by one supervisor.
#[derive(Debug)]
pub struct Chain {
    conn: Connection,
    head: Head,
    last_ms: u64,
}

impl Chain {
    /// Opens (or creates) the chain at `path` for `sandbox_id`, in WAL mode with `synchronous=FULL`: a
    /// committed entry survives a crash of the supervisor or the host. A chain left by an earlier
    /// generation continues, once its last entry verifies.
    ///
    /// # Errors
    /// [`ChainError`].
    pub fn open(path: &Path, sandbox_id: &str) -> Result<Self, ChainError> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.execute_batch(SCHEMA)?;
        let stored: Option<String> =
            conn.query_row("SELECT value FROM meta WHERE key = 'sandbox'", [], |r| r.get(0)).optional()?;
        match stored {
            None => {
                conn.execute("INSERT INTO meta (key, value) VALUES ('sandbox', ?1)", [sandbox_id])?;
            }
            Some(id) if id == sandbox_id => {}
            Some(_) => return Err(ChainError::Foreign),
        }
        let last = conn
            .query_row(
                "SELECT seq, time_ms, class, event_hash, prev, hash FROM entries ORDER BY seq DESC LIMIT 1",
                [],
                Entry::read,
            )
            .optional()?;
        let (head, last_ms) = match last {
            None => (Head { seq: 0, hash: genesis(sandbox_id) }, 0),
            Some(row) => {
                let row = row.checked().ok_or(ChainError::BrokenTail)?;
                (Head { seq: row.seq, hash: row.hash }, row.time_ms)
            }
        };
        Ok(Self { conn, head, last_ms })
    }

    /// The head: the last committed entry.
    pub fn head(&self) -> Head {
        self.head
    }

    /// Appends `batch` in one transaction (one sync to disk), returning each entry's head in order. Times
    /// never go backwards, whatever the wall clock does. On an error nothing of the batch is kept.
    ///
    /// # Errors
    /// [`ChainError`].
    pub fn append(&mut self, batch: &[NewEntry]) -> Result<Vec<Head>, ChainError> {
        let now = now_ms().max(self.last_ms);
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut head = self.head;
        let mut heads = Vec::with_capacity(batch.len());
        {
            let mut insert = tx.prepare_cached(
                "INSERT INTO entries (seq, time_ms, class, event_hash, prev, hash) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?;
            for entry in batch {
                let seq = head.seq + 1;
                let hash = entry_hash(seq, now, entry.class, &entry.event_hash, &head.hash);
                insert.execute(rusqlite::params![
                    sql_int(seq)?,
                    sql_int(now)?,
                    entry.class,
                    &entry.event_hash[..],
                    &head.hash[..],
                    &hash[..]
                ])?;
                head = Head { seq, hash };
                heads.push(head);
            }
        }
        tx.commit()?;
        self.head = head;
        self.last_ms = now;
        Ok(heads)
    }

    /// Seals the head: an orderly stop's mark, which [`crate::verify`] tells from an unsealed tail.
    ///
    /// # Errors
    /// [`ChainError`].
    pub fn seal(&mut self) -> Result<Head, ChainError> {
        let now = now_ms().max(self.last_ms);
        let seal = seal_hash(&self.head, now);
        self.conn.execute(
            "INSERT INTO seals (seq, hash, time_ms, seal) VALUES (?1, ?2, ?3, ?4)",
            rusqlite::params![sql_int(self.head.seq)?, &self.head.hash[..], sql_int(now)?, &seal[..]],
        )?;
        Ok(self.head)
    }
}

/// An entry as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its place, from 1.
    pub seq: u64,
    /// When it was appended, in milliseconds since the epoch (never before the entry before it).
    pub time_ms: u64,
    /// The event's OCSF `class_uid`.
    pub class: u32,
    /// SHA-256 of the event's bytes.
    pub event_hash: Hash,
    /// The hash of the entry before it ([`genesis`] for the first).
    pub prev: Hash,
    /// [`entry_hash`] of the fields above.
    pub hash: Hash,
}

impl Entry {
    /// Reads one row of `SELECT seq, time_ms, class, event_hash, prev, hash`. A value of the wrong size
    /// reads as zeroes, which no hash check passes.
    pub(crate) fn read(r: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        let hash = |i: usize| -> rusqlite::Result<Hash> {
            let bytes: Vec<u8> = r.get(i)?;
            Ok(bytes.try_into().unwrap_or([0; 32]))
        };
        let int = |i: usize| -> rusqlite::Result<u64> { Ok(u64::try_from(r.get::<_, i64>(i)?).unwrap_or(u64::MAX)) };
        Ok(Self {
            seq: int(0)?,
            time_ms: int(1)?,
            class: u32::try_from(r.get::<_, i64>(2)?).unwrap_or(u32::MAX),
            event_hash: hash(3)?,
            prev: hash(4)?,
            hash: hash(5)?,
        })
    }

    /// The row, if its hash is the hash of its fields.
    pub(crate) fn checked(self) -> Option<Self> {
        (entry_hash(self.seq, self.time_ms, self.class, &self.event_hash, &self.prev) == self.hash).then_some(self)
    }
}

fn sql_int(value: u64) -> Result<i64, ChainError> {
    i64::try_from(value).map_err(|_| ChainError::Range)
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
