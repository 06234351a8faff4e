//! Supervisor spans as OTLP traces to a real receiver (gRPC and HTTP/protobuf), on real VMs: boot,
//! admission, exec, policy update (under `vm-driver serve`) and stop, with exactly the log records' resource,
//! valid ids and times, parents that exist, the collector headers (rotated with the logs', over TLS), and no
//! argv in any attribute.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use vm_contract::layout::SandboxFile;
use vm_test_support::otlp_receiver::{authorization_headers, Behavior, Receiver, Request, Span, TlsIdentity};
use vm_test_support::output::{ok, stderr};
use vm_test_support::serve::Serve;
use vm_test_support::{sandbox, wait_until, Launch, Scratch};

const GATEWAY: &str = "gateway-spans-3";
const HEADER_SECRET: &str = "Bearer span-hdr-7c2e";
/// In the workload's argv only: it must never be a span attribute.
const ARGV_CANARY: &str = "argv-canary-51d0";

fn otlp_flags<'a>(endpoint: &'a str, protocol: &'a str) -> [&'a str; 6] {
    ["--otlp-ocsf-endpoint", endpoint, "--otlp-ocsf-protocol", protocol, "--gateway-name", GATEWAY]
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    span.attributes.get(key).map(String::as_str)
}

/// The spans of sandbox `id` once its root (`sandbox`, ended at the flush) has arrived, by name; checks what
/// every span must satisfy.
fn spans_of(receiver: &Receiver, id: &str, protocol: &str) -> HashMap<String, Vec<Span>> {
    let mine = |s: &Span| s.resource.get("openshell.sandbox.id").map(String::as_str) == Some(id);
    assert!(
        wait_until(Duration::from_secs(30), || receiver.spans().iter().any(|s| mine(s) && s.name == "sandbox")),
        "the root span of {id} never arrived: {:#?}",
        receiver.spans()
    );
    let spans: Vec<Span> = receiver.spans().into_iter().filter(mine).collect();
    assert_eq!(receiver.undecodable_traces(), 0, "every trace body decodes as ExportTraceServiceRequest");
    let records: Vec<_> = receiver
        .records()
        .into_iter()
        .filter(|r| r.resource.get("openshell.sandbox.id").map(String::as_str) == Some(id))
        .collect();
    assert!(!records.is_empty(), "the log records of {id} arrived too");
    let ids: HashSet<&[u8]> = spans.iter().map(|s| s.span_id.as_slice()).collect();
    assert_eq!(ids.len(), spans.len(), "span ids are unique");
    let roots: Vec<&Span> = spans.iter().filter(|s| s.parent_span_id.is_empty()).collect();
    assert_eq!(roots.len(), 1, "one root");
    assert_eq!(roots[0].name, "sandbox");
    for s in &spans {
        assert_eq!(s.protocol, if protocol == "grpc" { "grpc" } else { "http" });
        assert_eq!(s.resource.get("openshell.gateway.name").map(String::as_str), Some(GATEWAY), "{}", s.name);
        assert_eq!(s.resource.get("service.name").map(String::as_str), Some("vm-supervisor"));
        for r in &records {
            assert_eq!(r.resource, s.resource, "{}: the same resource as the log records", s.name);
        }
        assert_eq!(s.trace_id.len(), 16, "{}", s.name);
        assert_eq!(s.span_id.len(), 8, "{}", s.name);
        assert!(s.trace_id.iter().any(|b| *b != 0) && s.span_id.iter().any(|b| *b != 0), "{}", s.name);
        assert_eq!(s.trace_id, roots[0].trace_id, "{}: one trace per sandbox", s.name);
        assert!(s.start_time_unix_nano > 0 && s.end_time_unix_nano >= s.start_time_unix_nano, "{}", s.name);
        if !s.parent_span_id.is_empty() {
            assert_eq!(s.parent_span_id.len(), 8);
            assert!(ids.contains(s.parent_span_id.as_slice()), "{}: its parent exists", s.name);
        }
        assert_eq!(attr(s, "openshell.sandbox.id"), Some(id), "{}", s.name);
        assert!(attr(s, "openshell.operation").is_some(), "{}", s.name);
        for (key, value) in &s.attributes {
            assert!(!value.contains(ARGV_CANARY) && !key.contains(ARGV_CANARY), "{}: argv in {key}", s.name);
        }
        assert!(!s.name.contains(ARGV_CANARY));
    }
    let mut by_name: HashMap<String, Vec<Span>> = HashMap::new();
    for s in spans {
        by_name.entry(s.name.clone()).or_default().push(s);
    }
    for name in ["sandbox.boot", "sandbox.admission", "sandbox.exec", "sandbox.stop"] {
        assert!(by_name.contains_key(name), "{name} missing: {:?}", by_name.keys().collect::<Vec<_>>());
    }
    let one = |name: &str| {
        let spans = &by_name[name];
        assert_eq!(spans.len(), 1, "{name}");
        spans[0].clone()
    };
    assert_eq!(attr(&one("sandbox.boot"), "openshell.outcome"), Some("ready"));
    let admission = one("sandbox.admission");
    assert_eq!(attr(&admission, "openshell.outcome"), Some("approved"));
    assert_eq!(attr(&admission, "openshell.policy.revision"), Some("0"));
    assert_eq!(attr(&one("sandbox.stop"), "openshell.stop.reason"), Some("terminated"));
    for exec in &by_name["sandbox.exec"] {
        assert_eq!(attr(exec, "openshell.outcome"), Some("started"));
        assert!(attr(exec, "openshell.process.id").is_some_and(|p| p.parse::<u32>().is_ok()));
        assert!(attr(exec, "process.pid").is_some_and(|p| p.parse::<u32>().is_ok()));
    }
    by_name
}

