//! Credential slots on real VMs, under `vm-driver serve`: the collector token and the CA bundle rotated live
//! with `vm-driver credentials` (the token from stdin or a file, never argv); the next export presents the
//! new token, over plain gRPC, and over TLS (gRPC and HTTP/protobuf) with a CA made at test time; a rotated
//! CA takes effect on the next connection; a later start keeps the rotation; the new token goes nowhere but
//! the collector.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use vm_contract::layout::SandboxFile;
use vm_e2e::otlp_receiver::{Behavior, Receiver, TlsIdentity};
use vm_e2e::serve::Serve;
use vm_e2e::{wait_until, Scratch};

const OLD_TOKEN: &str = "Bearer old-tok-4c1e";
const NEW_TOKEN: &str = "Bearer rot-secret-9d27a1";
/// What the leak scans look for: only the rotated token's unique part.
const NEEDLE: &str = "rot-secret-9d27a1";

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn header(token: &str) -> String {
    format!("authorization={}", token.replace(' ', "%20"))
}

/// A throwaway CA and a server certificate it signed, for 127.0.0.1; the CA written to `dir/name`.
fn test_ca(dir: &Path, name: &str) -> (PathBuf, TlsIdentity) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, format!("e2e {name}"));
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &Issuer::new(ca_params, ca_key))
        .unwrap();
    let path = dir.join(name);
    std::fs::write(&path, ca_cert.pem()).unwrap();
    (path, TlsIdentity { cert_pem: server.pem(), key_pem: server_key.serialize_pem() })
}

/// `vm-driver serve` exporting to `endpoint` with the old token, its stderr kept for the leak scan.
fn serve(s: &Scratch, endpoint: &str, protocol: &str, ca: Option<&Path>) -> Serve {
    let mut args = vec!["--otlp-ocsf-endpoint", endpoint, "--otlp-ocsf-protocol", protocol];
    if let Some(ca) = ca {
        args.extend(["--otlp-ocsf-ca", ca.to_str().unwrap()]);
    }
    let headers = header(OLD_TOKEN);
    let env = [("OTEL_EXPORTER_OTLP_LOGS_HEADERS", headers.as_str())];
    Serve::with_env(s, &[], &args, &env, Some(&s.dir.join("serve.log")))
}

fn create(serve: &Serve, id: &str) {
    let out = serve.cli("create", &["--memory", "128", id]);
    assert!(out.status.success(), "create: {}", text(&out));
}

/// `vm-driver credentials ID --headers-file - ARGS...` with `headers` on stdin.
fn rotate_from_stdin(serve: &Serve, id: &str, headers: &str, args: &[&str]) -> Output {
    let mut all = vec![id, "--headers-file", "-"];
    all.extend_from_slice(args);
    let mut cmd = serve.cli_command("credentials", &all);
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(headers.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn tokens(receiver: &Receiver) -> Vec<String> {
    receiver.requests().iter().map(|r| r.headers.get("authorization").cloned().unwrap_or_default()).collect()
}

/// Runs a process in the sandbox: its events make the next export.
fn exec_true(serve: &Serve, id: &str) {
    let out = serve.cli("exec", &[id, "--", "true"]);
    assert!(out.status.success(), "exec: {}", text(&out));
}

fn events(serve: &Serve, id: &str) -> String {
    std::fs::read_to_string(serve.state.join("sandboxes").join(id).join(SandboxFile::Events.name())).unwrap_or_default()
}

/// Regular files under `dir` that hold `needle`.
fn files_holding(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return found };
    for entry in entries.flatten() {
        let (path, Ok(kind)) = (entry.path(), entry.file_type()) else { continue };
        if kind.is_dir() {
            found.extend(files_holding(&path, needle));
        } else if kind.is_file() && std::fs::read(&path).is_ok_and(|b| String::from_utf8_lossy(&b).contains(needle)) {
            found.push(path);
        }
    }
    found
}

/// Processes on the host whose argv or environment holds `needle`.
fn processes_holding(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        for file in ["cmdline", "environ"] {
            if std::fs::read(entry.path().join(file)).is_ok_and(|b| String::from_utf8_lossy(&b).contains(needle)) {
                found.push(format!("{name}/{file}"));
            }
        }
    }
    found
}

