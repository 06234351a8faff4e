use std::time::Duration;

use futures_util::StreamExt;
use tokio::io::{AsyncRead, DuplexStream};
use tokio_util::codec::FramedRead;
use vm_protocol::attach::{Disconnect, SupervisorReply, ToClient, ToSupervisor};
use vm_protocol::codec::FrameCodec;
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, Stream};

use super::*;

fn byte(id: u32, stream: Stream, b: u8) -> ToClient {
    ToClient::Process(ProcessEvent::Output { id: ProcId(id), stream, data: vec![b].into() })
}

/// Byte `i` of a numbered flood.
fn nth(i: usize) -> u8 {
    u8::try_from(i % 251).unwrap()
}

/// Frame `i` of a flood whose streams take turns: stdout carries 0, stderr 1.
fn turn(i: usize) -> ToClient {
    if i.is_multiple_of(2) {
        byte(1, Stream::Stdout, 0)
    } else {
        byte(1, Stream::Stderr, 1)
    }
}

fn queued(outbox: &Outbox) -> Vec<ToClient> {
    outbox.0.lock().items.iter().cloned().collect()
}

fn full(pressure: &Pressure) -> usize {
    *pressure.0.borrow()
}

/// A queue whose writer has taken one frame and is stuck writing it to a client that reads nothing.
async fn stuck(pressure: &Pressure) -> (Outbox, DuplexStream, tokio::sync::oneshot::Receiver<()>) {
    let (client, server) = tokio::io::duplex(64);
    let (stalled_tx, stalled) = tokio::sync::oneshot::channel();
    let (outbox, _writer) = start(pressure, server, async move {
        let _ = stalled_tx.send(());
    });
    outbox
        .push(ToClient::Process(ProcessEvent::Output {
            id: ProcId(1),
            stream: Stream::Stdout,
            data: vec![0; 4096].into(),
        }))
        .unwrap();
    while !queued(&outbox).is_empty() {
        tokio::task::yield_now().await;
    }
    (outbox, client, stalled)
}

/// Every frame the client gets, to the end of the connection.
async fn read_all(client: impl AsyncRead + Unpin) -> Vec<ToClient> {
    FramedRead::new(client, FrameCodec::<ToClient, ToSupervisor>::new()).map(Result::unwrap).collect().await
}

#[tokio::test]
async fn one_byte_output_of_one_stream_is_joined_into_frames_up_to_the_data_limit() {
    let pressure = Pressure::default();
    let (outbox, _client, _) = stuck(&pressure).await;
    let bytes = 2 * MAX_DATA_BYTES + 10;
    for i in 0..bytes {
        outbox.push(byte(1, Stream::Stdout, nth(i))).unwrap();
    }
    let frames = queued(&outbox);
    let sizes: Vec<usize> = frames
        .iter()
        .map(|f| match f {
            ToClient::Process(ProcessEvent::Output { data, .. }) => data.len(),
            other => panic!("only output: {other:?}"),
        })
        .collect();
    assert_eq!(sizes, [MAX_DATA_BYTES, MAX_DATA_BYTES, 10], "one frame per megabyte");
    let joined: Vec<u8> = frames
        .iter()
        .flat_map(|f| if let ToClient::Process(ProcessEvent::Output { data, .. }) = f { data.to_vec() } else { vec![] })
        .collect();
    assert!(joined.iter().enumerate().all(|(i, b)| *b == nth(i)), "in order");
    assert_eq!(full(&pressure), 0, "three frames hold nothing back");
}

#[tokio::test]
async fn output_of_another_stream_or_process_or_after_an_exit_is_not_joined() {
    let pressure = Pressure::default();
    let (outbox, _client, _) = stuck(&pressure).await;
    for msg in [
        byte(1, Stream::Stdout, b'a'),
        byte(1, Stream::Stderr, b'b'),
        byte(2, Stream::Stderr, b'c'),
        byte(2, Stream::Stderr, b'd'),
        ToClient::Process(ProcessEvent::Exited { id: ProcId(2), status: ExitStatus::Code(0) }),
        byte(1, Stream::Stderr, b'e'),
    ] {
        outbox.push(msg).unwrap();
    }
    let expected = [
        byte(1, Stream::Stdout, b'a'),
        byte(1, Stream::Stderr, b'b'),
        ToClient::Process(ProcessEvent::Output { id: ProcId(2), stream: Stream::Stderr, data: b"cd".to_vec().into() }),
        ToClient::Process(ProcessEvent::Exited { id: ProcId(2), status: ExitStatus::Code(0) }),
        byte(1, Stream::Stderr, b'e'),
    ];
    assert_eq!(queued(&outbox), expected);
}

