//! The audit chain between [`super::Telemetry::emit`] and the sinks. One thread appends each batch of
//! events to the sandbox's chain (`vm-audit`: one transaction, synced to disk), and only then gives them
//! to the console, `events.jsonl` and OTLP, each OTLP record carrying the chain's head after its event. No
//! sink sees an event the chain does not hold.
//!
//! The emitting side never waits on the disk: the queue between them is bounded ([`QUEUE_ITEMS`] events
//! of at most `MAX_EVENT_BYTES` each). Past [`HIGH_WATER`] queued events the queue reads as backlogged
//! ([`Backlog`]) and the serving loop stops reading the guest until it is back under [`LOW_WATER`]: a
//! workload that makes events faster than this host's disk takes them is slowed, and loses none. Only a
//! queue full all the same (events a client or egress caused while the guest was not read) drops an event
//! that is not essential (counted with the rate limit's drops, and reported the same way). Essential events
//! (lifecycle, drop reports) have [`ESSENTIAL_RESERVE`] places of their own beyond that, so the loop never
//! waits on the disk, not even for them. An append that
//! fails (the disk, SQLite) stops the chain for the rest of the generation: the events still reach the
//! sinks, the failure is logged once in fixed text, and the stop reports no head, so the chain reads as
//! unsealed from there.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::Notify;

use vm_audit::chain::{Chain, NewEntry};
use vm_audit::Head;
use vm_ocsf::Event;

use super::console::ConsoleHandle;
use super::jsonl::Jsonl;
use super::otlp::Otlp;
use super::TelemetryControls;

/// Events between `emit` and the chain.
pub const QUEUE_ITEMS: usize = 1024;
/// Places beyond [`QUEUE_ITEMS`] that only essential events may take: they are few (a start, a stop, a drop
/// report every ten seconds), so a stalled disk fills these only after minutes.
pub const ESSENTIAL_RESERVE: usize = 256;

/// Queued events past which the serving loop stops reading the guest.
pub const HIGH_WATER: usize = QUEUE_ITEMS * 3 / 4;
/// Queued events under which it reads the guest again.
pub const LOW_WATER: usize = QUEUE_ITEMS / 4;

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

/// How full the queue is, shared by the emitting side and the thread: events queued and not yet delivered.
#[derive(Debug)]
pub struct Backlog {
    queued: AtomicUsize,
    drained: Notify,
    /// `false` only under the `no-telemetry-backpressure` control.
    applies: bool,
}

impl Backlog {
    /// Whether the queue is past [`HIGH_WATER`]: the guest should not be read until [`Backlog::drained`].
    pub fn backlogged(&self) -> bool {
        self.applies && self.queued.load(Ordering::Acquire) > HIGH_WATER
    }

    /// Resolves once the queue has come back under [`LOW_WATER`] (perhaps already: check again).
    pub async fn drained(&self) {
        self.drained.notified().await;
    }

    fn delivered(&self, n: usize) {
        let before = self.queued.fetch_sub(n, Ordering::AcqRel);
        if before.saturating_sub(n) < LOW_WATER {
            self.drained.notify_one();
        }
    }
}

/// The emitting side.
#[derive(Debug)]
pub struct Audited {
    queue: Option<SyncSender<(Event, String)>>,
    backlog: Arc<Backlog>,
    thread: Option<JoinHandle<Finished>>,
}

impl Audited {
    /// Starts the thread; `chain` `None` (the `no-audit-chain` control) passes events straight through.
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn start(chain: Option<Chain>, sinks: Sinks, controls: TelemetryControls) -> std::io::Result<Self> {
        let (queue, events) = sync_channel(QUEUE_ITEMS + ESSENTIAL_RESERVE);
        let backlog = Arc::new(Backlog {
            queued: AtomicUsize::new(0),
            drained: Notify::new(),
            applies: !controls.no_backpressure,
        });
        let shared = Arc::clone(&backlog);
        let stall = controls.audit_stall.then(|| std::path::PathBuf::from(STALL_FILE));
        let thread = std::thread::Builder::new()
            .name("audit".into())
            .spawn(move || run(chain, sinks, &events, &shared, stall))?;
        Ok(Self { queue: Some(queue), backlog, thread: Some(thread) })
    }

    /// A queue whose thread appends nothing while `stall` exists, for the tests of a stalled disk.
    #[cfg(test)]
    fn stalled_by(stall: std::path::PathBuf, sinks: Sinks) -> Self {
        let (queue, events) = sync_channel(QUEUE_ITEMS + ESSENTIAL_RESERVE);
        let backlog = Arc::new(Backlog { queued: AtomicUsize::new(0), drained: Notify::new(), applies: true });
        let shared = Arc::clone(&backlog);
        let thread = std::thread::spawn(move || run(None, sinks, &events, &shared, Some(stall)));
        Self { queue: Some(queue), backlog, thread: Some(thread) }
    }

