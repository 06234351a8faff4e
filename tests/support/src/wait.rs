//! Polling against a deadline, instead of sleeping.

use std::time::{Duration, Instant};

/// Polls `check` every 10 ms until it holds or `limit` passes; whether it held (checked once more at the
/// end).
pub fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    check()
}
