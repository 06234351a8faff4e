//! The one place the agent needs `unsafe`: code that runs in a forked child before `exec`.
#![allow(unsafe_code)]

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the child a session leader whose controlling terminal is its stdin (the PTY's slave side), so
/// the terminal's signals (Ctrl-C, SIGWINCH) reach its foreground process group.
pub(crate) fn controlling_terminal(cmd: &mut Command) {
    // SAFETY: `pre_exec` closures run in the child between fork and exec, where only async-signal-safe
    // work is allowed. This one makes two raw syscalls through rustix (setsid, ioctl TIOCSCTTY), allocates
    // nothing, takes no locks and touches no state shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::setsid()?;
            rustix::process::ioctl_tiocsctty(rustix::stdio::stdin())?;
            Ok(())
        });
    }
}
