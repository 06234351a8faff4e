//! The session socket: each supervisor opens a session here, authenticated by the token in its auth bundle,
//! and keeps it open. The sandbox is ready only while its session is up; the supervisor opens its readiness
//! listener only after the session is accepted, and closes it when the session is lost.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use vm_contract::session::{SessionHello, SessionNote, SessionReply};

use super::actor::Command;
use super::hub::Hub;

/// Binds the session socket (0600, in the private state directory).
///
/// # Errors
/// The socket cannot be bound.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Lets tests cut sessions: bumping `epoch` drops every open session (supervisors reconnect); while `paused`,
/// new sessions wait for their answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gate {
    /// Sessions opened before the last bump are dropped.
    pub epoch: u64,
    /// Hold new sessions.
    pub paused: bool,
}

/// Longest line a supervisor sends (a hello or a note); a peer that sends more is dropped.
const MAX_LINE_BYTES: u64 = 4096;
/// How long a connecting peer may take to say hello.
const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Accepts sessions forever. An accept error (such as running out of descriptors) is waited out, never
/// fatal: without this server no sandbox can become ready.
pub async fn serve(listener: UnixListener, hub: Arc<Hub>, gate: watch::Receiver<Gate>) {
    let our_uid = rustix::process::getuid().as_raw();
    let mut serial = 0u64;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                tracing::warn!("cannot accept a supervisor session; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        if stream.peer_cred().map_or(true, |c| c.uid() != our_uid) {
            tracing::warn!("refused a session from another user");
            continue;
        }
        serial += 1;
        tokio::spawn(session(stream, serial, Arc::clone(&hub), gate.clone()));
    }
}

async fn session(stream: UnixStream, serial: u64, hub: Arc<Hub>, mut gate: watch::Receiver<Gate>) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read.take(MAX_LINE_BYTES)).lines();
    let Ok(Ok(Some(first))) = tokio::time::timeout(HELLO_TIMEOUT, lines.next_line()).await else { return };
    if gate.wait_for(|g| !g.paused).await.is_err() {
        return;
    }
    // A hello that does not parse is refused like a wrong one: the peer learns nothing more.
    let hello = serde_json::from_str::<SessionHello>(&first).ok();
    let accepted = hello
        .as_ref()
        .and_then(|h| Some((hub.tokens.check(h)?, h.generation)))
        .and_then(|(id, generation)| Some((hub.registry.inbox(&id)?, id, generation)));
    let reply = match accepted {
        Some(_) => SessionReply { accepted: true, reason: String::new() },
        None => SessionReply { accepted: false, reason: "unknown sandbox, generation or token".into() },
    };
    let mut line = serde_json::to_vec(&reply).unwrap_or_default();
    line.push(b'\n');
    if write.write_all(&line).await.is_err() {
        return;
    }
    let Some((inbox, id, generation)) = accepted else {
        // Fixed text: what a refused peer presented is not ours to echo.
        tracing::warn!("refused a supervisor session");
        return;
    };
    let current = gate.borrow_and_update().epoch;
    loop {
        // Each line gets the full bound again.
        lines.get_mut().get_mut().set_limit(MAX_LINE_BYTES);
        tokio::select! {
            next = lines.next_line() => match next {
                Ok(Some(line)) => {
                    if let Ok(note) = serde_json::from_str::<SessionNote>(&line) {
                        let up = Command::Session { generation, serial, readiness: Some(note.readiness) };
                        let _ = inbox.send(up).await;
                    }
                }
                _ => break,
            },
            changed = gate.changed() => if changed.is_err() || gate.borrow().epoch != current { break },
        }
    }
    tracing::info!(sandbox = %id, "supervisor session closed");
    let _ = inbox.send(Command::Session { generation, serial, readiness: None }).await;
}
