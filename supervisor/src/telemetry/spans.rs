//! The supervisor's spans, exported as OTLP traces when an OTLP endpoint is set ([`span_export`]).
//!
//! One trace per sandbox: a root span `sandbox` from the supervisor's start to its flush, and children
//! `sandbox.boot` (start to the agent's handshake), `sandbox.admission` (the launch descriptor and the
//! approved policy, revision 0),
//! `sandbox.exec` (one admitted `Spawn` dispatched to the guest, ended by its answer), `sandbox.policy_update`
//! (an `UpdatePolicy` through the gate) and `sandbox.stop` (the stop decision to the VMM's exit).
//!
//! Attributes are fixed text and ids only (the sandbox id, the guest-wide process id, the operation, the
//! policy revision, the outcome): never argv, environment or payload. The resource is the log records'
//! ([`super::otlp::resource`]).
//!
//! [`span_export`]: super::span_export

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, Span, SpanData};
use opentelemetry_sdk::Resource;
use vm_protocol::link::{ToGuest, ToHost};
use vm_protocol::policy::UpdateOutcome;
use vm_protocol::{ProcId, ProcessEvent, ProcessRequest};

use super::batch::{BatchExport, Queue};
use super::otlp::{ExportReport, OtlpError};
use super::span_export::{QueueProcessor, SpanSource, SPAN_BOUNDS};
use crate::stop::StopReason;

/// Exec spans open at once (dispatched, not yet answered); the multiplexer keeps far fewer processes.
pub const MAX_OPEN_EXEC_SPANS: usize = 1024;

/// How a dispatched spawn was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecOutcome {
    /// `Started`, with the process's pid in the guest.
    Started(u32),
    /// `SpawnFailed`.
    SpawnFailed,
    /// `Refused` by the agent.
    Refused,
    /// The guest's queue was full: the spawn never left the supervisor.
    NotDispatched,
}

impl ExecOutcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Started(_) => "started",
            Self::SpawnFailed => "spawn_failed",
            Self::Refused => "refused",
            Self::NotDispatched => "not_dispatched",
        }
    }
}

/// The guest's answer to a spawn, if `msg` is one: the guest-wide id and the outcome.
pub fn spawn_answer(msg: &ToHost) -> Option<(ProcId, ExecOutcome)> {
    match msg {
        ToHost::Process(ProcessEvent::Started { id, pid, .. }) => Some((*id, ExecOutcome::Started(*pid))),
        ToHost::Process(ProcessEvent::SpawnFailed { id, .. }) => Some((*id, ExecOutcome::SpawnFailed)),
        ToHost::Process(ProcessEvent::Refused { id, .. }) => Some((*id, ExecOutcome::Refused)),
        _ => None,
    }
}

/// The guest-wide id of a spawn being dispatched, if `msg` is one.
pub fn dispatched_spawn(msg: &ToGuest) -> Option<ProcId> {
    match msg {
        ToGuest::Process(ProcessRequest::Spawn(spawn)) => Some(spawn.id),
        _ => None,
    }
}

fn stop_kind(reason: &StopReason) -> &'static str {
    match reason {
        StopReason::Terminated => "terminated",
        StopReason::DriverGone => "driver_gone",
        StopReason::LeaseLost(_) => "lease_lost",
        StopReason::VmmExited(_) => "vmm_exited",
        StopReason::GuestViolation(_) => "guest_violation",
        StopReason::ChannelClosed => "channel_closed",
        StopReason::SessionRefused => "session_refused",
    }
}

fn update_outcome(outcome: UpdateOutcome) -> &'static str {
    match outcome {
        UpdateOutcome::Applied => "applied",
        UpdateOutcome::Stale => "stale",
        UpdateOutcome::NotApproved => "not_approved",
        UpdateOutcome::IdentityConflict => "identity_conflict",
    }
}

