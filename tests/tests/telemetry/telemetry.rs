//! OCSF events to a real OTLP receiver (gRPC and HTTP/protobuf), the JSONL file and the console; secrets
//! kept out of everything; lossless orderly stop; a console that never blocks; fixed-text failures.

use std::collections::HashSet;
use std::time::Duration;
use vm_contract::layout::SandboxFile;

use nix::sys::signal::Signal::SIGTERM;
use serde_json::Value;
use vm_test_support::attach::AttachClient;
use vm_test_support::events::{self, has};
use vm_test_support::ocsf_schema;
use vm_test_support::otlp_receiver::{authorization_headers, Behavior, Receiver, Record};
use vm_test_support::procs::signal;
use vm_test_support::{sandbox, wait_for_count, wait_until, DirectSupervisor, Launch, Running, Scratch, TestControl};

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

fn delivers_events(protocol: &str) {
    let receiver = Receiver::start(Behavior::Accept);
    let endpoint = receiver.endpoint(protocol);
    let s = Scratch::new(&format!("otlp-{}", protocol.replace('/', "-")));
    let id = format!("sb-{}", protocol.replace('/', "-"));
    let mut cmd = otlp_launch(&s, &id, &endpoint, protocol, &["/bin/sh", "-c", "echo ran; exit 7"]).command();
    cmd.env("OTEL_EXPORTER_OTLP_LOGS_HEADERS", authorization_headers(HEADER_SECRET));
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
    // Every record carries the audit chain's head after its event; the newest is the head the driver keeps.
    let seq = |head: &str| head.split(':').next().unwrap().parse::<u64>().unwrap();
    let heads: Vec<&str> = records.iter().map(|r| r.attributes["vm_driver.audit.head"].as_str()).collect();
    let newest = heads.iter().copied().max_by_key(|h| seq(h)).unwrap();
    let anchor = std::fs::read(s.state().join("audit").join(format!("{id}.json"))).unwrap();
    let anchor: Value = serde_json::from_slice(&anchor).unwrap();
    assert_eq!(
        newest,
        format!("{}:{}", anchor["seq"], anchor["hash"].as_str().unwrap()),
        "the last record anchors the chain"
    );
    ocsf_schema::assert_valid(&events);
    let requests = receiver.requests();
    assert!(!requests.is_empty());
    for r in &requests {
        assert_eq!(r.authorization(), Some(HEADER_SECRET), "header on every request");
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
    let dir = s.sandbox("jsonl-sb");
    let events = events::read(&dir);
    assert!(has(&events, 1007, 2) && events.iter().any(|e| e["exit_code"] == 3));
    ocsf_schema::assert_valid(&events);
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(events::path(&dir)).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
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
    let secret_env = authorization_headers(HEADER_SECRET);
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
    assert!(!run.sandbox_dir.join(SandboxFile::AuthBundle.name()).exists(), "the bundle is removed once read");
    signal(run.driver_pid(), SIGTERM);
    run.driver.wait().unwrap();
    let stderr = run.stderr_text();
    for (name, text) in [
        ("driver stderr", stderr),
        (SandboxFile::SupervisorLog.name(), sandbox::read(&run.sandbox_dir, SandboxFile::SupervisorLog)),
        (SandboxFile::Console.name(), sandbox::read(&run.sandbox_dir, SandboxFile::Console)),
        (SandboxFile::Events.name(), sandbox::read(&run.sandbox_dir, SandboxFile::Events)),
    ] {
        assert!(!text.contains("hdr-secret"), "the header value is in {name}");
    }
    // Positive control: it did reach the collector.
    assert!(receiver.requests().iter().all(|r| r.authorization() == Some(HEADER_SECRET)));
    assert!(!receiver.requests().is_empty());
}

/// Runs 5,000 processes through the attach socket (10,000 Process Activity events) while the collector
/// refuses everything, then makes it slow and stops the sandbox. Returns (events in JSONL, unique events the
/// collector received).
fn stop_with_10k_queued(name: &str, controls: &[TestControl]) -> (usize, usize) {
    let receiver = Receiver::start(Behavior::Reject("unavailable".into()));
    let s = Scratch::new(name);
    let launch =
        otlp_launch(&s, name, &receiver.grpc_endpoint(), "grpc", &["/bin/sh", "-c", "echo canary; exec sleep 1000"]);
    let launch = launch.controls(controls);
    let mut run = Running::start(launch, &[], "canary");
    let statuses = AttachClient::connect(&run.sandbox_dir).run_many(&["true"], 5_000, 32);
    assert!(statuses.iter().all(|s| s.shell_code() == 0));
    receiver.set_behavior(Behavior::Slow(Duration::from_millis(100)));
    signal(run.driver_pid(), SIGTERM);
    run.driver.wait().unwrap();
    let jsonl = events::read(&run.sandbox_dir).len();
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
    let (written, received) = stop_with_10k_queued("lossy", &[TestControl::CloseLivenessFirst]);
    eprintln!(
        "e2e: control, close -> SIGTERM: {received} of {written} events reached the collector, {} lost",
        written - received
    );
    assert!(received < written);
}

/// Runs 1,000 processes (2,000 Process Activity events, twice the queue to the audit chain) while the chain's
/// disk has stopped answering (`audit-stall`), lets the disk answer, stops the sandbox. Returns whether the
/// processes had all ended while the disk was stalled, the Process Activity events recorded and the
/// `telemetry_dropped` findings.
fn a_thousand_processes_behind_a_stalled_disk(name: &str, controls: &[TestControl]) -> (bool, usize, usize) {
    const PROCESSES: usize = 1_000;
    let s = Scratch::with_deadline(name, Duration::from_secs(420));
    let all: Vec<TestControl> = [TestControl::AuditStall].iter().chain(controls).copied().collect();
    let launch = Launch::new(&s, &["/bin/sh", "-c", "echo canary; exec sleep 1000"]).controls(&all);
    let mut run = Running::start(launch, &[], "canary");
    let stall = run.sandbox_dir.join("audit-stall");
    std::fs::write(&stall, b"").unwrap();
    let dir = run.sandbox_dir.clone();
    let many = std::thread::spawn(move || AttachClient::connect(&dir).run_many(&["true"], PROCESSES, 32));
    s.waiting_for("1,000 processes while the audit chain's disk is stalled");
    // Ends early only when they all end: without backpressure, as soon as the guest has run them; with it,
    // never, since their events cannot all be queued while the chain takes none.
    let ended = wait_until(Duration::from_secs(if controls.is_empty() { 20 } else { 300 }), || many.is_finished());
    std::fs::remove_file(&stall).unwrap();
    s.waiting_for("the processes once the disk answers again");
    let statuses = many.join().unwrap();
    assert!(statuses.iter().all(|st| st.shell_code() == 0));
    let count = || events::of_class(&events::read(&run.sandbox_dir), 1007).len();
    // The workload's own launch, plus two a process.
    wait_for_count(2 * PROCESSES + 1, Duration::from_secs(30), count);
    signal(run.driver_pid(), SIGTERM);
    run.driver.wait().unwrap();
    let events = events::read(&run.sandbox_dir);
    let processes = events::of_class(&events, 1007).len();
    let dropped = events::finding_types(&events).iter().filter(|t| **t == "telemetry_dropped").count();
    eprintln!("e2e: {name}: processes ended while stalled: {ended}; {processes} Process Activity events; {dropped} drop findings");
    (ended, processes, dropped)
}

#[test]
fn a_workload_faster_than_the_audit_disk_is_held_back_and_loses_no_event() {
    let (ended, processes, dropped) = a_thousand_processes_behind_a_stalled_disk("audit-stall", &[]);
    assert!(!ended, "the guest was held while the chain could take no more");
    assert!(processes >= 2_001, "every event recorded ({processes})");
    assert_eq!(dropped, 0);
}

#[test]
fn control_without_backpressure_a_stalled_audit_disk_drops_events() {
    let (ended, processes, dropped) =
        a_thousand_processes_behind_a_stalled_disk("audit-stall-ctl", &[TestControl::NoTelemetryBackpressure]);
    assert!(ended, "control: the guest ran on while the chain was stalled");
    assert!(processes < 2_000, "control: events dropped at the full queue ({processes} recorded)");
    assert!(dropped > 0, "the drops are reported");
}

const COLLECTOR_CANARY: &str = "collector-canary-91ac";
const PAYLOAD_CANARY: &str = "payload-canary-3e7d";
/// A targeted `RUST_LOG`: each library that talks to the collector, at its most verbose.
const LIBRARY_TRACE: &str = "info,h2=trace,hyper=trace,hyper_util=trace,tonic=trace,tower=trace,\
                             opentelemetry=trace,opentelemetry_sdk=trace,opentelemetry_otlp=trace,reqwest=trace";
const LIBRARIES: [&str; 6] = ["h2::", "hyper", "tonic::", "tower::", "opentelemetry", "reqwest::"];

/// The logs of one run, by name.
struct Logs(Vec<(&'static str, String)>);

impl Logs {
    fn all_lines(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.0.iter().flat_map(|(name, text)| text.lines().map(move |l| (*name, l)))
    }

    /// Every line of the logs (not `events.jsonl`, the record itself) that is not an OCSF event line. Event
    /// lines (`<time> OCSF ...`, `<time> OCSF_JSON {...}`) carry the record, argv included; everything else
    /// is a diagnostic (`<time> LEVEL target: ...`), failure lines among them, and may not.
    fn diagnostics(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.all_lines()
            .filter(|(log, _)| *log != SandboxFile::Events.name())
            .filter(|(_, l)| !matches!(l.split_whitespace().nth(1), Some("OCSF" | "OCSF_JSON")))
    }

    fn get(&self, name: &str) -> &str {
        self.0.iter().find(|(n, _)| *n == name).map_or("", |(_, t)| t.as_str())
    }

    /// Diagnostic lines written by an HTTP, gRPC or OpenTelemetry library.
    fn library_lines(&self) -> usize {
        self.diagnostics()
            .filter(|(_, l)| {
                l.split_whitespace().nth(2).is_some_and(|t| LIBRARIES.iter().any(|lib| t.starts_with(lib)))
            })
            .count()
    }
}

/// `echo PAYLOAD_CANARY` in a sandbox whose collector rejects every export with a message carrying the
/// collector canary, under `rust_log`.
fn redaction_run(name: &str, rust_log: &str, controls: &[TestControl], collector: &Receiver) -> Logs {
    let s = Scratch::new(name);
    let launch = otlp_launch(&s, name, &collector.grpc_endpoint(), "grpc", &["echo", PAYLOAD_CANARY]);
    let mut cmd = launch.controls(controls).command();
    let out = cmd.env("RUST_LOG", rust_log).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = s.sandbox(name);
    Logs(vec![
        ("driver stderr", String::from_utf8_lossy(&out.stderr).into_owned()),
        (SandboxFile::SupervisorLog.name(), sandbox::read(&dir, SandboxFile::SupervisorLog)),
        (SandboxFile::Console.name(), sandbox::read(&dir, SandboxFile::Console)),
        (SandboxFile::Events.name(), sandbox::read(&dir, SandboxFile::Events)),
    ])
}

#[test]
fn collector_errors_and_payloads_stay_out_of_every_log_line() {
    let rejecting = Receiver::start(Behavior::Reject(format!("denied: {COLLECTOR_CANARY}")));
    for (name, rust_log) in [("redact-all", "trace"), ("redact-libs", LIBRARY_TRACE)] {
        let logs = redaction_run(name, rust_log, &[], &rejecting);
        assert!(
            logs.get(SandboxFile::SupervisorLog.name()).contains("OCSF OTLP export failed"),
            "the failure is reported, in fixed text"
        );
        for (log, line) in logs.all_lines() {
            assert!(
                !line.contains(COLLECTOR_CANARY),
                "RUST_LOG={rust_log}: the collector's error text is in {log}: {line}"
            );
        }
        for (log, line) in logs.diagnostics() {
            assert!(!line.contains(PAYLOAD_CANARY), "RUST_LOG={rust_log}: payload in a diagnostic of {log}: {line}");
        }
        assert_eq!(logs.library_lines(), 0, "RUST_LOG={rust_log}: a library's log reached a log");
        // Positive controls: the payload reached its sink, and the collector really sends its canary.
        assert!(logs.get(SandboxFile::Events.name()).contains(PAYLOAD_CANARY));
    }
    assert!(rejecting.rejected() > 0);
    assert!(rejecting.probe_grpc().is_some_and(|m| m.contains(COLLECTOR_CANARY)));

    // A sink that fails (the JSONL file on a full disk: fault injection) while the records carry the canary.
    let accepting = Receiver::start(Behavior::Accept);
    let logs = redaction_run("redact-sink", "trace", &[TestControl::JsonlSinkFails], &accepting);
    assert!(
        logs.get(SandboxFile::SupervisorLog.name()).contains("OCSF JSONL sink write failed"),
        "the failure is reported, in fixed text"
    );
    for (log, line) in logs.diagnostics() {
        assert!(!line.contains(PAYLOAD_CANARY), "payload in a diagnostic of {log}: {line}");
    }
    assert!(accepting.records().iter().any(|r| r.body.contains(PAYLOAD_CANARY)), "positive control: it was exported");
}

#[test]
fn control_without_fixed_text_and_silencing_the_canaries_reach_the_logs() {
    let rejecting = Receiver::start(Behavior::Reject(format!("denied: {COLLECTOR_CANARY}")));
    for (name, rust_log) in [("redact-all-ctl", "trace"), ("redact-libs-ctl", LIBRARY_TRACE)] {
        let logs = redaction_run(name, rust_log, &[TestControl::VerboseFailureLogs], &rejecting);
        let leaked = logs.all_lines().filter(|(_, l)| l.contains(COLLECTOR_CANARY)).count();
        let payload = logs.diagnostics().filter(|(_, l)| l.contains(PAYLOAD_CANARY)).count();
        let libraries = logs.library_lines();
        eprintln!(
            "e2e: control, RUST_LOG={rust_log}: {leaked} lines carry the collector's text, {payload} diagnostics the \
             payload, {libraries} are library lines"
        );
        assert!(leaked > 0, "control: the collector's error text reaches the logs");
        assert!(payload > 0, "control: a naive failure line carries the payload");
        assert!(libraries > 0, "control: the library directives are live once the silencing is off");
    }
    let accepting = Receiver::start(Behavior::Accept);
    let controls = [TestControl::JsonlSinkFails, TestControl::VerboseFailureLogs];
    let logs = redaction_run("redact-sink-ctl", "info", &controls, &accepting);
    assert!(
        logs.diagnostics().any(|(_, l)| l.contains(PAYLOAD_CANARY)),
        "control: a naive failure line carries the payload"
    );
}

#[test]
fn a_blocked_stderr_never_stalls_the_supervisor_and_never_tears_a_line() {
    let s = Scratch::new("console");
    // A pipe nobody reads until the end: it fills after a few dozen lines.
    // Close-on-exec, as std makes every descriptor: the tests of this binary start processes of their own
    // meanwhile, and one that inherited the write end would keep the read below from ever ending.
    let (mut read_end, write_end) = std::io::pipe().unwrap();
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
    std::io::Read::read_to_end(&mut read_end, &mut text).unwrap();
    assert!(text.ends_with(b"\n"), "the last line is whole");
    for line in String::from_utf8(text).unwrap().lines() {
        assert!(line.starts_with("20"), "torn or interleaved line: {line:?}");
        if let Some((_, json)) = line.split_once(" OCSF_JSON ") {
            serde_json::from_str::<Value>(json).unwrap_or_else(|e| panic!("torn JSON line ({e}): {line}"));
        }
    }
    // The JSONL file lost nothing while the console dropped.
    let events = events::read(&sup.sandbox_dir).len();
    assert!(events >= 1_200, "{events}");
}

#[test]
fn tenant_argv_cannot_forge_a_log_line() {
    let s = Scratch::new("argv-forge");
    let forged = "x\n2026-01-01T00:00:00.000Z OCSF FORGED [Critical] fake\x1b[2J";
    let out = Launch::new(&s, &["/bin/sh", "-c", "exit 0", forged]).flag("--id").flag("forge").run();
    assert_eq!(out.code, Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = s.sandbox("forge");
    let log = sandbox::read(&dir, SandboxFile::SupervisorLog);
    assert!(log.contains("OCSF PROCESS:LAUNCH"), "the launch is logged");
    for text in [log.as_str(), &String::from_utf8_lossy(&out.stderr)] {
        assert!(!text.lines().any(|l| l.starts_with("2026-01-01T00:00:00.000Z")), "a forged line:\n{text}");
        assert!(!text.contains('\x1b'), "an escape sequence reached a log");
    }
}
