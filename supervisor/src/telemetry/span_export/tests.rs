use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
use opentelemetry_sdk::trace::SdkTracerProvider;

use super::*;

#[test]
fn the_queue_is_bounded_and_counts_what_it_drops() {
    let queue = Arc::new(Queue::new(SPAN_BOUNDS));
    let provider = SdkTracerProvider::builder().with_span_processor(QueueProcessor(Arc::clone(&queue))).build();
    let tracer = provider.tracer("t");
    for _ in 0..MAX_QUEUED_SPANS + 7 {
        tracer.start("s").end();
    }
    assert_eq!(queue.len(), MAX_QUEUED_SPANS);
    assert_eq!(queue.dropped(), 7);
}
