//! Startup admission on real VMs: the supervisor admits the launch descriptor against its trusted arguments
//! before it reads any credential or the policy. A descriptor naming another sandbox, session or generation
//! stops the start with a `descriptor_mismatch` finding, and the collector's credentials are never used (the
//! OTLP receiver sees nothing, no VMM starts). The control, with the check off, starts the same mismatched
//! sandbox and exports with its credentials.

use serde_json::Value;
use vm_contract::layout::SandboxFile;
use vm_contract::test_control::TestControl;
use vm_test_support::otlp_receiver::{authorization_headers, Behavior, Receiver};
use vm_test_support::{events, ocsf_schema, Launch, Scratch};

const TOKEN: &str = "Bearer admission-token-4e7a";

/// A launch under `controls` that exports to `receiver` with the collector token.
fn launch(s: &Scratch, receiver: &Receiver, controls: &[TestControl]) -> (std::process::Output, Vec<Value>) {
    let launch = Launch::new(s, &["/bin/sh", "-c", "echo ran"])
        .controls(controls)
        .flag("--id")
        .flag("adm")
        .flag("--otlp-ocsf-endpoint")
        .flag(&receiver.grpc_endpoint());
    let mut cmd = launch.command();
    cmd.env("OTEL_EXPORTER_OTLP_HEADERS", authorization_headers(TOKEN));
    let out = cmd.output().unwrap();
    (out, events::read(&s.sandbox("adm")))
}

fn mismatch_stops_the_start(control: TestControl, says: &str) {
    let s = Scratch::new(&format!("admission-{}", control.name()));
    let receiver = Receiver::start(Behavior::Accept);
    let (out, events) = launch(&s, &receiver, &[control]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("e2e: {}: {stderr}", control.name());
    assert!(!out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("ran"), "{stderr}");
    assert!(stderr.contains("the launch descriptor was refused") && stderr.contains(says), "{stderr}");
    let finding = events
        .iter()
        .find(|e| e["class_uid"] == 2004 && e["finding_info"]["types"][0] == "descriptor_mismatch")
        .unwrap_or_else(|| panic!("a descriptor_mismatch finding: {events:?}"));
    assert!(finding["finding_info"]["desc"].as_str().unwrap_or_default().contains(says), "{finding}");
    ocsf_schema::assert_valid(&events);
    // Stopped before any credential was installed: nothing was exported, no VM ran.
    assert!(receiver.requests().is_empty(), "the collector's credentials were used");
    let dir = s.sandbox("adm");
    assert!(!dir.join(SandboxFile::Console.name()).exists(), "a VMM started");
    assert!(!dir.join(SandboxFile::AuthBundle.name()).exists(), "the credentials were taken back");
}

#[test]
fn a_descriptor_naming_another_sandbox_stops_the_start() {
    mismatch_stops_the_start(TestControl::DescriptorWrongSandbox, "names another sandbox");
}

#[test]
fn a_descriptor_naming_another_session_stops_the_start() {
    mismatch_stops_the_start(TestControl::DescriptorWrongSession, "names another session");
}

#[test]
fn a_descriptor_naming_another_generation_stops_the_start() {
    mismatch_stops_the_start(TestControl::DescriptorWrongGeneration, "names another generation");
}

/// Control: without the admission check, the sandbox of a mismatched descriptor starts, runs its workload,
/// and exports with the collector's credentials.
#[test]
fn control_without_admission_a_mismatched_descriptor_starts_and_gets_the_credentials() {
    let s = Scratch::new("admission-control");
    let receiver = Receiver::start(Behavior::Accept);
    let (out, events) =
        launch(&s, &receiver, &[TestControl::DescriptorWrongGeneration, TestControl::DescriptorUnchecked]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ran");
    assert!(!events.iter().any(|e| e["finding_info"]["types"][0] == "descriptor_mismatch"));
    let requests = receiver.requests();
    assert!(
        requests.iter().any(|r| r.authorization() == Some(TOKEN)),
        "control: the mismatched start exported with the token"
    );
}
