//! The boundary's own decisions, checked without a VM: what it prepares and the gate judges, the control
//! requests, the network rules it publishes, the refusal rate, and the stop. The routers' rules are tested
//! beside them (`process/tests.rs`, `stream/tests.rs`); random interleavings of everything in
//! `tests/boundary_props.rs`.
use std::time::{Duration, Instant};

use vm_protocol::attach::{SupervisorReply, SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome, SecretCredential};
use vm_protocol::link::{ToGuest, ToHost, VmRequest};
use vm_protocol::message::{EnvVar, Refusal};
use vm_protocol::net::{ForwardEvent, ForwardRequest, Listener, NetToGuest, NetToHost, StreamFrame, StreamId};
use vm_protocol::policy::{Operation, PolicyUpdate, SandboxPolicy, UpdateOutcome};
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, SignalName, Spawn};

use super::*;
use crate::policy::Denial;

const A: ClientId = ClientId(1);

fn policy(json: &str) -> SandboxPolicy {
    SandboxPolicy::parse(json, &vm_protocol::identity::WORKLOAD).unwrap()
}

fn with(config: BoundaryConfig) -> (Boundary, Instant) {
    let now = Instant::now();
    let mut b = Boundary::new(config, now);
    let _ = b.handle(Input::Connected(A), now);
    (b, now)
}

fn spawn_msg(id: u32, argv: &[&str]) -> ToSupervisor {
    ToSupervisor::Process(ProcessRequest::Spawn(Spawn {
        id: ProcId(id),
        argv: argv.iter().map(|s| (*s).to_owned()).collect(),
        env: vec![],
        cwd: None,
        pty: None,
        output_window: 8,
        rlimits: Vec::new(),
        root: None,
    }))
}

fn spawned(out: &Output) -> Option<&Spawn> {
    out.sends.iter().find_map(|s| match s {
        Outgoing::ToGuest(ToGuest::Process(ProcessRequest::Spawn(spawn))) => Some(spawn),
        _ => None,
    })
}

fn refused_to(out: &Output, client: ClientId) -> bool {
    out.sends.iter().any(|s| {
        matches!(s, Outgoing::ToClient(c, ToClient::Process(ProcessEvent::Refused { reason: Refusal::Denied, .. })) if *c == client)
    })
}

fn started(id: u32, pid: u32) -> ToHost {
    ToHost::Process(ProcessEvent::Started { id: ProcId(id), pid, stdin_window: 4, output_window: 8 })
}

