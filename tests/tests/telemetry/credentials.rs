//! Credential slots on real VMs, under `vm-driver serve`: the collector token and the CA bundle rotated live
//! with `vm-driver credentials` (the token from stdin or a file, never argv); the next export presents the
//! new token, over plain gRPC, and over TLS (gRPC and HTTP/protobuf) with a CA made at test time; a rotated
//! CA takes effect on the next connection; a later start keeps the rotation; the new token goes nowhere but
//! the collector.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use vm_contract::layout::SandboxFile;
use vm_supervisor::telemetry::otlp::IN_FLIGHT;
use vm_test_support::leaks::{files_holding, processes_holding};
use vm_test_support::otlp_receiver::{authorization_headers, Behavior, Receiver, TlsIdentity};
use vm_test_support::output::{ok, text};
use vm_test_support::serve::Serve;
use vm_test_support::{events, sandbox, wait_until, Scratch};

const OLD_TOKEN: &str = "Bearer old-tok-4c1e";
const NEW_TOKEN: &str = "Bearer rot-secret-9d27a1";
/// What the leak scans look for: only the rotated token's unique part.
const NEEDLE: &str = "rot-secret-9d27a1";

/// `vm-driver serve` exporting to `endpoint` with the old token, its stderr kept for the leak scan.
fn serve(s: &Scratch, endpoint: &str, protocol: &str, ca: Option<&Path>) -> Serve {
    let mut args = vec!["--otlp-ocsf-endpoint", endpoint, "--otlp-ocsf-protocol", protocol];
    if let Some(ca) = ca {
        args.extend(["--otlp-ocsf-ca", ca.to_str().unwrap()]);
    }
    let headers = authorization_headers(OLD_TOKEN);
    let env = [("OTEL_EXPORTER_OTLP_LOGS_HEADERS", headers.as_str())];
    Serve::with_env(s, &[], &args, &env, Some(&s.dir.join("serve.log")))
}

/// `vm-driver credentials ID --headers-file - ARGS...` with `headers` on stdin.
fn rotate_from_stdin(serve: &Serve, id: &str, headers: &str, args: &[&str]) -> Output {
    let mut all = vec![id, "--headers-file", "-"];
    all.extend_from_slice(args);
    serve.cli_with_stdin("credentials", &all, headers.as_bytes())
}

fn tokens(receiver: &Receiver) -> Vec<String> {
    receiver.requests().iter().map(|r| r.authorization().unwrap_or_default().to_owned()).collect()
}

/// Runs a process in the sandbox: its events make the next export.
fn exec_true(serve: &Serve, id: &str) {
    ok(serve.cli("exec", &[id, "--", "true"]));
}

fn events(serve: &Serve, id: &str) -> String {
    events::text(&serve.sandbox(id))
}

/// The rotated token is nowhere but the collector: no process's argv or environment, no file of the state
/// directory, the service's log, or the guest's environment and kernel command line.
fn assert_no_leak(s: &Scratch, serve: &Serve, id: &str) {
    // Controls: each probe finds the needle where it was put on purpose.
    let planted = s.dir.join("planted");
    std::fs::write(&planted, NEEDLE).unwrap();
    assert_eq!(
        files_holding(&s.dir, NEEDLE.as_bytes()),
        std::slice::from_ref(&planted),
        "control: the file scan finds a planted needle"
    );
    std::fs::remove_file(&planted).unwrap();
    let mut decoy = std::process::Command::new("sleep").arg("30").env("DECOY", NEEDLE).spawn().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || !processes_holding(NEEDLE.as_bytes()).is_empty()),
        "control: process scan"
    );
    decoy.kill().unwrap();
    decoy.wait().unwrap();

    assert_eq!(
        processes_holding(NEEDLE.as_bytes()),
        Vec::<String>::new(),
        "the rotated token is in a process's argv or environ"
    );
    assert_eq!(
        files_holding(&serve.state, NEEDLE.as_bytes()),
        Vec::<PathBuf>::new(),
        "the rotated token is in the state dir"
    );
    let log = std::fs::read_to_string(s.dir.join("serve.log")).unwrap_or_default();
    assert!(!log.contains(NEEDLE), "the rotated token is in the service's log");
    let out = serve.cli("exec", &[id, "--", "/bin/sh", "-c", "env; cat /proc/cmdline; echo probe-done"]);
    let guest = String::from_utf8_lossy(&out.stdout);
    assert!(guest.contains("probe-done") && guest.contains("PATH="), "the guest probe ran: {}", text(&out));
    assert!(!guest.contains(NEEDLE), "the rotated token reached the guest");
}

