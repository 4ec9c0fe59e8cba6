//! Prometheus metrics (`agentvmd --metrics-listen HOST:PORT`, OpenMetrics text at
//! `/metrics`), kept with the maintained `prometheus-client` crate.
//!
//! Event-driven figures (latencies, counts) are recorded where they happen into one
//! process-wide [`Metrics`]; figures about the node's present state (sessions by state,
//! VMMs, memory per VM) are read when scraped, so they are never stale.

pub mod exposition;
pub mod server;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;

/// Latency buckets in seconds: 100 µs to 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// A metric's labels (and an exemplar's): name, value (escaped: see [`label`]).
pub type Labels = Vec<(String, String)>;

/// One label. prometheus-client writes label values as given, so they are escaped here as
/// the text formats require (a backslash, a double quote, a line feed).
pub fn label(name: &str, value: &str) -> (String, String) {
    let escaped = value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    (name.to_owned(), escaped)
}

/// Whether exemplars may name the session an observation was of (`--metrics-session-labels`:
/// like a per-session series, it names tenants' sessions to whoever scrapes).
static SESSION_EXEMPLARS: AtomicBool = AtomicBool::new(false);

/// Lets exemplars name sessions from now on.
pub fn name_sessions_in_exemplars(on: bool) {
    SESSION_EXEMPLARS.store(on, Ordering::Relaxed);
}

/// A latency histogram in seconds; the last observation of each bucket may carry the
/// session it was of as an exemplar (see [`name_sessions_in_exemplars`]).
#[derive(Clone)]
pub struct Latency(HistogramWithExemplars<Labels>);

impl Latency {
    fn new() -> Self {
        Self(HistogramWithExemplars::new(LATENCY_BUCKETS.iter().copied()))
    }

    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64(), None, None);
    }

    /// As [`Self::observe`], of session `session`.
    pub fn observe_of(&self, d: Duration, session: &str) {
        let exemplar = SESSION_EXEMPLARS
            .load(Ordering::Relaxed)
            .then(|| vec![label("session", session)]);
        self.0.observe(d.as_secs_f64(), exemplar, None);
    }
}

/// Counters by the value of one label.
#[derive(Clone)]
pub struct LabelledCounter {
    label: &'static str,
    family: Family<Labels, Counter>,
}

impl LabelledCounter {
    fn new(label: &'static str) -> Self {
        Self {
            label,
            family: Family::default(),
        }
    }

    pub fn inc(&self, value: &str) {
        self.family
            .get_or_create(&vec![label(self.label, value)])
            .inc();
    }
}

pub struct Metrics {
    pub journal_append: Latency,
    pub vmm_boot: Latency,
    pub vmm_restore: Latency,
    pub vmm_snapshot: Latency,
    pub fork: Latency,
    /// Executions by how they ended: completed, parked, failed.
    pub executions: LabelledCounter,
    /// Fork children created.
    pub fork_children: Counter,
    /// VMMs that died without being asked to.
    pub vmm_lost: Counter,
}

impl Metrics {
    fn new() -> Self {
        Self {
            journal_append: Latency::new(),
            vmm_boot: Latency::new(),
            vmm_restore: Latency::new(),
            vmm_snapshot: Latency::new(),
            fork: Latency::new(),
            executions: LabelledCounter::new("outcome"),
            fork_children: Counter::default(),
            vmm_lost: Counter::default(),
        }
    }
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}
