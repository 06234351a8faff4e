//! OTLP log export of OCSF events, over gRPC or HTTP/protobuf (opentelemetry-otlp).
//!
//! Each event becomes one log record: the body is the event's JSON text; severity is mapped from
//! `severity_id` (see [`severity`]); the event name is its class's (`ocsf.api_activity`, see
//! [`vm_ocsf::Class`]); attributes carry `ocsf.class_uid`, `ocsf.class_name`, `ocsf.activity_id`,
//! `ocsf.type_uid`, `ocsf.severity_id` and `ocsf.schema_version`. The resource carries `service.name`,
//! `service.version`, `openshell.sandbox.id` and `openshell.gateway.name`.
//!
//! Records go through the batch exporter ([`super::batch`]) instead of the SDK's batch processor: that one
//! drops a batch when an export fails and drops records when its 2,048-record queue is full. Ours keeps up
//! to [`MAX_QUEUED_RECORDS`] (and [`MAX_QUEUED_BYTES`]), retries failed batches with backoff, and at shutdown
//! flushes until a deadline, counting (never silently losing) what it could not deliver. A collector that is
//! down, slow or rejecting never stalls the supervisor: export runs in its own task.

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _, Severity};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::LogExporter;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::logs::{LogBatch, LogProcessor, SdkLogRecord, SdkLogger, SdkLoggerProvider};
use opentelemetry_sdk::Resource;
use vm_contract::audit::Head;

use super::batch::{BatchConfig, BatchExport, Bounds, Export, Queue};
use super::credentials::{CaBundle, CaError, Credentials, LiveCredentials};
use super::exporter::{ExporterSpec, Logs, Rebuild, Signal as _};

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
pub const IN_FLIGHT: usize = 4;
/// Per-request timeout.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

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

impl Debug for OtlpSettings {
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

/// A queued log record.
type LogItem = (SdkLogRecord, InstrumentationScope);

impl Export for LogExporter {
    type Item = LogItem;

    async fn export(&self, batch: &[LogItem]) -> OTelSdkResult {
        let refs: Vec<(&SdkLogRecord, &InstrumentationScope)> = batch.iter().map(|(r, s)| (r, s)).collect();
        opentelemetry_sdk::logs::LogExporter::export(self, LogBatch::new(&refs)).await
    }

    fn payload(item: &LogItem) -> Option<&dyn Debug> {
        item.0.body().map(|body| body as &dyn Debug)
    }
}

/// Hands every record to the export task's queue, sized by its body.
#[derive(Debug)]
struct QueueProcessor(Arc<Queue<LogItem>>);

impl LogProcessor for QueueProcessor {
    fn emit(&self, record: &mut SdkLogRecord, scope: &InstrumentationScope) {
        let size = match record.body() {
            Some(AnyValue::String(body)) => body.as_str().len() + RECORD_OVERHEAD_BYTES,
            _ => RECORD_OVERHEAD_BYTES,
        };
        self.0.push((record.clone(), scope.clone()), size);
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
    export: BatchExport<LogItem>,
    live: LiveCredentials,
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
    /// Builds the exporter and starts the export task; `verbose_failures` is the `verbose-failure-logs`
    /// control. Must run inside the tokio runtime.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    pub fn start(settings: &OtlpSettings, resource: Resource, verbose_failures: bool) -> Result<Self, OtlpError> {
        let ca = settings.ca_path.as_deref().map(CaBundle::load).transpose().map_err(OtlpError::Ca)?;
        if ca.is_none() && super::exporter::is_https(&settings.endpoint) {
            return Err(OtlpError::HttpsWithoutCa);
        }
        let live = LiveCredentials::new(Credentials { headers: settings.headers.clone(), ca });
        let spec = ExporterSpec { endpoint: settings.endpoint.clone(), protocol: settings.protocol, resource };
        let (provider, logger, queue) = logger(spec.resource.clone());
        let (exporter, mut rebuild) = Rebuild::<Logs>::first(spec, live.clone())?;
        let config =
            BatchConfig { name: Logs::NAME, batch_items: BATCH_RECORDS, in_flight: IN_FLIGHT, verbose_failures };
        let export = BatchExport::start(exporter, move || rebuild.refresh(), queue, config);
        Ok(Self { provider, logger, export, live })
    }

    /// The live credentials the export task reads.
    pub fn live(&self) -> &LiveCredentials {
        &self.live
    }

    /// Queues one event for export, with the audit chain's head once the chain holds it.
    pub fn emit(&self, event: &vm_ocsf::Event, json: &str, audit: Option<Head>) {
        emit(&self.logger, event, json, audit);
    }

    /// Flushes until `budget` has passed, then stops. Everything not delivered by then is counted as dropped.
    pub async fn shutdown(self, budget: Duration) -> ExportReport {
        let report = self.export.shutdown(budget).await;
        let _ = self.provider.shutdown();
        report
    }
}

/// A logger whose records go into the returned queue.
fn logger(resource: Resource) -> (SdkLoggerProvider, SdkLogger, Arc<Queue<LogItem>>) {
    let queue = Arc::new(Queue::new(Bounds { items: MAX_QUEUED_RECORDS, bytes: MAX_QUEUED_BYTES }));
    let provider = SdkLoggerProvider::builder()
        .with_resource(resource)
        .with_log_processor(QueueProcessor(Arc::clone(&queue)))
        .build();
    let logger = provider.logger("vm-supervisor");
    (provider, logger, queue)
}

/// The log record attribute holding the audit chain's head after the record's event (`SEQ:HEX`).
pub const AUDIT_HEAD_ATTRIBUTE: &str = "vm_driver.audit.head";

/// `event` as a log record, emitted through `logger`.
fn emit(logger: &SdkLogger, event: &vm_ocsf::Event, json: &str, audit: Option<Head>) {
    let mut record = logger.create_log_record();
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
    if let Some(head) = audit {
        // Every record anchors the chain outside the host; the last one, its final head.
        record.add_attribute(AUDIT_HEAD_ATTRIBUTE, head.to_attribute());
    }
    logger.emit(record);
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
        let start = |ca| Otlp::start(&settings(ca), resource("sb", None), false).err();
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

    #[test]
    fn every_class_exports_under_its_event_name() {
        let (_provider, logger, queue) = logger(resource("sb", None));
        let source = vm_ocsf::Source::new(vm_ocsf::SchemaVersion::default(), "sb", "vm-supervisor", "0.1.0");
        let events = [
            source.api_update("UpdatePolicy", "attach.sock", vm_ocsf::Status::Success, "revision 1 applied"),
            source.config_change("policy"),
        ];
        for event in &events {
            emit(&logger, event, &event.to_json(), None);
        }
        let names: Vec<_> = queue.snapshot().iter().map(|(record, _)| record.event_name()).collect();
        assert_eq!(names, [Some("ocsf.api_activity"), Some("ocsf.device_config_state_change")]);
        let records = queue.snapshot();
        let attribute =
            |key: &str| records[0].0.attributes_iter().find(|(k, _)| k.as_str() == key).map(|(_, v)| v.clone());
        assert_eq!(attribute("ocsf.class_uid"), Some(AnyValue::Int(6003)));
        assert_eq!(attribute("ocsf.class_name"), Some(AnyValue::String("API Activity".into())));
    }
}
