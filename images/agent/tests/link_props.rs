//! Stateful property test of the agent's link: random sequences of every host message, with real processes
//! on this host. Whatever the host sends, the agent never panics, always ends (a violation, the host gone
//! or a shutdown), and what it sends back follows the protocol: one `Started` per process before any
//! output, no empty output, no output beyond the window and the credit granted, nothing after the end of a
//! process, plausible statuses. A request of the attach socket never decodes on the link: the agent ends
//! the link as broken.
//!
//! The reaper waits for any child of this process, so this file is a test binary of its own, one case at a
//! time.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use proptest::prelude::*;
use vm_agent::link;
use vm_protocol::attach::ToSupervisor;
use vm_protocol::files::FileSpawn;
use vm_protocol::link::{ToGuest, ToHost, VmRequest};
use vm_protocol::message::{Refusal, MAX_FAILURE_MESSAGE_BYTES};
use vm_protocol::net::{NetToGuest, NetToHost, StreamFrame};
use vm_protocol::{arbitrary, frame, Capabilities, Hello, ProcId, ProcessEvent, ProcessRequest, SignalName, Spawn};

fn commands() -> Vec<Vec<String>> {
    [&["true"][..], &["cat"], &["sh", "-c", "echo out; echo err >&2; sleep 0.05"], &["/no/such/command"], &[]]
        .iter()
        .map(|argv| argv.iter().map(|s| (*s).to_owned()).collect())
        .collect()
}

/// Where one process stands, as the host has been told.
#[derive(Debug, Default)]
struct Proc {
    started: bool,
    ended: bool,
    /// Spawns the host sent with this id: past one, refusals of the id are the host's own doing.
    spawns: u32,
    /// Output bytes the agent may still send.
    allowance: u64,
}

/// Runs one link over a socket pair: the host sends `msgs`, then goes away. Returns what the agent sent
/// after its hello, or an error if the link did not end in time.
fn session(msgs: &[ToGuest]) -> Result<Vec<ToHost>, TestCaseError> {
    session_of(&msgs.iter().map(encoded).collect::<Vec<_>>()).map(|(got, _)| got)
}

/// [`session`] for frames already encoded, and whether the link ended without an error.
fn session_of(sent: &[Vec<u8>]) -> Result<(Vec<ToHost>, bool), TestCaseError> {
    let (mut host, guest) = UnixStream::pair().unwrap();
    let writer = File::from(OwnedFd::from(guest.try_clone().unwrap()));
    let (done, ended) = mpsc::channel();
    thread::spawn(move || {
        let _ = done.send(link::serve(guest, writer, &link::Config::default()).is_ok());
    });
    host.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut reader = host.try_clone().unwrap();
    let frames = thread::spawn(move || {
        let mut scratch = Vec::new();
        let mut got = Vec::new();
        while let Ok(Some(msg)) = frame::read::<ToHost, _>(&mut reader, &mut scratch) {
            got.push(msg);
        }
        got
    });
    let mut wire = Vec::new();
    let _ = frame::write(&mut host, &ToGuest::Hello(Hello::ours(Capabilities::NONE, "props")), &mut wire);
    for one in sent {
        // A write fails once the agent has ended the link: what follows goes nowhere, as on a real channel.
        if host.write_all(one).is_err() {
            break;
        }
    }
    let _ = host.shutdown(Shutdown::Write);
    let finished = ended.recv_timeout(Duration::from_secs(20));
    prop_assert!(finished.is_ok(), "the link did not end within 20 s of the host going away");
    let clean = finished.unwrap_or(false);
    // The agent's side of the socket closes when the link is over; whatever it sent is read by then.
    let _ = host.shutdown(Shutdown::Both);
    let mut got = frames.join().map_err(|_| TestCaseError::fail("the reader panicked"))?;
    prop_assert!(matches!(got.first(), Some(ToHost::Hello(_))), "the agent speaks first: {:?}", got.first());
    got.remove(0);
    Ok((got, clean))
}

