//! OCSF events to a real OTLP receiver (gRPC and HTTP/protobuf), the JSONL file and the console; secrets
//! kept out of everything; lossless orderly stop; a console that never blocks; fixed-text failures.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal::SIGTERM;
use serde_json::Value;
use vm_e2e::attach::AttachClient;
use vm_e2e::ocsf_schema::{schema_dir, Schema};
use vm_e2e::otlp_receiver::{Behavior, Receiver, Record};
use vm_e2e::procs::signal;
use vm_e2e::{DirectSupervisor, Launch, Running, Scratch};

const GATEWAY: &str = "gateway-e2e-7";
const HEADER_SECRET: &str = "Bearer hdr-secret-5b1f0c";

fn otlp_launch<'a>(s: &'a Scratch, id: &str, endpoint: &str, protocol: &str, cmd: &[&str]) -> Launch<'a> {
    Launch::new(s, cmd)
        .flag("--id")
        .flag(id)
        .flag("--otlp-ocsf-endpoint")
        .flag(endpoint)
        .flag("--otlp-ocsf-protocol")
        .flag(protocol)
        .flag("--gateway-name")
        .flag(GATEWAY)
}

fn bodies(records: &[Record]) -> Vec<Value> {
    records.iter().map(|r| serde_json::from_str(&r.body).expect("the body is OCSF JSON")).collect()
}

fn has(events: &[Value], class: u64, activity: u64) -> bool {
    events.iter().any(|e| e["class_uid"] == class && e["activity_id"] == activity)
}

fn delivers_events(protocol: &str) {
    let receiver = Receiver::start(Behavior::Accept);
    let endpoint = if protocol == "grpc" { receiver.grpc_endpoint() } else { receiver.http_endpoint() };
    let s = Scratch::new(&format!("otlp-{}", protocol.replace('/', "-")));
    let id = format!("sb-{}", protocol.replace('/', "-"));
    let mut cmd = otlp_launch(&s, &id, &endpoint, protocol, &["/bin/sh", "-c", "echo ran; exit 7"]).command();
    cmd.env("OTEL_EXPORTER_OTLP_LOGS_HEADERS", format!("authorization={}", HEADER_SECRET.replace(' ', "%20")));
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(7), "{}", String::from_utf8_lossy(&out.stderr));

    let records = receiver.records();
    let events = bodies(&records);
    assert!(has(&events, 6002, 3) && has(&events, 6002, 4), "lifecycle start and stop");
    assert!(has(&events, 1007, 1), "process launch");
    let terminate = events.iter().find(|e| e["class_uid"] == 1007 && e["activity_id"] == 2).expect("process terminate");
    assert_eq!(terminate["exit_code"], 7);
    for r in &records {
        assert_eq!(r.resource.get("openshell.sandbox.id").map(String::as_str), Some(id.as_str()));
        assert_eq!(r.resource.get("openshell.gateway.name").map(String::as_str), Some(GATEWAY));
        assert_eq!(r.resource.get("service.name").map(String::as_str), Some("vm-supervisor"));
        assert!(r.attributes.contains_key("ocsf.class_uid"));
    }
    let schema = Schema::load(&schema_dir());
    for e in &events {
        let problems = schema.validate(e);
        assert!(problems.is_empty(), "{}: {problems:#?}", e["type_name"]);
    }
    let requests = receiver.requests();
    assert!(!requests.is_empty());
    for r in &requests {
        assert_eq!(r.headers.get("authorization").map(String::as_str), Some(HEADER_SECRET), "header on every request");
    }
    eprintln!("e2e: {protocol}: {} records in {} requests, all valid OCSF 1.8.0", records.len(), requests.len());
}

#[test]
fn otlp_grpc_receives_every_event() {
    delivers_events("grpc");
}

#[test]
fn otlp_http_protobuf_receives_every_event() {
    delivers_events("http/protobuf");
}

#[test]
fn the_jsonl_file_holds_the_same_events() {
    let s = Scratch::new("jsonl");
    let out = Launch::new(&s, &["/bin/sh", "-c", "exit 3"]).flag("--id").flag("jsonl-sb").run();
    assert_eq!(out.code, Some(3));
    let text = std::fs::read_to_string(s.state().join("sandboxes/jsonl-sb/events.jsonl")).unwrap();
    let events: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(has(&events, 1007, 2) && events.iter().any(|e| e["exit_code"] == 3));
    let schema = Schema::load(&schema_dir());
    assert!(events.iter().all(|e| schema.validate(e).is_empty()));
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(s.state().join("sandboxes/jsonl-sb/events.jsonl")).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
}

