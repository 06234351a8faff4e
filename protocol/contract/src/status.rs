//! Status lines from the supervisor to the driver.
//!
//! The supervisor's stdin is the driver's liveness pipe, so status travels the other way on its stdout: one
//! JSON object per line, in the order the steps happen. The driver needs them to know when the attach socket
//! is ready, which accelerator was used and why a start failed.

use serde::{Deserialize, Serialize};

use crate::accel::Accelerator;

/// One status line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case", deny_unknown_fields)]
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
        /// The VMM's pid.
        vmm_pid: u32,
        /// The agent's software string from its hello (made safe to print).
        agent: String,
    },
    /// `--pooled`: the VM is booted as for [`SupervisorStatus::Ready`] and waits to be claimed
    /// ([`crate::claim`]); nothing is served and no telemetry leaves it until then.
    Pooled {
        /// The VMM's pid.
        vmm_pid: u32,
        /// The agent's software string from its hello (made safe to print).
        agent: String,
    },
    /// `--save-snapshot`: the booted VM was saved; the supervisor stops it and exits after
    /// [`SupervisorStatus::Stopped`].
    Saved {
        /// Bytes of the migration stream.
        bytes: u64,
    },
    /// Start-up failed; the supervisor exits after this line.
    Failed {
        /// The error and its causes, outermost first.
        error: String,
        /// A restore failed on its saved state itself (QEMU refused or could not load it), not on the host:
        /// a template it came from is to be made again.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        saved_state_refused: bool,
    },
    /// The VMM has exited; the supervisor drains its clients and flushes telemetry, within
    /// [`crate::stop::after_vmm_exit`], then says [`SupervisorStatus::Stopped`]. A supervisor that does not say
    /// this soon after its VMM is gone is hung.
    Stopping,
    /// The VM is gone and telemetry flushed; the supervisor exits after this line.
    Stopped {
        /// OCSF events emitted.
        events: u64,
        /// Records the OTLP collector accepted.
        otlp_exported: u64,
        /// Records that never reached the collector.
        otlp_dropped: u64,
        /// Events over the sandbox's rate or size limits, dropped before any sink.
        limited: u64,
        /// Lines `events.jsonl` did not take (queue full, or its cap reached).
        jsonl_dropped: u64,
        /// Console lines dropped: stderr not keeping up, or its cap reached.
        console_dropped: u64,
        /// The audit chain's head, sealed: the driver keeps it outside the sandbox directory. `None`
        /// without a chain, or when it failed.
        #[serde(default)]
        audit: Option<crate::audit::Head>,
    },
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
    fn lines_round_trip() {
        let s = SupervisorStatus::Accelerator { accel: Accelerator::Tcg, fallback: Some("no /dev/kvm".into()) };
        let line = s.to_line();
        assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
        assert_eq!(SupervisorStatus::from_line(&line).unwrap(), s);
        assert!(SupervisorStatus::from_line(r#"{"status":"failed","error":"x","extra":1}"#).is_err());
    }
}
