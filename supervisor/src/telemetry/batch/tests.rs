use std::sync::atomic::AtomicUsize;

use super::*;

/// Items per request in these tests (the span export's).
const BATCH: usize = 512;

/// Fails its first `fail` requests, hangs forever when `hang`, takes `delay` per request, accepts otherwise.
#[derive(Debug, Default)]
struct Collector {
    fail: usize,
    hang: bool,
    delay: Duration,
    calls: AtomicUsize,
    /// Requests under way now, and the most ever at once.
    open: AtomicUsize,
    most_open: AtomicUsize,
    accepted: Mutex<Vec<u32>>,
}

/// The exporter's handle on a [`Collector`] the test keeps too.
#[derive(Debug)]
struct To(Arc<Collector>);

impl Export for To {
    type Item = u32;

    async fn export(&self, batch: &[u32]) -> OTelSdkResult {
        let call = self.0.calls.fetch_add(1, Ordering::Relaxed);
        let open = self.0.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.0.most_open.fetch_max(open, Ordering::Relaxed);
        if self.0.hang {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.0.delay).await;
        self.0.open.fetch_sub(1, Ordering::Relaxed);
        if call < self.0.fail {
            return Err(OTelSdkError::InternalFailure("refused".into()));
        }
        self.0.accepted.lock().unwrap().extend_from_slice(batch);
        Ok(())
    }
}

fn config(in_flight: usize) -> BatchConfig {
    BatchConfig { name: "test OTLP", batch_items: BATCH, in_flight, verbose_failures: false }
}

/// A queue offered `n` items.
fn queue_of(n: usize) -> Arc<Queue<u32>> {
    let queue = Arc::new(Queue::new(Bounds { items: 100_000, bytes: usize::MAX }));
    for i in 0..n {
        queue.push(u32::try_from(i).unwrap(), 1);
    }
    queue
}

fn start(collector: &Arc<Collector>, queue: &Arc<Queue<u32>>, in_flight: usize) -> BatchExport<u32> {
    BatchExport::start(To(Arc::clone(collector)), || None, Arc::clone(queue), config(in_flight))
}

async fn until_accepted(collector: &Collector, n: usize) {
    let until = Instant::now() + Duration::from_secs(10);
    while collector.accepted.lock().unwrap().len() < n && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn the_queue_is_bounded_in_items_and_bytes_and_counts_what_it_drops() {
    let queue = Queue::new(Bounds { items: 3, bytes: 100 });
    for i in 0..5 {
        queue.push(i, 10);
    }
    assert_eq!((queue.len(), queue.bytes(), queue.dropped()), (3, 30, 2), "the item bound");
    let queue = Queue::new(Bounds { items: 100, bytes: 100 });
    for i in 0..5 {
        queue.push(i, 40);
    }
    queue.push(5, 20);
    assert_eq!((queue.len(), queue.bytes(), queue.dropped()), (3, 100, 3), "the byte bound");
    // A batch given back keeps its place and its bytes.
    let batch = queue.take(2);
    assert_eq!(queue.bytes(), 20);
    queue.put_back(batch);
    assert_eq!((queue.snapshot(), queue.bytes()), (vec![0, 1, 5], 100));
}

#[tokio::test]
async fn failed_batches_are_retried_and_all_delivered() {
    let collector = Arc::new(Collector { fail: 3, ..Collector::default() });
    let queue = queue_of(BATCH + 10);
    let export = start(&collector, &queue, 1);
    // Retried with backoff (100, 200, 400 ms) while running, not only by the flush.
    until_accepted(&collector, BATCH + 10).await;
    assert_eq!(collector.accepted.lock().unwrap().len(), BATCH + 10, "delivered before the flush");
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!(report.exported, (BATCH + 10) as u64);
    assert_eq!(report.failed_requests, 3);
    assert_eq!(report.dropped, 0);
    let mut accepted = collector.accepted.lock().unwrap().clone();
    accepted.sort_unstable();
    assert_eq!(accepted, (0..u32::try_from(BATCH + 10).unwrap()).collect::<Vec<_>>(), "each once");
}

#[tokio::test]
async fn the_flush_ends_at_its_deadline_and_counts_the_rest() {
    let collector = Arc::new(Collector { hang: true, ..Collector::default() });
    let queue = queue_of(BATCH + 10);
    let export = start(&collector, &queue, 1);
    let started = Instant::now();
    let report = export.shutdown(Duration::from_millis(500)).await;
    assert!(started.elapsed() < EXPORT_TIMEOUT, "the flush kept to its budget");
    assert_eq!(report.exported, 0);
    assert_eq!(report.dropped, (BATCH + 10) as u64, "queued and in flight alike");
}

#[tokio::test]
async fn items_queued_while_running_are_exported_without_a_flush() {
    let collector = Arc::new(Collector::default());
    let queue = queue_of(0);
    let export = start(&collector, &queue, 1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    for i in 0..3 {
        queue.push(i, 1);
    }
    until_accepted(&collector, 3).await;
    assert_eq!(collector.accepted.lock().unwrap().len(), 3);
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!((report.exported, report.dropped), (3, 0));
}

#[tokio::test]
async fn the_flush_does_not_wait_a_backoff_earned_before_the_stop() {
    // Five failures before the stop earn a 2 s backoff; the flush's first try fails too. It must retry
    // within its 1 s budget, not after the earned backoff.
    let collector = Arc::new(Collector { fail: 6, ..Collector::default() });
    let queue = queue_of(10);
    let export = start(&collector, &queue, 1);
    let until = Instant::now() + Duration::from_secs(10);
    while collector.calls.load(Ordering::Relaxed) < 5 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!((report.exported, report.dropped), (10, 0), "{report:?}");
    assert_eq!(collector.accepted.lock().unwrap().len(), 10);
}

#[tokio::test]
async fn requests_in_flight_stay_within_the_limit() {
    let collector = Arc::new(Collector { delay: Duration::from_millis(50), ..Collector::default() });
    let queue = queue_of(BATCH * 10);
    let export = start(&collector, &queue, 4);
    until_accepted(&collector, BATCH * 10).await;
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!((report.exported, report.dropped), ((BATCH * 10) as u64, 0));
    assert_eq!(collector.most_open.load(Ordering::Relaxed), 4, "four at once, never more");
    let one = Arc::new(Collector { delay: Duration::from_millis(5), ..Collector::default() });
    let export = start(&one, &queue_of(BATCH * 3), 1);
    until_accepted(&one, BATCH * 3).await;
    export.shutdown(Duration::from_secs(1)).await;
    assert_eq!(one.most_open.load(Ordering::Relaxed), 1, "the control: one at a time");
}

#[tokio::test]
async fn a_refreshed_exporter_takes_the_next_request() {
    let (old, new) = (Arc::new(Collector::default()), Arc::new(Collector::default()));
    let queue = queue_of(3);
    let mut fresh = Some(To(Arc::clone(&new)));
    let mut asked = 0;
    let refresh = move || {
        asked += 1;
        // The credentials change after the first request.
        if asked > 1 {
            fresh.take()
        } else {
            None
        }
    };
    let export = BatchExport::start(To(Arc::clone(&old)), refresh, Arc::clone(&queue), config(1));
    until_accepted(&old, 3).await;
    queue.push(7, 1);
    until_accepted(&new, 1).await;
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!(report.exported, 4);
    assert_eq!((old.accepted.lock().unwrap().len(), new.accepted.lock().unwrap().clone()), (3, vec![7]));
}
