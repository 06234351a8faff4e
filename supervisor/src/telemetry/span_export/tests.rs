use std::sync::atomic::AtomicUsize;

use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
use opentelemetry_sdk::trace::SdkTracerProvider;

use super::*;

/// `n` ended spans, through the processor.
fn ended(n: usize) -> Vec<SpanData> {
    let queue = Arc::new(SpanQueue::default());
    let provider = SdkTracerProvider::builder().with_span_processor(QueueProcessor(Arc::clone(&queue))).build();
    let tracer = provider.tracer("t");
    for _ in 0..n {
        tracer.start("s").end();
    }
    queue.take(usize::MAX)
}

/// Fails its first `fail` requests, hangs forever when `hang`, accepts otherwise.
#[derive(Debug, Default)]
struct Collector {
    fail: usize,
    hang: bool,
    calls: AtomicUsize,
    accepted: Mutex<Vec<SpanData>>,
}

/// The exporter's handle on a [`Collector`] the test keeps too.
#[derive(Debug)]
struct To(Arc<Collector>);

impl SpanExporter for To {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let call = self.0.calls.fetch_add(1, Ordering::Relaxed);
        if self.0.hang {
            std::future::pending::<()>().await;
        }
        if call < self.0.fail {
            return Err(OTelSdkError::InternalFailure("refused".into()));
        }
        self.0.accepted.lock().unwrap().extend(batch);
        Ok(())
    }
}

/// A queue offered `n` spans (copies of one: the generating queue is bounded too).
fn queue_of(n: usize) -> Arc<SpanQueue> {
    let queue = Arc::new(SpanQueue::default());
    let span = ended(1).remove(0);
    for _ in 0..n {
        queue.push(span.clone());
    }
    queue
}

#[test]
fn the_queue_is_bounded_and_counts_what_it_drops() {
    let queue = queue_of(MAX_QUEUED_SPANS + 7);
    assert_eq!(queue.len(), MAX_QUEUED_SPANS);
    assert_eq!(queue.dropped(), 7);
}

#[tokio::test]
async fn failed_batches_are_retried_and_all_delivered() {
    let collector = Arc::new(Collector { fail: 3, ..Collector::default() });
    let queue = queue_of(BATCH_SPANS + 10);
    let export = SpanExport::start(To(Arc::clone(&collector)), || None, Arc::clone(&queue));
    // Retried with backoff (100, 200, 400 ms) while running, not only by the flush.
    let until = Instant::now() + Duration::from_secs(10);
    while collector.accepted.lock().unwrap().len() < BATCH_SPANS + 10 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(collector.accepted.lock().unwrap().len(), BATCH_SPANS + 10, "delivered before the flush");
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!(report.exported, (BATCH_SPANS + 10) as u64);
    assert_eq!(report.failed_requests, 3);
    assert_eq!(report.dropped, 0);
    assert_eq!(collector.accepted.lock().unwrap().len(), BATCH_SPANS + 10);
}

#[tokio::test]
async fn the_flush_ends_at_its_deadline_and_counts_the_rest() {
    let collector = Arc::new(Collector { hang: true, ..Collector::default() });
    let queue = queue_of(BATCH_SPANS + 10);
    let export = SpanExport::start(To(Arc::clone(&collector)), || None, Arc::clone(&queue));
    let started = Instant::now();
    let report = export.shutdown(Duration::from_millis(500)).await;
    assert!(started.elapsed() < EXPORT_TIMEOUT, "the flush kept to its budget");
    assert_eq!(report.exported, 0);
    assert_eq!(report.dropped, (BATCH_SPANS + 10) as u64);
}

#[tokio::test]
async fn spans_ended_while_running_are_exported_without_a_flush() {
    let collector = Arc::new(Collector::default());
    let queue = Arc::new(SpanQueue::default());
    let export = SpanExport::start(To(Arc::clone(&collector)), || None, Arc::clone(&queue));
    tokio::time::sleep(Duration::from_millis(10)).await;
    for span in ended(3) {
        queue.push(span);
    }
    let until = Instant::now() + Duration::from_secs(5);
    while collector.accepted.lock().unwrap().len() < 3 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(collector.accepted.lock().unwrap().len(), 3);
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!((report.exported, report.dropped), (3, 0));
}

#[test]
fn traces_go_beside_the_logs() {
    assert_eq!(http_traces_url("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/traces");
    assert_eq!(http_traces_url("http://127.0.0.1:4318/"), "http://127.0.0.1:4318/v1/traces");
    assert_eq!(http_traces_url("http://c:4318/v1/logs"), "http://c:4318/v1/traces");
    assert_eq!(http_traces_url("http://c:4318/custom/logs"), "http://c:4318/custom/traces");
    assert_eq!(http_traces_url("http://c:4318/ingest"), "http://c:4318/v1/traces");
    assert_eq!(http_traces_url("http://c:4318/blogs"), "http://c:4318/v1/traces");
}

#[tokio::test]
async fn the_flush_does_not_wait_a_backoff_earned_before_the_stop() {
    // Five failures before the stop earn a 2 s backoff; the flush's first try fails too. It must retry
    // within its 1 s budget, not after the earned backoff.
    let collector = Arc::new(Collector { fail: 6, ..Collector::default() });
    let queue = queue_of(10);
    let export = SpanExport::start(To(Arc::clone(&collector)), || None, Arc::clone(&queue));
    let until = Instant::now() + Duration::from_secs(10);
    while collector.calls.load(Ordering::Relaxed) < 5 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let report = export.shutdown(Duration::from_secs(1)).await;
    assert_eq!((report.exported, report.dropped), (10, 0), "{report:?}");
    assert_eq!(collector.accepted.lock().unwrap().len(), 10);
}
