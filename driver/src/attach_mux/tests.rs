//! The shared connection against a scripted supervisor on a socket pair.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::UnixStream;
use tokio_util::codec::Framed;
use vm_protocol::attach::{SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::codec::FrameCodec;
use vm_protocol::{Capabilities, ExitStatus, ProcId, ProcessEvent, ProcessRequest, Spawn, Stream};

use super::{Conn, Lost, STREAM_FRAMES};

type Supervisor = Framed<UnixStream, FrameCodec<ToSupervisor, ToClient>>;

fn pair() -> (Conn, Supervisor, tokio::sync::oneshot::Receiver<()>) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (closed_tx, closed) = tokio::sync::oneshot::channel();
    let conn = Conn::start(ours, Capabilities::EXEC, false, move || {
        let _ = closed_tx.send(());
    });
    (conn, Framed::new(theirs, FrameCodec::new()), closed)
}

fn spawn(id: ProcId) -> ToSupervisor {
    ToSupervisor::Process(ProcessRequest::Spawn(Spawn {
        id,
        argv: vec!["x".into()],
        env: vec![],
        cwd: None,
        pty: None,
        output_window: 8,
        rlimits: Vec::new(),
        root: None,
    }))
}

fn out(id: u32, data: &[u8]) -> ProcessEvent {
    ProcessEvent::Output { id: ProcId(id), stream: Stream::Stdout, data: data.to_vec().into() }
}

async fn next(sup: &mut Supervisor) -> ToSupervisor {
    tokio::time::timeout(Duration::from_secs(5), sup.next()).await.unwrap().unwrap().unwrap()
}

async fn recv(p: &mut super::Process) -> Result<ProcessEvent, Lost> {
    tokio::time::timeout(Duration::from_secs(5), p.recv()).await.unwrap()
}

#[tokio::test]
async fn processes_get_increasing_ids_and_a_stalled_one_holds_up_no_other() {
    let (conn, mut sup, _closed) = pair();
    let mut slow = conn.open(8, spawn).await.unwrap();
    let mut fast = conn.open(8, spawn).await.unwrap();
    assert!(matches!(next(&mut sup).await, ToSupervisor::Process(ProcessRequest::Spawn(s)) if s.id == ProcId(1)));
    assert!(matches!(next(&mut sup).await, ToSupervisor::Process(ProcessRequest::Spawn(s)) if s.id == ProcId(2)));
    // The slow stream's whole window, in one-byte frames it never takes, then the fast one's life.
    for _ in 0..8 {
        sup.send(out(1, b"s").into()).await.unwrap();
    }
    sup.send(ToClient::Process(ProcessEvent::Started { id: ProcId(2), pid: 9, stdin_window: 0, output_window: 8 }))
        .await
        .unwrap();
    sup.send(ToClient::Process(ProcessEvent::Exited { id: ProcId(2), status: ExitStatus::Code(0) })).await.unwrap();
    assert!(matches!(recv(&mut fast).await, Ok(ProcessEvent::Started { pid: 9, .. })));
    assert!(matches!(recv(&mut fast).await, Ok(ProcessEvent::Exited { .. })));
    // Nothing of the slow one's was lost meanwhile.
    for _ in 0..8 {
        assert_eq!(recv(&mut slow).await, Ok(out(1, b"s")));
    }
    assert_eq!(conn.open_processes(), 2);
    drop(fast);
    assert_eq!(conn.open_processes(), 1, "a dropped stream leaves the connection");
}

#[tokio::test]
async fn a_queue_past_its_window_or_its_frames_ends_its_own_stream_only() {
    let (conn, mut sup, _closed) = pair();
    let mut bytes = conn.open(8, spawn).await.unwrap();
    let mut frames = conn.open(8, spawn).await.unwrap();
    let mut other = conn.open(8, spawn).await.unwrap();
    sup.send(out(1, b"12345678").into()).await.unwrap();
    sup.send(out(1, b"9").into()).await.unwrap();
    for _ in 0..=STREAM_FRAMES {
        sup.send(ToClient::Process(ProcessEvent::StdinCredit { id: ProcId(2), bytes: 1 })).await.unwrap();
    }
    sup.send(out(3, b"ok").into()).await.unwrap();
    assert_eq!(recv(&mut other).await, Ok(out(3, b"ok")));
    assert_eq!(recv(&mut bytes).await, Ok(out(1, b"12345678")), "what fitted is delivered");
    assert_eq!(recv(&mut bytes).await, Err(Lost::Overflow));
    for _ in 0..STREAM_FRAMES {
        assert!(matches!(recv(&mut frames).await, Ok(ProcessEvent::StdinCredit { .. })));
    }
    assert_eq!(recv(&mut frames).await, Err(Lost::Overflow));
    // Its process is let go of, and the connection carries on.
    frames.release(true).await;
    let detach = loop {
        match next(&mut sup).await {
            ToSupervisor::Process(ProcessRequest::Spawn(_)) => {}
            other => break other,
        }
    };
    assert_eq!(detach, ToSupervisor::Supervisor(SupervisorRequest::Detach { id: ProcId(2) }));
    assert!(!conn.is_closed());
}

#[tokio::test]
async fn a_broken_connection_ends_every_stream_and_refuses_new_ones() {
    let (conn, sup, closed) = pair();
    let mut a = conn.open(8, spawn).await.unwrap();
    let mut b = conn.open(8, spawn).await.unwrap();
    drop(sup);
    assert_eq!(recv(&mut a).await, Err(Lost::Connection));
    assert_eq!(recv(&mut b).await, Err(Lost::Connection));
    tokio::time::timeout(Duration::from_secs(5), closed).await.unwrap().unwrap();
    assert!(conn.is_closed());
    assert!(matches!(conn.open(8, spawn).await, Err(Lost::Connection)));
}