/// Lines of a log that are diagnostics rather than OCSF event lines (which carry the record itself).
fn diagnostics(text: &str) -> Vec<&str> {
    text.lines().filter(|l| !l.contains(" OCSF ") && !l.contains(" OCSF_JSON ")).collect()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn header_values_go_nowhere_but_the_collector() {
    let receiver = Receiver::start(Behavior::Accept);
    let s = Scratch::new("secrets");
    let launch = otlp_launch(
        &s,
        "secret-sb",
        &receiver.grpc_endpoint(),
        "grpc",
        &["/bin/sh", "-c", "echo canary; env; echo env-done; exec sleep 1000"],
    );
    let secret_env = format!("authorization={}", HEADER_SECRET.replace(' ', "%20"));
    let mut run = Running::start(launch, &[("OTEL_EXPORTER_OTLP_HEADERS", &secret_env)], "canary");
    let mut guest_env = String::new();
    loop {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut run.stdout, &mut line).unwrap();
        if line.trim() == "env-done" || line.is_empty() {
            break;
        }
        guest_env.push_str(&line);
    }
    assert!(guest_env.contains("PATH="), "the probe read the guest's environment");
    assert!(!guest_env.contains("hdr-secret"), "the header value reached the guest");
    let p = run.procs();
    for (what, proc) in [("supervisor", &p.supervisor), ("watchdog", &p.watchdog), ("VMM", &p.vmm)] {
        for file in ["cmdline", "environ"] {
            let bytes = std::fs::read(format!("/proc/{}/{file}", proc.pid)).unwrap();
            assert!(
                !String::from_utf8_lossy(&bytes).contains("hdr-secret"),
                "the header value is in the {what}'s {file}"
            );
        }
        assert!(!std::fs::read(format!("/proc/{}/environ", proc.pid)).unwrap().is_empty() || what != "supervisor");
    }
    assert!(!run.sandbox_dir.join("auth.json").exists(), "the bundle is removed once read");
    signal(i32::try_from(run.driver.id()).unwrap(), SIGTERM);
    run.driver.wait().unwrap();
    let stderr = run.stderr_text();
    for (name, text) in [
        ("driver stderr", stderr),
        ("supervisor.log", read(&run.sandbox_dir.join("supervisor.log"))),
        ("console.log", read(&run.sandbox_dir.join("console.log"))),
        ("events.jsonl", read(&run.sandbox_dir.join("events.jsonl"))),
    ] {
        assert!(!text.contains("hdr-secret"), "the header value is in {name}");
    }
    // Positive control: it did reach the collector.
    assert!(receiver
        .requests()
        .iter()
        .all(|r| r.headers.get("authorization").map(String::as_str) == Some(HEADER_SECRET)));
    assert!(!receiver.requests().is_empty());
}

/// Runs 5,000 processes through the attach socket (10,000 Process Activity events) while the collector
/// refuses everything, then makes it slow and stops the sandbox. Returns (events in JSONL, unique events the
/// collector received).
fn stop_with_10k_queued(name: &str, env: &[(&str, &str)]) -> (usize, usize) {
    let receiver = Receiver::start(Behavior::Reject("unavailable".into()));
    let s = Scratch::new(name);
    let launch =
        otlp_launch(&s, name, &receiver.grpc_endpoint(), "grpc", &["/bin/sh", "-c", "echo canary; exec sleep 1000"]);
    let mut run = Running::start(launch, env, "canary");
    let statuses = AttachClient::connect(&run.sandbox_dir).run_many(&["true"], 5_000, 32);
    assert!(statuses.iter().all(|s| s.shell_code() == 0));
    receiver.set_behavior(Behavior::Slow(Duration::from_millis(100)));
    signal(i32::try_from(run.driver.id()).unwrap(), SIGTERM);
    run.driver.wait().unwrap();
    let jsonl = read(&run.sandbox_dir.join("events.jsonl")).lines().count();
    let unique: HashSet<u64> =
        bodies(&receiver.records()).iter().filter_map(|e| e["metadata"]["sequence"].as_u64()).collect();
    (jsonl, unique.len())
}

#[test]
fn an_orderly_stop_delivers_ten_thousand_queued_events() {
    let (written, received) = stop_with_10k_queued("lossless", &[]);
    eprintln!("e2e: SIGTERM -> wait -> close: {received} of {written} events reached the collector");
    assert!(written >= 10_000);
    assert_eq!(received, written);
}

#[test]
fn control_closing_the_pipe_first_loses_queued_events() {
    let (written, received) = stop_with_10k_queued("lossy", &[("VM_TEST_CONTROL", "close-liveness-first")]);
    eprintln!(
        "e2e: control, close -> SIGTERM: {received} of {written} events reached the collector, {} lost",
        written - received
    );
    assert!(received < written);
}

