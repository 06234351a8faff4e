//! The stream of changes `Watch` follows: every published record, and platform events.

use tokio::sync::broadcast;
use vm_contract::ids::SandboxId;

use super::record::SandboxRecord;

/// Changes `Watch` subscribers may lag behind before they miss some.
const WATCH_BUFFER: usize = 1024;

/// One change.
#[derive(Debug, Clone)]
pub enum Event {
    /// A sandbox's new record.
    Changed(Box<SandboxRecord>),
    /// Something happened to a sandbox that its record does not show.
    Platform(PlatformNote),
}

/// A platform event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlatformNote {
    /// The sandbox.
    pub sandbox: SandboxId,
    /// What kind (`accelerator`, `deleted`, `supervisor-exited` ...).
    pub kind: String,
    /// In words.
    pub message: String,
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: i64,
}

/// The bus.
#[derive(Debug)]
pub struct Events {
    tx: broadcast::Sender<Event>,
}

impl Default for Events {
    fn default() -> Self {
        Self { tx: broadcast::channel(WATCH_BUFFER).0 }
    }
}

impl Events {
    /// Publishes a sandbox's new record.
    pub fn changed(&self, record: &SandboxRecord) {
        self.send(Event::Changed(Box::new(record.clone())));
    }

    /// Publishes a platform event.
    pub fn platform(&self, id: &SandboxId, kind: &str, message: impl Into<String>) {
        let time_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let note = PlatformNote { sandbox: id.clone(), kind: kind.into(), message: message.into(), time_ms };
        self.send(Event::Platform(note));
    }

    fn send(&self, event: Event) {
        // No subscribers is fine.
        let _ = self.tx.send(event);
    }

    /// Changes from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}
