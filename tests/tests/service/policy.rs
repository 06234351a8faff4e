//! Sandbox policy on real VMs, under `vm-driver serve`: operations approved at create, restricted and
//! restored live by revision, every denial a finding that names the operation and the revision, every update
//! a configuration event; stale and widening updates close admission until a newer valid one.

use std::process::Output;

use vm_contract::test_control::TestControl;
use vm_protocol::attach::{SupervisorReply, SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::message::Refusal;
use vm_protocol::policy::{Operation, PolicyUpdate, UpdateOutcome};
use vm_protocol::{ExitStatus, ProcId, ProcessEvent};
use vm_test_support::attach::AttachClient;
use vm_test_support::output::text;
use vm_test_support::serve::Serve;
use vm_test_support::{events, ocsf_schema, Scratch};

fn exec_echo(serve: &Serve, id: &str, word: &str) -> Output {
    serve.cli("exec", &[id, "--", "echo", word])
}

fn delivered(out: &Output, word: &str) -> bool {
    out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == word
}

fn policy(serve: &Serve, id: &str, revision: u64, allow: &str) -> Output {
    serve.update_policy(id, revision, allow, None)
}

/// The events of sandbox `id` once its file stopped growing: it is written by its own thread, a moment
/// after the act the test just saw answered.
fn events(serve: &Serve, id: &str) -> Vec<serde_json::Value> {
    events::settled(&serve.sandbox(id))
}

fn messages(serve: &Serve, id: &str, class: u64) -> Vec<String> {
    events(serve, id)
        .iter()
        .filter(|e| e["class_uid"] == class)
        .map(|e| {
            format!("{} {}", e["message"].as_str().unwrap_or(""), e["finding_info"]["desc"].as_str().unwrap_or(""))
        })
        .collect()
}

/// Every event the sandbox wrote (approvals, updates, denials, processes) is valid OCSF 1.8.0.
fn assert_valid_ocsf(serve: &Serve, id: &str) {
    let events = events(serve, id);
    assert!(!events.is_empty());
    ocsf_schema::assert_valid(&events);
}

#[test]
fn an_operator_revokes_and_restores_exec_within_the_approved_policy() {
    let s = Scratch::new("policy-revoke");
    let serve = Serve::start(&s);
    serve.create_small("p", Some(r#"{"allow":["exec","stdin","list_processes"]}"#));
    for word in ["one", "two"] {
        assert!(delivered(&exec_echo(&serve, "p", word), word), "an allowed exec is delivered");
    }
    let out = policy(&serve, "p", 1, "list_processes");
    assert!(out.status.success() && text(&out).contains("revision 1 applied"), "{}", text(&out));
    for word in ["three", "four"] {
        let out = exec_echo(&serve, "p", word);
        assert!(!out.status.success() && !String::from_utf8_lossy(&out.stdout).contains(word), "{}", text(&out));
        assert!(text(&out).contains("denied"), "the refusal says why: {}", text(&out));
    }
    let denials: Vec<String> =
        messages(&serve, "p", 2004).into_iter().filter(|m| m.contains("exec denied at policy revision 1")).collect();
    assert_eq!(denials.len(), 2, "one finding per denied exec, naming the revision: {denials:?}");
    assert!(serve.cli("ps", &["p"]).status.success(), "what is still allowed still works");

    assert!(policy(&serve, "p", 2, "exec,stdin,list_processes").status.success());
    assert!(delivered(&exec_echo(&serve, "p", "five"), "five"), "restored");
    // Signals were never approved: an update that allows them is refused and closes admission.
    let out = policy(&serve, "p", 3, "exec,signal");
    assert!(!out.status.success() && text(&out).contains("never approved"), "{}", text(&out));
    assert!(!exec_echo(&serve, "p", "six").status.success(), "admission closed after an invalid update");
    assert!(!serve.cli("ps", &["p"]).status.success(), "closed for every operation");
    let changes = messages(&serve, "p", 5019);
    for expected in ["revision 0 approved", "revision 1 applied", "revision 2 applied", "revision 3 refused"] {
        assert!(changes.iter().any(|c| c.contains(expected)), "no configuration event for {expected}: {changes:?}");
    }
    // A newer valid revision reopens it.
    assert!(policy(&serve, "p", 4, "exec,stdin").status.success());
    assert!(delivered(&exec_echo(&serve, "p", "seven"), "seven"));
}

#[test]
fn a_stale_revision_closes_admission_until_a_newer_valid_one() {
    let s = Scratch::new("policy-stale");
    let serve = Serve::start(&s);
    serve.create_small("q", Some(r#"{"allow":["exec","stdin"]}"#));
    assert!(policy(&serve, "q", 5, "exec,stdin").status.success());
    let out = policy(&serve, "q", 5, "exec,stdin");
    assert!(!out.status.success() && text(&out).contains("not above"), "{}", text(&out));
    assert!(!exec_echo(&serve, "q", "x").status.success(), "closed by the stale revision");
    let out = policy(&serve, "q", 4, "exec,stdin");
    assert!(!out.status.success(), "an older revision does not reopen it");
    assert!(!exec_echo(&serve, "q", "x").status.success());
    assert!(policy(&serve, "q", 6, "exec,stdin").status.success());
    assert!(delivered(&exec_echo(&serve, "q", "back"), "back"));
}

#[test]
fn an_exec_allow_list_admits_only_its_programs_and_bad_policies_are_refused_at_create() {
    let s = Scratch::new("policy-programs");
    let serve = Serve::start(&s);
    serve.create_small("r", Some(r#"{"allow":["exec","stdin"],"exec_programs":["echo"]}"#));
    assert!(delivered(&exec_echo(&serve, "r", "listed"), "listed"));
    let out = serve.cli("exec", &["r", "--", "sh", "-c", "echo unlisted"]);
    assert!(!out.status.success() && !text(&out).contains("unlisted\n"), "{}", text(&out));
    // A listed name with a PATH of the client's choosing would run any binary called `echo`.
    let out = serve.cli("exec", &["-e", "PATH=/tmp", "r", "--", "echo", "listed"]);
    assert!(!out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("listed"), "{}", text(&out));
    let findings = messages(&serve, "r", 2004);
    assert!(findings.iter().any(|f| f.contains("exec allow-list")), "{findings:?}");
    assert!(findings.iter().any(|f| f.contains("PATH or LD_")), "{findings:?}");
    for (bad, says) in [
        (r#"{"allow":["exec","teleport"]}"#, "unknown operation"),
        (r#"{"allow":["stdin"],"exec_programs":["echo"]}"#, "exec is not allowed"),
        (r#"{"allow":[],"surprise":true}"#, "not valid JSON"),
    ] {
        let file = s.dir.join("bad.json");
        std::fs::write(&file, bad).unwrap();
        let out = serve.cli("create", &["--policy", file.to_str().unwrap(), "bad"]);
        assert!(!out.status.success() && text(&out).contains(says), "{bad}: {}", text(&out));
    }
    assert!(!serve.sandbox("bad").exists(), "a refused policy creates nothing");
}

/// The race, on one attach connection, in one write so the supervisor finds it queued together: an exec
/// (which runs for a second), a revocation of exec, and an exec queued behind the revocation. Returns the
/// two execs' ids and everything the client read until both were answered.
fn race(serve: &Serve, id: &str) -> (ProcId, ProcId, Vec<ToClient>) {
    let mut client = AttachClient::connect(&serve.sandbox(id));
    let (in_flight, first) = client.spawn_message(&["sh", "-c", "sleep 1; echo in-flight-done"]);
    let revoke = PolicyUpdate {
        revision: 1,
        allow: vec![Operation::Stdin, Operation::ListProcesses],
        run_as: None,
        network: None,
    };
    let (queued, second) = client.spawn_message(&["echo", "queued-ran"]);
    client.send_together(&[first, ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(revoke)), second]);
    let answered = |seen: &[ToClient], id: ProcId| {
        seen.iter().any(|m| matches!(m, ToClient::Process(ProcessEvent::Exited { id: i, .. }) | ToClient::Process(ProcessEvent::Refused { id: i, .. }) if *i == id))
    };
    let seen = client.read_until(|seen| answered(seen, in_flight) && answered(seen, queued));
    eprintln!("e2e: the client read, in order: {seen:?}");
    (in_flight, queued, seen)
}

fn position(seen: &[ToClient], what: impl Fn(&ToClient) -> bool) -> Option<usize> {
    seen.iter().position(what)
}

fn stdout_of(seen: &[ToClient], id: ProcId) -> String {
    let bytes: Vec<u8> = seen
        .iter()
        .filter_map(|m| match m {
            ToClient::Process(ProcessEvent::Output { id: i, data, .. }) if *i == id => Some(data.to_vec()),
            _ => None,
        })
        .flatten()
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// An exec admitted before a revocation was dispatched before the revocation is acknowledged, and runs to
/// its end; an exec queued behind the revocation is judged by it and denied.
#[test]
fn a_revocation_serializes_with_dispatch_the_exec_before_it_runs_and_the_one_behind_it_is_denied() {
    let s = Scratch::new("policy-race");
    let serve = Serve::start(&s);
    serve.create_small("race", Some(r#"{"allow":["exec","stdin","list_processes"]}"#));
    let (in_flight, queued, seen) = race(&serve, "race");
    let ack = position(&seen, |m| {
        matches!(m, ToClient::Supervisor(SupervisorReply::PolicyAck { revision: 1, outcome: UpdateOutcome::Applied }))
    });
    assert!(ack.is_some(), "the revocation is acknowledged as applied");
    assert!(position(&seen, |m| matches!(m, ToClient::Process(ProcessEvent::Started { id, .. }) if *id == in_flight))
        .is_some());
    assert_eq!(stdout_of(&seen, in_flight).trim(), "in-flight-done", "the exec in flight runs to its end");
    assert!(seen.iter().any(
        |m| matches!(m, ToClient::Process(ProcessEvent::Exited { id, status: ExitStatus::Code(0) }) if *id == in_flight)
    ));
    let refused = |m: &ToClient| matches!(m, ToClient::Process(ProcessEvent::Refused { id, reason: Refusal::Denied }) if *id == queued);
    assert!(position(&seen, refused).is_some(), "the queued exec is denied");
    assert!(
        !seen.iter().any(|m| matches!(m, ToClient::Process(ProcessEvent::Started { id, .. }) if *id == queued)),
        "and never started"
    );
    let denials: Vec<String> =
        messages(&serve, "race", 2004).into_iter().filter(|m| m.contains("exec denied at policy revision 1")).collect();
    assert_eq!(denials.len(), 1, "{denials:?}");
    assert_valid_ocsf(&serve, "race");
}

/// Control: with the update acknowledged on receipt and applied late (the serialization dropped), the exec
/// queued behind the revocation is admitted after the client was told exec is revoked.
#[test]
fn control_without_serialization_a_queued_exec_is_admitted_after_the_acknowledgment() {
    let s = Scratch::new("policy-race-ctl");
    let serve = Serve::with_controls(&s, &[TestControl::UnserializedPolicy]);
    serve.create_small("race", Some(r#"{"allow":["exec","stdin","list_processes"]}"#));
    let (_, queued, seen) = race(&serve, "race");
    let ack = position(&seen, |m| matches!(m, ToClient::Supervisor(SupervisorReply::PolicyAck { revision: 1, .. })))
        .expect("acknowledged");
    let started =
        position(&seen, |m| matches!(m, ToClient::Process(ProcessEvent::Started { id, .. }) if *id == queued));
    assert!(started.is_some_and(|at| at > ack), "control: the queued exec started after the acknowledgment");
    assert_eq!(stdout_of(&seen, queued).trim(), "queued-ran");
}

/// Workloads run as the fixed workload identity, never root; a policy may name it but not select another,
/// neither at create nor in a live update (which then closes admission until a valid newer revision).
#[test]
fn workloads_run_as_the_sandbox_user_and_conflicting_selectors_are_refused_at_create_and_on_update() {
    let s = Scratch::new("policy-identity");
    let serve = Serve::start(&s);
    serve.create_small(
        "w",
        Some(r#"{"allow":["exec","stdin","list_processes"],"run_as":{"user":"sandbox","group":"1000"}}"#),
    );
    let probe = "id -u; id -g; id -un; echo $HOME; touch $HOME/f && echo home-writable; \
                 touch /f 2>/dev/null || echo root-fs-refused";
    let out = serve.cli("exec", &["w", "--", "sh", "-c", probe]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().collect::<Vec<_>>(),
        ["1000", "1000", "sandbox", "/home/sandbox", "home-writable", "root-fs-refused"],
        "{}",
        text(&out)
    );
    for (bad, part) in [
        (r#"{"allow":["exec"],"run_as":{"user":"root"}}"#, "user"),
        (r#"{"allow":["exec"],"run_as":{"group":"0"}}"#, "group"),
    ] {
        let file = s.dir.join("root.json");
        std::fs::write(&file, bad).unwrap();
        let out = serve.cli("create", &["--policy", file.to_str().unwrap(), "root"]);
        let says = format!("run_as.{part} conflicts with the fixed workload identity");
        assert!(!out.status.success() && text(&out).contains(&says), "{bad}: {}", text(&out));
    }
    assert!(!serve.sandbox("root").exists(), "a refused policy creates nothing");
    let out = serve.cli("policy", &["w", "--revision", "1", "--allow", "exec,stdin", "--run-as-user", "0"]);
    assert!(
        !out.status.success() && text(&out).contains("conflicts with the fixed workload identity"),
        "{}",
        text(&out)
    );
    assert!(!exec_echo(&serve, "w", "closed").status.success(), "a conflicting update closes admission");
    let out = serve.cli("policy", &["w", "--revision", "2", "--allow", "exec,stdin", "--run-as-user", "sandbox"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(delivered(&exec_echo(&serve, "w", "reopened"), "reopened"));
    let changes = messages(&serve, "w", 5019);
    assert!(changes.iter().any(|m| m.contains("policy revision 1 refused: its run_as conflicts")), "{changes:?}");
    // Each call is recorded as well: API Activity, Update, failed for the refused one.
    let calls: Vec<(String, u64)> = events(&serve, "w")
        .iter()
        .filter(|e| e["class_uid"] == 6003 && e["api"]["operation"] == "UpdatePolicy")
        .map(|e| (e["message"].as_str().unwrap_or_default().to_owned(), e["status_id"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[0].0.contains("revision 1 refused") && calls[0].1 == 2, "{calls:?}");
    assert!(calls[1].0.contains("revision 2 applied") && calls[1].1 == 1, "{calls:?}");
    assert_valid_ocsf(&serve, "w");
}

/// `caps.max_processes`: with that many running, a further exec is denied, with a finding; room again once
/// one exits.
#[test]
fn the_process_cap_denies_an_exec_beyond_it() {
    let s = Scratch::new("policy-caps");
    let serve = Serve::start(&s);
    serve.create_small("c", Some(r#"{"allow":["exec","stdin","list_processes"],"caps":{"max_processes":1}}"#));
    let mut client = AttachClient::connect(&serve.sandbox("c"));
    let (long, spawn) = client.spawn_message(&["sleep", "3"]);
    client.send_together(&[spawn]);
    client.read_until(|seen| {
        seen.iter().any(|m| matches!(m, ToClient::Process(ProcessEvent::Started { id, .. }) if *id == long))
    });
    let out = exec_echo(&serve, "c", "over");
    assert!(!out.status.success() && text(&out).contains("denied"), "{}", text(&out));
    let findings = messages(&serve, "c", 2004);
    assert!(findings.iter().any(|f| f.contains("max_processes are running")), "{findings:?}");
    client.read_until(|seen| {
        seen.iter().any(|m| matches!(m, ToClient::Process(ProcessEvent::Exited { id, .. }) if *id == long))
    });
    assert!(delivered(&exec_echo(&serve, "c", "room"), "room"), "room again after the first exited");
}
