//! Status lines to the driver, on stdout (stdin is the liveness pipe).

use std::io::Write;

use vm_contract::status::SupervisorStatus;

/// Writes one status line. A driver that stopped reading loses nothing it needs: it learns the outcome from
/// the exit status, so a failed write is ignored.
pub fn report(status: &SupervisorStatus) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(status.to_line().as_bytes());
    let _ = out.flush();
}