fn egress_policy() -> SandboxPolicy {
    policy(r#"{"allow":["exec"],"network":{"allow":[{"host":"example.com","ports":[443]}],"max_connections":2}}"#)
}

fn opened(id: u32) -> ToHost {
    ToHost::Net(NetToHost::Opened { id: StreamId(id), listener: Listener::Http, window: 8 })
}

#[test]
fn an_images_defaults_reach_the_guest_under_the_requests_own_and_the_gate_judges_the_entrypoint() {
    let run = RunConfig {
        env: vec!["PATH=/usr/local/bin:/usr/bin".into(), "LANG=C.UTF-8".into()],
        working_dir: Some("/srv".into()),
        entrypoint: vec!["/entry".into()],
        cmd: vec!["serve".into()],
        ..RunConfig::default()
    };
    let (mut b, now) = with(BoundaryConfig { run: run.clone(), ..BoundaryConfig::default() });
    let mut request = Spawn {
        id: ProcId(1),
        argv: vec![],
        env: vec![EnvVar { key: "LANG".into(), value: "fr_FR".into() }],
        cwd: None,
        pty: None,
        output_window: 8,
        rlimits: Vec::new(),
        root: None,
    };
    let out = b.handle(Input::Client(A, ToSupervisor::Process(ProcessRequest::Spawn(request.clone()))), now);
    let sent = spawned(&out).expect("dispatched");
    assert_eq!(sent.argv, ["/entry", "serve"]);
    let keys: Vec<(&str, &str)> = sent.env.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
    assert_eq!(keys, [("PATH", "/usr/local/bin:/usr/bin"), ("LANG", "C.UTF-8"), ("LANG", "fr_FR")]);
    assert_eq!(sent.cwd.as_deref(), Some("/srv"));
    assert!(matches!(out.notes.as_slice(), [Note::ExecDispatched(ProcId(1))]), "{:?}", out.notes);

    // A request's own directory wins; only programs the policy names run, the entrypoint included.
    let gated = SandboxPolicy { exec_programs: Some(vec!["sh".into()]), ..SandboxPolicy::default() };
    let (mut b, now) = with(BoundaryConfig { run, policy: gated, ..BoundaryConfig::default() });
    request.argv = vec!["sh".into()];
    request.cwd = Some("/tmp".into());
    let out = b.handle(Input::Client(A, ToSupervisor::Process(ProcessRequest::Spawn(request))), now);
    assert!(spawned(&out).is_none(), "the program is the entrypoint, which the policy does not name");
    assert!(matches!(out.notes.as_slice(), [Note::Denied { op: Operation::Exec, .. }]), "{:?}", out.notes);
    assert!(refused_to(&out, A));
}

#[test]
fn the_stop_signal_is_the_images_when_it_names_one_this_product_sends() {
    let signal_of = |signal: Option<&str>| {
        let run = RunConfig { stop_signal: signal.map(String::from), ..RunConfig::default() };
        let (mut b, now) = with(BoundaryConfig { run, stop_grace_ms: 7, ..BoundaryConfig::default() });
        let out = b.handle(Input::Stop, now);
        match out.sends.as_slice() {
            [Outgoing::ToGuestFirst(ToGuest::Vm(VmRequest::Shutdown { grace_ms: 7, signal }))] => *signal,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(signal_of(None), SignalName::Term);
    assert_eq!(signal_of(Some("SIGINT")), SignalName::Int);
    assert_eq!(signal_of(Some("3")), SignalName::Quit);
    assert_eq!(signal_of(Some("SIGRTMIN+3")), SignalName::Term, "outside the set: SIGTERM");
}

#[test]
fn a_stopping_boundary_refuses_new_processes_and_streams_and_asks_for_the_shutdown_once() {
    let (mut b, now) = with(BoundaryConfig { policy: egress_policy(), ..BoundaryConfig::default() });
    let _ = b.handle(Input::Attached, now);
    let out = b.handle(Input::Stop, now);
    assert_eq!(out.sends.len(), 1);
    assert!(b.handle(Input::Stop, now).sends.is_empty(), "once");
    let out = b.handle(Input::Client(A, spawn_msg(1, &["true"])), now);
    assert!(matches!(
        out.sends.as_slice(),
        [Outgoing::ToClient(A, ToClient::Process(ProcessEvent::Refused { reason: Refusal::ShuttingDown, .. }))]
    ));
    let out = b.handle(Input::Guest(opened(1)), now);
    assert!(matches!(out.notes.as_slice(), [Note::StreamRefused(r)] if r.reason == "the sandbox is stopping"));
}

#[test]
fn a_revocation_is_acknowledged_after_the_exec_before_it_and_before_the_exec_behind_it() {
    let (mut b, now) = with(BoundaryConfig::default());
    assert!(spawned(&b.handle(Input::Client(A, spawn_msg(1, &["true"])), now)).is_some(), "admitted and dispatched");
    let revoke = PolicyUpdate { revision: 1, allow: vec![Operation::Stdin], run_as: None, network: None };
    let out = b.handle(Input::Client(A, ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(revoke))), now);
    assert!(matches!(
        out.notes.as_slice(),
        [Note::PolicyUpdateReceived, Note::PolicyUpdated { revision: 1, outcome: UpdateOutcome::Applied, .. }]
    ));
    assert!(out.sends.iter().any(|s| matches!(
        s,
        Outgoing::ToClient(A, ToClient::Supervisor(SupervisorReply::PolicyAck { outcome: UpdateOutcome::Applied, .. }))
    )));
    let queued = b.handle(Input::Client(A, spawn_msg(2, &["true"])), now);
    assert!(matches!(queued.notes.as_slice(), [Note::Denied { op: Operation::Exec, revision: 1, .. }]));
    assert!(refused_to(&queued, A));
    // The process admitted before the revocation keeps running and is still served.
    let out = b.handle(Input::Guest(started(1, 77)), now);
    assert!(out
        .sends
        .iter()
        .any(|s| matches!(s, Outgoing::ToClient(A, ToClient::Process(ProcessEvent::Started { .. })))));
}

#[test]
fn control_an_unserialized_update_is_acknowledged_before_it_applies_and_the_next_exec_gets_through() {
    let rules = Rules { serialized_policy: false, ..Rules::default() };
    let (mut b, now) = with(BoundaryConfig { rules, ..BoundaryConfig::default() });
    let revoke = PolicyUpdate { revision: 1, allow: vec![Operation::Stdin], run_as: None, network: None };
    let _ = b.handle(Input::Client(A, ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(revoke))), now);
    assert!(spawned(&b.handle(Input::Client(A, spawn_msg(1, &["true"])), now)).is_some(), "the broken design");
    assert!(spawned(&b.handle(Input::Client(A, spawn_msg(2, &["true"])), now)).is_none(), "applied late");
}

#[test]
fn the_process_cap_counts_what_has_not_exited() {
    let mut capped = SandboxPolicy::default();
    capped.caps.max_processes = Some(1);
    let (mut b, now) = with(BoundaryConfig { policy: capped, ..BoundaryConfig::default() });
    assert!(spawned(&b.handle(Input::Client(A, spawn_msg(1, &["true"])), now)).is_some());
    let second = b.handle(Input::Client(A, spawn_msg(2, &["true"])), now);
    assert!(matches!(second.notes.as_slice(), [Note::Denied { denial: Denial::ProcessCap, .. }]), "{:?}", second.notes);
    let _ = b.handle(Input::Guest(started(1, 77)), now);
    let exited = ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(0) });
    let out = b.handle(Input::Guest(exited), now);
    assert!(out.notes.iter().any(|n| matches!(n, Note::Exited { status: ExitStatus::Code(0), .. })));
    assert!(spawned(&b.handle(Input::Client(A, spawn_msg(3, &["true"])), now)).is_some(), "room again");
}

