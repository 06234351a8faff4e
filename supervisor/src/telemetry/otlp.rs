//! OTLP log export of OCSF events, over gRPC or HTTP/protobuf (opentelemetry-otlp).
//!
//! Each event becomes one log record: the body is the event's JSON text; severity is mapped from
//! `severity_id` (see [`severity`]); the event name is its class's (`ocsf.api_activity`, see
//! [`vm_ocsf::Class`]); attributes carry `ocsf.class_uid`, `ocsf.class_name`,
//! `ocsf.activity_id`, `ocsf.type_uid`, `ocsf.severity_id` and `ocsf.schema_version`. The resource carries
//! `service.name`, `service.version`, `openshell.sandbox.id` and `openshell.gateway.name`.
//!
//! Records go through our own processor instead of the SDK's batch processor: that one drops a batch when
//! an export fails and drops records when its 2,048-record queue is full. Ours keeps up to
//! [`MAX_QUEUED_RECORDS`], retries failed batches with backoff, and at shutdown flushes until a deadline,
//! counting (never silently losing) what it could not deliver. A collector that is down, slow or rejecting
//! never stalls the supervisor: export runs in its own task. Failures are logged with fixed text only.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::stream::{FuturesUnordered, StreamExt};
use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _, Severity};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::LogExporter;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::logs::{LogBatch, LogExporter as _, LogProcessor, SdkLogRecord, SdkLogger, SdkLoggerProvider};
use opentelemetry_sdk::Resource;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::credentials::{CaBundle, CaError, CredentialSlots, Credentials};
use super::exporter::ExporterSpec;

/// Records kept waiting for the collector before new ones are dropped (and counted).
pub const MAX_QUEUED_RECORDS: usize = 100_000;
/// Bytes of them (bodies plus a fixed overhead each).
pub const MAX_QUEUED_BYTES: usize = 32 * 1024 * 1024;
/// What a record costs beside its body, roughly: attributes, timestamps, the scope.
const RECORD_OVERHEAD_BYTES: usize = 256;
/// Records per export request.
const BATCH_RECORDS: usize = 1024;
/// Export requests in flight at once: a slow collector (a second per request, say) still takes a full queue
/// within the stop budget's flush.
const IN_FLIGHT: usize = 4;
/// Per-request timeout.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);
/// Retry backoff bounds.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// At most one failure line per this interval.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// The wire protocol to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/gRPC (default; the endpoint is `http://host:port`).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (the endpoint is the logs URL; `/v1/logs` is added when it has no path).
    HttpProtobuf,
}

impl Protocol {
    /// Parses `grpc` or `http/protobuf`.
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "" | "grpc" => Some(Self::Grpc),
            "http/protobuf" | "http" => Some(Self::HttpProtobuf),
            _ => None,
        }
    }
}

/// Where and how to export.
#[derive(Clone)]
pub struct OtlpSettings {
    /// Collector endpoint.
    pub endpoint: String,
    /// Wire protocol.
    pub protocol: Protocol,
    /// Request headers (secrets): from the auth bundle only.
    pub headers: Vec<(String, String)>,
    /// CA bundle for an `https://` collector (absolute path).
    pub ca_path: Option<PathBuf>,
}

impl std::fmt::Debug for OtlpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpSettings")
            .field("endpoint", &self.endpoint)
            .field("protocol", &self.protocol)
            .field("headers", &self.headers.len())
            .field("ca_path", &self.ca_path)
            .finish()
    }
}

/// Why the exporter could not be built. No variant carries a header value.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    /// A header name or value is not valid on the wire.
    #[error("an OTLP header is not a valid header name or value")]
    Header,
    /// The exporter refused its configuration (bad endpoint).
    #[error("the OTLP exporter cannot be built for this endpoint")]
    Build,
    /// The CA bundle cannot be used.
    #[error("the OTLP CA bundle cannot be used")]
    Ca(#[source] CaError),
    /// An `https://` endpoint without a CA bundle: no other roots are trusted.
    #[error("an https:// OTLP endpoint needs a CA bundle")]
    HttpsWithoutCa,
}

/// What the export achieved, reported at shutdown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// Records the collector accepted.
    pub exported: u64,
    /// Records never delivered (queue full, or still queued when the flush deadline passed).
    pub dropped: u64,
    /// Export requests that failed.
    pub failed_requests: u64,
}

