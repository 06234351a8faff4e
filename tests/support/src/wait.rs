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

/// Polls `progress` (a count that only grows, perhaps costly to take) every 50 ms until it reaches `target`, for as long as it keeps
/// growing: the wait ends early only after `stall` without any progress, so a busy host that is slow but
/// moving is waited for, and a stuck one is not. The last count.
pub fn wait_for_count(target: usize, stall: Duration, mut progress: impl FnMut() -> usize) -> usize {
    let mut last = progress();
    let mut moved = Instant::now();
    while last < target && moved.elapsed() < stall {
        std::thread::sleep(Duration::from_millis(50));
        let now = progress();
        if now > last {
            last = now;
            moved = Instant::now();
        }
    }
    last
}