/// Rotates the token mid-run and checks the next export carries it, and nothing after it the old one.
fn rotates_mid_run(name: &str, protocol: &str, tls: bool) {
    let s = Scratch::new(name);
    let (ca, identity) = TlsIdentity::issue(&s.dir, "ca.pem");
    let receiver =
        if tls { Receiver::start_tls(Behavior::Accept, &identity) } else { Receiver::start(Behavior::Accept) };
    let endpoint = receiver.endpoint(protocol);
    let serve = serve(&s, &endpoint, protocol, tls.then_some(ca.as_path()));
    serve.create_small("c", None);
    let old = format!("authorization={OLD_TOKEN}");
    assert!(wait_until(Duration::from_secs(30), || !receiver.requests().is_empty()), "no export before the rotation");
    assert!(tokens(&receiver).iter().all(|t| t == OLD_TOKEN), "{old} on every request before the rotation");

    let before = receiver.requests().len();
    let out = rotate_from_stdin(&serve, "c", &format!("{}\n", authorization_headers(NEW_TOKEN)), &[]);
    assert!(out.status.success() && text(&out).contains("applied"), "rotate: {}", text(&out));
    assert!(!text(&out).contains(NEEDLE), "the CLI shows the token");
    exec_true(&serve, "c");
    assert!(
        wait_until(Duration::from_secs(30), || tokens(&receiver).iter().any(|t| t == NEW_TOKEN)),
        "the next export did not carry the rotated token: {:?}",
        tokens(&receiver).len()
    );
    let all = tokens(&receiver);
    let first_new = all.iter().position(|t| t == NEW_TOKEN).unwrap();
    assert!(first_new >= before, "the new token appeared before the rotation");
    // Requests already in flight when the exporter was rebuilt finish with the old token and may land after
    // the first new one; the new one took a slot, so at most IN_FLIGHT - 1 of them can. More means an
    // export sent after the rotation still carried the old token.
    let late_old = all[first_new..].iter().filter(|t| *t != NEW_TOKEN).count();
    assert!(late_old < IN_FLIGHT, "the old token on exports sent after the rotation: {:?}", &all[first_new..]);
    let events = events(&serve, "c");
    assert!(events.contains("OTLP credentials rotation 1 applied"), "a configuration event says it happened");
    assert!(!events.contains(NEEDLE));
    assert_no_leak(&s, &serve, "c");
    eprintln!("e2e: {name}: {} requests, rotated at {first_new}", all.len());
}

#[test]
fn a_rotated_token_reaches_a_grpc_collector_on_the_next_export() {
    rotates_mid_run("creds-grpc", "grpc", false);
}

#[test]
fn a_rotated_token_reaches_a_grpc_collector_over_tls() {
    rotates_mid_run("creds-grpc-tls", "grpc", true);
}

#[test]
fn a_rotated_token_reaches_an_http_collector_over_tls() {
    rotates_mid_run("creds-http-tls", "http/protobuf", true);
}

