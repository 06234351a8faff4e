//! The parent-liveness pipe: stdin is the read end of a pipe whose write end only the driver holds. When
//! the driver exits, however it exits, the kernel closes that end and this reader sees EOF.
//!
//! A dedicated thread does the blocking read, so a busy or stuck event loop cannot delay the verdict, and
//! nothing else ever reads stdin in this mode. A pooled supervisor first reads its claim line here
//! ([`vm_contract::claim`]); after it, the pipe is only the liveness pipe again.

use std::io::{BufRead, BufReader, Read};
use std::thread;

use tokio::sync::oneshot;
use vm_contract::claim::{Claim, ClaimError, MAX_LINE};

use crate::inbox::Senders;

/// The reader thread's niceness.
pub const LIVENESS_NICE: i32 = -10;

/// Where a pooled supervisor's claim goes once read.
pub type ClaimSender = oneshot::Sender<Result<Claim, ClaimError>>;

/// Starts the reader thread; with `claim`, it first reads one claim line and sends it there.
///
/// # Errors
/// The thread cannot be started.
pub fn watch_stdin(senders: Senders, claim: Option<ClaimSender>) -> std::io::Result<()> {
    thread::Builder::new().name("parent-liveness".into()).spawn(move || {
        // It sleeps until the driver dies, then must run at once, on a host whose control plane may be busy:
        // raised above it where permitted (root), as this thread only (Linux applies it per thread).
        let _ = rustix::process::setpriority_process(None, LIVENESS_NICE);
        let mut stdin = BufReader::new(std::io::stdin().lock());
        if let Some(claim) = claim {
            match read_claim(&mut stdin) {
                // EOF before a claim: the driver is gone.
                None => {}
                Some(read) => {
                    let _ = claim.send(read);
                    drain_until_eof(&mut stdin);
                }
            }
        } else {
            drain_until_eof(&mut stdin);
        }
        // The VM first, then the orderly rest.
        senders.vmm_kill.pull();
        senders.driver_gone();
    })?;
    Ok(())
}

/// One line of at most [`MAX_LINE`] bytes; `None` at EOF (or a read error) before its newline.
fn read_claim(stdin: &mut impl BufRead) -> Option<Result<Claim, ClaimError>> {
    let mut line = Vec::new();
    let read = stdin.by_ref().take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line).ok()?;
    match line.last() {
        Some(b'\n') => Some(Claim::from_line(&line)),
        _ if read > MAX_LINE => Some(Err(ClaimError::TooLong)),
        _ => None,
    }
}

fn drain_until_eof(stdin: &mut impl Read) {
    let mut buf = [0u8; 64];
    loop {
        match stdin.read(&mut buf) {
            // EOF or an error: either way the driver can no longer vouch for us.
            Ok(0) | Err(_) => return,
            Ok(_) => tracing::warn!("unexpected bytes on the parent-liveness pipe; ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_one_bounded_line() {
        let claim = Claim {
            sandbox_id: vm_contract::SandboxId::parse("b").unwrap(),
            session: Some(vm_contract::claim::ClaimSession {
                id: vm_contract::session::SessionId::from_bytes([1; 16]),
                socket: "/s".into(),
            }),
            generation: vm_contract::session::Generation(1),
            telemetry: vm_contract::telemetry::TelemetryConfig::default(),
            origin: vm_contract::claim::Origin::Pool,
        };
        let line = claim.to_line().unwrap();
        assert_eq!(read_claim(&mut line.as_bytes()), Some(Ok(claim)));
        // EOF mid-line is the driver gone, not a claim.
        assert_eq!(read_claim(&mut &line.as_bytes()[..5]), None);
        assert_eq!(read_claim(&mut &b""[..]), None);
        let long = vec![b'x'; MAX_LINE + 10];
        assert_eq!(read_claim(&mut long.as_slice()), Some(Err(ClaimError::TooLong)));
        assert_eq!(read_claim(&mut &b"nonsense\n"[..]), Some(Err(ClaimError::Malformed)));
    }
}
