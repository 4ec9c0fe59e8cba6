//! The OpenMetrics text of the node's metrics: the process-wide event metrics and the
//! node's present state, read at scrape time. Names are those agentvm has always exposed
//! (a counter registered as `agentvm_executions` is written `agentvm_executions_total`).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use super::{Labels, Metrics};

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the node is now, read at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeState {
    /// Active sessions by compute state (`live`, `cold`, `none`).
    pub sessions: Vec<(String, u64)>,
    /// Running VMMs: (session, proportional set size in bytes).
    pub vmms: Vec<(String, u64)>,
    /// Each VMM's memory as a series of its own, labelled with its session (opt-in).
    pub per_session: bool,
    /// Free bytes of the directories the node writes (`state`, `ram`).
    pub disk_free: Vec<(&'static str, u64)>,
}

/// A gauge family of `(label value, value)` under label `label`.
fn by_label<'a>(
    label: &str,
    values: impl IntoIterator<Item = (&'a str, u64)>,
) -> Family<Labels, Gauge<u64, std::sync::atomic::AtomicU64>> {
    let family = Family::<Labels, Gauge<u64, std::sync::atomic::AtomicU64>>::default();
    for (value, n) in values {
        family
            .get_or_create(&vec![super::label(label, value)])
            .set(n);
    }
    family
}

fn gauge(n: u64) -> Gauge<u64, std::sync::atomic::AtomicU64> {
    let gauge = Gauge::<u64, std::sync::atomic::AtomicU64>::default();
    gauge.set(n);
    gauge
}

pub fn render(m: &Metrics, state: &NodeState) -> String {
    let mut r = Registry::default();
    r.register(
        "agentvm_build",
        "The agentvmd build",
        Info::new(vec![(
            "version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        )]),
    );
    r.register(
        "agentvm_sessions",
        "Active sessions by compute state",
        by_label(
            "compute_state",
            state.sessions.iter().map(|(s, n)| (s.as_str(), *n)),
        ),
    );
    r.register(
        "agentvm_vmms",
        "VMM processes running on this node",
        gauge(state.vmms.len() as u64),
    );
    r.register(
        "agentvm_vmm_memory_pss_bytes",
        "Proportional set size of every running VMM together (guest RAM they touched included)",
        gauge(state.vmms.iter().map(|(_, pss)| pss).sum()),
    );
    if state.per_session {
        r.register(
            "agentvm_vmm_session_memory_pss_bytes",
            "Proportional set size of each session's VMM (metrics_session_labels)",
            by_label(
                "session",
                state.vmms.iter().map(|(s, pss)| (s.as_str(), *pss)),
            ),
        );
    }
    r.register(
        "agentvm_disk_free_bytes",
        "Free space of the directories the node writes (state: journal and snapshots; ram: guest memory)",
        by_label("dir", state.disk_free.iter().copied()),
    );
    for (name, help, h) in [
        (
            "agentvm_journal_append_seconds",
            "Journal append latency, commit (and fsync) included",
            &m.journal_append,
        ),
        (
            "agentvm_vmm_boot_seconds",
            "VMM spawn to guest ready, for a fresh boot",
            &m.vmm_boot,
        ),
        (
            "agentvm_vmm_restore_seconds",
            "VMM spawn to guest ready, for a restore from a snapshot (forks included)",
            &m.vmm_restore,
        ),
        (
            "agentvm_vmm_snapshot_seconds",
            "Pause to snapshot written, for a suspend or a fork's checkpoint",
            &m.vmm_snapshot,
        ),
        (
            "agentvm_fork_seconds",
            "Fork RPCs, checkpoint and every child included",
            &m.fork,
        ),
    ] {
        r.register(name, help, h.0.clone());
    }
    r.register(
        "agentvm_executions",
        "Executions run (live, recovered) by how they ended",
        m.executions.family.clone(),
    );
    r.register(
        "agentvm_fork_children",
        "Sessions created by Fork",
        m.fork_children.clone(),
    );
    r.register(
        "agentvm_vmm_lost",
        "VMMs that exited without being asked to",
        m.vmm_lost.clone(),
    );
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &r);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_line_parses_and_labels_are_escaped() {
        let m = Metrics::new();
        m.executions.inc("completed");
        m.journal_append
            .observe(std::time::Duration::from_millis(2));
        let mut state = NodeState {
            sessions: vec![("live".into(), 2)],
            vmms: vec![("we\"ird\\".into(), 1024), ("b".into(), 1)],
            disk_free: vec![("state", 4096)],
            per_session: false,
        };
        let text = render(&m, &state);
        assert!(text.contains("agentvm_vmm_memory_pss_bytes 1025"), "{text}");
        assert!(
            !text.contains("session="),
            "no session labels unless asked: {text}"
        );
        state.per_session = true;
        let text = render(&m, &state);
        assert!(
            text.contains("agentvm_build_info{version=\"0.1.0\"} 1"),
            "{text}"
        );
        assert!(text.contains("agentvm_sessions{compute_state=\"live\"} 2"));
        assert!(text.contains("agentvm_disk_free_bytes{dir=\"state\"} 4096"));
        assert!(text.contains("session=\"we\\\"ird\\\\\"} 1024"), "{text}");
        assert!(text.contains("agentvm_journal_append_seconds_bucket{le=\"+Inf\"} 1"));
        assert!(text.contains("agentvm_executions_total{outcome=\"completed\"} 1"));
        assert!(text.contains("agentvm_fork_children_total 0"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
            assert!(line.starts_with("agentvm_"), "{line}");
        }
    }

    #[test]
    fn exemplars_name_a_session_only_when_asked() {
        let m = Metrics::new();
        m.fork
            .observe_of(std::time::Duration::from_millis(3), "sess-a");
        assert!(!render(&m, &NodeState::default()).contains("sess-a"));
        super::super::name_sessions_in_exemplars(true);
        m.fork
            .observe_of(std::time::Duration::from_millis(3), "sess-b");
        super::super::name_sessions_in_exemplars(false);
        let text = render(&m, &NodeState::default());
        assert!(
            text.lines()
                .any(|l| l.starts_with("agentvm_fork_seconds_bucket")
                    && l.contains("# {session=\"sess-b\"} 0.003")),
            "{text}"
        );
    }
}
