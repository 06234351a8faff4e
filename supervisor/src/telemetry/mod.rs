//! Where OCSF events go: the console (shorthand and, when enabled, timestamped JSON lines), the per-sandbox
//! JSONL file (when JSON is enabled), and an OTLP collector (when an endpoint is set).
//!
//! - [`audit`]: every event appended to the sandbox's audit chain (`audit.db`) before any sink is given it.
//! - [`console`]: the one bounded, non-blocking stderr writer, shared with the diagnostics.
//! - [`jsonl`]: `events.jsonl` in the sandbox directory.
//! - [`otlp`]: OTLP log export over gRPC or HTTP/protobuf; [`exporter`] builds the exporters (TLS with a CA
//!   bundle for `https://`), [`credentials`] holds the headers and the CA bundle rotated live.
//! - [`spans`]: the supervisor's spans (boot, admission, exec, policy update, stop), and [`span_export`],
//!   their OTLP trace export to the same collector, with the same credentials.
//! - `batch`: the one batch exporter (bounded queue, export task) behind both OTLP exports.
//! - [`settings`]: the environment and the auth bundle; [`TelemetryControls`]: the test controls the sinks
//!   obey, read by the caller at the binary's edge.
//!
//! Console JSON is independent of the file sink and of the diagnostic filter (`RUST_LOG`): every event of
//! severity Informational or above reaches it. The JSON switch and the schema version are shared by console
//! JSON and the JSONL file. On an orderly stop the final events are emitted and everything queued is flushed
//! within a bound; see [`Telemetry::shutdown`].

pub mod audit;
pub(crate) mod batch;
pub mod console;
pub mod credentials;
pub mod exporter;
pub mod jsonl;
pub mod limit;
pub mod otlp;
pub mod settings;
pub mod span_export;
pub mod spans;

use std::time::{Duration, Instant};

use vm_contract::layout::SandboxFile;
use vm_ocsf::{Event, Finding, Source};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};

use self::audit::{Audited, Sinks};
use self::console::{Console, ConsoleHandle, CONSOLE_DRAIN};
use self::credentials::LiveCredentials;
use self::exporter::ExporterSpec;
use self::jsonl::{Jsonl, JsonlReport};
use self::limit::Limiter;
use self::otlp::{ExportReport, Otlp, OtlpError};
use self::settings::TelemetrySettings;
use self::span_export::SpanSource;
use self::spans::Spans;

/// Largest event, as JSON; a larger one is dropped and counted (the workload's argv is cut long before).
pub const MAX_EVENT_BYTES: usize = 16 * 1024;

/// What the sinks delivered, reported at shutdown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TelemetryReport {
    /// Events emitted.
    pub events: u64,
    /// Events over the rate or size limits, dropped before any sink.
    pub limited: u64,
    /// OTLP outcome.
    pub otlp: ExportReport,
    /// OTLP span export outcome (counted in spans, not events).
    pub spans: ExportReport,
    /// The JSONL file's losses.
    pub jsonl: JsonlReport,
    /// Console lines dropped (queue full, over the cap, or still queued at exit).
    pub console_dropped: u64,
    /// The audit chain's sealed head; `None` without a chain or when it failed.
    pub audit: Option<vm_audit::Head>,
}

