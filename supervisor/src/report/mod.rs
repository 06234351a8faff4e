//! The reporter: the one place a running sandbox's notes ([`Note`]) become OCSF events and spans.
//!
//! Every note is reported, but findings that a workload can cause without end pass through token buckets
//! ([`TokenBucket`]): a refused connection always gets its Network Activity event (under the telemetry's own
//! rate limit), but at most [`REFUSAL_FINDINGS_PER_SEC`] `policy_denied` findings a second, and interception's
//! findings come in a burst of [`INTERCEPT_FINDINGS_BURST`], then one a second. The next finding that passes
//! says how many were held back, and so does the tick when no later finding came.
//!
//! Network events are built in [`network`].

mod network;

use std::time::Instant;

use vm_contract::layout::SandboxFile;
use vm_ocsf::{FileActivity, Finding, ProcessActivity, ProcessInfo, Status};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};
use vm_protocol::files::FileOp;
use vm_protocol::policy::UpdateOutcome;

use crate::boot::lease::LeaseFailure;
use crate::boundary::Note;
use crate::bucket::TokenBucket;
use crate::gateway::GatewayEvent;
use crate::telemetry::spans::ExecOutcome;
use crate::telemetry::Telemetry;

/// Refusal findings a second (and in a burst): every refusal has its own Network Activity event, and a
/// workload that opens connections without end must not flood the findings.
pub const REFUSAL_FINDINGS_PER_SEC: u32 = 1;
/// Findings about intercepted requests and placeholders: a burst this large, then one a second. Each request
/// also has its own HTTP Activity event; a workload that sends 403s without end must not flood the findings.
pub const INTERCEPT_FINDINGS_BURST: u32 = 16;

/// The endpoint API Activity events name for the calls this supervisor makes to an OpenShell gateway.
const GATEWAY_ENDPOINT: &str = "openshell-gateway";

/// Reports one sandbox's notes into its telemetry.
#[derive(Debug)]
pub struct Reporter<'a> {
    telemetry: &'a mut Telemetry,
    sandbox_id: String,
    refusal_findings: TokenBucket,
    intercept_findings: TokenBucket,
    /// A message to the guest was dropped since the last time that was logged.
    guest_queue_full: bool,
}

impl<'a> Reporter<'a> {
    /// A reporter into `telemetry` for `sandbox_id`, at `now`.
    pub fn new(telemetry: &'a mut Telemetry, sandbox_id: &str, now: Instant) -> Self {
        Self {
            telemetry,
            sandbox_id: sandbox_id.to_owned(),
            refusal_findings: TokenBucket::new(REFUSAL_FINDINGS_PER_SEC, REFUSAL_FINDINGS_PER_SEC, now),
            intercept_findings: TokenBucket::new(INTERCEPT_FINDINGS_BURST, 1, now),
            guest_queue_full: false,
        }
    }

    /// Reports every note of `notes`, at `now`.
    pub fn notes(&mut self, notes: Vec<Note>, now: Instant) {
        for note in notes {
            self.note(note, now);
        }
    }