type Item = (SdkLogRecord, InstrumentationScope, usize);

#[derive(Debug, Default)]
struct Queue {
    items: Mutex<Items>,
    ready: Notify,
    dropped: AtomicU64,
}

#[derive(Debug, Default)]
struct Items {
    queue: VecDeque<Item>,
    bytes: usize,
}

impl Queue {
    fn push(&self, record: SdkLogRecord, scope: InstrumentationScope, size: usize) {
        let mut items = self.items.lock().unwrap_or_else(PoisonError::into_inner);
        if items.queue.len() >= MAX_QUEUED_RECORDS || items.bytes + size > MAX_QUEUED_BYTES {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        items.bytes += size;
        items.queue.push_back((record, scope, size));
        drop(items);
        self.ready.notify_one();
    }

    fn take(&self, max: usize) -> Vec<Item> {
        let mut items = self.items.lock().unwrap_or_else(PoisonError::into_inner);
        let n = items.queue.len().min(max);
        let batch: Vec<Item> = items.queue.drain(..n).collect();
        items.bytes -= batch.iter().map(|i| i.2).sum::<usize>();
        batch
    }

    fn put_back(&self, batch: Vec<Item>) {
        let mut items = self.items.lock().unwrap_or_else(PoisonError::into_inner);
        items.bytes += batch.iter().map(|i| i.2).sum::<usize>();
        for item in batch.into_iter().rev() {
            items.queue.push_front(item);
        }
    }

    fn len(&self) -> usize {
        self.items.lock().unwrap_or_else(PoisonError::into_inner).queue.len()
    }
}

/// Hands every record to the export task's queue.
#[derive(Debug)]
struct QueueProcessor {
    queue: Arc<Queue>,
}

impl LogProcessor for QueueProcessor {
    fn emit(&self, record: &mut SdkLogRecord, scope: &InstrumentationScope) {
        let size = match record.body() {
            Some(AnyValue::String(body)) => body.as_str().len() + RECORD_OVERHEAD_BYTES,
            _ => RECORD_OVERHEAD_BYTES,
        };
        self.queue.push(record.clone(), scope.clone(), size);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The running exporter.
#[derive(Debug)]
pub struct Otlp {
    provider: SdkLoggerProvider,
    logger: SdkLogger,
    queue: Arc<Queue>,
    stop: watch::Sender<Option<Instant>>,
    task: JoinHandle<ExportReport>,
    slots: CredentialSlots,
}

/// Maps OCSF `severity_id` to OTLP severity: Informational -> INFO, Low -> INFO2, Medium -> WARN,
/// High -> ERROR, Critical -> FATAL, Fatal -> FATAL4.
pub fn severity(severity_id: u8) -> Severity {
    match severity_id {
        2 => Severity::Info2,
        3 => Severity::Warn,
        4 => Severity::Error,
        5 => Severity::Fatal,
        6 => Severity::Fatal4,
        _ => Severity::Info,
    }
}

impl Otlp {
    /// Builds the exporter and starts the export task. Must run inside the tokio runtime.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    pub fn start(settings: &OtlpSettings, resource: Resource) -> Result<Self, OtlpError> {
        let ca = settings.ca_path.as_deref().map(CaBundle::load).transpose().map_err(OtlpError::Ca)?;
        if ca.is_none() && super::exporter::is_https(&settings.endpoint) {
            return Err(OtlpError::HttpsWithoutCa);
        }
        let credentials = Credentials { headers: settings.headers.clone(), ca };
        let spec = ExporterSpec { endpoint: settings.endpoint.clone(), protocol: settings.protocol, resource };
        let exporter = spec.build(&credentials)?;
        let slots = CredentialSlots::new(credentials);
        let resource = spec.resource.clone();
        let queue = Arc::new(Queue::default());
        let provider = SdkLoggerProvider::builder()
            .with_resource(resource)
            .with_log_processor(QueueProcessor { queue: Arc::clone(&queue) })
            .build();
        let logger = provider.logger("vm-supervisor");
        let (stop, stopped) = watch::channel(None);
        let source = ExporterSource { spec, slots: slots.clone(), version: 0 };
        let task = tokio::spawn(export_loop(Arc::new(exporter), source, Arc::clone(&queue), stopped));
        Ok(Self { provider, logger, queue, stop, task, slots })
    }

    /// The credential slots the export task reads.
    pub fn slots(&self) -> &CredentialSlots {
        &self.slots
    }

    /// Queues one event for export.
    pub fn emit(&self, event: &vm_ocsf::Event, json: &str) {
        let mut record = self.logger.create_log_record();
        let millis = u64::try_from(event.time).unwrap_or(0);
        record.set_timestamp(UNIX_EPOCH + Duration::from_millis(millis));
        record.set_observed_timestamp(SystemTime::now());
        record.set_severity_number(severity(event.severity_id));
        record.set_severity_text(event.severity);
        record.set_event_name(event.class.event_name);
        record.set_body(AnyValue::String(json.to_owned().into()));
        record.add_attribute("ocsf.class_uid", i64::from(event.class.uid));
        record.add_attribute("ocsf.class_name", event.class.caption);
        record.add_attribute("ocsf.activity_id", i64::from(event.activity_id));
        record.add_attribute("ocsf.type_uid", i64::try_from(event.type_uid).unwrap_or(i64::MAX));
        record.add_attribute("ocsf.severity_id", i64::from(event.severity_id));
        record.add_attribute("ocsf.schema_version", event.metadata.version.clone());
        self.logger.emit(record);
    }

    /// Flushes until `budget` has passed, then stops. Everything not delivered by then is counted as dropped.
    pub async fn shutdown(self, budget: Duration) -> ExportReport {
        let _ = self.stop.send(Some(Instant::now() + budget));
        let mut report = self.task.await.unwrap_or_default();
        report.dropped += self.queue.dropped.load(Ordering::Relaxed);
        let _ = self.provider.shutdown();
        report
    }
}

/// Where the export task gets its exporter: rebuilt when the credential slots changed.
#[derive(Debug)]
struct ExporterSource {
    spec: ExporterSpec,
    slots: CredentialSlots,
    /// The slots' version the current exporter was built from.
    version: u64,
}

impl ExporterSource {
    /// Swaps in an exporter built from the credentials now in force, if they changed. Requests in flight
    /// finish on the old one.
    fn refresh(&mut self, exporter: &mut Arc<LogExporter>) {
        if self.slots.version() == self.version {
            return;
        }
        let (version, credentials) = self.slots.current();
        self.version = version;
        match self.spec.build(&credentials) {
            Ok(new) => *exporter = Arc::new(new),
            // Validated at the rotation, so not expected; the old credentials stay in use.
            Err(_) => tracing::warn!("cannot build the OCSF OTLP exporter for rotated credentials; keeping the old"),
        }
    }
}

/// One export request of `batch`; gives the batch back with the outcome.
async fn export_one(exporter: Arc<LogExporter>, batch: Vec<Item>) -> (Vec<Item>, OTelSdkResult) {
    let refs: Vec<(&SdkLogRecord, &InstrumentationScope)> = batch.iter().map(|b| (&b.0, &b.1)).collect();
    let timeout = opentelemetry_sdk::error::OTelSdkError::Timeout(EXPORT_TIMEOUT);
    let result =
        tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(LogBatch::new(&refs))).await.unwrap_or(Err(timeout));
    drop(refs);
    (batch, result)
}

/// Exports until told to stop, then flushes until the deadline: up to [`IN_FLIGHT`] requests at once, failed
/// batches back at the head of the queue after a backoff. What is still queued or in flight at the deadline
/// is counted as dropped.
async fn export_loop(
    mut exporter: Arc<LogExporter>,
    mut source: ExporterSource,
    queue: Arc<Queue>,
    mut stop: watch::Receiver<Option<Instant>>,
) -> ExportReport {
    let mut report = ExportReport::default();
    let mut backoff = BACKOFF_MIN;
    let mut resume_at: Option<Instant> = None;
    let mut last_failure_log: Option<Instant> = None;
    let mut in_flight = FuturesUnordered::new();
    let mut in_flight_records = 0usize;
    let mut flushing = false;
    loop {
        let deadline = *stop.borrow();
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
            // Every export presents the credentials in force when it starts.
            source.refresh(&mut exporter);
            while in_flight.len() < IN_FLIGHT {
                let batch = queue.take(BATCH_RECORDS);
                if batch.is_empty() {
                    break;
                }
                in_flight_records += batch.len();
                in_flight.push(export_one(Arc::clone(&exporter), batch));
            }
        }
        if in_flight.is_empty() && deadline.is_some() && queue.len() == 0 {
            break;
        }
        let wake = resume_at.or(deadline);
        tokio::select! {
            Some((batch, result)) = in_flight.next() => match (in_flight_records -= batch.len(), result).1 {
                Ok(()) => {
                    report.exported += batch.len() as u64;
                    backoff = BACKOFF_MIN;
                }
                Err(e) => {
                    report.failed_requests += 1;
                    // The control of the redaction test logs what a naive exporter would: every failure, with
                    // its error and records (rate-limited, the first failed batch may hold no payload yet).
                    let verbose = crate::diagnostics::verbose_failures();
                    if verbose || last_failure_log.is_none_or(|t| t.elapsed() >= FAILURE_LOG_INTERVAL) {
                        if verbose {
                            let records: Vec<_> = batch.iter().filter_map(|(r, _, _)| r.body()).collect();
                            tracing::warn!(error = %e, ?records, "OCSF OTLP export failed; retrying");
                        } else {
                            // Fixed text: the error could carry the collector's message or echo a header.
                            tracing::warn!(queued = queue.len() + batch.len(), "OCSF OTLP export failed; retrying");
                        }
                        last_failure_log = Some(Instant::now());
                    }
                    queue.put_back(batch);
                    resume_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            },
            () = queue.ready.notified(), if in_flight.len() < IN_FLIGHT && resume_at.is_none() => {}
            () = sleep_until_some(wake) => {}
            _ = stop.changed() => {}
        }
    }
    drop(in_flight);
    // Records of requests cut at the deadline count as dropped: the collector may not have them.
    report.dropped += (queue.take(usize::MAX).len() + in_flight_records) as u64;
    if report.dropped > 0 || report.failed_requests > 0 {
        tracing::warn!(
            exported = report.exported,
            dropped = report.dropped,
            failed_requests = report.failed_requests,
            "OCSF OTLP export incomplete"
        );
    }
    report
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The resource every record (and any span) of this supervisor carries.
pub fn resource(sandbox_id: &str, gateway_name: Option<&str>) -> Resource {
    let mut attributes = vec![
        KeyValue::new("service.name", "vm-supervisor"),
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::new("openshell.sandbox.id", sandbox_id.to_owned()),
    ];
    if let Some(gateway) = gateway_name {
        attributes.push(KeyValue::new("openshell.gateway.name", gateway.to_owned()));
    }
    Resource::builder_empty().with_attributes(attributes).build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn severities_map_upwards() {
        assert_eq!(severity(1), Severity::Info);
        assert_eq!(severity(3), Severity::Warn);
        assert_eq!(severity(4), Severity::Error);
        assert_eq!(severity(6), Severity::Fatal4);
    }

    #[test]
    fn https_needs_a_usable_ca_bundle() {
        let settings = |ca: Option<&str>| OtlpSettings {
            endpoint: "https://127.0.0.1:4317".into(),
            protocol: Protocol::Grpc,
            headers: vec![("authorization".into(), "Bearer s3cret".into())],
            ca_path: ca.map(PathBuf::from),
        };
        let start = |ca| Otlp::start(&settings(ca), resource("sb", None)).err();
        assert!(matches!(start(None), Some(OtlpError::HttpsWithoutCa)));
        assert!(matches!(start(Some("/nonexistent/ca.pem")), Some(OtlpError::Ca(CaError::Unreadable))));
        assert!(matches!(start(Some("/dev/null")), Some(OtlpError::Ca(CaError::Unreadable))), "not a regular file");
        assert!(matches!(start(Some("ca.pem")), Some(OtlpError::Ca(CaError::NotAbsolute))));
    }

    #[test]
    fn protocols_parse() {
        assert_eq!(Protocol::parse(""), Some(Protocol::Grpc));
        assert_eq!(Protocol::parse("http/protobuf"), Some(Protocol::HttpProtobuf));
        assert_eq!(Protocol::parse("http/json"), None);
    }
}
