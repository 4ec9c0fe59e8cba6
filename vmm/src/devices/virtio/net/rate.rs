//! Token buckets with Cloud Hypervisor's (Firecracker's) semantics, used for policing: a
//! frame the buckets cannot pay for is dropped, never queued.
//!
//! A bucket holds `size` tokens and refills from empty in `refill_time` ms, continuously;
//! it starts full, with `one_time_burst` extra tokens spent before any of the regular ones.
//! A frame costing more than the whole bucket passes only when the bucket is full, and the
//! bucket then owes the difference (it refills from below zero), as Firecracker's
//! over-consumption does.
//!
//! The time is always passed in, so tests drive the buckets with a clock of their own.

use std::time::Instant;

use agentvm_vmm_api::config::{RateLimiterConfig, TokenBucket as BucketConfig};

/// One bucket. Amounts are kept in token-nanoseconds (tokens × the refill period in ns), so
/// a refill of `elapsed` ns adds exactly `elapsed × size` and nothing is lost to rounding.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    size: u64,
    refill_ns: i128,
    /// What the bucket holds, in token-nanoseconds; below zero after an over-consumption.
    budget: i128,
    burst: u64,
    last_refill: Instant,
}

impl TokenBucket {
    /// A full bucket, or `None` for a size of 0 (no limit, as in Cloud Hypervisor).
    pub fn new(config: &BucketConfig, now: Instant) -> Option<Self> {
        if config.size == 0 || config.refill_time == 0 {
            return None;
        }
        let refill_ns = i128::from(config.refill_time) * 1_000_000;
        Some(Self {
            size: config.size,
            refill_ns,
            budget: i128::from(config.size) * refill_ns,
            burst: config.one_time_burst.unwrap_or(0),
            last_refill: now,
        })
    }

    fn full(&self) -> i128 {
        i128::from(self.size) * self.refill_ns
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last_refill).as_nanos();
        self.last_refill = self.last_refill.max(now);
        let added = i128::try_from(elapsed)
            .ok()
            .and_then(|ns| ns.checked_mul(i128::from(self.size)))
            .unwrap_or(i128::MAX);
        self.budget = self.budget.saturating_add(added).min(self.full());
    }

    /// Whether `tokens` can be taken now (after refilling to `now`).
    fn can_take(&mut self, tokens: u64, now: Instant) -> bool {
        self.refill(now);
        // Larger than the bucket: it needs the bucket full (see the module docs).
        let needed = tokens.min(self.size);
        let from_burst = needed.min(self.burst);
        i128::from(needed - from_burst) * self.refill_ns <= self.budget
    }

    /// Takes `tokens`, the one-time burst first; call after `can_take` said yes.
    fn take(&mut self, tokens: u64) {
        let from_burst = tokens.min(self.burst);
        self.burst -= from_burst;
        self.budget -= i128::from(tokens - from_burst) * self.refill_ns;
    }

    /// Tokens available now, for tests and diagnostics (the burst included; a debt is 0).
    #[cfg(test)]
    fn available(&self) -> u64 {
        let regular = (self.budget.max(0) / self.refill_ns) as u64;
        regular.saturating_add(self.burst)
    }
}

/// The buckets of one direction: bytes and frames.
#[derive(Debug, Clone, Default)]
pub struct RateLimiter {
    bandwidth: Option<TokenBucket>,
    ops: Option<TokenBucket>,
}

impl RateLimiter {
    /// Full buckets as `config` describes (no limit without one).
    pub fn new(config: Option<&RateLimiterConfig>, now: Instant) -> Self {
        let bucket = |b: &Option<BucketConfig>| b.as_ref().and_then(|b| TokenBucket::new(b, now));
        match config {
            Some(config) => Self {
                bandwidth: bucket(&config.bandwidth),
                ops: bucket(&config.ops),
            },
            None => Self::default(),
        }
    }

