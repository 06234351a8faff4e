//! The multiplexer's rules, checked without a VM.
use super::*;
use vm_protocol::{PtySize, Spawn, Stream};

const A: ClientId = ClientId(1);
const B: ClientId = ClientId(2);

fn spawn(id: u32, window: u32) -> ToGuest {
    ToGuest::Spawn(Spawn {
        id: ProcId(id),
        argv: vec!["true".into()],
        env: vec![],
        cwd: None,
        pty: None,
        output_window: window,
    })
}

fn mux_with(clients: &[ClientId]) -> Mux {
    let mut mux = Mux::default();
    for c in clients {
        mux.add_client(*c);
    }
    mux
}

#[test]
fn two_clients_may_use_the_same_ids() {
    let mut mux = mux_with(&[A, B]);
    let a = mux.from_client(A, spawn(1, 10)).unwrap();
    let b = mux.from_client(B, spawn(1, 10)).unwrap();
    assert!(matches!(&a[..], [Action::ToGuest(ToGuest::Spawn(s))] if s.id == ProcId(1)));
    assert!(matches!(&b[..], [Action::ToGuest(ToGuest::Spawn(s))] if s.id == ProcId(2)));
    let out =
        mux.from_guest(ToHost::Output { id: ProcId(2), stream: Stream::Stdout, data: b"hi".to_vec().into() }).unwrap();
    assert!(matches!(&out[..], [Action::ToClient(c, ToHost::Output { id, .. })] if *c == B && *id == ProcId(1)));
}

#[test]
fn guest_output_beyond_the_window_is_a_violation() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(1, 4)).unwrap();
    let out = |n: usize| ToHost::Output { id: ProcId(1), stream: Stream::Stdout, data: vec![0; n].into() };
    mux.from_guest(out(4)).unwrap();
    assert!(matches!(mux.from_guest(out(1)), Err(GuestViolation::Credit { .. })));
    mux.from_client(A, ToGuest::Credit { id: ProcId(1), bytes: 1 }).unwrap();
    mux.from_guest(out(1)).unwrap();
}

#[test]
fn client_stdin_beyond_the_guest_window_is_a_violation() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(1, 4)).unwrap();
    let stdin = |n: usize| ToGuest::Stdin { id: ProcId(1), data: vec![0; n].into() };
    assert!(matches!(mux.from_client(A, stdin(1)), Err(ClientViolation::Credit { .. })), "before Started");
    mux.from_guest(ToHost::Started { id: ProcId(1), pid: 10, stdin_window: 3 }).unwrap();
    mux.from_client(A, stdin(3)).unwrap();
    assert!(matches!(mux.from_client(A, stdin(1)), Err(ClientViolation::Credit { .. })));
}

#[test]
fn a_departed_clients_process_keeps_running_and_its_output_waits_for_reattach() {
    let mut mux = mux_with(&[A, B]);
    mux.from_client(A, spawn(1, 8)).unwrap();
    mux.from_guest(ToHost::Started { id: ProcId(1), pid: 77, stdin_window: 4 }).unwrap();
    assert_eq!(mux.remove_client(A), []);
    let out = |n: usize| ToHost::Output { id: ProcId(1), stream: Stream::Stdout, data: vec![1; n].into() };
    assert_eq!(mux.from_guest(out(5)).unwrap(), [], "held, not credited and not dropped");
    assert!(matches!(mux.from_guest(out(4)), Err(GuestViolation::Credit { .. })), "the hold is bounded by the window");
    let listed = mux.from_client(B, ToGuest::ListProcesses).unwrap();
    assert!(
        matches!(&listed[..], [Action::ToClient(_, ToHost::Processes { list })] if list[0].pid == 77 && !list[0].attached)
    );
    let attached = mux.from_client(B, ToGuest::Reattach { id: ProcId(9), pid: 77 }).unwrap();
    assert!(
        matches!(&attached[0], Action::ToClient(c, ToHost::Started { id, pid: 77, .. }) if *c == B && *id == ProcId(9))
    );
    assert!(
        matches!(&attached[1], Action::ToClient(c, ToHost::Output { id, data, .. }) if *c == B && *id == ProcId(9) && data.len() == 5)
    );
    // From now on B drives it.
    let credit = mux.from_client(B, ToGuest::Credit { id: ProcId(9), bytes: 5 }).unwrap();
    assert_eq!(credit, [Action::ToGuest(ToGuest::Credit { id: ProcId(1), bytes: 5 })]);
}

#[test]
fn a_process_that_exits_while_detached_keeps_its_status_for_the_next_client() {
    let mut mux = mux_with(&[A, B]);
    mux.from_client(A, spawn(1, 8)).unwrap();
    mux.from_guest(ToHost::Started { id: ProcId(1), pid: 5, stdin_window: 4 }).unwrap();
    assert_eq!(mux.remove_client(A), []);
    let exited = mux.from_guest(ToHost::Exited { id: ProcId(1), status: ExitStatus::Code(3) }).unwrap();
    assert!(matches!(&exited[..], [Action::Exited { .. }]), "reported for telemetry");
    let attached = mux.from_client(B, ToGuest::Reattach { id: ProcId(1), pid: 5 }).unwrap();
    assert!(matches!(attached.last(), Some(Action::ToClient(_, ToHost::Exited { status: ExitStatus::Code(3), .. }))));
    assert_eq!(mux.live_processes(), 0, "collected once");
    let again = mux.from_client(B, ToGuest::Reattach { id: ProcId(2), pid: 5 }).unwrap();
    assert!(matches!(&again[..], [Action::ToClient(_, ToHost::Refused { reason: Refusal::NoSuchProcess, .. })]));
}