/// Checks the agent's messages against what the host sent (in the order sent; the agent answers in order
/// per process, and credit only ever adds to what it may send).
fn check(sent: &[ToGuest], got: &[ToHost]) -> Result<(), TestCaseError> {
    let mut procs: HashMap<ProcId, Proc> = HashMap::new();
    let mut dialed = std::collections::HashSet::new();
    for msg in sent {
        match msg {
            ToGuest::Net(NetToGuest::Connect { id, .. }) => {
                dialed.insert(*id);
            }
            ToGuest::Process(ProcessRequest::Spawn(Spawn { id, output_window, .. }))
            | ToGuest::Process(ProcessRequest::Files(FileSpawn { id, output_window, .. })) => {
                let p = procs.entry(*id).or_default();
                p.allowance += u64::from(*output_window);
                p.spawns += 1;
            }
            ToGuest::Process(ProcessRequest::Credit { id, bytes }) => {
                procs.entry(*id).or_default().allowance += u64::from(*bytes);
            }
            _ => {}
        }
    }
    for msg in got {
        match msg {
            ToHost::Process(ProcessEvent::Started { id, .. }) => {
                let p = procs.get_mut(id);
                prop_assert!(p.is_some(), "Started for {id} that was never spawned");
                let p = p.unwrap();
                prop_assert!(!p.started && !p.ended, "a second Started for {id}");
                p.started = true;
            }
            ToHost::Process(ProcessEvent::Output { id, data, .. }) => {
                let p = procs.get_mut(id);
                prop_assert!(p.as_ref().is_some_and(|p| p.started && !p.ended), "output outside Started..Exited");
                prop_assert!(!data.is_empty(), "empty output");
                let p = p.unwrap();
                prop_assert!(data.len() as u64 <= p.allowance, "output beyond the window and credit for {id}");
                p.allowance -= data.len() as u64;
            }
            ToHost::Process(ProcessEvent::Exited { id, status }) => {
                let p = procs.get_mut(id);
                prop_assert!(p.as_ref().is_some_and(|p| p.started && !p.ended), "Exited outside Started");
                prop_assert!(status.is_plausible(), "{status:?}");
                p.unwrap().ended = true;
            }
            ToHost::Process(ProcessEvent::SpawnFailed { id, status, message }) => {
                let p = procs.get_mut(id);
                prop_assert!(p.as_ref().is_some_and(|p| !p.started && !p.ended), "SpawnFailed after Started");
                prop_assert!(status.is_plausible() && message.len() <= MAX_FAILURE_MESSAGE_BYTES);
                p.unwrap().ended = true;
            }
            // A spawn reusing an id is refused, whatever that id's process is doing.
            ToHost::Process(ProcessEvent::Refused { reason: Refusal::IdNotIncreasing, .. }) => {}
            ToHost::Process(ProcessEvent::Refused { id, .. }) if procs.get(id).is_some_and(|p| p.spawns > 1) => {}
            ToHost::Process(ProcessEvent::Refused { id, .. }) => {
                let p = procs.get_mut(id);
                prop_assert!(p.as_ref().is_some_and(|p| !p.started && !p.ended), "a refusal after Started");
                p.unwrap().ended = true;
            }
            ToHost::Process(ProcessEvent::StdinCredit { bytes, .. }) => prop_assert!(*bytes > 0, "zero stdin credit"),
            ToHost::Pong { .. } => {}
            // A port forward the host asked for: dialed on this host's loopback, where usually nothing listens.
            ToHost::Net(NetToHost::Stream(StreamFrame::Close { id }) | NetToHost::Connected { id, .. }) => {
                prop_assert!(dialed.contains(id), "a stream the host never opened: {id}");
            }
            other => prop_assert!(false, "the agent sent {other:?}"),
        }
    }
    Ok(())
}

/// One step of the host: mostly what a well-behaved host would send next, sometimes anything at all (so
/// cases reach running processes before the first violation, if any).
#[derive(Debug, Clone)]
enum Step {
    Any(ToGuest),
    SpawnNext(prop::sample::Index, u32),
    Eof(prop::sample::Index),
    Credit(prop::sample::Index, u32),
    Signal(prop::sample::Index, SignalName),
    Stdin(prop::sample::Index, u8),
}

