//! The service's shared connections, one per sandbox, made on first use and again after one breaks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use vm_contract::layout::SandboxLayout;

use super::Conn;
use crate::attach_client::{self, AttachError};

/// A sandbox's connection, or none yet. Held across a connect, so concurrent first opens make one.
type Slot = tokio::sync::Mutex<Option<Conn>>;

/// The shared connections, by sandbox directory.
#[derive(Debug, Default)]
pub struct Connections {
    slots: Mutex<HashMap<PathBuf, Arc<Slot>>>,
    /// The `exec-mux-head-of-line` control, for every connection made.
    head_of_line: bool,
}

impl Connections {
    /// None yet; `head_of_line` is the `exec-mux-head-of-line` control (see [`Conn::start`]).
    pub fn new(head_of_line: bool) -> Arc<Self> {
        Arc::new(Self { slots: Mutex::default(), head_of_line })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<PathBuf, Arc<Slot>>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sandboxes with a connection entry (live or being made).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sandbox's live connection, or a new one (connect and handshake within
    /// [`attach_client::CONNECT_TIMEOUT`]).
    ///
    /// # Errors
    /// [`AttachError`] when no connection can be made.
    pub async fn get(self: &Arc<Self>, layout: &SandboxLayout) -> Result<Conn, AttachError> {
        let key = layout.dir().to_path_buf();
        let slot = Arc::clone(self.lock().entry(key.clone()).or_default());
        let mut held = slot.lock().await;
        if let Some(conn) = held.as_ref().filter(|c| !c.is_closed()) {
            return Ok(conn.clone());
        }
        *held = None;
        match attach_client::handshaken(layout).await {
            Ok((stream, capabilities)) => {
                let (connections, weak_slot, at) = (Arc::downgrade(self), Arc::downgrade(&slot), key);
                let conn = Conn::start(stream, capabilities, self.head_of_line, move || {
                    if let Some(connections) = connections.upgrade() {
                        connections.forget(&at, &weak_slot);
                    }
                });
                *held = Some(conn.clone());
                Ok(conn)
            }
            Err(e) => {
                drop(held);
                self.forget(&key, &Arc::downgrade(&slot));
                Err(e)
            }
        }
    }

    /// Drops the entry of a connection that closed (or never came), unless a new one is in it or being made:
    /// nothing stays behind for a deleted sandbox.
    fn forget(&self, key: &PathBuf, slot: &Weak<Slot>) {
        let mut slots = self.lock();
        let Some(current) = slots.get(key) else { return };
        if !std::ptr::eq(Arc::as_ptr(current), slot.as_ptr()) {
            return;
        }
        let idle = current.try_lock().is_ok_and(|c| c.as_ref().is_none_or(Conn::is_closed));
        if idle {
            slots.remove(key);
        }
    }
}
