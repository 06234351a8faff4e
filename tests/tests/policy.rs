//! Sandbox policy on real VMs, under `vm-driver serve`: operations approved at create, restricted and
//! restored live by revision, every denial a finding that names the operation and the revision, every update
//! a configuration event; stale and widening updates close admission until a newer valid one.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::process::Output;

use vm_contract::layout::SandboxFile;
use vm_e2e::serve::Serve;
use vm_e2e::Scratch;

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn exec_echo(serve: &Serve, id: &str, word: &str) -> Output {
    serve.cli("exec", &[id, "--", "echo", word])
}

fn delivered(out: &Output, word: &str) -> bool {
    out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == word
}

fn policy(serve: &Serve, id: &str, revision: u64, allow: &str) -> Output {
    serve.cli("policy", &[id, "--revision", &revision.to_string(), "--allow", allow])
}

/// The events of sandbox `id`, one JSON object a line.
fn events(serve: &Serve, id: &str) -> Vec<serde_json::Value> {
    let path = serve.state.join("sandboxes").join(id).join(SandboxFile::Events.name());
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
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

fn create_with_policy(s: &Scratch, serve: &Serve, id: &str, policy: &str) {
    let file = s.dir.join(format!("{id}.policy.json"));
    std::fs::write(&file, policy).unwrap();
    let out = serve.cli("create", &["--memory", "128", "--policy", file.to_str().unwrap(), id]);
    assert!(out.status.success(), "create: {}", text(&out));
}

#[test]
fn an_operator_revokes_and_restores_exec_within_the_approved_policy() {
    let s = Scratch::new("policy-revoke");
    let serve = Serve::start(&s);
    create_with_policy(&s, &serve, "p", r#"{"allow":["exec","stdin","list_processes"]}"#);
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
    create_with_policy(&s, &serve, "q", r#"{"allow":["exec","stdin"]}"#);
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
    create_with_policy(&s, &serve, "r", r#"{"allow":["exec","stdin"],"exec_programs":["echo"]}"#);
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
    assert!(!serve.state.join("sandboxes/bad").exists(), "a refused policy creates nothing");
}