    /// Reports one note, at `now`.
    pub fn note(&mut self, note: Note, now: Instant) {
        match note {
            Note::Started { guest_id, pid, argv } => {
                let info = ProcessInfo::new(&self.sandbox_id, guest_id.0, i32::try_from(pid).ok(), &argv);
                let event = self.telemetry.source().process(ProcessActivity::Launch, info, None);
                self.telemetry.emit(event);
            }
            Note::Exited { guest_id, pid, argv, status } => {
                let pid = pid.and_then(|p| i32::try_from(p).ok());
                let info = ProcessInfo::new(&self.sandbox_id, guest_id.0, pid, &argv);
                let event =
                    self.telemetry.source().process(ProcessActivity::Terminate, info, Some(status.shell_code()));
                self.telemetry.emit(event);
            }
            Note::FileDone { op, bytes, status } => {
                let paths = op.paths();
                let done = if status == vm_protocol::ExitStatus::Code(0) { Status::Success } else { Status::Failure };
                let event =
                    self.telemetry.source().file(file_activity(&op), paths[0], paths.get(1).copied(), bytes, done);
                self.telemetry.emit(event);
            }
            Note::ExecDispatched(id) => self.telemetry.spans().exec_dispatched(id),
            Note::ExecAnswered(id, outcome) => self.telemetry.spans().exec_answered(id, outcome),
            Note::TarRefused { path, reason } => {
                let detail = format!("copy_out {path:?} refused by the host's extractor: {}", reason.describe());
                self.finding(Finding::TarRefused, &detail);
            }
            Note::Denied { op, revision, denial } => {
                let detail = format!("{op} denied at policy revision {revision}: {}", denial.describe());
                self.finding(Finding::PolicyDenied, &detail);
            }
            Note::PolicyUpdateReceived => self.telemetry.spans().policy_update_received(),
            Note::PolicyUpdated { revision, outcome, allowed } => {
                self.telemetry.spans().policy_updated(revision, outcome);
                let applied = outcome == UpdateOutcome::Applied;
                self.api_call("UpdatePolicy", applied, &format!("revision {revision} {}", outcome.describe()));
                self.config_change(&format!("policy revision {revision} {}; allowed: {allowed}", outcome.describe()));
            }
            Note::SecretsRotated { outcome, names } => {
                self.config_change(&format!("credentials {}: {}", outcome.describe(), names.join(", ")));
            }
            Note::RotationAnswered(outcome) => {
                self.api_call("RotateCredentials", outcome == RotationOutcome::Applied, outcome.describe());
            }
            Note::StreamRefused(refused) => self.stream_refused(&refused, now),
            Note::Forward(forward) => self.forward(forward),
            Note::Egress(report) => self.egress(report, now),
            Note::ClientViolation(_, violation) => {
                tracing::warn!(error = %violation, "protocol violation by an attach client; disconnected");
            }
            Note::GuestViolation(violation) => {
                tracing::error!(error = %violation, "protocol violation by the guest");
                self.finding(Finding::GuestProtocolViolation, &violation.to_string());
            }
            Note::GuestQueueFull => {
                if !std::mem::replace(&mut self.guest_queue_full, true) {
                    tracing::warn!("the guest is not reading its link; messages to it are dropped");
                }
            }
            Note::AdmissionRefused(what) => self.finding(Finding::AdmissionRefused, what),
            Note::Gateway(event) => self.gateway(event, now),
            Note::LogCapped(log) => {
                self.finding(Finding::LogCapped, &format!("{log} reached its cap; the rest is dropped and counted"));
            }
            Note::SessionRefused => {
                self.finding(Finding::AdmissionRefused, "the driver refused this supervisor's session");
            }
            Note::DriverGone => {
                tracing::warn!("the driver is gone (liveness pipe closed); killing the VM");
                self.finding(Finding::LivenessLost, "the parent-liveness pipe closed");
            }
            Note::LeaseLost(failure) => {
                tracing::error!(error = %failure, "lease lost; stopping the VM");
                let finding =
                    if failure == LeaseFailure::WatchdogKilling { Finding::WatchdogAction } else { Finding::LeaseLost };
                self.finding(finding, &failure.to_string());
            }
            Note::VmmLimit(hit) => self.finding(Finding::VmmLimit, hit),
            Note::StopDecided => self.telemetry.spans().stop_decided(),
            Note::VmmExited(reason) => self.telemetry.spans().vmm_exited(&reason),
        }
    }

    /// About once a second: what the limits held back with no later finding to say so, and what the
    /// telemetry's own limits dropped.
    pub fn tick(&mut self, now: Instant) {
        if self.refusal_findings.ready(now) {
            let held = self.refusal_findings.take_held();
            if held > 0 && self.refusal_findings.take(now) {
                self.finding(Finding::PolicyDenied, &format!("{held} more connections refused since the last finding"));
            }
        }
        if self.intercept_findings.ready(now) {
            let held = self.intercept_findings.take_held();
            if held > 0 && self.intercept_findings.take(now) {
                let detail = format!("{held} more intercepted requests refused since the last finding");
                self.finding(Finding::PolicyDenied, &detail);
            }
        }
        self.telemetry.tick();
    }

