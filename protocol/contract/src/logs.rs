//! What the host processes may log, and how they word an error. The HTTP, gRPC, TLS and OpenTelemetry libraries never reach a log, at
//! any `RUST_LOG`: their messages can carry a collector's error text or echo request metadata (headers,
//! tokens). Each process filters them out with [`is_silenced`], whatever directives `RUST_LOG` holds.

/// Library crates whose log targets are dropped. OpenTelemetry's own diagnostics use the package name as
/// the target, hyphens and all (`opentelemetry-otlp`), beside the module paths (`opentelemetry_otlp::..`).
pub const SILENCED: [&str; 13] = [
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry_otlp",
    "opentelemetry-otlp",
    "opentelemetry_http",
    "opentelemetry-http",
    "tonic",
    "h2",
    "hyper",
    "hyper_util",
    "reqwest",
    "tower",
    "rustls",
];

/// An error and its causes, outermost first, as one line: how every host process words a failure in a log,
/// a status line or an API detail.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Untrusted text (a workload's argv, a guest's console) made safe for one log line or a terminal: every
/// control character (newline, ESC) becomes `?`, and it is cut to `max` characters, the cut marked `...`.
pub fn printable(text: &str, max: usize) -> String {
    let mut out: String = text.chars().take(max).map(|c| if c.is_control() { '?' } else { c }).collect();
    if text.chars().nth(max).is_some() {
        out.push_str("...");
    }
    out
}

/// Whether a log target belongs to a silenced crate (the crate itself or one of its modules).
pub fn is_silenced(target: &str) -> bool {
    SILENCED.iter().any(|t| target == *t || target.strip_prefix(t).is_some_and(|rest| rest.starts_with("::")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_text_has_no_control_characters_and_a_bound() {
        assert_eq!(printable("a\x1b[2Jb\nc", 100), "a?[2Jb?c");
        assert_eq!(printable("abcdef", 3), "abc...");
        assert_eq!(printable("abc", 3), "abc");
    }

    #[test]
    fn silenced_by_crate_not_by_prefix() {
        assert!(is_silenced("h2") && is_silenced("h2::codec") && is_silenced("opentelemetry_otlp::logs"));
        assert!(!is_silenced("h2o") && !is_silenced("vm_supervisor::telemetry::otlp"));
        assert!(is_silenced("opentelemetry-otlp") && is_silenced("opentelemetry-http"), "internal-log targets");
    }
}