/// Started with a CA that did not sign the collector's certificate, nothing is delivered; once the right CA
/// is rotated in, the queued events are (the next connection trusts it). Then the sandbox is stopped and
/// started again: the new supervisor keeps the rotated CA and token.
#[test]
fn a_rotated_ca_takes_effect_on_the_next_connection_and_outlives_a_restart() {
    let s = Scratch::new("creds-ca");
    let (wrong, _) = TlsIdentity::issue(&s.dir, "wrong-ca.pem");
    let (right, identity) = TlsIdentity::issue(&s.dir, "right-ca.pem");
    let receiver = Receiver::start_tls(Behavior::Accept, &identity);
    let serve = serve(&s, &receiver.grpc_endpoint(), "grpc", Some(&wrong));
    serve.create_small("c", None);
    exec_true(&serve, "c");
    std::thread::sleep(Duration::from_secs(3));
    assert!(receiver.requests().is_empty(), "control: a collector the CA did not sign receives nothing");
    let log = sandbox::read(&serve.sandbox("c"), SandboxFile::SupervisorLog);
    assert!(log.contains("OCSF OTLP export failed; retrying"), "the failure is logged, in fixed text");

    let headers_file = s.dir.join("headers");
    std::fs::write(&headers_file, authorization_headers(NEW_TOKEN)).unwrap();
    let out = serve
        .cli("credentials", &["c", "--headers-file", headers_file.to_str().unwrap(), "--ca", right.to_str().unwrap()]);
    assert!(out.status.success(), "rotate: {}", text(&out));
    std::fs::remove_file(&headers_file).unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || receiver
            .records()
            .iter()
            .any(|r| r.body.contains("\"class_uid\":6002"))),
        "the queued events were not delivered after the CA rotation"
    );
    assert!(tokens(&receiver).iter().all(|t| t == NEW_TOKEN), "every delivered request carries the new token");

    for step in ["stop", "start"] {
        let out = serve.cli(step, &["c"]);
        assert!(out.status.success(), "{step}: {}", text(&out));
    }
    let before = receiver.requests().len();
    assert!(wait_until(Duration::from_secs(60), || serve.cli("exec", &["c", "--", "true"]).status.success()));
    assert!(
        wait_until(Duration::from_secs(30), || receiver.requests().len() > before),
        "the restarted sandbox exports nothing"
    );
    assert!(tokens(&receiver).iter().all(|t| t == NEW_TOKEN), "the restart kept the rotated token");
    assert!(!serve.sandbox("c").join(SandboxFile::AuthBundle.name()).exists(), "the bundle was read");
    assert_no_leak(&s, &serve, "c");
}

/// A rotation the supervisor cannot use changes nothing: fixed text, no value, the old token kept.
#[test]
fn an_unreadable_ca_or_a_bad_header_is_refused_and_changes_nothing() {
    let s = Scratch::new("creds-refused");
    let receiver = Receiver::start(Behavior::Accept);
    let serve = serve(&s, &receiver.grpc_endpoint(), "grpc", None);
    serve.create_small("c", None);
    let not_pem = s.dir.join("not-a-ca.pem");
    std::fs::write(&not_pem, "nothing here").unwrap();
    let out = rotate_from_stdin(&serve, "c", &authorization_headers(NEW_TOKEN), &["--ca", not_pem.to_str().unwrap()]);
    assert!(!out.status.success() && text(&out).contains("CA bundle is unreadable"), "{}", text(&out));
    let out = rotate_from_stdin(&serve, "c", &format!("authorization={NEEDLE}%0A"), &[]);
    assert!(!out.status.success() && text(&out).contains("not valid on the wire"), "{}", text(&out));
    assert!(!text(&out).contains(NEEDLE), "the refusal shows the value");
    let out = rotate_from_stdin(&serve, "c", "no pairs here", &[]);
    assert!(!out.status.success() && !text(&out).contains("pairs here"), "{}", text(&out));
    let out = serve.cli("credentials", &["c"]);
    assert!(!out.status.success() && text(&out).contains("nothing to rotate"), "{}", text(&out));
    exec_true(&serve, "c");
    let before = receiver.requests().len();
    exec_true(&serve, "c");
    assert!(wait_until(Duration::from_secs(30), || receiver.requests().len() > before));
    assert!(tokens(&receiver).iter().all(|t| t == OLD_TOKEN), "a refused rotation changed the token");
    let events = events(&serve, "c");
    assert_eq!(events.matches("OTLP credentials rotation refused").count(), 2, "a configuration event for each");
    assert!(!events.contains(NEEDLE));
    assert_no_leak(&s, &serve, "c");
}
