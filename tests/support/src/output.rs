//! What a finished command (`vm-driver create`, `exec`, `image pull`, ...) said.

use std::process::Output;

/// Its stdout (lossy UTF-8).
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Its stderr (lossy UTF-8).
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Its stdout then its stderr: all it said, as a terminal would show it.
pub fn text(out: &Output) -> String {
    format!("{}{}", stdout(out), stderr(out))
}

/// Asserts that the command succeeded (showing all it said if not); its stdout.
pub fn ok(out: Output) -> String {
    assert!(out.status.success(), "{}: {}\n{}", out.status, stdout(&out), stderr(&out));
    stdout(&out)
}
