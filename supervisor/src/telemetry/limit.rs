//! How much telemetry a sandbox may produce: a token bucket per sandbox over the events the guest or a client
//! can cause. Lifecycle events and the reports of what was dropped always pass; everything else beyond the
//! rate is dropped and counted, and the count goes out as one Detection Finding per interval.

use std::time::{Duration, Instant};

use crate::bucket::TokenBucket;

/// Events per second, sustained: a busy workload starting a thousand processes a second stays under it.
pub const RATE_PER_SEC: u32 = 2_000;
/// Events allowed in a burst.
pub const BURST: u32 = 20_000;
/// How often a non-zero drop count is reported.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// The bucket, and what it dropped.
#[derive(Debug)]
pub struct Limiter {
    bucket: TokenBucket,
    last_report: Instant,
    /// Dropped in all.
    pub dropped: u64,
}

impl Limiter {
    /// A full bucket; `enabled` off only in the `no-telemetry-limits` control.
    pub fn new(enabled: bool, now: Instant) -> Self {
        let bucket = if enabled { TokenBucket::new(BURST, RATE_PER_SEC, now) } else { TokenBucket::unlimited(now) };
        Self { bucket, last_report: now, dropped: 0 }
    }

    /// Whether one more event may go out at `now`; counts it when not.
    pub fn admit(&mut self, now: Instant) -> bool {
        let admitted = self.bucket.take(now);
        if !admitted {
            self.dropped += 1;
        }
        admitted
    }

    /// The count to report now, if any: what the bucket held back plus `other` (events dropped elsewhere and
    /// not reported yet), at most once per [`REPORT_INTERVAL`], or whatever is left when `last`. `None`
    /// leaves `other` to the caller, to report next time.
    pub fn report(&mut self, now: Instant, last: bool, other: u64) -> Option<u64> {
        let due = last || now.saturating_duration_since(self.last_report) >= REPORT_INTERVAL;
        if !due {
            return None;
        }
        let unreported = self.bucket.take_held().saturating_add(other);
        if unreported == 0 {
            return None;
        }
        self.last_report = now;
        Some(unreported)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rate_holds_and_drops_are_reported_once_per_interval() {
        let t0 = Instant::now();
        let mut l = Limiter::new(true, t0);
        let passed = (0..BURST + 100).filter(|_| l.admit(t0)).count();
        assert_eq!(passed, BURST as usize);
        assert_eq!(l.report(t0, false, 0), None, "not yet due");
        let later = t0 + REPORT_INTERVAL;
        assert_eq!(l.report(later, false, 0), Some(100));
        assert_eq!(l.report(later, false, 0), None, "reported once");
        assert_eq!(l.report(later, false, 7), None, "drops elsewhere wait for the interval too");
        assert_eq!(l.report(later, true, 7), Some(7), "and are reported even when the bucket dropped nothing");
        let one_second = later + Duration::from_secs(1);
        let refilled = (0..RATE_PER_SEC * 2).filter(|_| l.admit(one_second)).count();
        assert!(refilled >= RATE_PER_SEC as usize && refilled <= BURST as usize);
        assert!(Limiter::new(false, t0).admit(t0), "the control passes everything");
    }
}
