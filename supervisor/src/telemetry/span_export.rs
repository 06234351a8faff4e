//! OTLP trace export of the supervisor's spans: a bounded queue, fed by a span processor that never blocks,
//! and one export task that sends batches to the collector of the log export: the same endpoint and
//! protocol, and the same credentials (headers, CA bundle), read from the log export's slots, so a rotation
//! applies to both.
//!
//! Not the SDK's `BatchSpanProcessor`: it exports on a thread of its own with a blocking executor, where the
//! async HTTP client has no runtime to run on, and its shutdown blocks the caller (our single-threaded
//! runtime, which the gRPC client needs to make progress). Ours runs in the supervisor's runtime like the
//! log export: a full queue drops new spans (counted), a failed batch is retried with backoff, and at
//! shutdown it flushes until a deadline. Failures are logged with fixed text only.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_otlp::{Protocol as OtlpProtocol, WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::credentials::{CredentialSlots, Credentials};
use super::exporter::{grpc_metadata, grpc_tls, http_client};
use super::otlp::{ExportReport, OtlpError, Protocol, EXPORT_TIMEOUT};

/// Ended spans kept waiting for the collector before new ones are dropped (and counted).
pub const MAX_QUEUED_SPANS: usize = 2048;
/// Spans per export request.
const BATCH_SPANS: usize = 512;
/// Retry backoff bounds.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// At most one failure line per this interval.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// The bounded queue between the processor and the export task.
#[derive(Debug, Default)]
pub(crate) struct SpanQueue {
    spans: Mutex<VecDeque<SpanData>>,
    ready: Notify,
    dropped: AtomicU64,
}

