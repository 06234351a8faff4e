//! The registry: which sandboxes exist, each one's last published record and its actor's inbox. Nothing
//! else: shares live in [`super::ledger`], changes on [`super::events`], sessions in [`super::tokens`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use tokio::sync::mpsc;
use vm_contract::ids::SandboxId;

use super::actor::Command;
use super::admission::Refused;
use super::record::SandboxRecord;

struct Entry {
    record: SandboxRecord,
    inbox: mpsc::Sender<Command>,
}

/// Why a sandbox could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    /// The id is taken.
    #[error("the id is taken")]
    Taken,
    /// The driver is going down.
    #[error("the driver is shutting down")]
    Closing,
    /// It does not fit.
    #[error(transparent)]
    Refused(#[from] Refused),
}

/// The sandboxes, by id.
#[derive(Default)]
pub struct Registry {
    entries: Mutex<HashMap<SandboxId, Entry>>,
    /// Set (under the `entries` lock) once the driver is going down: no sandbox may be added after.
    closing: AtomicBool,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("closing", &self.is_closing()).finish_non_exhaustive()
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a sandbox; `share` is taken in the same locked step (so a create never holds room for an id it
    /// did not get) and returned.
    ///
    /// # Errors
    /// [`InsertError`]; `share` is not called then, or it refused.
    pub fn insert<T>(
        &self,
        record: SandboxRecord,
        inbox: mpsc::Sender<Command>,
        share: impl FnOnce() -> Result<T, Refused>,
    ) -> Result<T, InsertError> {
        let mut entries = self.lock();
        if self.is_closing() {
            return Err(InsertError::Closing);
        }
        if entries.contains_key(&record.id) {
            return Err(InsertError::Taken);
        }
        let share = share()?;
        entries.insert(record.id.clone(), Entry { record, inbox });
        Ok(share)
    }

    /// Keeps a sandbox's newly published record.
    pub fn update(&self, record: &SandboxRecord) {
        if let Some(entry) = self.lock().get_mut(&record.id) {
            entry.record = record.clone();
        }
    }

    /// Whether the id is taken.
    pub fn contains(&self, id: &SandboxId) -> bool {
        self.lock().contains_key(id)
    }

    /// Removes a sandbox.
    pub fn remove(&self, id: &SandboxId) {
        self.lock().remove(id);
    }

    /// One sandbox's record.
    pub fn get(&self, id: &SandboxId) -> Option<SandboxRecord> {
        self.lock().get(id).map(|e| e.record.clone())
    }

    /// Every sandbox's record, by id.
    pub fn list(&self) -> Vec<SandboxRecord> {
        let mut all: Vec<SandboxRecord> = self.lock().values().map(|e| e.record.clone()).collect();
        all.sort_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
        all
    }

    /// The actor's inbox.
    pub fn inbox(&self, id: &SandboxId) -> Option<mpsc::Sender<Command>> {
        self.lock().get(id).map(|e| e.inbox.clone())
    }

    /// Refuses new sandboxes from now on and returns every actor's inbox, so each gets its orderly stop.
    pub fn close(&self) -> Vec<mpsc::Sender<Command>> {
        let entries = self.lock();
        self.closing.store(true, Ordering::SeqCst);
        entries.values().map(|e| e.inbox.clone()).collect()
    }

    /// Whether the driver is going down.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }
}