/// The spans of one supervisor; every method is a no-op without an OTLP endpoint.
#[derive(Debug, Default)]
pub struct Spans(Option<Inner>);

#[derive(Debug)]
struct Inner {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    root: Context,
    sandbox_id: String,
    boot: Option<Span>,
    execs: HashMap<ProcId, Span>,
    update_received: Option<SystemTime>,
    stop: Option<Span>,
    queue: Arc<Queue<SpanData>>,
    export: Option<BatchExport<SpanData>>,
}

impl Spans {
    /// Starts the span export to the log export's collector, with its credentials, and opens the `sandbox`
    /// and `sandbox.boot` spans. Must run inside the tokio runtime.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    pub(crate) fn start(source: SpanSource, sandbox_id: &str) -> Result<Self, OtlpError> {
        let mut spans = Self::unexported(source.spec.resource.clone(), sandbox_id);
        if let Some(inner) = &mut spans.0 {
            inner.export = Some(source.start(Arc::clone(&inner.queue))?);
        }
        Ok(spans)
    }

    /// The spans without an export task: they stay in the queue (for tests, and as the core of `start`).
    fn unexported(resource: Resource, sandbox_id: &str) -> Self {
        let queue = Arc::new(Queue::new(SPAN_BOUNDS));
        let provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_span_processor(QueueProcessor(Arc::clone(&queue)))
            .build();
        let tracer = provider.tracer("vm-supervisor");
        let attrs = |op: &'static str| {
            vec![KeyValue::new("openshell.sandbox.id", sandbox_id.to_owned()), KeyValue::new("openshell.operation", op)]
        };
        let root = tracer.span_builder("sandbox").with_kind(SpanKind::Internal).with_attributes(attrs("sandbox"));
        let root = Context::new().with_span(root.start_with_context(&tracer, &Context::new()));
        let boot =
            tracer.span_builder("sandbox.boot").with_attributes(attrs("boot")).start_with_context(&tracer, &root);
        Self(Some(Inner {
            provider,
            tracer,
            root,
            sandbox_id: sandbox_id.to_owned(),
            boot: Some(boot),
            execs: HashMap::new(),
            update_received: None,
            stop: None,
            queue,
            export: None,
        }))
    }

    /// Where the VM came from when it was not booted for this sandbox (`pool`, `template`: started before, then
    /// claimed);
    /// the boot span then covers the claim.
    pub fn boot_origin(&mut self, origin: &'static str) {
        let Some(inner) = &mut self.0 else { return };
        if let Some(boot) = &mut inner.boot {
            boot.set_attribute(KeyValue::new("openshell.boot.origin", origin));
        }
    }

    /// The agent's handshake completed (`ready`), or the boot failed.
    pub fn boot_ended(&mut self, ready: bool) {
        let Some(inner) = &mut self.0 else { return };
        if let Some(mut boot) = inner.boot.take() {
            end(&mut boot, if ready { "ready" } else { "failed" }, !ready);
        }
    }

    /// The start-up admission, begun at `started`: the launch descriptor was admitted and the approved policy
    /// (revision 0) read and accepted, or refused. (A refused descriptor stops the start before any
    /// credential is read, so before the export exists: it has no span.)
    pub fn admission(&mut self, started: SystemTime, approved: bool) {
        let Some(inner) = &mut self.0 else { return };
        let mut span = inner.child("sandbox.admission", "admission", started);
        span.set_attribute(KeyValue::new("openshell.policy.revision", 0i64));
        end(&mut span, if approved { "approved" } else { "refused" }, !approved);
    }

    /// An admitted spawn is being dispatched to the guest under its guest-wide id.
    pub fn exec_dispatched(&mut self, id: ProcId) {
        let Some(inner) = &mut self.0 else { return };
        if inner.execs.len() >= MAX_OPEN_EXEC_SPANS {
            return;
        }
        let mut span = inner.child("sandbox.exec", "exec", SystemTime::now());
        span.set_attribute(KeyValue::new("openshell.process.id", i64::from(id.0)));
        // A second spawn under the same id cannot happen (ids only grow); if it did, the first span ends.
        if let Some(mut old) = inner.execs.insert(id, span) {
            end(&mut old, "replaced", false);
        }
    }

    /// The guest answered (or the spawn never left): ends that process's exec span.
    pub fn exec_answered(&mut self, id: ProcId, outcome: ExecOutcome) {
        let Some(inner) = &mut self.0 else { return };
        let Some(mut span) = inner.execs.remove(&id) else { return };
        if let ExecOutcome::Started(pid) = outcome {
            span.set_attribute(KeyValue::new("process.pid", i64::from(pid)));
        }
        end(&mut span, outcome.as_str(), false);
    }

    /// A client's `UpdatePolicy` reached the event loop.
    pub fn policy_update_received(&mut self) {
        if let Some(inner) = &mut self.0 {
            inner.update_received = Some(SystemTime::now());
        }
    }

    /// The gate applied or refused the update with `revision`.
    pub fn policy_updated(&mut self, revision: u64, outcome: UpdateOutcome) {
        let Some(inner) = &mut self.0 else { return };
        let started = inner.update_received.take().unwrap_or_else(SystemTime::now);
        let mut span = inner.child("sandbox.policy_update", "policy_update", started);
        span.set_attribute(KeyValue::new("openshell.policy.revision", i64::try_from(revision).unwrap_or(i64::MAX)));
        end(&mut span, update_outcome(outcome), outcome != UpdateOutcome::Applied);
    }

    /// The supervisor decided to stop the VM; the first decision opens the stop span.
    pub fn stop_decided(&mut self) {
        let Some(inner) = &mut self.0 else { return };
        if inner.stop.is_none() {
            inner.stop = Some(inner.child("sandbox.stop", "stop", SystemTime::now()));
        }
    }

    /// The VMM exited, for `reason`: ends the stop span (one that starts now if nothing decided a stop).
    pub fn vmm_exited(&mut self, reason: &StopReason) {
        let Some(inner) = &mut self.0 else { return };
        let mut span = match inner.stop.take() {
            Some(span) => span,
            None => inner.child("sandbox.stop", "stop", SystemTime::now()),
        };
        span.set_attribute(KeyValue::new("openshell.stop.reason", stop_kind(reason)));
        end(&mut span, "vmm_exited", false);
    }

    /// Ends what is still open and the root, then flushes until `budget` has passed.
    pub async fn shutdown(self, budget: Duration) -> ExportReport {
        let Some(mut inner) = self.0 else { return ExportReport::default() };
        inner.end_open();
        match inner.export.take() {
            Some(export) => {
                let report = export.shutdown(budget).await;
                let _ = inner.provider.shutdown();
                report
            }
            None => ExportReport::default(),
        }
    }
}

impl Inner {
    fn child(&self, name: &'static str, op: &'static str, started: SystemTime) -> Span {
        self.tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(started)
            .with_attributes([
                KeyValue::new("openshell.sandbox.id", self.sandbox_id.clone()),
                KeyValue::new("openshell.operation", op),
            ])
            .start_with_context(&self.tracer, &self.root)
    }

    /// Spans the sandbox ended before they could finish.
    fn end_open(&mut self) {
        if let Some(mut boot) = self.boot.take() {
            end(&mut boot, "failed", true);
        }
        for (_, mut span) in self.execs.drain() {
            end(&mut span, "unanswered", false);
        }
        if let Some(mut stop) = self.stop.take() {
            end(&mut stop, "unfinished", true);
        }
        self.root.span().end();
    }
}

fn end(span: &mut Span, outcome: &'static str, error: bool) {
    span.set_attribute(KeyValue::new("openshell.outcome", outcome));
    if error {
        span.set_status(Status::error(outcome));
    }
    span.end();
}

#[cfg(test)]
mod tests;
