//! The parent-liveness pipe: stdin is the read end of a pipe whose write end only the driver holds. When
//! the driver exits, however it exits, the kernel closes that end and this reader sees EOF.
//!
//! A dedicated thread does the blocking read, so a busy or stuck event loop cannot delay the verdict, and
//! nothing else ever reads stdin in this mode.

use std::io::Read;
use std::thread;

use crate::inbox::Senders;

/// The reader thread's niceness.
pub const LIVENESS_NICE: i32 = -10;

/// Starts the reader thread.
///
/// # Errors
/// The thread cannot be started.
pub fn watch_stdin(senders: Senders) -> std::io::Result<()> {
    thread::Builder::new().name("parent-liveness".into()).spawn(move || {
        // It sleeps until the driver dies, then must run at once, on a host whose control plane may be busy:
        // raised above it where permitted (root), as this thread only (Linux applies it per thread).
        let _ = rustix::process::setpriority_process(None, LIVENESS_NICE);
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 64];
        loop {
            match stdin.read(&mut buf) {
                // EOF or an error: either way the driver can no longer vouch for us.
                Ok(0) | Err(_) => break,
                Ok(_) => tracing::warn!("unexpected bytes on the parent-liveness pipe; ignored"),
            }
        }
        // The VM first, then the orderly rest.
        senders.vmm_kill.pull();
        senders.driver_gone();
    })?;
    Ok(())
}
