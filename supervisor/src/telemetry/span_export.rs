//! OTLP trace export of the supervisor's spans, through the batch exporter ([`super::batch`]), to the
//! collector of the log export: the same endpoint and protocol, and the same credentials (headers, CA
//! bundle), read from the log export's live credentials, so a rotation applies to both.
//!
//! A full queue drops new spans (counted), one request is in flight at a time, a failed batch is retried
//! with backoff, and at shutdown the queue is flushed until a deadline. Failures are logged with fixed text
//! only.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};

use super::batch::{BatchConfig, BatchExport, Bounds, Export, Queue};
use super::credentials::LiveCredentials;
use super::exporter::{ExporterSpec, Rebuild, Signal as _, Traces};
use super::otlp::OtlpError;

/// Ended spans kept waiting for the collector before new ones are dropped (and counted).
pub const MAX_QUEUED_SPANS: usize = 2048;
/// Spans per export request.
const BATCH_SPANS: usize = 512;
/// The span queue's bound: spans are counted, not sized (their attributes are fixed text and ids).
pub(crate) const SPAN_BOUNDS: Bounds = Bounds { items: MAX_QUEUED_SPANS, bytes: usize::MAX };

impl Export for opentelemetry_otlp::SpanExporter {
    type Item = SpanData;

    async fn export(&self, batch: &[SpanData]) -> OTelSdkResult {
        opentelemetry_sdk::trace::SpanExporter::export(self, batch.to_vec()).await
    }
}

/// Hands every ended span to the queue; never blocks beyond a short lock.
#[derive(Debug)]
pub(crate) struct QueueProcessor(pub(crate) Arc<Queue<SpanData>>);

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.push(span, 0);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Where the span exporter comes from: the log export's collector and live credentials.
#[derive(Debug, Clone)]
pub(crate) struct SpanSource {
    /// The log export's collector, protocol and resource.
    pub(crate) spec: ExporterSpec,
    /// The log export's credentials.
    pub(crate) live: LiveCredentials,
}

impl SpanSource {
    /// Starts exporting what `queue` receives. Must run inside the tokio runtime.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    pub(crate) fn start(self, queue: Arc<Queue<SpanData>>) -> Result<BatchExport<SpanData>, OtlpError> {
        let (exporter, mut rebuild) = Rebuild::<Traces>::first(self.spec, self.live)?;
        // The verbose-failure-logs control widens the log export's failure lines only.
        let config =
            BatchConfig { name: Traces::NAME, batch_items: BATCH_SPANS, in_flight: 1, verbose_failures: false };
        Ok(BatchExport::start(exporter, move || rebuild.refresh(), queue, config))
    }
}

#[cfg(test)]
mod tests;