#[test]
fn a_file_operation_without_its_permission_is_denied_before_the_guest_sees_it() {
    use vm_protocol::files::{FileOp, FileSpawn};
    let op = FileOp::Write { path: "/home/sandbox/f".into(), mode: 0o644 };
    let files = ToSupervisor::Process(ProcessRequest::Files(FileSpawn { id: ProcId(1), op, output_window: 8 }));
    let gated = SandboxPolicy { allow: [Operation::Exec, Operation::FilesRead].into(), ..SandboxPolicy::default() };
    let (mut b, now) = with(BoundaryConfig { policy: gated, ..BoundaryConfig::default() });
    let out = b.handle(Input::Client(A, files), now);
    assert!(matches!(out.notes.as_slice(), [Note::Denied { op: Operation::FilesWrite, .. }]), "{:?}", out.notes);
    assert!(out.sends.iter().all(|s| !matches!(s, Outgoing::ToGuest(_))), "{:?}", out.sends);
    assert!(refused_to(&out, A));
}

#[test]
fn the_network_rules_are_published_at_attach_with_trust_first_and_follow_updates() {
    let config = BoundaryConfig { policy: egress_policy(), trust: Some("PEM".into()), ..BoundaryConfig::default() };
    let (mut b, now) = with(config);
    let out = b.handle(Input::Attached, now);
    match out.sends.as_slice() {
        [Outgoing::ToGuest(ToGuest::Vm(VmRequest::Trust { ca_pem })), Outgoing::ToGuest(ToGuest::Vm(VmRequest::Egress { listen: true })), Outgoing::PublishRules(view)]
            if ca_pem == "PEM" && view.rules.len() == 1 => {}
        other => panic!("{other:?}"),
    }
    // A stream is accepted and its task started; the update that allows no network closes it and the listeners.
    let out = b.handle(Input::Guest(opened(1)), now);
    let Some(Outgoing::StartEgress(_, _, pipe)) = out.sends.iter().find(|s| matches!(s, Outgoing::StartEgress(..)))
    else {
        panic!("{:?}", out.sends)
    };
    let pipe = Arc::clone(pipe);
    pipe.decide(&egress_policy().network.unwrap().allow[0]);
    let none = PolicyUpdate { revision: 1, allow: vec![Operation::Exec], run_as: None, network: Some(vec![]) };
    let out = b.handle(Input::Client(A, ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(none))), now);
    assert!(out.sends.iter().any(|s| matches!(s, Outgoing::ToGuest(ToGuest::Vm(VmRequest::Egress { listen: false })))));
    assert!(out.sends.iter().any(|s| matches!(s, Outgoing::PublishRules(view) if view.rules.is_empty())));
    assert!(pipe.ended().is_some(), "what the update no longer allows is closed");
}

