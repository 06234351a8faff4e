//! The local terminal, for `-t` (`exec`, `launch`): its size, and raw mode while a guest terminal is in use,
//! so Ctrl-C travels as a byte and the guest's terminal turns it into SIGINT.

use std::os::fd::AsFd;

use vm_protocol::driver_api::TerminalSize;
use vm_protocol::PtySize;

/// This terminal's size, when stdin is one.
pub fn local_size() -> Option<TerminalSize> {
    let ws = rustix::termios::tcgetwinsize(std::io::stdin().as_fd()).ok()?;
    Some(TerminalSize { rows: u32::from(ws.ws_row), cols: u32::from(ws.ws_col) })
}

/// The same, as the guest link has it (24x80 when stdin is no terminal).
pub fn pty_size() -> PtySize {
    let size = local_size().unwrap_or_default();
    PtySize {
        rows: u16::try_from(size.rows).ok().filter(|r| *r > 0).unwrap_or(24),
        cols: u16::try_from(size.cols).ok().filter(|c| *c > 0).unwrap_or(80),
    }
}

/// Puts the local terminal in raw mode until dropped.
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