    /// How full the queue is.
    pub fn backlog(&self) -> Arc<Backlog> {
        Arc::clone(&self.backlog)
    }

    /// Queues one event, never waiting. Returns `false` when it was dropped: the queue was full (its reserve
    /// too, for an essential one).
    pub fn send(&self, event: Event, json: String) -> bool {
        let Some(queue) = &self.queue else { return false };
        if !event.essential && self.backlog.queued.load(Ordering::Acquire) >= QUEUE_ITEMS {
            return false;
        }
        // Counted before it is queued, so the thread never counts down past what it was given.
        self.backlog.queued.fetch_add(1, Ordering::AcqRel);
        let sent = queue.try_send((event, json)).is_ok();
        if !sent {
            self.backlog.queued.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }

    /// Closes the queue and waits for the thread to append, deliver and seal what it holds. Blocking.
    pub fn finish(mut self) -> Option<Finished> {
        drop(self.queue.take());
        self.thread.take()?.join().ok()
    }
}

/// The `audit-stall` fault injection's file, in the sandbox directory (the supervisor's working directory).
const STALL_FILE: &str = "audit-stall";

fn run(
    mut chain: Option<Chain>,
    sinks: Sinks,
    events: &Receiver<(Event, String)>,
    backlog: &Backlog,
    stall: Option<std::path::PathBuf>,
) -> Finished {
    while let Ok(first) = events.recv() {
        while stall.as_ref().is_some_and(|file| file.exists()) {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
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
        let n = batch.len();
        for ((event, json), head) in batch.into_iter().zip(heads) {
            sinks.deliver(&event, json, head);
        }
        backlog.delivered(n);
    }
    let head = chain.as_mut().and_then(|c| c.seal().ok());
    Finished { sinks, head }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backlog(applies: bool) -> Backlog {
        Backlog { queued: AtomicUsize::new(0), drained: Notify::new(), applies }
    }

    #[tokio::test]
    async fn the_backlog_holds_the_guest_from_high_water_until_under_low_water() {
        let b = backlog(true);
        b.queued.store(HIGH_WATER, Ordering::Release);
        assert!(!b.backlogged(), "at high water, still read");
        b.queued.fetch_add(1, Ordering::AcqRel);
        assert!(b.backlogged());
        b.delivered(HIGH_WATER + 1 - LOW_WATER);
        assert!(!b.backlogged());
        let waited = tokio::time::timeout(std::time::Duration::from_millis(200), b.drained()).await;
        assert!(waited.is_err(), "at low water, not yet drained");
        b.delivered(1);
        let waited = tokio::time::timeout(std::time::Duration::from_secs(5), b.drained()).await;
        assert!(waited.is_ok(), "under low water, the loop is woken");
    }

    #[test]
    fn a_stalled_disk_never_makes_the_emitter_wait_and_essential_events_keep_a_reserve() {
        let stall = std::env::temp_dir().join(format!("audit-stall-unit-{}", std::process::id()));
        std::fs::write(&stall, b"").unwrap();
        let console = super::super::console::Console::start_on(Box::new(std::io::sink()));
        let sinks = Sinks { console: console.handle(), json: false, jsonl: None, otlp: None };
        let audited = Audited::stalled_by(stall.clone(), sinks);
        let source = vm_ocsf::Source::new(vm_ocsf::SchemaVersion::default(), "sb", "test", "0");
        let event = |essential: bool| {
            let mut e = source.config_change("x");
            e.essential = essential;
            let json = e.to_json();
            (e, json)
        };
        let started = std::time::Instant::now();
        // The thread may hold the first event in hand, stalled, before the queue counts as full.
        let plain = (0..QUEUE_ITEMS + 10)
            .filter(|_| {
                let (e, j) = event(false);
                audited.send(e, j)
            })
            .count();
        assert!((QUEUE_ITEMS..=QUEUE_ITEMS + 1).contains(&plain), "{plain} queued");
        assert!(audited.backlog().backlogged());
        let essential = (0..ESSENTIAL_RESERVE + 10)
            .filter(|_| {
                let (e, j) = event(true);
                audited.send(e, j)
            })
            .count();
        assert!(essential >= ESSENTIAL_RESERVE - 1, "essential events use the reserve: {essential}");
        assert!(essential < ESSENTIAL_RESERVE + 10, "and are dropped past it rather than waited for");
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "the emitter never waited");
        std::fs::remove_file(&stall).unwrap();
        assert!(audited.finish().is_some());
        console.shutdown(std::time::Instant::now());
    }

    #[test]
    fn control_without_backpressure_the_queue_never_reads_as_backlogged() {
        let b = backlog(false);
        b.queued.store(QUEUE_ITEMS, Ordering::Release);
        assert!(!b.backlogged());
    }
}