    /// The collector's part of a rotation (the telemetry's, which reports it).
    pub fn rotate_collector(&mut self, rotation: &CredentialRotation) -> RotationOutcome {
        self.telemetry.rotate(rotation)
    }

    /// A message to the guest that a full queue dropped.
    pub fn undelivered(&mut self, msg: &vm_protocol::link::ToGuest, now: Instant) {
        if let Some(id) = crate::telemetry::spans::dispatched_spawn(msg) {
            self.note(Note::ExecAnswered(id, ExecOutcome::NotDispatched), now);
        }
        self.note(Note::GuestQueueFull, now);
    }

    /// Reports a finding. `detail` is fixed text plus ids.
    fn finding(&mut self, finding: Finding, detail: &str) {
        let event = self.telemetry.source().finding(finding, detail);
        self.telemetry.emit(event);
    }

    /// A finding through `bucket` (the refusals' or interception's): held back and counted when it is empty,
    /// and the next one that passes says how many were.
    fn limited_finding(&mut self, interception: bool, now: Instant, detail: &str) {
        let bucket = if interception { &mut self.intercept_findings } else { &mut self.refusal_findings };
        if !bucket.take(now) {
            return;
        }
        let held = bucket.take_held();
        let what = if interception { "held back" } else { "refused" };
        let also = if held > 0 { format!(" ({held} more {what} since the last finding)") } else { String::new() };
        self.finding(Finding::PolicyDenied, &format!("{detail}{also}"));
    }

    /// The gateway's session as API Activity (`ConnectSupervisor`, `ReportMainProcessExit`); refused relays as
    /// findings, limited as refusals are.
    fn gateway(&mut self, event: GatewayEvent, now: Instant) {
        let mut call = |operation: &str, status: Status, outcome: &str| {
            let event = self.telemetry.source().api_update(operation, GATEWAY_ENDPOINT, status, outcome);
            self.telemetry.emit(event);
        };
        match event {
            GatewayEvent::SessionUp => call("ConnectSupervisor", Status::Success, "session accepted by the gateway"),
            GatewayEvent::SessionDown(why) => call("ConnectSupervisor", Status::Failure, why),
            GatewayEvent::MainExitReported(code) => {
                call("ReportMainProcessExit", Status::Success, &format!("main process exit code {code} reported"));
            }
            GatewayEvent::RelayRefused(why) => {
                self.limited_finding(false, now, &format!("a relay the gateway asked for was refused: {why}"));
            }
        }
    }

    fn config_change(&mut self, what: &str) {
        let event = self.telemetry.source().config_change(what);
        self.telemetry.emit(event);
    }

    /// Records a control-plane call that came through the attach socket (API Activity); `outcome` is fixed text.
    fn api_call(&mut self, operation: &str, applied: bool, outcome: &str) {
        let status = if applied { Status::Success } else { Status::Failure };
        let event = self.telemetry.source().api_update(operation, SandboxFile::Attach.name(), status, outcome);
        self.telemetry.emit(event);
    }
}

/// The OCSF activity of a file operation.
fn file_activity(op: &FileOp) -> FileActivity {
    match op {
        FileOp::Read { .. } | FileOp::CopyOut { .. } => FileActivity::Read,
        FileOp::Write { .. } => FileActivity::Update,
        FileOp::List { .. } | FileOp::Stat { .. } => FileActivity::GetAttributes,
        FileOp::MakeDir { .. } | FileOp::CopyIn { .. } => FileActivity::Create,
        FileOp::Remove { .. } => FileActivity::Delete,
        FileOp::Rename { .. } => FileActivity::Rename,
    }
}
