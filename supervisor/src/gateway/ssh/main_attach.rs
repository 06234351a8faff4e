//! The `openshell-main` subsystem (`openshell sandbox connect`): a channel attached to the main process.
//! What it printed is replayed, then followed live; the first attachment holds its input, later ones watch
//! (and are told so). Ctrl-P Ctrl-Q, or the channel's end, detaches and leaves it running; its end ends the
//! channel with its status.

use bytes::Bytes;
use russh::server::Msg;
use russh::{Channel, ChannelMsg, ChannelWriteHalf};
use tokio::sync::broadcast::error::RecvError;
use vm_protocol::{PtySize, Stream};

use super::process::{end, Setup};
use super::signal_name;
use crate::gateway::main_process::{Chunk, MainSession};

/// The detach sequence: Ctrl-P, Ctrl-Q.
const DETACH: [u8; 2] = [0x10, 0x11];

/// Serves the attachment until the client detaches or the main process ends.
pub async fn run(channel: Channel<Msg>, main: MainSession, setup: Setup) {
    let mut sub = main.subscribe();
    let input = main.take_input();
    let (mut read, write) = channel.split();
    if input.is_none() {
        let note = "vm-supervisor: another attachment holds the main process's input; this one only watches\n";
        let _ = write.extended_data_bytes(1, Bytes::from(note)).await;
    } else if let (Some(input), Some((_, size))) = (&input, setup.pty) {
        input.resize(size).await;
    }
    for chunk in sub.replay.drain(..) {
        if send(&write, chunk).await.is_err() {
            return;
        }
    }
    let mut last = 0u8;
    loop {
        tokio::select! {
            live = sub.live.recv() => match live {
                Ok(chunk) => {
                    if send(&write, chunk).await.is_err() {
                        return;
                    }
                }
                Err(RecvError::Lagged(_)) => {
                    let _ = end(&write, "this attachment fell behind the main process's output", 255).await;
                    return;
                }
                Err(RecvError::Closed) => break,
            },
            changed = sub.exit.changed() => {
                if changed.is_err() || sub.exit.borrow().is_some() {
                    break;
                }
            }
            msg = read.wait() => match msg {
                Some(ChannelMsg::Data { data }) => {
                    let Some(input) = &input else { continue };
                    let detach = data.windows(2).any(|w| w == DETACH) || (last == DETACH[0] && data.first() == Some(&DETACH[1]));
                    if detach {
                        return detached(&write).await;
                    }
                    last = data.last().copied().unwrap_or(last);
                    if !input.stdin(&data).await {
                        break;
                    }
                }
                Some(ChannelMsg::WindowChange { col_width, row_height, .. }) => {
                    if let Some(input) = &input {
                        input.resize(PtySize::from_client(row_height, col_width)).await;
                    }
                }
                Some(ChannelMsg::Signal { signal }) => {
                    if let (Some(input), Some(signal)) = (&input, signal_name(&signal)) {
                        input.signal(signal).await;
                    }
                }
                Some(ChannelMsg::Eof) | Some(ChannelMsg::Close) | None => return detached(&write).await,
                Some(_) => {}
            },
        }
    }
    // The main process ended: what is left of its output, then its status.
    while let Ok(chunk) = sub.live.try_recv() {
        if send(&write, chunk).await.is_err() {
            return;
        }
    }
    let code = (*sub.exit.borrow()).map_or(255, |status| u32::from(status.exit_code()));
    let _ = write.eof().await;
    let _ = write.exit_status(code).await;
    let _ = write.close().await;
}

async fn send(write: &ChannelWriteHalf<Msg>, chunk: Chunk) -> Result<(), russh::Error> {
    match chunk.stream {
        Stream::Stdout => write.data_bytes(chunk.data).await,
        Stream::Stderr => write.extended_data_bytes(1, chunk.data).await,
    }
}

/// The client let go: the main process runs on.
async fn detached(write: &ChannelWriteHalf<Msg>) {
    let _ = write.eof().await;
    let _ = write.exit_status(0).await;
    let _ = write.close().await;
}
