//! Prometheus metrics (`agentvmd --metrics-listen HOST:PORT`, text format at `/metrics`).
//!
//! Event-driven figures (latencies, counts) are recorded where they happen into one
//! process-wide [`Metrics`]; figures about the node's present state (sessions by state,
//! VMMs, memory per VM) are read when scraped, so they are never stale.

pub mod exposition;
pub mod server;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Latency buckets in seconds: 100 µs to 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last counts what is above every bound.
    buckets: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(
            d.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// (upper bound, cumulative count) per bucket, then the sum in seconds and the count.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, f64, u64) {
        let mut cumulative = 0;
        let mut out = Vec::with_capacity(self.bounds.len() + 1);
        for (i, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            let bound = self.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            out.push((bound, cumulative));
        }
        (
            out,
            self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// Counters by one label value.
#[derive(Default)]
pub struct LabelledCounter(Mutex<BTreeMap<String, u64>>);

impl LabelledCounter {
    pub fn inc(&self, label: &str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(label.to_owned())
            .or_default() += 1;
    }
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

pub struct Metrics {
    pub journal_append: Histogram,
    pub vmm_boot: Histogram,
    pub vmm_restore: Histogram,
    pub vmm_snapshot: Histogram,
    pub fork: Histogram,
    /// Executions by how they ended: completed, parked, failed.
    pub executions: LabelledCounter,
    /// Fork children created.
    pub fork_children: AtomicU64,
    /// VMMs that died without being asked to.
    pub vmm_lost: AtomicU64,
}

impl Metrics {
    fn new() -> Self {
        Self {
            journal_append: Histogram::new(LATENCY_BUCKETS),
            vmm_boot: Histogram::new(LATENCY_BUCKETS),
            vmm_restore: Histogram::new(LATENCY_BUCKETS),
            vmm_snapshot: Histogram::new(LATENCY_BUCKETS),
            fork: Histogram::new(LATENCY_BUCKETS),
            executions: LabelledCounter::default(),
            fork_children: AtomicU64::new(0),
            vmm_lost: AtomicU64::new(0),
        }
    }
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_an_infinite_bucket() {
        let h = Histogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(3));
        let (buckets, sum, count) = h.snapshot();
        assert_eq!(buckets, [(0.001, 1), (0.01, 2), (f64::INFINITY, 3)]);
        assert_eq!(count, 3);
        assert!((sum - 3.0055).abs() < 1e-9);
    }
}
