//! The supervisor's session with `vm-driver serve`, and the readiness listener it gates.
//!
//! After boot the supervisor connects to the driver's session socket and presents its sandbox id,
//! generation and token (from the auth bundle). Only once the driver accepts does it open a TCP listener on
//! loopback, the readiness endpoint a gateway probes, and report its address. When the session is lost the
//! listener is closed (dropping it is the guard), and the supervisor reconnects with backoff; an accepted
//! reconnection opens it again, on the same port where possible. A refused session (wrong token or
//! generation) stops the sandbox.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, UnixStream};
use vm_contract::session::{SessionHello, SessionNote, SessionReply};

use crate::inbox::{Notice, Senders};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Where and as whom to open the session.
#[derive(Clone)]
pub struct SessionConfig {
    /// The driver's session socket.
    pub socket: PathBuf,
    /// What to present.
    pub hello: SessionHello,
}

impl std::fmt::Debug for SessionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionConfig").field("socket", &self.socket).field("hello", &self.hello).finish()
    }
}

/// Keeps the session up for as long as the sandbox runs. Reports `SessionRefused` and returns when the driver
/// refuses it.
pub async fn run(config: SessionConfig, senders: Senders) {
    let mut backoff = BACKOFF_MIN;
    let mut port = 0;
    loop {
        match connect(&config).await {
            Ok(Accepted::Yes(mut stream)) => {
                backoff = BACKOFF_MIN;
                match open_readiness(port).await {
                    Ok((listener, addr)) => {
                        port = addr.port();
                        let note = SessionNote { readiness: addr.to_string() };
                        let _ = write_line(&mut stream, &note).await;
                        let _ = senders.notices.send(Notice::SessionUp(addr.to_string())).await;
                        tokio::select! {
                            () = serve_probes(listener) => {}
                            () = closed(&mut stream) => {}
                        }
                        // The listener is gone with the select: connections are refused from here on.
                        let _ = senders.notices.send(Notice::SessionDown).await;
                    }
                    Err(_) => tracing::error!("cannot open the readiness listener"),
                }
            }
            Ok(Accepted::No(reason)) => {
                tracing::error!(reason = %reason, "the driver refused this supervisor's session");
                let _ = senders.notices.send(Notice::SessionRefused).await;
                return;
            }
            Err(_) => {}
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

enum Accepted {
    Yes(UnixStream),
    No(String),
}

async fn connect(config: &SessionConfig) -> std::io::Result<Accepted> {
    let mut stream = UnixStream::connect(&config.socket).await?;
    write_line(&mut stream, &config.hello).await?;
    let mut line = String::new();
    BufReader::new(&mut stream).read_line(&mut line).await?;
    let reply: SessionReply = serde_json::from_str(&line).map_err(std::io::Error::other)?;
    Ok(if reply.accepted { Accepted::Yes(stream) } else { Accepted::No(reply.reason) })
}

async fn write_line<T: serde::Serialize>(stream: &mut UnixStream, value: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line).await
}

/// Loopback, on `port` if it is still free (so a gateway's probe address survives a reconnection).
async fn open_readiness(port: u16) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = match TcpListener::bind(("127.0.0.1", port)).await {
        Ok(l) => l,
        Err(_) => TcpListener::bind(("127.0.0.1", 0)).await?,
    };
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// Accepts and closes probe connections.
async fn serve_probes(listener: TcpListener) {
    while let Ok((conn, _)) = listener.accept().await {
        drop(conn);
    }
}

/// Returns when the driver closes the session.
async fn closed(stream: &mut UnixStream) {
    let mut buf = [0u8; 64];
    loop {
        match tokio::io::AsyncReadExt::read(stream, &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}