impl SpanQueue {
    fn push(&self, span: SpanData) {
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        if spans.len() >= MAX_QUEUED_SPANS {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        spans.push_back(span);
        drop(spans);
        self.ready.notify_one();
    }

    fn take(&self, max: usize) -> Vec<SpanData> {
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        let n = spans.len().min(max);
        spans.drain(..n).collect()
    }

    fn put_back(&self, batch: Vec<SpanData>) {
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        for span in batch.into_iter().rev() {
            spans.push_front(span);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.spans.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Spans dropped because the queue was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    pub(crate) fn snapshot(&self) -> Vec<SpanData> {
        self.spans.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect()
    }
}

/// Hands every ended span to the queue; never blocks beyond a short lock.
#[derive(Debug)]
pub(crate) struct QueueProcessor(pub(crate) Arc<SpanQueue>);

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.push(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The running export task.
#[derive(Debug)]
pub(crate) struct SpanExport {
    queue: Arc<SpanQueue>,
    stop: watch::Sender<Option<Instant>>,
    task: JoinHandle<ExportReport>,
}

impl SpanExport {
    /// Starts exporting what `queue` receives with `exporter`, or the newer one `refresh` gives before a
    /// request. Must run inside the tokio runtime.
    pub(crate) fn start<E, F>(exporter: E, refresh: F, queue: Arc<SpanQueue>) -> Self
    where
        E: SpanExporter + 'static,
        F: FnMut() -> Option<E> + Send + 'static,
    {
        let (stop, stopped) = watch::channel(None);
        let task = tokio::spawn(export_loop(exporter, refresh, Arc::clone(&queue), stopped));
        Self { queue, stop, task }
    }

    /// Flushes until `budget` has passed, then stops. What is not delivered by then is counted as dropped.
    pub(crate) async fn shutdown(self, budget: Duration) -> ExportReport {
        let _ = self.stop.send(Some(Instant::now() + budget));
        let mut report = self.task.await.unwrap_or_default();
        report.dropped += self.queue.dropped();
        report
    }
}

/// Where the span exporter comes from: the log export's collector and credential slots.
#[derive(Debug, Clone)]
pub(crate) struct SpanSource {
    /// Collector endpoint.
    pub(crate) endpoint: String,
    /// Wire protocol.
    pub(crate) protocol: Protocol,
    /// The log records' resource.
    pub(crate) resource: Resource,
    /// The log export's credentials.
    pub(crate) slots: CredentialSlots,
}

impl SpanSource {
    /// An exporter for the credentials in force now, and their version.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    pub(crate) fn build(&self) -> Result<(opentelemetry_otlp::SpanExporter, u64), OtlpError> {
        let (version, credentials) = self.slots.current();
        let mut exporter = match self.protocol {
            Protocol::Grpc => grpc(&self.endpoint, &credentials)?,
            Protocol::HttpProtobuf => http(&self.endpoint, &credentials)?,
        };
        exporter.set_resource(&self.resource);
        Ok((exporter, version))
    }

    /// What the export task calls before each request: a new exporter once the credentials were rotated.
    /// A build that fails keeps the old one (the rotation was validated, so it is not expected).
    pub(crate) fn refresher(self, mut version: u64) -> impl FnMut() -> Option<opentelemetry_otlp::SpanExporter> {
        move || {
            if self.slots.version() == version {
                return None;
            }
            match self.build() {
                Ok((exporter, built)) => {
                    version = built;
                    Some(exporter)
                }
                Err(_) => {
                    version = self.slots.version();
                    tracing::warn!("cannot build the span OTLP exporter for rotated credentials; keeping the old");
                    None
                }
            }
        }
    }
}

// The same configuration as the log exporter's (`exporter.rs`), for spans: keep the two in step.
fn grpc(endpoint: &str, credentials: &Credentials) -> Result<opentelemetry_otlp::SpanExporter, OtlpError> {
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(EXPORT_TIMEOUT)
        .with_metadata(grpc_metadata(credentials)?);
    if let Some(tls) = grpc_tls(endpoint, credentials) {
        builder = builder.with_tls_config(tls);
    }
    builder.build().map_err(|_| OtlpError::Build)
}

fn http(endpoint: &str, credentials: &Credentials) -> Result<opentelemetry_otlp::SpanExporter, OtlpError> {
    let headers: HashMap<String, String> = credentials.headers.iter().cloned().collect();
    opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(http_client(credentials.ca.as_ref())?)
        .with_endpoint(http_traces_url(endpoint))
        .with_protocol(OtlpProtocol::HttpBinary)
        .with_timeout(EXPORT_TIMEOUT)
        .with_headers(headers)
        .build()
        .map_err(|_| OtlpError::Build)
}

/// The traces URL beside the logs URL: `http://c:4318` and `http://c:4318/v1/logs` give
/// `http://c:4318/v1/traces`; a custom path ending in `logs` gets `traces` in its place; any other path is
/// replaced by `/v1/traces`.
fn http_traces_url(endpoint: &str) -> String {
    let trimmed = endpoint.trim_end_matches('/');
    let (scheme, rest) = trimmed.split_once("://").map_or(("", trimmed), |(s, r)| (s, r));
    let prefix = if scheme.is_empty() { String::new() } else { format!("{scheme}://") };
    match rest.split_once('/') {
        None => format!("{prefix}{rest}/v1/traces"),
        Some((authority, path)) => match path.strip_suffix("logs") {
            Some(base) if base.is_empty() || base.ends_with('/') => format!("{prefix}{authority}/{base}traces"),
            _ => format!("{prefix}{authority}/v1/traces"),
        },
    }
}

/// Exports until told to stop, then flushes until the deadline: one request at a time, a failed batch back at
/// the head of the queue after a backoff. What is still queued or in flight at the deadline is dropped and
/// counted.
async fn export_loop<E: SpanExporter, F: FnMut() -> Option<E>>(
    mut exporter: E,
    mut refresh: F,
    queue: Arc<SpanQueue>,
    mut stop: watch::Receiver<Option<Instant>>,
) -> ExportReport {
    let mut report = ExportReport::default();
    let mut backoff = BACKOFF_MIN;
    let mut resume_at: Option<Instant> = None;
    let mut last_failure_log: Option<Instant> = None;
    let mut flushing = false;
    loop {
        let deadline = *stop.borrow_and_update();
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        if deadline.is_some() && !flushing {
            // The flush tries at once: a backoff earned before the stop would eat its budget.
            flushing = true;
            (resume_at, backoff) = (None, BACKOFF_MIN);
        }
        if resume_at.is_none_or(|t| Instant::now() >= t) {
            resume_at = None;
            let batch = queue.take(BATCH_SPANS);
            if batch.is_empty() && deadline.is_some() {
                break;
            }
            if !batch.is_empty() {
                if let Some(new) = refresh() {
                    exporter = new;
                }
                let len = batch.len();
                if export_one(&exporter, batch.clone(), &mut stop).await.is_ok() {
                    report.exported += len as u64;
                    backoff = BACKOFF_MIN;
                } else {
                    report.failed_requests += 1;
                    if last_failure_log.is_none_or(|t| t.elapsed() >= FAILURE_LOG_INTERVAL) {
                        // Fixed text: the error could carry the collector's message or echo a header.
                        tracing::warn!(queued = queue.len() + len, "span OTLP export failed; retrying");
                        last_failure_log = Some(Instant::now());
                    }
                    queue.put_back(batch);
                    resume_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
                continue;
            }
        }
        let wake = match (resume_at, deadline) {
            (Some(r), Some(d)) => Some(r.min(d)),
            (r, d) => r.or(d),
        };
        tokio::select! {
            () = queue.ready.notified(), if resume_at.is_none() => {}
            () = sleep_until_some(wake) => {}
            changed = stop.changed() => if changed.is_err() { break },
        }
    }
    report.dropped += queue.take(usize::MAX).len() as u64;
    if report.dropped > 0 || report.failed_requests > 0 {
        tracing::warn!(
            exported = report.exported,
            dropped = report.dropped,
            failed_requests = report.failed_requests,
            "span OTLP export incomplete"
        );
    }
    report
}

/// One export request, cut at its timeout or at the flush deadline, whichever comes first (a stop that
/// arrives while it is out moves its end).
async fn export_one<E: SpanExporter>(
    exporter: &E,
    batch: Vec<SpanData>,
    stop: &mut watch::Receiver<Option<Instant>>,
) -> OTelSdkResult {
    let send = exporter.export(batch);
    tokio::pin!(send);
    let timeout = Instant::now() + EXPORT_TIMEOUT;
    loop {
        let cut = stop.borrow().map_or(timeout, |d| d.min(timeout));
        tokio::select! {
            result = &mut send => return result,
            () = tokio::time::sleep_until(cut) => return Err(OTelSdkError::Timeout(EXPORT_TIMEOUT)),
            changed = stop.changed() => if changed.is_err() { return Err(OTelSdkError::AlreadyShutdown) },
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