/// `vm-driver launch`: boot, admission, the workload's exec and the stop, with the collector headers.
fn launch_spans(protocol: &str) {
    let receiver = Receiver::start(Behavior::Accept);
    let endpoint = receiver.endpoint(protocol);
    let s = Scratch::new(&format!("spans-{}", protocol.replace('/', "-")));
    let id = format!("spans-{}", protocol.replace('/', "-"));
    let launch = otlp_flags(&endpoint, protocol)
        .into_iter()
        .fold(Launch::new(&s, &["/bin/sh", "-c", "exit 0", ARGV_CANARY]).flag("--id").flag(&id), |l, f| l.flag(f));
    let mut cmd = launch.command();
    cmd.env("OTEL_EXPORTER_OTLP_HEADERS", authorization_headers(HEADER_SECRET));
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let spans = spans_of(&receiver, &id, protocol);
    assert_eq!(spans["sandbox.exec"].len(), 1, "the workload");
    let requests = receiver.trace_requests();
    assert!(!requests.is_empty());
    for r in &requests {
        assert_eq!(r.authorization(), Some(HEADER_SECRET), "headers on traces");
    }
    eprintln!(
        "e2e: {protocol}: {} spans in {} trace requests",
        spans.values().map(Vec::len).sum::<usize>(),
        requests.len()
    );
}

#[test]
fn launch_spans_reach_a_grpc_collector() {
    launch_spans("grpc");
}

#[test]
fn launch_spans_reach_an_http_protobuf_collector() {
    launch_spans("http/protobuf");
}

#[test]
fn a_refusing_collector_costs_fixed_text_only() {
    const COLLECTOR_CANARY: &str = "collector-canary-span-0f3a";
    let receiver = Receiver::start(Behavior::Reject(format!("denied: {COLLECTOR_CANARY}")));
    let endpoint = receiver.grpc_endpoint();
    let s = Scratch::new("spans-refused");
    let launch = otlp_flags(&endpoint, "grpc")
        .into_iter()
        .fold(Launch::new(&s, &["/bin/sh", "-c", "exit 0", ARGV_CANARY]).flag("--id").flag("refused"), |l, f| {
            l.flag(f)
        });
    let out = launch.command().env("RUST_LOG", "trace").output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let log = sandbox::read(&s.sandbox("refused"), SandboxFile::SupervisorLog);
    assert!(log.contains("span OTLP export failed; retrying"), "the failure is reported, in fixed text");
    assert!(log.contains("span OTLP export incomplete"), "and what was lost, counted");
    for text in [log.as_str(), &String::from_utf8_lossy(&out.stderr)] {
        assert!(!text.contains(COLLECTOR_CANARY), "the collector's text reached a log");
    }
    assert!(receiver.spans().is_empty() && receiver.rejected() > 0, "positive control: exports were refused");
    assert!(receiver.probe_grpc().is_some_and(|m| m.contains(COLLECTOR_CANARY)), "the refusal carries the canary");
}

