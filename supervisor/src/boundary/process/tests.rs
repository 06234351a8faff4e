//! The process router's rules, checked without a VM.
use super::*;
use crate::boundary::violation::GuestViolation;
use vm_protocol::flow::MAX_WINDOW_BYTES;
use vm_protocol::link::{ToGuest, ToHost};
use vm_protocol::message::MAX_FAILURE_MESSAGE_BYTES;
use vm_protocol::{PtySize, Spawn, Stream};

const A: ClientId = ClientId(1);
const B: ClientId = ClientId(2);

fn spawn(id: u32, window: u32) -> ToSupervisor {
    ToSupervisor::Process(ProcessRequest::Spawn(Spawn {
        id: ProcId(id),
        argv: vec!["true".into()],
        env: vec![],
        cwd: None,
        pty: None,
        output_window: window,
        rlimits: Vec::new(),
        root: None,
    }))
}

fn mux_with(clients: &[ClientId]) -> ProcessRouter {
    let mut mux = ProcessRouter::default();
    for c in clients {
        mux.add_client(*c);
    }
    mux
}

fn out(id: u32, bytes: &[u8]) -> ToHost {
    ToHost::Process(ProcessEvent::Output { id: ProcId(id), stream: Stream::Stdout, data: bytes.to_vec().into() })
}

fn started(id: u32, pid: u32, stdin_window: u32) -> ToHost {
    started_with(id, pid, stdin_window, 8)
}

fn started_with(id: u32, pid: u32, stdin_window: u32, output_window: u32) -> ToHost {
    ToHost::Process(ProcessEvent::Started { id: ProcId(id), pid, stdin_window, output_window })
}

/// A mux with one process of client A, guest id 1, running as pid 77 with an 8-byte output window.
fn running() -> ProcessRouter {
    let mut mux = mux_with(&[A, B]);
    mux.from_client(A, spawn(1, 8)).unwrap();
    mux.from_guest(started(1, 77, 4)).unwrap();
    mux
}

#[test]
fn two_clients_may_use_the_same_ids() {
    let mut mux = mux_with(&[A, B]);
    let a = mux.from_client(A, spawn(1, 10)).unwrap();
    let b = mux.from_client(B, spawn(1, 10)).unwrap();
    assert!(matches!(&a[..], [Action::ToGuest(ToGuest::Process(ProcessRequest::Spawn(s)))] if s.id == ProcId(1)));
    assert!(matches!(&b[..], [Action::ToGuest(ToGuest::Process(ProcessRequest::Spawn(s)))] if s.id == ProcId(2)));
    mux.from_guest(started_with(2, 5, 0, 10)).unwrap();
    let output = mux.from_guest(out(2, b"hi")).unwrap();
    assert!(
        matches!(&output[..], [Action::ToClient(c, ToClient::Process(ProcessEvent::Output { id, .. }))] if *c == B && *id == ProcId(1))
    );
}

#[test]
fn guest_output_beyond_the_window_is_a_violation() {
    let mut mux = running();
    mux.from_guest(out(1, &[0; 8])).unwrap();
    assert!(matches!(mux.from_guest(out(1, &[0])), Err(GuestViolation::Credit { .. })));
    mux.from_client(A, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 1 })).unwrap();
    mux.from_guest(out(1, &[0])).unwrap();
}

