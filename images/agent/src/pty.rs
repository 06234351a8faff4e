//! Pseudo-terminals for processes that ask for one.

use std::io;
use std::os::fd::OwnedFd;

use rustix::fs::{Mode, OFlags};
use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
use rustix::termios::{tcsetwinsize, Winsize};
use vm_protocol::PtySize;

/// A PTY pair: the master stays with the agent, the slave becomes the process's stdio.
#[derive(Debug)]
pub(crate) struct Pty {
    pub(crate) master: OwnedFd,
    pub(crate) slave: OwnedFd,
}

impl Pty {
    /// Opens a new PTY of `size`.
    pub(crate) fn open(size: PtySize) -> io::Result<Self> {
        let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
        grantpt(&master)?;
        unlockpt(&master)?;
        let name = ptsname(&master, Vec::new())?;
        let slave = rustix::fs::open(name.as_c_str(), OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC, Mode::empty())?;
        resize(&master, size)?;
        Ok(Self { master, slave })
    }
}

/// Sets the terminal size; the kernel sends SIGWINCH to the foreground process group.
pub(crate) fn resize(master: &OwnedFd, size: PtySize) -> io::Result<()> {
    tcsetwinsize(master, Winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 })?;
    Ok(())
}