    /// Whether a frame of `bytes` may pass now; if so its bytes and its one op are paid.
    /// A frame refused pays nothing.
    pub fn allow(&mut self, bytes: u64, now: Instant) -> bool {
        let bytes_ok = self
            .bandwidth
            .as_mut()
            .is_none_or(|b| b.can_take(bytes, now));
        let ops_ok = self.ops.as_mut().is_none_or(|b| b.can_take(1, now));
        if !(bytes_ok && ops_ok) {
            return false;
        }
        if let Some(b) = &mut self.bandwidth {
            b.take(bytes);
        }
        if let Some(b) = &mut self.ops {
            b.take(1);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn bucket(size: u64, burst: Option<u64>, refill_ms: u64) -> BucketConfig {
        BucketConfig {
            size,
            one_time_burst: burst,
            refill_time: refill_ms,
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_bucket_starts_full_refills_over_its_period_and_never_past_full() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(&bucket(1000, None, 100), t0).unwrap();
        assert_eq!(b.available(), 1000);
        assert!(b.can_take(1000, t0));
        b.take(1000);
        assert!(!b.can_take(1, t0));
        // 10 ms is a tenth of the period: 100 tokens.
        assert!(b.can_take(100, t0 + ms(10)));
        assert!(!b.can_take(101, t0 + ms(10)));
        assert_eq!(b.available(), 100);
        // Fractions add up exactly: 3 × 1/3 ms of a 1000/100 ms bucket is 10 tokens.
        let third = Duration::from_nanos(333_334);
        b.refill(t0 + ms(10) + third);
        b.refill(t0 + ms(10) + third * 2);
        b.refill(t0 + ms(10) + third * 3);
        assert_eq!(b.available(), 110);
        // Long idle: full, not more.
        b.refill(t0 + Duration::from_secs(3600));
        assert_eq!(b.available(), 1000);
        // A clock that goes backwards adds nothing.
        b.take(1000);
        b.refill(t0);
        assert_eq!(b.available(), 0);
    }

    #[test]
    fn the_one_time_burst_is_spent_first_and_once() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(&bucket(100, Some(500), 1000), t0).unwrap();
        assert_eq!(b.available(), 600);
        assert!(b.can_take(450, t0));
        b.take(450);
        assert_eq!(b.available(), 150, "50 burst + 100 regular");
        assert!(b.can_take(150, t0));
        b.take(150);
        assert_eq!(b.available(), 0);
        b.refill(t0 + Duration::from_secs(100));
        assert_eq!(b.available(), 100, "the burst does not come back");
    }

    #[test]
    fn a_frame_larger_than_the_bucket_needs_it_full_and_leaves_a_debt() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(&bucket(1000, None, 1000), t0).unwrap();
        assert!(b.can_take(1500, t0));
        b.take(1500);
        // 500 owed: after 0.5 s the bucket is back at zero, after 1.5 s full again.
        assert!(!b.can_take(1, t0 + ms(499)));
        assert!(b.can_take(1, t0 + ms(501)));
        assert!(!b.can_take(1500, t0 + ms(1400)));
        assert!(b.can_take(1500, t0 + ms(1500)));
    }

    #[test]
    fn size_zero_is_no_limit() {
        let t0 = Instant::now();
        assert!(TokenBucket::new(&bucket(0, Some(5), 10), t0).is_none());
        let mut unlimited = RateLimiter::new(None, t0);
        for _ in 0..10_000 {
            assert!(unlimited.allow(65535, t0));
        }
    }

    #[test]
    fn a_limiter_charges_both_buckets_or_neither() {
        let t0 = Instant::now();
        let config = RateLimiterConfig {
            bandwidth: Some(bucket(3000, None, 1000)),
            ops: Some(bucket(2, None, 1000)),
        };
        let mut limiter = RateLimiter::new(Some(&config), t0);
        assert!(limiter.allow(1000, t0));
        assert!(limiter.allow(1000, t0));
        // Bytes are left, frames are not: refused, and the bytes are not charged.
        assert!(!limiter.allow(100, t0));
        assert_eq!(limiter.bandwidth.as_ref().unwrap().available(), 1000);
        // Half a second: one more frame, 1500 more bytes.
        let later = t0 + ms(500);
        assert!(!limiter.allow(2600, later), "bytes short");
        assert_eq!(
            limiter.ops.as_ref().unwrap().available(),
            1,
            "frame not charged"
        );
        assert!(limiter.allow(2500, later));
        assert!(!limiter.allow(1, later));
    }

    #[test]
    fn huge_values_do_not_overflow() {
        let t0 = Instant::now();
        let config = RateLimiterConfig {
            bandwidth: Some(bucket(u64::MAX, Some(u64::MAX), 86_400_000)),
            ops: Some(bucket(u64::MAX, None, 1)),
        };
        let mut limiter = RateLimiter::new(Some(&config), t0);
        for i in 0..1000 {
            assert!(limiter.allow(65535, t0 + Duration::from_secs(i * 1_000_000)));
        }
        let mut slow = TokenBucket::new(&bucket(1, None, 86_400_000), t0).unwrap();
        assert!(slow.can_take(u64::MAX, t0));
        slow.take(u64::MAX);
        assert!(!slow.can_take(1, t0 + Duration::from_secs(1 << 40)));
    }
}