#[test]
fn every_guest_rule_is_enforced() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(1, 8)).unwrap();
    assert_eq!(mux.from_guest(out(1, b"x")), Err(GuestViolation::OutOfOrder(ProcId(1))), "output before Started");
    mux.from_guest(started(1, 7, 4)).unwrap();
    assert_eq!(mux.from_guest(started(1, 7, 4)), Err(GuestViolation::StartedTwice(ProcId(1))));
    assert_eq!(mux.from_guest(out(1, b"")), Err(GuestViolation::Empty(ProcId(1))), "zero-length output");
    let zero_credit = ToHost::Process(ProcessEvent::StdinCredit { id: ProcId(1), bytes: 0 });
    assert_eq!(mux.from_guest(zero_credit), Err(GuestViolation::Empty(ProcId(1))));
    let too_much = ToHost::Process(ProcessEvent::StdinCredit { id: ProcId(1), bytes: 1 });
    assert!(matches!(mux.from_guest(too_much), Err(GuestViolation::Credit { .. })), "credit for bytes never sent");
    for status in [ExitStatus::Signaled(i32::MAX), ExitStatus::Signaled(-128), ExitStatus::Code(256)] {
        assert_eq!(
            mux.from_guest(ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status })),
            Err(GuestViolation::ImplausibleStatus(ProcId(1))),
            "{status:?}"
        );
    }
    let failed = ToHost::Process(ProcessEvent::SpawnFailed {
        id: ProcId(1),
        status: ExitStatus::Code(127),
        message: "x".into(),
    });
    assert_eq!(mux.from_guest(failed), Err(GuestViolation::OutOfOrder(ProcId(1))), "a start failure after Started");
    assert_eq!(mux.from_guest(out(9, b"x")), Err(GuestViolation::UnknownProcess(ProcId(9))));
    mux.from_client(A, spawn(2, 8)).unwrap();
    let big = started(2, 8, MAX_WINDOW_BYTES + 1);
    assert_eq!(mux.from_guest(big), Err(GuestViolation::WindowTooLarge(ProcId(2))));
    let wrong = started_with(2, 8, 4, 9);
    assert_eq!(mux.from_guest(wrong), Err(GuestViolation::WindowTooLarge(ProcId(2))), "not the granted window");
    let long = ToHost::Process(ProcessEvent::SpawnFailed {
        id: ProcId(2),
        status: ExitStatus::Code(127),
        message: "x".repeat(MAX_FAILURE_MESSAGE_BYTES + 1),
    });
    assert_eq!(mux.from_guest(long), Err(GuestViolation::MessageTooLong(ProcId(2))));
}

#[test]
fn the_control_without_the_rules_lets_empty_output_pile_up() {
    // The `no-guest-invariants` control: every empty frame is routed and, detached, retained.
    let mut mux = ProcessRouter::new(false);
    mux.add_client(A);
    mux.from_client(A, spawn(1, 8)).unwrap();
    mux.from_guest(started(1, 7, 4)).unwrap();
    mux.remove_client(A);
    for _ in 0..1000 {
        mux.from_guest(out(1, b"")).unwrap();
        mux.from_guest(started(1, 7, 4)).unwrap();
    }
    assert_eq!(mux.known_processes(), 1);
}

#[test]
fn client_stdin_beyond_the_guest_window_is_a_violation() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(1, 4)).unwrap();
    let stdin = |n: usize| ToSupervisor::Process(ProcessRequest::Stdin { id: ProcId(1), data: vec![0; n].into() });
    assert!(matches!(mux.from_client(A, stdin(1)), Err(ClientViolation::Credit { .. })), "before Started");
    mux.from_guest(started_with(1, 10, 3, 4)).unwrap();
    mux.from_client(A, stdin(3)).unwrap();
    assert!(matches!(mux.from_client(A, stdin(1)), Err(ClientViolation::Credit { .. })));
    assert_eq!(mux.from_client(A, stdin(0)), Err(ClientViolation::Empty(ProcId(1))));
    assert_eq!(
        mux.from_client(A, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 0 })),
        Err(ClientViolation::Empty(ProcId(1)))
    );
}

#[test]
fn a_client_may_only_credit_what_it_received() {
    let mut mux = running();
    mux.from_guest(out(1, b"abc")).unwrap();
    assert!(matches!(
        mux.from_client(A, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 4 })),
        Err(ClientViolation::Credit { .. })
    ));
    assert_eq!(
        mux.from_client(A, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 3 })).unwrap(),
        [Action::ToGuest(ToGuest::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 3 }))]
    );
}