#[test]
fn collector_errors_and_sink_failures_stay_out_of_the_logs() {
    const COLLECTOR_CANARY: &str = "collector-canary-91ac";
    const PAYLOAD_CANARY: &str = "payload-canary-3e7d";
    // A collector that rejects every export with a message carrying a canary.
    let rejecting = Receiver::start(Behavior::Reject(format!("denied: {COLLECTOR_CANARY}")));
    let s = Scratch::new("redact-collector");
    let mut cmd = otlp_launch(&s, "redact-a", &rejecting.grpc_endpoint(), "grpc", &["echo", PAYLOAD_CANARY]).command();
    let out = cmd.env("RUST_LOG", "trace").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let dir = s.state().join("sandboxes/redact-a");
    let supervisor_log = read(&dir.join("supervisor.log"));
    assert!(supervisor_log.contains("OCSF OTLP export failed"), "the failure is reported, in fixed text");
    for (name, text) in [
        ("driver stderr", String::from_utf8_lossy(&out.stderr).into_owned()),
        ("supervisor.log", supervisor_log.clone()),
        ("console.log", read(&dir.join("console.log"))),
        ("events.jsonl", read(&dir.join("events.jsonl"))),
    ] {
        assert!(!text.contains(COLLECTOR_CANARY), "the collector's error text is in {name}");
    }
    assert!(diagnostics(&supervisor_log).iter().all(|l| !l.contains(PAYLOAD_CANARY)), "payload in a diagnostic");
    // Positive controls: the collector really sends its canary, and the payload reached its sink.
    assert!(rejecting.rejected() > 0);
    assert!(rejecting.probe_grpc().is_some_and(|m| m.contains(COLLECTOR_CANARY)));
    assert!(read(&dir.join("events.jsonl")).contains(PAYLOAD_CANARY));

    // A sink that fails (the JSONL file on a full disk) while the records carry a canary.
    let accepting = Receiver::start(Behavior::Accept);
    let s = Scratch::new("redact-sink");
    let mut cmd = otlp_launch(&s, "redact-b", &accepting.grpc_endpoint(), "grpc", &["echo", PAYLOAD_CANARY]).command();
    let out = cmd.env("RUST_LOG", "trace").env("VM_TEST_CONTROL", "jsonl-sink-fails").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let supervisor_log = read(&s.state().join("sandboxes/redact-b/supervisor.log"));
    assert!(supervisor_log.contains("OCSF JSONL sink write failed"), "the failure is reported, in fixed text");
    assert!(diagnostics(&supervisor_log).iter().all(|l| !l.contains(PAYLOAD_CANARY)), "payload in a diagnostic");
    assert!(!String::from_utf8_lossy(&out.stderr).contains(PAYLOAD_CANARY));
    assert!(
        accepting.records().iter().any(|r| r.body.contains(PAYLOAD_CANARY)),
        "positive control: it reached the collector"
    );
}

#[test]
fn a_blocked_stderr_never_stalls_the_supervisor_and_never_tears_a_line() {
    let s = Scratch::new("console");
    // A pipe nobody reads until the end: it fills after a few dozen lines.
    let (read_end, write_end) = nix::unistd::pipe().unwrap();
    let mut sup = DirectSupervisor::start(&s, std::process::Stdio::from(write_end));
    let dir = sup.sandbox_dir.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let statuses = AttachClient::connect(&dir).run_many(&["true"], 600, 16);
        let _ = tx.send(statuses.len());
    });
    // 600 processes = 1,200 events = 2,400 console lines: far more than the pipe and the queue hold.
    let done = rx.recv_timeout(Duration::from_secs(180)).expect("the supervisor kept serving with stderr blocked");
    assert_eq!(done, 600);
    let (lines, status) = sup.stop();
    assert!(status.success(), "{status}");
    let stopped = lines.iter().find(|l| l.contains("\"status\":\"stopped\"")).expect("a final report");
    let report: Value = serde_json::from_str(stopped).unwrap();
    let dropped = report["console_dropped"].as_u64().unwrap();
    eprintln!("e2e: console lines dropped and counted while stderr was blocked: {dropped}");
    assert!(dropped > 0);
    // What did get through: whole lines only, each a timestamped diagnostic or event line.
    let mut text = Vec::new();
    std::io::Read::read_to_end(&mut std::fs::File::from(read_end), &mut text).unwrap();
    assert!(text.ends_with(b"\n"), "the last line is whole");
    for line in String::from_utf8(text).unwrap().lines() {
        assert!(line.starts_with("20"), "torn or interleaved line: {line:?}");
        if let Some((_, json)) = line.split_once(" OCSF_JSON ") {
            serde_json::from_str::<Value>(json).unwrap_or_else(|e| panic!("torn JSON line ({e}): {line}"));
        }
    }
    // The JSONL file lost nothing while the console dropped.
    let events = read(&sup.sandbox_dir.join("events.jsonl")).lines().count();
    assert!(events >= 1_200, "{events}");
}