fn step() -> impl Strategy<Value = Step> {
    let i = any::<prop::sample::Index>;
    prop_oneof![
        2 => arbitrary::link_to_guest(1..5, commands()).prop_map(Step::Any),
        4 => (i(), 1..65_536u32).prop_map(|(c, w)| Step::SpawnNext(c, w)),
        3 => i().prop_map(Step::Eof),
        3 => (i(), 1..65_536u32).prop_map(|(p, b)| Step::Credit(p, b)),
        1 => (i(), prop::sample::select(SignalName::ALL.to_vec())).prop_map(|(p, s)| Step::Signal(p, s)),
        2 => (i(), 1..255u8).prop_map(|(p, n)| Step::Stdin(p, n)),
    ]
}

/// The host's messages for `steps`: well-behaved steps use increasing ids and the processes spawned so far.
fn messages(steps: Vec<Step>) -> Vec<ToGuest> {
    let runnable: Vec<Vec<String>> = commands().into_iter().filter(|c| !c.is_empty()).collect();
    let mut next = 1u32;
    let mut spawned: Vec<ProcId> = Vec::new();
    let pick =
        |at: &prop::sample::Index, spawned: &[ProcId]| (!spawned.is_empty()).then(|| spawned[at.index(spawned.len())]);
    steps
        .into_iter()
        .filter_map(|s| match s {
            Step::Any(msg) => {
                if let ToGuest::Process(ProcessRequest::Spawn(sp)) = &msg {
                    next = next.max(sp.id.0 + 1);
                }
                Some(msg)
            }
            Step::SpawnNext(c, output_window) => {
                let id = ProcId(next);
                next += 1;
                spawned.push(id);
                let argv = runnable[c.index(runnable.len())].clone();
                Some(ToGuest::Process(ProcessRequest::Spawn(Spawn {
                    id,
                    argv,
                    env: vec![],
                    cwd: None,
                    pty: None,
                    output_window,
                    rlimits: Vec::new(),
                    root: None,
                })))
            }
            Step::Eof(p) => pick(&p, &spawned).map(|id| ToGuest::Process(ProcessRequest::StdinEof { id })),
            Step::Credit(p, bytes) => {
                pick(&p, &spawned).map(|id| ToGuest::Process(ProcessRequest::Credit { id, bytes }))
            }
            Step::Signal(p, signal) => {
                pick(&p, &spawned).map(|id| ToGuest::Process(ProcessRequest::Signal { id, signal }))
            }
            Step::Stdin(p, n) => pick(&p, &spawned)
                .map(|id| ToGuest::Process(ProcessRequest::Stdin { id, data: vec![b'i'; usize::from(n)].into() })),
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_host_sequence_ends_cleanly_and_keeps_the_rules(
        steps in prop::collection::vec(step(), 0..32),
    ) {
        let msgs = messages(steps);
        let got = session(&msgs)?;
        check(&msgs, &got)?;
    }

    #[test]
    fn an_attach_socket_request_never_decodes_on_the_link(
        before in prop::collection::vec(arbitrary::link_to_guest(1..5, commands()), 0..4),
        request in arbitrary::supervisor_request(1..5),
    ) {
        // Those before it may break the link first; either way it never ends cleanly (a shutdown before it
        // would: none is sent).
        let before: Vec<ToGuest> =
            before.into_iter().filter(|m| !matches!(m, ToGuest::Vm(VmRequest::Shutdown { .. }))).collect();
        let mut frames: Vec<Vec<u8>> = before.iter().map(encoded).collect();
        let mut wire = Vec::new();
        frame::encode(&ToSupervisor::Supervisor(request), &mut wire).unwrap();
        frames.push(wire);
        let (got, clean) = session_of(&frames)?;
        prop_assert!(!clean, "the link ended cleanly after an attach-socket request");
        check(&before, &got)?;
    }
}

fn encoded(msg: &ToGuest) -> Vec<u8> {
    let mut wire = Vec::new();
    frame::encode(msg, &mut wire).unwrap();
    wire
}
