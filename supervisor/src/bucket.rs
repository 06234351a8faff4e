//! The one rate limit of the supervisor: a token bucket, used wherever a guest or a client can make the
//! supervisor do something without end (events, findings, refused connections).
//!
//! A bucket holds at most `burst` tokens and gains `per_sec` a second; each act takes one. What finds the
//! bucket empty is counted as held back, so the next act that passes (or a summary) can say how many did not.
//! Time is an input, so the bucket is tested without a clock.

use std::time::{Duration, Instant};

/// Nanoseconds in a second: tokens are kept in billionths, so slow rates refill without rounding away.
const NANOS_PER_SEC: u128 = 1_000_000_000;

/// A token bucket and what it held back.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    /// Billionths of a token.
    level: u128,
    burst: u32,
    per_sec: u32,
    last: Instant,
    /// Held back since [`TokenBucket::take_held`] last ran.
    held: u64,
    /// `false` only for a test control that lifts a limit: every act passes.
    limited: bool,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens that gains `per_sec` a second.
    pub fn new(burst: u32, per_sec: u32, now: Instant) -> Self {
        Self { level: u128::from(burst) * NANOS_PER_SEC, burst, per_sec, last: now, held: 0, limited: true }
    }

    /// A bucket that never runs out (a test control that lifts the limit).
    pub fn unlimited(now: Instant) -> Self {
        Self { limited: false, ..Self::new(1, 1, now) }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last);
        self.last = self.last.max(now);
        let gained = elapsed.as_nanos().saturating_mul(u128::from(self.per_sec));
        self.level = self.level.saturating_add(gained).min(u128::from(self.burst) * NANOS_PER_SEC);
    }

    /// Takes one token at `now`: `true` when the act may go on; `false` (and counted) when the bucket is empty.
    pub fn take(&mut self, now: Instant) -> bool {
        if !self.limited {
            return true;
        }
        self.refill(now);
        if self.level >= NANOS_PER_SEC {
            self.level -= NANOS_PER_SEC;
            true
        } else {
            self.held = self.held.saturating_add(1);
            false
        }
    }

    /// Whether a token is there at `now` (without taking it).
    pub fn ready(&mut self, now: Instant) -> bool {
        if !self.limited {
            return true;
        }
        self.refill(now);
        self.level >= NANOS_PER_SEC
    }

    /// How many acts were held back since the last call; resets the count.
    pub fn take_held(&mut self) -> u64 {
        std::mem::take(&mut self.held)
    }

    /// When the next token will be there, from `now`.
    pub fn next_token_in(&mut self, now: Instant) -> Duration {
        self.refill(now);
        if !self.limited || self.level >= NANOS_PER_SEC || self.per_sec == 0 {
            return Duration::ZERO;
        }
        let missing = NANOS_PER_SEC - self.level;
        let nanos = missing.div_ceil(u128::from(self.per_sec));
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rate_holds_and_what_was_held_is_counted_once() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(16, 1, t0);
        assert_eq!((0..20).filter(|_| b.take(t0)).count(), 16);
        assert_eq!(b.take_held(), 4);
        assert_eq!(b.take_held(), 0, "counted once");
        assert!(!b.take(t0 + Duration::from_millis(999)), "not a whole token yet");
        assert!(b.take(t0 + Duration::from_secs(1)), "one a second");
        assert!(!b.take(t0 + Duration::from_secs(1)));
        let much_later = t0 + Duration::from_secs(3600);
        assert_eq!((0..100).filter(|_| b.take(much_later)).count(), 16, "never more than the burst");
    }

    #[test]
    fn fast_rates_refill_by_the_fraction_of_a_second_that_passed() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2000, 2000, t0);
        assert_eq!((0..3000).filter(|_| b.take(t0)).count(), 2000);
        let quarter = t0 + Duration::from_millis(250);
        assert_eq!((0..3000).filter(|_| b.take(quarter)).count(), 500);
        assert!(!b.ready(quarter));
        assert_eq!(b.next_token_in(quarter), Duration::from_micros(500));
    }

    #[test]
    fn time_going_backwards_gains_nothing_and_an_unlimited_bucket_always_passes() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(1, 1, t0);
        assert!(b.take(t0));
        assert!(!b.take(t0 - Duration::from_secs(5)), "an earlier instant refills nothing");
        let mut free = TokenBucket::unlimited(t0);
        assert!((0..10_000).all(|_| free.take(t0)));
        assert_eq!(free.take_held(), 0);
    }
}