#[test]
fn everything_a_departed_client_never_credited_is_replayed_in_order() {
    let mut mux = running();
    // A received "ab" and "cd" but credited only "a": "bcd" was never delivered.
    mux.from_guest(out(1, b"ab")).unwrap();
    mux.from_guest(out(1, b"cd")).unwrap();
    mux.from_client(A, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 1 })).unwrap();
    mux.remove_client(A);
    assert_eq!(mux.from_guest(out(1, b"efghi")).unwrap(), [], "held while detached");
    assert!(matches!(mux.from_guest(out(1, b"j")), Err(GuestViolation::Credit { .. })), "bounded by the window");
    let listed = mux.from_client(B, ToSupervisor::Supervisor(SupervisorRequest::ListProcesses)).unwrap();
    assert!(
        matches!(&listed[..], [Action::ToClient(_, ToClient::Supervisor(SupervisorReply::Processes { list }))] if list[0].pid == 77 && !list[0].attached)
    );
    let back =
        mux.from_client(B, ToSupervisor::Supervisor(SupervisorRequest::Reattach { id: ProcId(9), pid: 77 })).unwrap();
    assert!(
        matches!(&back[0], Action::ToClient(c, ToClient::Process(ProcessEvent::Started { id, pid: 77, .. })) if *c == B && *id == ProcId(9))
    );
    let replayed: Vec<u8> = back[1..]
        .iter()
        .flat_map(|a| match a {
            Action::ToClient(_, ToClient::Process(ProcessEvent::Output { id, data, .. })) if *id == ProcId(9) => {
                data.to_vec()
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(replayed, b"bcdefghi");
    // From now on B drives it, and its credit reopens the guest's window.
    assert_eq!(
        mux.from_client(B, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(9), bytes: 8 })).unwrap(),
        [Action::ToGuest(ToGuest::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 8 }))]
    );
}

#[test]
fn a_process_that_exits_undelivered_waits_for_the_next_client_and_is_collected_once() {
    let mut mux = running();
    mux.from_guest(out(1, b"last")).unwrap();
    let exited =
        mux.from_guest(ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(3) })).unwrap();
    assert!(matches!(&exited[0], Action::Exited { .. }), "reported for telemetry");
    mux.remove_client(A);
    let back =
        mux.from_client(B, ToSupervisor::Supervisor(SupervisorRequest::Reattach { id: ProcId(1), pid: 77 })).unwrap();
    assert!(
        matches!(&back[1], Action::ToClient(_, ToClient::Process(ProcessEvent::Output { data, .. })) if data.as_ref() == b"last")
    );
    assert!(matches!(
        back.last(),
        Some(Action::ToClient(_, ToClient::Process(ProcessEvent::Exited { status: ExitStatus::Code(3), .. })))
    ));
    assert_eq!(mux.known_processes(), 1, "until B credits what it got");
    assert_eq!(
        mux.from_client(B, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 4 })).unwrap(),
        [],
        "no credit to a dead process"
    );
    assert_eq!(mux.known_processes(), 0, "collected once");
    let again =
        mux.from_client(B, ToSupervisor::Supervisor(SupervisorRequest::Reattach { id: ProcId(2), pid: 77 })).unwrap();
    assert!(matches!(
        &again[..],
        [Action::ToClient(_, ToClient::Process(ProcessEvent::Refused { reason: Refusal::NoSuchProcess, .. }))]
    ));
}

#[test]
fn a_delivered_process_is_forgotten_at_its_exit() {
    let mut mux = running();
    mux.from_guest(out(1, b"x")).unwrap();
    mux.from_client(A, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 1 })).unwrap();
    mux.from_guest(ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(0) })).unwrap();
    assert_eq!(mux.known_processes(), 0);
}

#[test]
fn a_start_failure_reaches_the_client_and_ends_the_process() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(1, 8)).unwrap();
    let failed = ToHost::Process(ProcessEvent::SpawnFailed {
        id: ProcId(1),
        status: ExitStatus::Code(127),
        message: "nope: not found".into(),
    });
    let actions = mux.from_guest(failed).unwrap();
    assert!(matches!(&actions[0], Action::Exited { pid: None, status: ExitStatus::Code(127), .. }));
    assert!(matches!(
        &actions[1],
        Action::ToClient(A, ToClient::Process(ProcessEvent::SpawnFailed { id: ProcId(1), .. }))
    ));
    assert_eq!(mux.known_processes(), 0);
}

#[test]
fn late_and_unknown_ids_are_told_apart() {
    let mut mux = running();
    mux.from_guest(ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(0) })).unwrap();
    assert_eq!(mux.from_client(A, ToSupervisor::Process(ProcessRequest::StdinEof { id: ProcId(1) })).unwrap(), []);
    assert_eq!(mux.from_guest(ToHost::Process(ProcessEvent::StdinCredit { id: ProcId(1), bytes: 1 })).unwrap(), []);
    assert!(matches!(
        mux.from_client(A, ToSupervisor::Process(ProcessRequest::StdinEof { id: ProcId(2) })),
        Err(ClientViolation::UnknownProcess(_))
    ));
    assert_eq!(mux.from_guest(out(1, b"x")), Err(GuestViolation::UnknownProcess(ProcId(1))), "output after exit");
    assert!(matches!(
        mux.from_guest(ToHost::Process(ProcessEvent::StdinCredit { id: ProcId(9), bytes: 1 })),
        Err(GuestViolation::UnknownProcess(_))
    ));
}

