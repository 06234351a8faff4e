//! The operator's upstream proxy (`--egress-proxy`): every connection leaves through it as an HTTP CONNECT
//! to the address this supervisor already resolved and checked, never to a name the proxy would resolve
//! again. Its credentials come from the auth bundle, never argv.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest answer head read from the proxy.
const MAX_ANSWER_BYTES: usize = 8 * 1024;
/// How long the proxy has to answer the CONNECT.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the proxy is, and how to authenticate to it.
#[derive(Clone)]
pub struct Upstream {
    /// `host:port` of the proxy.
    pub address: String,
    /// A `Proxy-Authorization` value (`Basic ...`), from the auth bundle.
    pub authorization: Option<String>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream").field("address", &self.address).field("authorization", &"..").finish()
    }
}

/// Why the proxy did not open the tunnel (fixed text).
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Connecting to, or talking with, the proxy failed.
    #[error("cannot reach the upstream proxy")]
    Io(#[from] std::io::Error),
    /// It did not answer in time, or answered more than a head.
    #[error("the upstream proxy did not answer in time")]
    NoAnswer,
    /// It answered, but not 200.
    #[error("the upstream proxy refused the connection")]
    Refused,
}

impl Upstream {
    /// A tunnel to `addr` through the proxy.
    ///
    /// # Errors
    /// [`UpstreamError`].
    pub async fn connect(&self, addr: SocketAddr) -> Result<TcpStream, UpstreamError> {
        let mut stream = TcpStream::connect(&self.address).await?;
        let mut head = format!("CONNECT {addr} HTTP/1.1\r\nHost: {addr}\r\n");
        if let Some(auth) = &self.authorization {
            head.push_str(&format!("Proxy-Authorization: {auth}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await?;
        let answer = tokio::time::timeout(ANSWER_TIMEOUT, read_head(&mut stream))
            .await
            .map_err(|_| UpstreamError::NoAnswer)??;
        let status = answer.split(|b| *b == b' ').nth(1).unwrap_or_default();
        if status != b"200" {
            return Err(UpstreamError::Refused);
        }
        Ok(stream)
    }
}

/// Reads the answer's head byte by byte, so nothing of the tunnel after it is taken.
async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, UpstreamError> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() == MAX_ANSWER_BYTES {
            return Err(UpstreamError::NoAnswer);
        }
        let byte = stream.read_u8().await?;
        head.push(byte);
    }
    Ok(head)
}
