//! What the host processes may log. The HTTP, gRPC, TLS and OpenTelemetry libraries never reach a log, at
//! any `RUST_LOG`: their messages can carry a collector's error text or echo request metadata (headers,
//! tokens). Each process filters them out with [`is_silenced`], whatever directives `RUST_LOG` holds.

/// Library crates whose log targets are dropped.
pub const SILENCED: [&str; 11] = [
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry_otlp",
    "opentelemetry_http",
    "tonic",
    "h2",
    "hyper",
    "hyper_util",
    "reqwest",
    "tower",
    "rustls",
];

/// Whether a log target belongs to a silenced crate (the crate itself or one of its modules).
pub fn is_silenced(target: &str) -> bool {
    SILENCED.iter().any(|t| target == *t || target.strip_prefix(t).is_some_and(|rest| rest.starts_with("::")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silenced_by_crate_not_by_prefix() {
        assert!(is_silenced("h2") && is_silenced("h2::codec") && is_silenced("opentelemetry_otlp::logs"));
        assert!(!is_silenced("h2o") && !is_silenced("vm_supervisor::telemetry::otlp"));
    }
}