#[test]
fn refuses_spawns_when_stopping_or_out_of_order_and_shrinks_windows_past_the_budget() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(5, 4)).unwrap();
    assert_eq!(
        mux.from_client(A, spawn(5, 4)).unwrap(),
        [Action::ToClient(
            A,
            ToClient::Process(ProcessEvent::Refused { id: ProcId(5), reason: Refusal::IdNotIncreasing })
        )]
    );
    assert_eq!(
        mux.from_client(A, spawn(6, MAX_WINDOW_BYTES + 1)).unwrap(),
        [Action::ToClient(A, ToClient::Process(ProcessEvent::Refused { id: ProcId(6), reason: Refusal::Invalid }))]
    );
    // Past the budget, windows shrink to the minimum instead of being refused.
    let per = u32::try_from(OUTPUT_BUDGET_BYTES / 4).unwrap();
    let windows: Vec<u32> = (7..14)
        .map(|id| match &mux.from_client(A, spawn(id, per)).unwrap()[..] {
            [Action::ToGuest(ToGuest::Process(ProcessRequest::Spawn(s)))] => s.output_window,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(&windows[..3], [per; 3], "three quarters fit next to the first small window");
    assert!(windows[3] < per && windows[4..].iter().all(|w| *w == MIN_WINDOW_BYTES), "{windows:?}");
    mux.stop_accepting();
    assert_eq!(
        mux.from_client(A, spawn(30, 4)).unwrap(),
        [Action::ToClient(
            A,
            ToClient::Process(ProcessEvent::Refused { id: ProcId(30), reason: Refusal::ShuttingDown })
        )]
    );
}

#[test]
fn clients_may_not_shut_the_vm_down() {
    // The attach socket's type has no shutdown: the link's one, sent by a client, never decodes.
    let mut wire = Vec::new();
    let shutdown = ToGuest::Vm(vm_protocol::link::VmRequest::Shutdown { grace_ms: 0, signal: SignalName::Term });
    vm_protocol::frame::encode(&shutdown, &mut wire).unwrap();
    assert!(matches!(vm_protocol::frame::decode::<ToSupervisor>(&wire), Err(vm_protocol::FrameError::Malformed(_))));
}

#[test]
fn stdin_eof_reaches_the_guest_once_and_credit_never_outgrows_a_reattached_client() {
    let mut mux = running();
    let stdin =
        |id: u32, n: usize| ToSupervisor::Process(ProcessRequest::Stdin { id: ProcId(id), data: vec![1; n].into() });
    mux.from_client(A, stdin(1, 3)).unwrap();
    mux.remove_client(A);
    let back =
        mux.from_client(B, ToSupervisor::Supervisor(SupervisorRequest::Reattach { id: ProcId(1), pid: 77 })).unwrap();
    assert!(
        matches!(&back[0], Action::ToClient(_, ToClient::Process(ProcessEvent::Started { stdin_window: 1, .. }))),
        "what is left"
    );
    // The guest now credits the 3 bytes A sent: B was never told of them, so it does not hear of them.
    assert_eq!(mux.from_guest(ToHost::Process(ProcessEvent::StdinCredit { id: ProcId(1), bytes: 3 })).unwrap(), []);
    mux.from_client(B, stdin(1, 1)).unwrap();
    assert_eq!(
        mux.from_guest(ToHost::Process(ProcessEvent::StdinCredit { id: ProcId(1), bytes: 1 })).unwrap(),
        [Action::ToClient(B, ToClient::Process(ProcessEvent::StdinCredit { id: ProcId(1), bytes: 1 }))]
    );
    assert_eq!(
        mux.from_client(B, ToSupervisor::Process(ProcessRequest::StdinEof { id: ProcId(1) })).unwrap(),
        [Action::ToGuest(ToGuest::Process(ProcessRequest::StdinEof { id: ProcId(1) }))]
    );
    mux.remove_client(B);
    mux.add_client(ClientId(3));
    mux.from_client(ClientId(3), ToSupervisor::Supervisor(SupervisorRequest::Reattach { id: ProcId(1), pid: 77 }))
        .unwrap();
    assert_eq!(
        mux.from_client(ClientId(3), ToSupervisor::Process(ProcessRequest::StdinEof { id: ProcId(1) })).unwrap(),
        [],
        "not a second EOF"
    );
    assert!(
        matches!(mux.from_client(ClientId(3), stdin(1, 1)), Err(ClientViolation::Unexpected(_))),
        "data after EOF stays with the client"
    );
}

#[test]
fn only_a_terminal_is_resized() {
    let mut mux = mux_with(&[A]);
    let size = PtySize { rows: 10, cols: 20 };
    mux.from_client(A, spawn(1, 8)).unwrap();
    assert_eq!(
        mux.from_client(A, ToSupervisor::Process(ProcessRequest::Resize { id: ProcId(1), size })).unwrap(),
        [],
        "no terminal: dropped"
    );
    let ToSupervisor::Process(ProcessRequest::Spawn(mut tty)) = spawn(2, 8) else { unreachable!() };
    tty.pty = Some(size);
    mux.from_client(A, ToSupervisor::Process(ProcessRequest::Spawn(tty))).unwrap();
    assert_eq!(
        mux.from_client(A, ToSupervisor::Process(ProcessRequest::Resize { id: ProcId(2), size })).unwrap(),
        [Action::ToGuest(ToGuest::Process(ProcessRequest::Resize { id: ProcId(2), size }))]
    );
}

#[test]
fn a_removed_client_is_not_brought_back_by_its_late_messages() {
    let mut mux = mux_with(&[A]);
    mux.remove_client(A);
    assert_eq!(mux.from_client(A, spawn(1, 8)).unwrap(), [], "nothing reaches the guest");
    assert_eq!(mux.from_client(A, ToSupervisor::Supervisor(SupervisorRequest::ListProcesses)).unwrap(), []);
}

#[test]
fn a_detached_process_leaves_its_connection_and_the_others_stay() {
    let mut mux = running();
    mux.from_client(A, spawn(2, 8)).unwrap();
    mux.from_guest(started(2, 78, 4)).unwrap();
    mux.from_guest(out(1, b"held")).unwrap();
    assert_eq!(mux.from_client(A, ToSupervisor::Supervisor(SupervisorRequest::Detach { id: ProcId(1) })).unwrap(), []);
    assert_eq!(mux.from_guest(out(1, b"more")).unwrap(), [], "held while detached");
    let other = mux.from_guest(out(2, b"x")).unwrap();
    assert!(
        matches!(&other[..], [Action::ToClient(A, ToClient::Process(ProcessEvent::Output { id: ProcId(2), .. }))]),
        "2 stays with A"
    );
    assert_eq!(
        mux.from_client(A, ToSupervisor::Process(ProcessRequest::Credit { id: ProcId(1), bytes: 4 })).unwrap(),
        [],
        "A let go of 1"
    );
    assert_eq!(
        mux.from_client(A, ToSupervisor::Supervisor(SupervisorRequest::Detach { id: ProcId(1) })).unwrap(),
        [],
        "twice is a no-op"
    );
    assert!(matches!(
        mux.from_client(A, ToSupervisor::Supervisor(SupervisorRequest::Detach { id: ProcId(5) })),
        Err(ClientViolation::UnknownProcess(_))
    ));
    // The same connection takes it back under a new id, with everything it never credited.
    let back =
        mux.from_client(A, ToSupervisor::Supervisor(SupervisorRequest::Reattach { id: ProcId(3), pid: 77 })).unwrap();
    let replayed: Vec<u8> = back[1..]
        .iter()
        .flat_map(|a| match a {
            Action::ToClient(A, ToClient::Process(ProcessEvent::Output { id: ProcId(3), data, .. })) => data.to_vec(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(replayed, b"heldmore");
}

#[test]
fn a_detached_process_whose_output_was_all_delivered_is_forgotten() {
    let mut mux = running();
    mux.from_guest(out(1, b"x")).unwrap();
    mux.from_guest(ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(0) })).unwrap();
    assert_eq!(mux.known_processes(), 1, "its output is not credited yet");
    mux.from_client(A, ToSupervisor::Supervisor(SupervisorRequest::Detach { id: ProcId(1) })).unwrap();
    assert_eq!(mux.known_processes(), 1, "kept for a re-attach");
    let mut mux = running();
    mux.from_guest(ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(0) })).unwrap();
    assert_eq!(mux.known_processes(), 0, "delivered at its exit");
    assert_eq!(
        mux.from_client(A, ToSupervisor::Supervisor(SupervisorRequest::Detach { id: ProcId(1) })).unwrap(),
        [],
        "a late detach is harmless"
    );
}