#[test]
fn control_egress_that_ignores_updates_keeps_the_rules_approved_at_create() {
    let rules = Rules { egress_follows_updates: false, ..Rules::default() };
    let (mut b, now) = with(BoundaryConfig { policy: egress_policy(), rules, ..BoundaryConfig::default() });
    let _ = b.handle(Input::Attached, now);
    let none = PolicyUpdate { revision: 1, allow: vec![Operation::Exec], run_as: None, network: Some(vec![]) };
    let out = b.handle(Input::Client(A, ToSupervisor::Supervisor(SupervisorRequest::UpdatePolicy(none))), now);
    assert!(out.sends.iter().all(|s| !matches!(s, Outgoing::PublishRules(_))), "{:?}", out.sends);
    let out = b.handle(Input::Guest(opened(1)), now);
    assert!(out.sends.iter().any(|s| matches!(s, Outgoing::StartEgress(..))), "still accepted: the broken design");
}

#[test]
fn refusals_past_their_rate_pause_the_guest_until_a_tick_finds_tokens_again() {
    let (mut b, now) = with(BoundaryConfig::default());
    let _ = b.handle(Input::Attached, now);
    // No rule allows egress: every stream is refused.
    for id in 1..=REFUSALS_PER_SEC {
        let out = b.handle(Input::Guest(opened(id)), now);
        assert!(matches!(out.notes.as_slice(), [Note::StreamRefused(_)]));
    }
    assert!(b.reading_guest(), "within the burst");
    let _ = b.handle(Input::Guest(opened(REFUSALS_PER_SEC + 1)), now);
    assert!(!b.reading_guest(), "past it, the guest's link is not read");
    let _ = b.handle(Input::Tick, now + Duration::from_millis(1));
    assert!(!b.reading_guest(), "no token yet");
    let _ = b.handle(Input::Tick, now + Duration::from_secs(1));
    assert!(b.reading_guest(), "tokens again");
    // An egress task's refusal takes a token as well.
    let (mut b, now) = with(BoundaryConfig::default());
    let report = |id| Report::Refused {
        id: StreamId(id),
        listener: Listener::Http,
        host: None,
        port: None,
        ip: None,
        reason: "no",
    };
    for id in 0..=REFUSALS_PER_SEC {
        let out = b.handle(Input::Egress(report(id)), now);
        assert!(matches!(out.notes.as_slice(), [Note::Egress(Report::Refused { .. })]));
    }
    assert!(!b.reading_guest());
}