/// The rotated token is nowhere but the collector: no process's argv or environment, no file of the state
/// directory, the service's log, or the guest's environment and kernel command line.
fn assert_no_leak(s: &Scratch, serve: &Serve, id: &str) {
    // Controls: each probe finds the needle where it was put on purpose.
    let planted = s.dir.join("planted");
    std::fs::write(&planted, NEEDLE).unwrap();
    assert_eq!(files_holding(&s.dir, NEEDLE), vec![planted.clone()], "control: the file scan finds a planted needle");
    std::fs::remove_file(&planted).unwrap();
    let mut decoy = std::process::Command::new("sleep").arg("30").env("DECOY", NEEDLE).spawn().unwrap();
    assert!(wait_until(Duration::from_secs(5), || !processes_holding(NEEDLE).is_empty()), "control: process scan");
    decoy.kill().unwrap();
    decoy.wait().unwrap();

    assert_eq!(processes_holding(NEEDLE), Vec::<String>::new(), "the rotated token is in a process's argv or environ");
    assert_eq!(files_holding(&serve.state, NEEDLE), Vec::<PathBuf>::new(), "the rotated token is in the state dir");
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
    let (ca, identity) = test_ca(&s.dir, "ca.pem");
    let receiver =
        if tls { Receiver::start_tls(Behavior::Accept, &identity) } else { Receiver::start(Behavior::Accept) };
    let endpoint = if protocol == "grpc" { receiver.grpc_endpoint() } else { receiver.http_endpoint() };
    let serve = serve(&s, &endpoint, protocol, tls.then_some(ca.as_path()));
    create(&serve, "c");
    let old = format!("authorization={OLD_TOKEN}");
    assert!(wait_until(Duration::from_secs(30), || !receiver.requests().is_empty()), "no export before the rotation");
    assert!(tokens(&receiver).iter().all(|t| t == OLD_TOKEN), "{old} on every request before the rotation");

    let before = receiver.requests().len();
    let out = rotate_from_stdin(&serve, "c", &format!("{}\n", header(NEW_TOKEN)), &[]);
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
    assert!(
        all[first_new..].iter().all(|t| t == NEW_TOKEN),
        "the old token after the new one: {:?}",
        &all[first_new..]
    );
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
    let (wrong, _) = test_ca(&s.dir, "wrong-ca.pem");
    let (right, identity) = test_ca(&s.dir, "right-ca.pem");
    let receiver = Receiver::start_tls(Behavior::Accept, &identity);
    let serve = serve(&s, &receiver.grpc_endpoint(), "grpc", Some(&wrong));
    create(&serve, "c");
    exec_true(&serve, "c");
    std::thread::sleep(Duration::from_secs(3));
    assert!(receiver.requests().is_empty(), "control: a collector the CA did not sign receives nothing");
    let supervisor_log = serve.state.join("sandboxes/c").join(SandboxFile::SupervisorLog.name());
    let log = std::fs::read_to_string(&supervisor_log).unwrap_or_default();
    assert!(log.contains("OCSF OTLP export failed; retrying"), "the failure is logged, in fixed text");

    let headers_file = s.dir.join("headers");
    std::fs::write(&headers_file, header(NEW_TOKEN)).unwrap();
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
    assert!(!serve.state.join("sandboxes/c").join(SandboxFile::AuthBundle.name()).exists(), "the bundle was read");
    assert_no_leak(&s, &serve, "c");
}

/// A rotation the supervisor cannot use changes nothing: fixed text, no value, the old token kept.
#[test]
fn an_unreadable_ca_or_a_bad_header_is_refused_and_changes_nothing() {
    let s = Scratch::new("creds-refused");
    let receiver = Receiver::start(Behavior::Accept);
    let serve = serve(&s, &receiver.grpc_endpoint(), "grpc", None);
    create(&serve, "c");
    let not_pem = s.dir.join("not-a-ca.pem");
    std::fs::write(&not_pem, "nothing here").unwrap();
    let out = rotate_from_stdin(&serve, "c", &header(NEW_TOKEN), &["--ca", not_pem.to_str().unwrap()]);
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