#[test]
fn a_file_operation_is_a_process_of_its_own_reported_at_its_end() {
    use vm_protocol::files::{FileOp, FileSpawn};
    let op = FileOp::Write { path: "/home/sandbox/f".into(), mode: 0o644 };
    let files = |id| {
        ToSupervisor::Process(ProcessRequest::Files(FileSpawn { id: ProcId(id), op: op.clone(), output_window: 8 }))
    };
    let mut mux = mux_with(&[A]);
    let actions = mux.from_client(A, files(1)).unwrap();
    assert!(matches!(&actions[..], [Action::ToGuest(ToGuest::Process(ProcessRequest::Files(f)))] if f.id == ProcId(1)));
    assert!(mux.from_guest(started(1, 9, 16)).unwrap().iter().all(|a| !matches!(a, Action::Started { .. })));
    let stdin = ToSupervisor::Process(ProcessRequest::Stdin { id: ProcId(1), data: b"hello".to_vec().into() });
    mux.from_client(A, stdin).unwrap();
    let exited = ToHost::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(0) });
    let actions = mux.from_guest(exited).unwrap();
    assert!(
        matches!(&actions[..], [Action::FileDone { bytes: 5, status: ExitStatus::Code(0), .. }, ..]),
        "one File System Activity with the bytes moved: {actions:?}"
    );

    // A malformed op is refused by the supervisor before the guest sees it.
    let bad = FileSpawn { id: ProcId(2), op: FileOp::Read { path: String::new() }, output_window: 8 };
    let actions = mux.from_client(A, ToSupervisor::Process(ProcessRequest::Files(bad))).unwrap();
    assert!(matches!(
        &actions[..],
        [Action::ToClient(A, ToClient::Process(ProcessEvent::Refused { reason: Refusal::Invalid, .. }))]
    ));
}

