//! What the boundary (and the event loop around it) tells the record: one [`Note`] per security-relevant act,
//! which the reporter (`crate::report`) turns into OCSF events and spans. A note says what happened, in the
//! boundary's terms; how it is worded, rated and exported is the reporter's.

use vm_protocol::credentials::RotationOutcome;
use vm_protocol::files::{FileOp, TarRefusal};
use vm_protocol::policy::{Operation, UpdateOutcome};
use vm_protocol::{ExitStatus, ProcId};

use super::stream::{ForwardNote, Refused};
use super::violation::{ClientViolation, GuestViolation};
use super::ClientId;
use crate::boot::lease::LeaseFailure;
use crate::network::egress::Report;
use crate::policy::Denial;
use crate::stop::StopReason;
use crate::telemetry::spans::ExecOutcome;

/// One thing the sandbox's record must say.
#[derive(Debug)]
pub enum Note {
    /// A workload process started.
    Started {
        /// The guest-wide id.
        guest_id: ProcId,
        /// Its pid inside the guest.
        pid: u32,
        /// Its argv (bounded).
        argv: Vec<String>,
    },
    /// A workload process ended, or never started.
    Exited {
        /// The guest-wide id.
        guest_id: ProcId,
        /// Its pid inside the guest, if it started.
        pid: Option<u32>,
        /// Its argv (bounded).
        argv: Vec<String>,
        /// How it ended.
        status: ExitStatus,
    },
    /// A file operation ended.
    FileDone {
        /// What it was.
        op: FileOp,
        /// Bytes in on stdin and out on stdout.
        bytes: u64,
        /// How it ended: 0 is success.
        status: ExitStatus,
    },
    /// A spawn left for the guest.
    ExecDispatched(ProcId),
    /// The guest answered a spawn, or it never left.
    ExecAnswered(ProcId, ExecOutcome),
    /// The client's hardened extractor refused a `CopyOut`'s tar.
    TarRefused {
        /// The guest path copied out.
        path: String,
        /// Why.
        reason: TarRefusal,
    },
    /// The policy denied a client's operation.
    Denied {
        /// What was asked.
        op: Operation,
        /// The revision in force.
        revision: u64,
        /// Why.
        denial: Denial,
    },
    /// A policy update arrived.
    PolicyUpdateReceived,
    /// A policy update was applied or refused.
    PolicyUpdated {
        /// Its revision.
        revision: u64,
        /// What became of it.
        outcome: UpdateOutcome,
        /// The operations allowed now.
        allowed: String,
    },
    /// A rotation's credentials (the egress secrets) were swapped or refused; the collector's half is the
    /// telemetry's own event.
    SecretsRotated {
        /// What became of them.
        outcome: RotationOutcome,
        /// Their names (never a value).
        names: Vec<String>,
    },
    /// The whole rotation was answered.
    RotationAnswered(RotationOutcome),
    /// A stream was refused before it opened (the stream router's refusals).
    StreamRefused(Refused),
    /// A port forward opened or ended.
    Forward(ForwardNote),
    /// An egress task's report.
    Egress(Report),
    /// A client broke the protocol and was disconnected.
    ClientViolation(ClientId, ClientViolation),
    /// The guest broke the protocol: the sandbox stops.
    GuestViolation(GuestViolation),
    /// The guest's queue was full and a message to it was dropped (the first of a run).
    GuestQueueFull,
    /// An attach connection was refused (fixed text).
    AdmissionRefused(&'static str),
    /// A log the guest fills reached its cap (the file's name).
    LogCapped(&'static str),
    /// The OpenShell gateway's session or relays.
    Gateway(crate::gateway::GatewayEvent),
    /// The driver refused this supervisor's session.
    SessionRefused,
    /// The parent-liveness pipe closed.
    DriverGone,
    /// The lease with the watchdog was lost.
    LeaseLost(LeaseFailure),
    /// The VMM hit one of its cgroup limits (fixed text).
    VmmLimit(&'static str),
    /// The supervisor decided to stop the VM.
    StopDecided,
    /// The VMM exited, for this reason.
    VmmExited(StopReason),
}
