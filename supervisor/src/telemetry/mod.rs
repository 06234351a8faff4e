//! Where OCSF events go: the console (shorthand and, when enabled, timestamped JSON lines), the per-sandbox
//! JSONL file (when JSON is enabled), and an OTLP collector (when an endpoint is set).
//!
//! - [`console`]: the one bounded, non-blocking stderr writer, shared with the diagnostics.
//! - [`jsonl`]: `events.jsonl` in the sandbox directory.
//! - [`otlp`]: OTLP log export over gRPC or HTTP/protobuf.
//! - [`settings`]: the environment and the auth bundle.
//!
//! Console JSON is independent of the file sink and of the diagnostic filter (`RUST_LOG`): every event of
//! severity Informational or above reaches it. The JSON switch and the schema version are shared by console
//! JSON and the JSONL file. On an orderly stop the final events are emitted and everything queued is flushed
//! within a bound; see [`Telemetry::shutdown`].

pub mod console;
pub mod jsonl;
pub mod otlp;
pub mod settings;

use std::time::{Duration, Instant};

use vm_ocsf::{Event, Source};

use self::console::{Console, ConsoleHandle, CONSOLE_DRAIN};
use vm_contract::layout::SandboxFile;

use self::jsonl::Jsonl;
use self::otlp::{ExportReport, Otlp, OtlpError};
use self::settings::TelemetrySettings;

/// What the sinks delivered, reported at shutdown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TelemetryReport {
    /// Events emitted.
    pub events: u64,
    /// OTLP outcome.
    pub otlp: ExportReport,
    /// JSONL write batches that failed.
    pub jsonl_failures: u64,
    /// Console lines dropped (queue full or still queued at exit).
    pub console_dropped: u64,
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The events file cannot be opened.
    #[error("cannot open {}", SandboxFile::Events.name())]
    Jsonl(#[source] std::io::Error),
    /// The OTLP exporter cannot be built.
    #[error("cannot set up OTLP export")]
    Otlp(#[source] OtlpError),
}

/// The sinks of one supervisor. Its guards (writer threads, export task) live until [`Telemetry::shutdown`].
#[derive(Debug)]
pub struct Telemetry {
    source: Source,
    console: ConsoleHandle,
    jsonl: Option<Jsonl>,
    otlp: Option<Otlp>,
    json: bool,
    events: u64,
}

impl Telemetry {
    /// Starts the sinks `settings` ask for, in the current (sandbox) directory. Must run inside tokio.
    ///
    /// # Errors
    /// [`TelemetryError`].
    pub fn start(
        console: ConsoleHandle,
        sandbox_id: &str,
        settings: &TelemetrySettings,
    ) -> Result<Self, TelemetryError> {
        let source = Source::new(settings.schema.clone(), sandbox_id, "vm-supervisor", env!("CARGO_PKG_VERSION"));
        let jsonl = if settings.json { Some(open_jsonl().map_err(TelemetryError::Jsonl)?) } else { None };
        let otlp = match &settings.otlp {
            Some(otlp) => Some(
                Otlp::start(otlp, otlp::resource(sandbox_id, settings.gateway_name.as_deref()))
                    .map_err(TelemetryError::Otlp)?,
            ),
            None => None,
        };
        Ok(Self { source, console, jsonl, otlp, json: settings.json, events: 0 })
    }

    /// Builds events with the right product, schema and sandbox.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Sends one event to every sink. Never blocks.
    pub fn emit(&mut self, event: Event) {
        self.events += 1;
        let json = event.to_json();
        let stamp = humantime::format_rfc3339_millis(std::time::SystemTime::now());
        self.console.line(format!("{stamp} {}", event.shorthand()).into_bytes());
        if self.json {
            self.console.line(format!("{stamp} OCSF_JSON {json}").into_bytes());
        }
        if let Some(otlp) = &self.otlp {
            otlp.emit(&event, &json);
        }
        if let Some(jsonl) = &self.jsonl {
            jsonl.write(json);
        }
    }

    /// Flushes every sink: the JSONL file to disk, the OTLP queue within `otlp_budget`, the console within a
    /// second. Returns what was delivered; the caller emits nothing after this.
    pub async fn shutdown(self, otlp_budget: Duration, console: Console) -> TelemetryReport {
        let otlp = match self.otlp {
            Some(otlp) => otlp.shutdown(otlp_budget).await,
            None => ExportReport::default(),
        };
        let jsonl_failures = self.jsonl.map_or(0, |j| j.shutdown(Instant::now() + Duration::from_secs(5)));
        let report = TelemetryReport { events: self.events, otlp, jsonl_failures, console_dropped: console.dropped() };
        tracing::info!(
            events = report.events,
            otlp_exported = report.otlp.exported,
            otlp_dropped = report.otlp.dropped,
            jsonl_failures = report.jsonl_failures,
            console_dropped = report.console_dropped,
            "telemetry flushed"
        );
        TelemetryReport { console_dropped: console.shutdown(Instant::now() + CONSOLE_DRAIN), ..report }
    }
}

fn open_jsonl() -> std::io::Result<Jsonl> {
    if crate::control(vm_contract::test_control::TestControl::JsonlSinkFails) {
        // Fault injection: every write fails (ENOSPC).
        return Ok(Jsonl::on_file(std::fs::OpenOptions::new().write(true).open("/dev/full")?));
    }
    Jsonl::open(SandboxFile::Events.as_ref())
}