#[test]
fn a_refused_tar_is_a_finding_and_kills_a_copy_still_running() {
    use vm_protocol::files::{FileOp, FileSpawn, TarRefusal};
    let copy_out = |id| {
        let op = FileOp::CopyOut { path: "/out".into() };
        ToSupervisor::Process(ProcessRequest::Files(FileSpawn { id: ProcId(id), op, output_window: 8 }))
    };
    let refused = |id, path: &str| {
        let reason = TarRefusal::ThroughSymlink;
        ToSupervisor::Supervisor(SupervisorRequest::TarRefused { id: ProcId(id), path: path.into(), reason })
    };
    let mut mux = mux_with(&[A]);
    mux.from_client(A, copy_out(1)).unwrap();
    mux.from_guest(started(1, 9, 16)).unwrap();
    let actions = mux.from_client(A, refused(1, "/out")).unwrap();
    assert!(
        matches!(&actions[..], [
            Action::TarRefused { path, reason: TarRefusal::ThroughSymlink },
            Action::ToGuest(ToGuest::Process(ProcessRequest::Signal { signal: SignalName::Kill, .. })),
        ] if path == "/out"),
        "{actions:?}"
    );
    // After the operation ended and was delivered: still a finding, and nothing to kill.
    mux.from_client(A, copy_out(2)).unwrap();
    mux.from_guest(started(2, 10, 16)).unwrap();
    mux.from_guest(ToHost::Process(ProcessEvent::Exited { id: ProcId(2), status: ExitStatus::Code(0) })).unwrap();
    let actions = mux.from_client(A, refused(2, "/out")).unwrap();
    assert_eq!(actions, [Action::TarRefused { path: "/out".into(), reason: TarRefusal::ThroughSymlink }]);
    // An id the client never used, or a path past the limit, is its violation.
    assert!(mux.from_client(A, refused(9, "/out")).is_err());
    let mut fresh = mux_with(&[A]);
    assert!(fresh.from_client(A, refused(0, &"a".repeat(5000))).is_err());
}