#[test]
fn a_port_forward_is_gated_then_routed_and_a_violation_disconnects_its_client() {
    let denied = policy(r#"{"allow":["exec"]}"#);
    let (mut b, now) = with(BoundaryConfig { policy: denied, ..BoundaryConfig::default() });
    let connect = ToSupervisor::Forward(ForwardRequest::Connect { id: StreamId(1), port: 80, window: 16 });
    let out = b.handle(Input::Client(A, connect.clone()), now);
    assert!(matches!(out.notes.as_slice(), [Note::Denied { op: Operation::PortForward, .. }]));
    assert!(matches!(out.sends.as_slice(), [Outgoing::ToClient(A, ToClient::Forward(ForwardEvent::Refused { .. }))]));

    let (mut b, now) = with(BoundaryConfig::default());
    let out = b.handle(Input::Client(A, connect), now);
    assert!(matches!(out.sends.as_slice(), [Outgoing::ToGuest(ToGuest::Net(NetToGuest::Connect { port: 80, .. }))]));
    assert_eq!(b.open_streams(), 1);
    // Data before the guest connected: the client is cut off, and its forward closed on the guest.
    let early =
        ToSupervisor::Forward(ForwardRequest::Stream(StreamFrame::Data { id: StreamId(1), data: vec![1].into() }));
    let out = b.handle(Input::Client(A, early), now);
    assert!(matches!(out.notes.as_slice(), [Note::ClientViolation(A, ClientViolation::Stream(..))]));
    assert!(matches!(out.sends.last(), Some(Outgoing::Disconnect(A))), "{:?}", out.sends);
    assert!(out
        .sends
        .iter()
        .any(|s| matches!(s, Outgoing::ToGuest(ToGuest::Net(NetToGuest::Stream(StreamFrame::Close { .. }))))));
    assert_eq!(b.open_streams(), 0);
    assert!(b.handle(Input::Client(A, spawn_msg(1, &["true"])), now).sends.is_empty(), "a gone client's late message");
}

#[test]
fn a_guest_that_breaks_a_rule_is_a_violation_whatever_it_breaks() {
    let (mut b, now) = with(BoundaryConfig::default());
    let out = b.handle(Input::Guest(started(9, 1)), now);
    assert!(matches!(out.violation, Some(GuestViolation::UnknownProcess(_))));
    let forged = ToHost::Net(NetToHost::Stream(StreamFrame::Data { id: StreamId(3), data: vec![1].into() }));
    assert!(matches!(b.handle(Input::Guest(forged), now).violation, Some(GuestViolation::Stream(..))));
    assert!(matches!(
        b.handle(
            Input::Client(A, ToSupervisor::Hello(vm_protocol::Hello::ours(vm_protocol::Capabilities::NONE, "x"))),
            now
        )
        .notes
        .as_slice(),
        [Note::ClientViolation(A, ClientViolation::Unexpected(_))]
    ));
}

fn credential(name: &str) -> SecretCredential {
    serde_json::from_value(serde_json::json!({"name": name, "value": "v", "hosts": ["api.example.com"]})).unwrap()
}

#[test]
fn a_rotation_checks_names_first_then_the_collector_then_swaps_the_credentials() {
    let secrets = Secrets::new(vec![credential("KEY")]).unwrap();
    let (mut b, now) = with(BoundaryConfig { secrets, ..BoundaryConfig::default() });
    let ask =
        |r: CredentialRotation| Input::Client(A, ToSupervisor::Supervisor(SupervisorRequest::RotateCredentials(r)));
    let ack = |out: &Output| {
        out.sends.iter().find_map(|s| match s {
            Outgoing::ToClient(A, ToClient::Supervisor(SupervisorReply::CredentialsAck { outcome })) => Some(*outcome),
            _ => None,
        })
    };
    // An unknown name changes nothing, the collector included.
    let unknown = CredentialRotation { secrets: Some(vec![credential("OTHER")]), ..CredentialRotation::default() };
    let out = b.handle(ask(unknown), now);
    assert_eq!(ack(&out), Some(RotationOutcome::UnknownSecret));
    assert!(out.sends.iter().all(|s| !matches!(s, Outgoing::RotateCollector(..))));
    // Headers and credentials: the collector's part first, through the caller.
    let both = CredentialRotation {
        headers: Some(vec![]),
        secrets: Some(vec![credential("KEY")]),
        ..CredentialRotation::default()
    };
    let out = b.handle(ask(both.clone()), now);
    assert!(matches!(out.sends.as_slice(), [Outgoing::RotateCollector(A, _)]));
    let refused = Input::CollectorRotated { client: A, rotation: both.clone(), outcome: RotationOutcome::NoCollector };
    let out = b.handle(refused, now);
    assert_eq!(ack(&out), Some(RotationOutcome::NoCollector));
    assert!(out.notes.iter().all(|n| !matches!(n, Note::SecretsRotated { .. })), "all or nothing");
    let applied = Input::CollectorRotated { client: A, rotation: both, outcome: RotationOutcome::Applied };
    let out = b.handle(applied, now);
    assert!(
        matches!(out.notes.as_slice(), [Note::SecretsRotated { outcome: RotationOutcome::Applied, names }, Note::RotationAnswered(RotationOutcome::Applied)] if names == &["KEY"])
    );
    assert_eq!(ack(&out), Some(RotationOutcome::Applied));
}