#[test]
fn late_and_unknown_ids_are_told_apart() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(1, 4)).unwrap();
    mux.from_guest(ToHost::Exited { id: ProcId(1), status: ExitStatus::Code(0) }).unwrap();
    assert_eq!(mux.from_client(A, ToGuest::StdinEof { id: ProcId(1) }).unwrap(), []);
    assert_eq!(mux.from_guest(ToHost::StdinCredit { id: ProcId(1), bytes: 1 }).unwrap(), []);
    assert!(matches!(mux.from_client(A, ToGuest::StdinEof { id: ProcId(2) }), Err(ClientViolation::UnknownProcess(_))));
    assert!(matches!(
        mux.from_guest(ToHost::Output { id: ProcId(1), stream: Stream::Stdout, data: vec![].into() }),
        Err(GuestViolation::UnknownProcess(_))
    ));
    assert!(matches!(
        mux.from_guest(ToHost::StdinCredit { id: ProcId(9), bytes: 1 }),
        Err(GuestViolation::UnknownProcess(_))
    ));
}

#[test]
fn refuses_spawns_when_stopping_or_out_of_order() {
    let mut mux = mux_with(&[A]);
    mux.from_client(A, spawn(5, 4)).unwrap();
    assert_eq!(
        mux.from_client(A, spawn(5, 4)).unwrap(),
        [Action::ToClient(A, ToHost::Refused { id: ProcId(5), reason: Refusal::IdNotIncreasing })]
    );
    mux.stop_accepting();
    assert_eq!(
        mux.from_client(A, spawn(6, 4)).unwrap(),
        [Action::ToClient(A, ToHost::Refused { id: ProcId(6), reason: Refusal::ShuttingDown })]
    );
}

#[test]
fn clients_may_not_shut_the_vm_down() {
    let mut mux = mux_with(&[A]);
    assert!(matches!(mux.from_client(A, ToGuest::Shutdown { grace_ms: 0 }), Err(ClientViolation::Unexpected(_))));
}

#[test]
fn stdin_eof_reaches_the_guest_once_even_across_reattach() {
    let mut mux = mux_with(&[A, B]);
    mux.from_client(A, spawn(1, 8)).unwrap();
    mux.from_guest(ToHost::Started { id: ProcId(1), pid: 6, stdin_window: 4 }).unwrap();
    assert_eq!(
        mux.from_client(A, ToGuest::StdinEof { id: ProcId(1) }).unwrap(),
        [Action::ToGuest(ToGuest::StdinEof { id: ProcId(1) })]
    );
    assert_eq!(mux.remove_client(A), []);
    mux.from_client(B, ToGuest::Reattach { id: ProcId(1), pid: 6 }).unwrap();
    assert_eq!(mux.from_client(B, ToGuest::StdinEof { id: ProcId(1) }).unwrap(), [], "not a second EOF to the guest");
    let data = ToGuest::Stdin { id: ProcId(1), data: vec![1].into() };
    assert!(
        matches!(mux.from_client(B, data), Err(ClientViolation::Unexpected(_))),
        "data after EOF stays with the client"
    );
}

#[test]
fn a_detach_credits_back_what_the_departed_client_never_credited() {
    let mut mux = mux_with(&[A, B]);
    mux.from_client(A, spawn(1, 8)).unwrap();
    mux.from_guest(ToHost::Started { id: ProcId(1), pid: 7, stdin_window: 0 }).unwrap();
    let out = |n: usize| ToHost::Output { id: ProcId(1), stream: Stream::Stdout, data: vec![1; n].into() };
    mux.from_guest(out(6)).unwrap();
    assert_eq!(
        mux.remove_client(A),
        [Action::ToGuest(ToGuest::Credit { id: ProcId(1), bytes: 6 })],
        "the window is whole again"
    );
    assert_eq!(mux.from_guest(out(8)).unwrap(), [], "a whole window is held");
    assert!(matches!(mux.from_guest(out(1)), Err(GuestViolation::Credit { .. })), "and no more");
}

#[test]
fn only_a_terminal_is_resized() {
    let mut mux = mux_with(&[A]);
    let size = PtySize { rows: 10, cols: 20 };
    mux.from_client(A, spawn(1, 8)).unwrap();
    assert_eq!(mux.from_client(A, ToGuest::Resize { id: ProcId(1), size }).unwrap(), [], "no terminal: dropped");
    let ToGuest::Spawn(mut tty) = spawn(2, 8) else { unreachable!() };
    tty.pty = Some(size);
    mux.from_client(A, ToGuest::Spawn(tty)).unwrap();
    assert_eq!(
        mux.from_client(A, ToGuest::Resize { id: ProcId(2), size }).unwrap(),
        [Action::ToGuest(ToGuest::Resize { id: ProcId(2), size })]
    );
}

#[test]
fn a_removed_client_is_not_brought_back_by_its_late_messages() {
    let mut mux = mux_with(&[A]);
    let _ = mux.remove_client(A);
    assert_eq!(mux.from_client(A, spawn(1, 8)).unwrap(), [], "nothing reaches the guest");
    assert_eq!(mux.from_client(A, ToGuest::ListProcesses).unwrap(), []);
}