/// The false disconnect of issue 20: a flood of 1-byte frames that cannot be joined (two streams, taking
/// turns), to a client that reads them all. The guest side waits for room as the guest link does.
#[tokio::test]
async fn a_reading_client_gets_every_byte_of_a_one_byte_flood_and_is_never_cut() {
    const FRAMES: usize = 6 * TO_CLIENT_ITEMS;
    let pressure = Pressure::default();
    let (client, server) = tokio::io::duplex(4096);
    let (outbox, writer) = start(&pressure, server, async { panic!("a reading client was found stalled") });
    let reader = tokio::spawn(read_all(client));
    let mut held_back = 0;
    for i in 0..FRAMES {
        if full(&pressure) > 0 {
            held_back += 1;
        }
        pressure.room().await;
        outbox.push(turn(i)).unwrap();
    }
    outbox.push(ToClient::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(7) })).unwrap();
    drop(outbox);
    writer.await.unwrap();
    let frames = reader.await.unwrap();
    assert!(held_back > 0, "the guest was held back meanwhile");
    let (last, output) = frames.split_last().unwrap();
    assert_eq!(*last, ToClient::Process(ProcessEvent::Exited { id: ProcId(1), status: ExitStatus::Code(7) }));
    assert_eq!(output.len(), FRAMES, "every byte, in its own frame, in order");
    assert!(output.iter().enumerate().all(|(i, f)| *f == turn(i)));
    assert_eq!(full(&pressure), 0);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_reads_nothing_is_cut_after_the_stall_and_told_why() {
    let pressure = Pressure::default();
    let (outbox, client, stalled) = stuck(&pressure).await;
    let mut pushed = 0;
    while full(&pressure) == 0 {
        outbox.push(ToClient::Pong { nonce: pushed }).unwrap();
        pushed += 1;
    }
    assert_eq!(pushed, TO_CLIENT_ITEMS as u64 + 1, "full past the bound, not before");
    tokio::time::sleep(Duration::from_millis(STALL_MS - CHECK_MS)).await;
    assert!(outbox.0.lock().cut.is_none(), "not before the stall");
    tokio::time::sleep(Duration::from_millis(2 * CHECK_MS)).await;
    stalled.await.expect("the writer reports the stall to the loop");
    assert_eq!(full(&pressure), 0, "a cut client holds the guest no longer");
    assert!(queued(&outbox).is_empty(), "and its queue is let go of");
    let frames = read_all(client).await;
    assert_eq!(
        frames.last(),
        Some(&ToClient::Supervisor(SupervisorReply::Disconnected { reason: Disconnect::NotReading })),
        "the reason comes last"
    );
}

#[tokio::test]
async fn a_queue_twice_over_its_bounds_is_cut_at_once() {
    let pressure = Pressure::default();
    let (outbox, client, _) = stuck(&pressure).await;
    let mut pushed = 0u64;
    let cut = loop {
        match outbox.push(ToClient::Pong { nonce: pushed }) {
            Ok(()) => pushed += 1,
            Err(overflow) => break overflow,
        }
    };
    assert_eq!(cut, Overflow);
    assert_eq!(pushed, (HARD_FACTOR * TO_CLIENT_ITEMS) as u64);
    assert_eq!(full(&pressure), 0);
    assert_eq!(outbox.push(ToClient::Pong { nonce: 0 }), Ok(()), "later frames go nowhere");
    drop(outbox);
    let frames = read_all(client).await;
    assert_eq!(
        frames.last(),
        Some(&ToClient::Supervisor(SupervisorReply::Disconnected { reason: Disconnect::NotReading }))
    );
}

#[tokio::test]
async fn a_writer_that_ends_lets_go_of_the_guest() {
    let pressure = Pressure::default();
    let (outbox, client, _) = stuck(&pressure).await;
    for nonce in 0..=TO_CLIENT_ITEMS as u64 {
        outbox.push(ToClient::Pong { nonce }).unwrap();
    }
    assert_eq!(full(&pressure), 1);
    drop(client);
    tokio::time::timeout(Duration::from_secs(5), pressure.room()).await.expect("the guest may go on");
}
