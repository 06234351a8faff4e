//! A QMP client for QEMU's monitor: a saved VM's save, a template clone's restore ([`super::snapshot`]).
//! One JSON object a line each way, each line bounded, each answer awaited within a step's time; events
//! between replies are skipped. QEMU runs beside the guest: what it says is parsed, never trusted further.

use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::sync::LazyLock;
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// The most bytes of one monitor reply line.
const MAX_LINE: u64 = 64 * 1024;
/// How long each answer may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// `migrate-set-capabilities`' arguments that leave RAM in a file out of the stream (`x-ignore-shared`).
pub static IGNORE_SHARED: LazyLock<Value> =
    LazyLock::new(|| json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }));

/// Why the monitor failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// An answer took too long.
    #[error("QEMU's monitor did not answer in time at {0}")]
    Timeout(&'static str),
    /// QEMU's monitor failed, or answered with an error or something that is not QMP.
    #[error("QEMU's monitor refused or failed at {0}")]
    Monitor(&'static str),
}

/// A QMP connection, out of negotiation mode.
pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Qmp {
    /// Reads QEMU's greeting and leaves negotiation mode.
    pub async fn open(stream: UnixStream) -> Result<Self, QmpError> {
        let (read, writer) = stream.into_split();
        let mut qmp = Self { reader: BufReader::new(read), writer };
        let greeting = qmp.line("greeting").await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Monitor("greeting"));
        }
        qmp.execute("qmp_capabilities", Value::Null).await?;
        Ok(qmp)
    }

    /// Runs `command` and returns its `return` value.
    pub async fn execute(&mut self, command: &'static str, arguments: Value) -> Result<Value, QmpError> {
        let text = request(command, arguments);
        self.writer.write_all(text.as_bytes()).await.map_err(|_| QmpError::Monitor(command))?;
        self.answer(command).await
    }

    /// Hands `file` to QEMU under `name` (`getfd`, the descriptor sent with the command's bytes).
    pub async fn send_fd(&mut self, name: &str, file: &impl AsFd) -> Result<(), QmpError> {
        const COMMAND: &str = "getfd";
        let text = request(COMMAND, json!({ "fdname": name }));
        let stream: &UnixStream = self.writer.as_ref();
        let fds = [file.as_fd()];
        let send = || {
            let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut ancillary = SendAncillaryBuffer::new(&mut space);
            if !ancillary.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(std::io::ErrorKind::InvalidInput.into());
            }
            let slices = [std::io::IoSlice::new(text.as_bytes())];
            rustix::net::sendmsg(stream, &slices, &mut ancillary, SendFlags::NOSIGNAL).map_err(std::io::Error::from)
        };
        loop {
            stream.writable().await.map_err(|_| QmpError::Monitor(COMMAND))?;
            // `try_io` clears the readiness a would-block leaves, so the next wait is a real one.
            match stream.try_io(tokio::io::Interest::WRITABLE, send) {
                Ok(n) if n == text.len() => break,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                _ => return Err(QmpError::Monitor(COMMAND)),
            }
        }
        self.answer(COMMAND).await.map(drop)
    }

    /// The reply to `command`: its `return` value.
    async fn answer(&mut self, command: &'static str) -> Result<Value, QmpError> {
        loop {
            let reply = self.line(command).await?;
            if let Some(value) = reply.get("return") {
                return Ok(value.clone());
            }
            if reply.get("event").is_none() {
                return Err(QmpError::Monitor(command));
            }
        }
    }

    /// The next line, as JSON, within [`STEP_TIMEOUT`] and [`MAX_LINE`].
    async fn line(&mut self, step: &'static str) -> Result<Value, QmpError> {
        let mut text = String::new();
        let mut limited = (&mut self.reader).take(MAX_LINE);
        let read = limited.read_line(&mut text);
        match tokio::time::timeout(STEP_TIMEOUT, read).await {
            Ok(Ok(n)) if n > 0 && text.ends_with('\n') => {
                serde_json::from_str(&text).map_err(|_| QmpError::Monitor(step))
            }
            Ok(_) => Err(QmpError::Monitor(step)),
            Err(_) => Err(QmpError::Timeout(step)),
        }
    }
}

/// One request line.
fn request(command: &str, arguments: Value) -> String {
    let request = if arguments.is_null() {
        json!({ "execute": command })
    } else {
        json!({ "execute": command, "arguments": arguments })
    };
    let mut text = request.to_string();
    text.push('\n');
    text
}
