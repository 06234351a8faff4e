//! This process's terminal and stdin, for `launch`, `exec` and `cp`: the terminal's size, raw mode while a
//! guest terminal is in use (so Ctrl-C travels as a byte and the guest's terminal turns it into SIGINT), and
//! stdin read on a dedicated thread (a blocking read cannot be cancelled, so it must not hold up the runtime)
//! into a small bounded queue.

use std::os::fd::AsFd;

use tokio::sync::mpsc;
use vm_protocol::driver_api::TerminalSize;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::PtySize;

/// This terminal's size, when stdin is one.
pub fn local_size() -> Option<TerminalSize> {
    let ws = rustix::termios::tcgetwinsize(std::io::stdin().as_fd()).ok()?;
    Some(TerminalSize { rows: u32::from(ws.ws_row), cols: u32::from(ws.ws_col) })
}

/// The same, as the guest link has it (24x80 when stdin is no terminal).
pub fn pty_size() -> PtySize {
    let size = local_size().unwrap_or_default();
    PtySize::from_client(size.rows, size.cols)
}

/// Puts the local terminal in raw mode until dropped.
#[derive(Debug)]
pub struct RawMode(nix::sys::termios::Termios);

impl RawMode {
    /// Raw mode, when stdin is a terminal.
    pub fn enter() -> Option<Self> {
        let stdin = std::io::stdin();
        let saved = nix::sys::termios::tcgetattr(stdin.as_fd()).ok()?;
        let mut raw = saved.clone();
        nix::sys::termios::cfmakeraw(&mut raw);
        nix::sys::termios::tcsetattr(stdin.as_fd(), nix::sys::termios::SetArg::TCSANOW, &raw).ok()?;
        Some(Self(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = nix::sys::termios::tcsetattr(std::io::stdin().as_fd(), nix::sys::termios::SetArg::TCSANOW, &self.0);
    }
}

/// Chunks of stdin; the channel closing is EOF. An unreadable stdin is treated as an empty one.
pub fn stdin_chunks() -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(4);
    let spawned = std::thread::Builder::new().name("stdin".into()).spawn(move || {
        use std::io::Read;
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; MAX_DATA_BYTES];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    });
    if spawned.is_err() {
        tracing::warn!("cannot start the stdin thread; the process gets an empty stdin");
    }
    rx
}
