//! The supervisor's own diagnostics: what reaches `supervisor.log`, and how errors are worded there.
//!
//! Diagnostics go through the one console writer, filtered by `RUST_LOG` (default `info`). The HTTP, gRPC,
//! TLS and OpenTelemetry libraries are silenced by a filter of their own (`vm_contract::logs`) that no
//! `RUST_LOG` directive can widen (`h2=trace` included).
//! Failures of the telemetry sinks are logged in fixed text with counts, never the error or the record.

use std::path::Path;

use tracing_subscriber::filter::{filter_fn, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};
pub use vm_contract::logs::chain;
use vm_contract::logs::is_silenced;

use crate::telemetry::console::ConsoleHandle;

/// Lines of `vmm.log` and `console.log` quoted in a boot failure.
const LOG_TAIL_LINES: usize = 12;

/// Installs the diagnostics subscriber on `console`. `quiet_failures` is off only in the control of the
/// redaction test (`verbose-failure-logs`): then the libraries are heard, to show that this filter is what
/// keeps payloads out of the logs.
pub fn init(console: ConsoleHandle, quiet_failures: bool) {
    let env = EnvFilter::try_new(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let layer = tracing_subscriber::fmt::layer().with_writer(console).with_ansi(false);
    let layer = if !quiet_failures {
        layer.with_filter(FilterExt::boxed(env))
    } else {
        layer.with_filter(FilterExt::boxed(env.and(filter_fn(|meta| !is_silenced(meta.target())))))
    };
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// The last lines of QEMU's and the guest's logs, for a boot failure message.
pub fn tails(files: &[&str]) -> String {
    let mut text = String::new();
    for file in files {
        let tail = tail(Path::new(file));
        if !tail.is_empty() {
            text.push_str(&format!("\n--- last lines of {file} ---\n{tail}"));
        }
    }
    text
}

/// The last lines of `path`, made safe to print: the guest writes the console, so control characters
/// (terminal escapes among them) become `?` and each line is cut at 240 characters.
fn tail(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..]
        .iter()
        .map(|line| vm_contract::logs::printable(line, 240))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_tails_carry_no_terminal_escapes() {
        let path = std::env::temp_dir().join(format!("tail-{}.log", std::process::id()));
        std::fs::write(&path, b"boot\n\x1b]0;owned\x07\x1b[2Jclear\xff\n").unwrap();
        let tail = tail(&path);
        let _ = std::fs::remove_file(&path);
        assert_eq!(tail, "boot\n?]0;owned??[2Jclear\u{fffd}");
    }
}