/// `vm-driver serve`: the same, plus two execs and two policy updates (one applied, one stale).
fn serve_spans(protocol: &str) {
    let receiver = Receiver::start(Behavior::Accept);
    let endpoint = receiver.endpoint(protocol);
    let s = Scratch::new(&format!("spans-serve-{}", protocol.replace('/', "-")));
    let serve = Serve::with(&s, &[], &otlp_flags(&endpoint, protocol));
    let id = "spans-p";
    serve.create_small(id, Some(r#"{"allow":["exec","list_processes"]}"#));
    for _ in 0..2 {
        ok(serve.cli("exec", &[id, "--", "/bin/sh", "-c", "exit 0", ARGV_CANARY]));
    }
    let policy = || serve.update_policy(id, 1, "list_processes", None);
    assert!(policy().status.success(), "revision 1 applies");
    assert!(!policy().status.success(), "revision 1 again is stale");
    ok(serve.cli("stop", &[id]));
    let spans = spans_of(&receiver, id, protocol);
    assert_eq!(spans["sandbox.exec"].len(), 2);
    let updates = spans.get("sandbox.policy_update").expect("policy update spans");
    let mut seen: Vec<(Option<&str>, Option<&str>, i32)> = updates
        .iter()
        .map(|u| (attr(u, "openshell.policy.revision"), attr(u, "openshell.outcome"), u.status_code))
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, vec![(Some("1"), Some("applied"), 0), (Some("1"), Some("stale"), 2)]);
    eprintln!("e2e: serve, {protocol}: {} spans", spans.values().map(Vec::len).sum::<usize>());
}

#[test]
fn serve_spans_with_policy_updates_reach_a_grpc_collector() {
    serve_spans("grpc");
}

#[test]
fn serve_spans_with_policy_updates_reach_an_http_protobuf_collector() {
    serve_spans("http/protobuf");
}

/// Over TLS (the CA bundle of the logs), spans carry the logs' token, and after a rotation the new one.
fn spans_follow_the_credentials(protocol: &str) {
    const OLD: &str = "Bearer span-old-61b2";
    const NEW: &str = "Bearer span-new-0c9e";
    let s = Scratch::new(&format!("spans-tls-{}", protocol.replace('/', "-")));
    let (ca, identity) = TlsIdentity::issue(&s.dir, "ca.pem");
    let receiver = Receiver::start_tls(Behavior::Accept, &identity);
    let endpoint = receiver.endpoint(protocol);
    let mut args = otlp_flags(&endpoint, protocol).to_vec();
    args.extend(["--otlp-ocsf-ca", ca.to_str().unwrap()]);
    let headers = authorization_headers(OLD);
    let serve = Serve::with_env(&s, &[], &args, &[("OTEL_EXPORTER_OTLP_HEADERS", headers.as_str())], None);
    let id = "spans-tls";
    serve.create_small(id, None);
    let token = |r: &Request| r.authorization().unwrap_or_default().to_owned();
    assert!(
        wait_until(Duration::from_secs(30), || receiver.trace_requests().iter().any(|r| token(r) == OLD)),
        "the boot and admission spans arrive over TLS with the logs' token"
    );
    let out = serve.cli_with_stdin("credentials", &[id, "--headers-file", "-"], authorization_headers(NEW).as_bytes());
    assert!(out.status.success(), "rotation: {}", stderr(&out));
    assert!(serve.cli("exec", &[id, "--", "true"]).status.success());
    assert!(serve.cli("stop", &[id]).status.success());
    let spans = spans_of(&receiver, id, protocol);
    assert_eq!(spans["sandbox.exec"].len(), 1);
    let tokens: Vec<String> = receiver.trace_requests().iter().map(token).collect();
    assert_eq!(tokens.first().map(String::as_str), Some(OLD), "{tokens:?}");
    assert_eq!(tokens.last().map(String::as_str), Some(NEW), "the spans after the rotation: {tokens:?}");
    assert!(tokens.iter().all(|t| t == OLD || t == NEW), "{tokens:?}");
}

#[test]
fn spans_follow_tls_and_a_rotation_over_grpc() {
    spans_follow_the_credentials("grpc");
}

#[test]
fn spans_follow_tls_and_a_rotation_over_http_protobuf() {
    spans_follow_the_credentials("http/protobuf");
}
