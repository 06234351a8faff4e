//! Status lines from the supervisor to the driver.
//!
//! The supervisor's stdin is the driver's liveness pipe, so status travels the other way on its stdout: one
//! JSON object per line, in the order the steps happen. The driver needs them to know when the attach socket
//! is ready, which accelerator was used and why a start failed.

use serde::{Deserialize, Serialize};

/// The hardware-assisted or emulated CPU the VMM runs the guest on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accelerator {
    /// Linux KVM.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
}

impl Accelerator {
    /// `kvm` or `tcg`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Tcg => "tcg",
        }
    }
}

/// One status line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SupervisorStatus {
    /// The accelerator was chosen. `fallback` says why `auto` did not pick KVM, when it did not.
    Accelerator {
        /// The choice.
        accel: Accelerator,
        /// Why KVM was not used, when `auto` fell back.
        fallback: Option<String>,
    },
    /// The VMM runs and the guest agent answered the handshake; the attach socket accepts connections.
    Ready {
        /// File name of the attach socket inside the sandbox directory.
        attach_socket: String,
        /// The VMM's pid.
        vmm_pid: u32,
        /// The agent's software string from its hello.
        agent: String,
    },
    /// Start-up failed; the supervisor exits after this line.
    Failed {
        /// The error and its causes, outermost first.
        error: String,
    },
    /// The VM is gone and telemetry flushed; the supervisor exits after this line.
    Stopped {
        /// OCSF events emitted.
        events: u64,
        /// Records the OTLP collector accepted.
        otlp_exported: u64,
        /// Records that never reached the collector.
        otlp_dropped: u64,
        /// Console lines dropped because stderr was not keeping up.
        console_dropped: u64,
    },
}

/// The supervisor's attach socket, in the sandbox directory (the `Ready` line reports it too).
pub const ATTACH_SOCKET: &str = "attach.sock";

/// File in the sandbox directory where the supervisor records the processes of its sandbox, for the
/// driver's orphan reaper.
pub const PIDS_FILE: &str = "pids.json";

/// A process named by pid and start time (field 22 of `/proc/<pid>/stat`), so a reused pid is never
/// mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRecord {
    /// The pid.
    pub pid: i32,
    /// Start time in clock ticks since boot.
    pub start_time: u64,
}

impl ProcessRecord {
    /// The record of `pid` as it runs now, from `/proc/<pid>/stat`; `None` when it is gone or a zombie
    /// (it has exited and only waits to be reaped). The one reader of start times for the driver and the
    /// supervisor; the watchdog keeps its own so it stays dependency-free.
    pub fn read(pid: i32) -> Option<Self> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let fields: Vec<&str> = text.rsplit_once(") ")?.1.split(' ').collect();
        if fields.first() == Some(&"Z") {
            return None;
        }
        Some(Self { pid, start_time: fields.get(19)?.parse().ok()? })
    }
}

/// The contents of [`PIDS_FILE`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxPids {
    /// The supervisor itself.
    pub supervisor: ProcessRecord,
    /// The VMM, once started.
    pub vmm: Option<ProcessRecord>,
    /// The lease watchdog, once started.
    pub watchdog: Option<ProcessRecord>,
}

/// Environment variables through which the driver passes telemetry settings to the supervisor. None of
/// them is a secret: collector headers travel in the [`AuthBundle`] only.
pub mod env {
    /// OTLP collector endpoint for OCSF events; unset means no export.
    pub const OTLP_ENDPOINT: &str = "OPENSHELL_OTLP_OCSF_ENDPOINT";
    /// OCSF schema version (default 1.8.0).
    pub const SCHEMA_VERSION: &str = "OPENSHELL_OTLP_OCSF_SCHEMA_VERSION";
    /// Name of the gateway, for the `openshell.gateway.name` resource attribute.
    pub const GATEWAY_NAME: &str = "OPENSHELL_GATEWAY_NAME";
    /// `grpc` (default) or `http/protobuf`.
    pub const OTLP_PROTOCOL: &str = "OPENSHELL_OTLP_OCSF_PROTOCOL";
    /// `on` (default) or `off`: OCSF JSON on the console and in the JSONL file.
    pub const OCSF_JSON: &str = "OPENSHELL_OCSF_JSON";
}

/// File in the sandbox directory holding the supervisor's secrets (mode 0600): written by the driver, read
/// and removed by the supervisor at start. Secrets never travel in argv or the environment.
pub const AUTH_BUNDLE_FILE: &str = "auth.json";

/// The contents of [`AUTH_BUNDLE_FILE`]. Its `Debug` never shows a value.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthBundle {
    /// Headers for the OTLP collector (from `OTEL_EXPORTER_OTLP_LOGS_HEADERS` or `OTEL_EXPORTER_OTLP_HEADERS`).
    pub otlp_headers: Vec<(String, String)>,
    /// The token this supervisor presents when it opens its session to the driver.
    #[serde(default)]
    pub session_token: Option<String>,
}

impl std::fmt::Debug for AuthBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.otlp_headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("AuthBundle")
            .field("otlp_header_names", &names)
            .field("session_token", &self.session_token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The session between a supervisor and `vm-driver serve`, one JSON object per line on the driver's
/// session socket: the supervisor sends [`SessionHello`], the driver answers [`SessionReply`], the supervisor
/// then reports its readiness endpoint with [`SessionNote`]. Either side closing ends the session.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionHello {
    /// The sandbox.
    pub sandbox_id: String,
    /// Its generation (increments on each start).
    pub generation: u64,
    /// The token from the auth bundle.
    pub token: String,
}

impl std::fmt::Debug for SessionHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHello")
            .field("sandbox_id", &self.sandbox_id)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// The driver's answer to a [`SessionHello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionReply {
    /// Whether the session is accepted.
    pub accepted: bool,
    /// Why not (fixed text).
    #[serde(default)]
    pub reason: String,
}

/// What the supervisor reports once accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionNote {
    /// `127.0.0.1:PORT` of the readiness listener.
    pub readiness: String,
}

impl SupervisorStatus {
    /// One line of JSON, newline included.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self)
            .unwrap_or_else(|_| String::from("{\"status\":\"failed\",\"error\":\"status encoding\"}"));
        line.push('\n');
        line
    }

    /// Parses one line.
    ///
    /// # Errors
    /// The JSON error when the line is not a status.
    pub fn from_line(line: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(line.trim_end())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth_bundle_debug_shows_no_values() {
        let b = AuthBundle {
            otlp_headers: vec![("authorization".into(), "Bearer s3cret".into())],
            session_token: Some("t0ken-value".into()),
        };
        let shown = format!("{b:?}");
        assert!(shown.contains("authorization") && !shown.contains("s3cret") && !shown.contains("t0ken"), "{shown}");
    }

    #[test]
    fn lines_round_trip() {
        let s = SupervisorStatus::Accelerator { accel: Accelerator::Tcg, fallback: Some("no /dev/kvm".into()) };
        let line = s.to_line();
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        assert_eq!(SupervisorStatus::from_line(&line).unwrap(), s);
    }
}