/// The test controls the sinks obey: plain values, read once where the binary starts (`crate::safeguards`).
/// All off in a build without the `test-controls` feature.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TelemetryControls {
    /// `jsonl-sink-fails`: fault injection, every write to `events.jsonl` fails (ENOSPC).
    pub jsonl_fails: bool,
    /// `no-telemetry-limits`: no rate limit on events and no cap on `events.jsonl`.
    pub no_limits: bool,
    /// `verbose-failure-logs`: the sinks log failures with their error text and records.
    pub verbose_failures: bool,
    /// `no-audit-chain`: events reach the sinks with no audit chain written.
    pub no_audit_chain: bool,
    /// `audit-stall`: fault injection, the chain appends nothing while `audit-stall` is in the sandbox directory.
    pub audit_stall: bool,
    /// `no-telemetry-backpressure`: the guest is read however far behind the chain is.
    pub no_backpressure: bool,
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
    /// The audit chain cannot be opened, or it was edited while the sandbox was stopped.
    #[error("cannot open the audit chain ({})", SandboxFile::Audit.name())]
    Audit(#[source] vm_audit::chain::ChainError),
    /// The audit thread cannot be started.
    #[error("cannot start the audit thread")]
    Thread(#[source] std::io::Error),
}

/// The sinks of one supervisor. Its guards (writer threads, export task) live until [`Telemetry::shutdown`].
#[derive(Debug)]
pub struct Telemetry {
    source: Source,
    audited: Audited,
    /// The collector's credentials, rotated live (with a collector).
    live: Option<LiveCredentials>,
    spans: Spans,
    events: u64,
    limiter: Limiter,
    /// Events dropped outside the rate limit (over [`MAX_EVENT_BYTES`], or at a full queue to the audit
    /// chain) and not reported yet.
    unreported_drops: u64,
}

impl Telemetry {
    /// Starts the sinks `settings` ask for, in the current (sandbox) directory, under `controls`. Must run
    /// inside tokio.
    ///
    /// # Errors
    /// [`TelemetryError`].
    pub fn start(
        console: ConsoleHandle,
        sandbox_id: &str,
        settings: &TelemetrySettings,
        controls: TelemetryControls,
    ) -> Result<Self, TelemetryError> {
        let source = Source::new(settings.schema.clone(), sandbox_id, "vm-supervisor", env!("CARGO_PKG_VERSION"));
        let limits = !controls.no_limits;
        let jsonl = if settings.json { Some(open_jsonl(controls).map_err(TelemetryError::Jsonl)?) } else { None };
        let (otlp, spans) = match &settings.otlp {
            Some(otlp) => {
                let resource = otlp::resource(sandbox_id, settings.gateway_name.as_deref());
                let logs =
                    Otlp::start(otlp, resource.clone(), controls.verbose_failures).map_err(TelemetryError::Otlp)?;
                // The spans go where the logs go, with the same credentials (and their rotations).
                let spec = ExporterSpec { endpoint: otlp.endpoint.clone(), protocol: otlp.protocol, resource };
                let source = SpanSource { spec, live: logs.live().clone() };
                (Some(logs), Spans::start(source, sandbox_id).map_err(TelemetryError::Otlp)?)
            }
            None => (None, Spans::default()),
        };
        let limiter = Limiter::new(limits, Instant::now());
        let chain = if controls.no_audit_chain {
            None
        } else {
            Some(vm_audit::chain::Chain::open(SandboxFile::Audit.as_ref(), sandbox_id).map_err(TelemetryError::Audit)?)
        };
        let live = otlp.as_ref().map(|o| o.live().clone());
        let sinks = Sinks { console, json: settings.json, jsonl, otlp };
        let audited = Audited::start(chain, sinks, controls).map_err(TelemetryError::Thread)?;
        Ok(Self { source, audited, live, spans, events: 0, limiter, unreported_drops: 0 })
    }

    /// Builds events with the right product, schema and sandbox.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// How full the queue to the audit chain is: the serving loop reads the guest only while it is not
    /// backlogged.
    pub fn backlog(&self) -> std::sync::Arc<audit::Backlog> {
        self.audited.backlog()
    }

    /// The spans (exported only with an OTLP endpoint).
    pub fn spans(&mut self) -> &mut Spans {
        &mut self.spans
    }

    /// Sends one event to the audit chain, then every sink, unless it is over the sandbox's limits (then
    /// it is counted). Never blocks.
    pub fn emit(&mut self, event: Event) {
        if !event.essential && !self.limiter.admit(Instant::now()) {
            return;
        }
        let json = event.to_json();
        if json.len() > MAX_EVENT_BYTES {
            self.unreported_drops += 1;
            return;
        }
        if self.audited.send(event, json) {
            self.events += 1;
        } else {
            self.unreported_drops += 1;
        }
    }

    /// Swaps the OTLP credentials for `rotation`'s, validated first, and says so in a configuration event
    /// (never a value). The next export uses them.
    pub fn rotate(&mut self, rotation: &CredentialRotation) -> RotationOutcome {
        let Some(live) = &self.live else {
            let outcome = RotationOutcome::NoCollector;
            self.emit_rotation(outcome, 0, rotation);
            return outcome;
        };
        let (outcome, version) = live.rotate(rotation);
        self.emit_rotation(outcome, version, rotation);
        outcome
    }

    fn emit_rotation(&mut self, outcome: RotationOutcome, version: u64, rotation: &CredentialRotation) {
        let what = match outcome {
            RotationOutcome::Applied => {
                let headers = rotation.headers.as_ref().map_or(0, Vec::len);
                let ca = if rotation.ca_path.is_some() { "replaced" } else { "kept" };
                format!("OTLP credentials rotation {version} applied: {headers} headers replaced, CA bundle {ca}")
            }
            refused => format!("OTLP credentials rotation {}", refused.describe()),
        };
        let event = self.source.config_change(&what);
        self.emit(event);
    }

    /// Called about once a second: reports what the limits dropped, at most once per interval.
    pub fn tick(&mut self) {
        self.report_drops(false);
    }

    fn report_drops(&mut self, last: bool) {
        let Some(n) = self.limiter.report(Instant::now(), last, self.unreported_drops) else {
            return;
        };
        self.limiter.dropped += std::mem::take(&mut self.unreported_drops);
        let detail = format!("{n} events over the sandbox's rate or size limits were dropped");
        let event = self.source.finding(Finding::TelemetryDropped, &detail);
        self.emit(event);
    }

    /// Flushes every sink within `budget`: the OTLP queues (logs and spans) and the JSONL file side by side,
    /// then the console for what is left of it (at least [`CONSOLE_DRAIN`]). Returns what was delivered; the caller emits
    /// nothing after this.
    pub async fn shutdown(mut self, budget: Duration, console: Console) -> TelemetryReport {
        self.report_drops(true);
        let deadline = Instant::now() + budget;
        // The chain first: it appends and delivers what is queued, then seals.
        let audited = self.audited;
        let finished = tokio::task::spawn_blocking(move || audited.finish()).await.ok().flatten();
        let (jsonl, otlp, audit) = match finished {
            Some(f) => (f.sinks.jsonl, f.sinks.otlp, f.head),
            None => (None, None, None),
        };
        let jsonl = jsonl.map(|j| tokio::task::spawn_blocking(move || j.shutdown(deadline)));
        let spans = std::mem::take(&mut self.spans);
        let otlp = async move {
            match otlp {
                Some(otlp) => otlp.shutdown(budget).await,
                None => ExportReport::default(),
            }
        };
        let (otlp, spans) = tokio::join!(otlp, spans.shutdown(budget));
        let jsonl = match jsonl {
            Some(task) => task.await.unwrap_or_default(),
            None => JsonlReport::default(),
        };
        let report = TelemetryReport {
            events: self.events,
            limited: self.limiter.dropped,
            otlp,
            spans,
            jsonl,
            console_dropped: console.dropped(),
            audit,
        };
        tracing::info!(
            events = report.events,
            limited = report.limited,
            otlp_exported = report.otlp.exported,
            otlp_dropped = report.otlp.dropped,
            spans_exported = report.spans.exported,
            spans_dropped = report.spans.dropped,
            jsonl_dropped = report.jsonl.dropped,
            jsonl_failures = report.jsonl.failures,
            console_dropped = report.console_dropped,
            audit_seq = report.audit.map_or(0, |h| h.seq),
            "telemetry flushed"
        );
        let console_by = deadline.max(Instant::now() + CONSOLE_DRAIN);
        TelemetryReport { console_dropped: console.shutdown(console_by), ..report }
    }
}

fn open_jsonl(controls: TelemetryControls) -> std::io::Result<Jsonl> {
    let verbose = controls.verbose_failures;
    if controls.jsonl_fails {
        // Fault injection: every write fails (ENOSPC).
        return Ok(Jsonl::on_file(std::fs::OpenOptions::new().write(true).open("/dev/full")?, verbose));
    }
    let cap = if controls.no_limits { u64::MAX } else { jsonl::CAP_BYTES };
    Jsonl::open(SandboxFile::Events.as_ref(), cap, verbose)
}
