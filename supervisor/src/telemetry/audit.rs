//! The audit chain between [`super::Telemetry::emit`] and the sinks. One thread appends each batch of
//! events to the sandbox's chain (`vm-audit`: one transaction, synced to disk), and only then gives them
//! to the console, `events.jsonl` and OTLP, each OTLP record carrying the chain's head after its event. No
//! sink sees an event the chain does not hold.
//!
//! The emitting side never waits on the disk: the queue between them is bounded ([`QUEUE_ITEMS`] events
//! of at most `MAX_EVENT_BYTES` each). A full queue drops an event that is not essential (counted with
//! the rate limit's drops, and reported the same way) and waits for an essential one. An append that
//! fails (the disk, SQLite) stops the chain for the rest of the generation: the events still reach the
//! sinks, the failure is logged once in fixed text, and the stop reports no head, so the chain reads as
//! unsealed from there.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;

use vm_audit::chain::{Chain, NewEntry};
use vm_audit::Head;
use vm_ocsf::Event;

use super::console::ConsoleHandle;
use super::jsonl::Jsonl;
use super::otlp::Otlp;

/// Events between `emit` and the chain.
pub const QUEUE_ITEMS: usize = 1024;

/// Most events appended in one transaction.
const BATCH: usize = 256;

/// Where events go once the chain holds them.
#[derive(Debug)]
pub struct Sinks {
    /// The console (shorthand, and JSON lines when `json`).
    pub console: ConsoleHandle,
    /// Console JSON.
    pub json: bool,
    /// `events.jsonl`.
    pub jsonl: Option<Jsonl>,
    /// The collector.
    pub otlp: Option<Otlp>,
}

impl Sinks {
    fn deliver(&self, event: &Event, json: String, head: Option<Head>) {
        let stamp = humantime::format_rfc3339_millis(std::time::SystemTime::now());
        self.console.line(format!("{stamp} {}", event.shorthand()).into_bytes());
        if self.json {
            self.console.line(format!("{stamp} OCSF_JSON {json}").into_bytes());
        }
        if let Some(otlp) = &self.otlp {
            otlp.emit(event, &json, head);
        }
        if let Some(jsonl) = &self.jsonl {
            jsonl.write(json, event.essential);
        }
    }
}

/// What the thread hands back at the end.
#[derive(Debug)]
pub struct Finished {
    /// The sinks, to flush.
    pub sinks: Sinks,
    /// The sealed head; `None` without a chain, or when it failed.
    pub head: Option<Head>,
}

/// The emitting side.
#[derive(Debug)]
pub struct Audited {
    queue: Option<SyncSender<(Event, String)>>,
    thread: Option<JoinHandle<Finished>>,
}

impl Audited {
    /// Starts the thread; `chain` `None` (the `no-audit-chain` control) passes events straight through.
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn start(chain: Option<Chain>, sinks: Sinks) -> std::io::Result<Self> {
        let (queue, events) = sync_channel(QUEUE_ITEMS);
        let thread = std::thread::Builder::new().name("audit".into()).spawn(move || run(chain, sinks, &events))?;
        Ok(Self { queue: Some(queue), thread: Some(thread) })
    }

    /// Queues one event. Returns `false` when it was dropped: the queue was full and it is not essential.
    pub fn send(&self, event: Event, json: String) -> bool {
        let Some(queue) = &self.queue else { return false };
        let essential = event.essential;
        match queue.try_send((event, json)) {
            Ok(()) => true,
            Err(TrySendError::Full(item)) if essential => queue.send(item).is_ok(),
            Err(_) => false,
        }
    }

    /// Closes the queue and waits for the thread to append, deliver and seal what it holds. Blocking.
    pub fn finish(mut self) -> Option<Finished> {
        drop(self.queue.take());
        self.thread.take()?.join().ok()
    }
}

fn run(mut chain: Option<Chain>, sinks: Sinks, events: &Receiver<(Event, String)>) -> Finished {
    while let Ok(first) = events.recv() {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match events.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let entries: Vec<NewEntry> = batch
            .iter()
            .map(|(event, json)| NewEntry { class: event.class.uid, event_hash: vm_audit::event_hash(json.as_bytes()) })
            .collect();
        let heads = match chain.as_mut().map(|c| c.append(&entries)) {
            Some(Ok(heads)) => heads.into_iter().map(Some).collect(),
            Some(Err(_)) => {
                tracing::error!("the audit chain cannot be appended to; events go on to the sinks without it");
                chain = None;
                vec![None; batch.len()]
            }
            None => vec![None; batch.len()],
        };
        for ((event, json), head) in batch.into_iter().zip(heads) {
            sinks.deliver(&event, json, head);
        }
    }
    let head = chain.as_mut().and_then(|c| c.seal().ok());
    Finished { sinks, head }
}
