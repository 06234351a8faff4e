//! What a finished command (`vm-driver create`, `exec`, `image pull`, ...) said.

use std::process::{Command, Output, Stdio};

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

/// Runs `cmd` with `input` on its stdin, written from a thread of its own so that a command that answers
/// before it has read everything cannot stall; a command that exits without reading all of it breaks the
/// pipe, and its status says what happened.
pub fn with_stdin(cmd: &mut Command, input: &[u8]) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot run the command");
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &input));
    let out = child.wait_with_output().expect("the command did not finish");
    let _ = writer.join();
    out
}
