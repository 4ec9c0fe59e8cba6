//! The Prometheus text format (version 0.0.4) of the node's metrics.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use super::{Histogram, Metrics};

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

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    family(out, name, "histogram", help);
    let (buckets, sum, count) = h.snapshot();
    for (bound, cumulative) in buckets {
        let le = if bound.is_infinite() {
            "+Inf".to_owned()
        } else {
            bound.to_string()
        };
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_sum {sum}");
    let _ = writeln!(out, "{name}_count {count}");
}

pub fn render(m: &Metrics, state: &NodeState) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "agentvm_build_info",
        "gauge",
        "The agentvmd build; always 1.",
    );
    let _ = writeln!(
        out,
        "agentvm_build_info{{version=\"{}\"}} 1",
        escape(env!("CARGO_PKG_VERSION"))
    );
    family(
        &mut out,
        "agentvm_sessions",
        "gauge",
        "Active sessions by compute state.",
    );
    for (compute_state, n) in &state.sessions {
        let _ = writeln!(
            out,
            "agentvm_sessions{{compute_state=\"{}\"}} {n}",
            escape(compute_state)
        );
    }
    family(
        &mut out,
        "agentvm_vmms",
        "gauge",
        "VMM processes running on this node.",
    );
    let _ = writeln!(out, "agentvm_vmms {}", state.vmms.len());
    family(
        &mut out,
        "agentvm_vmm_memory_pss_bytes",
        "gauge",
        "Proportional set size of every running VMM together (guest RAM they touched included).",
    );
    let total: u64 = state.vmms.iter().map(|(_, pss)| pss).sum();
    let _ = writeln!(out, "agentvm_vmm_memory_pss_bytes {total}");
    if state.per_session {
        family(
            &mut out,
            "agentvm_vmm_session_memory_pss_bytes",
            "gauge",
            "Proportional set size of each session's VMM (metrics_session_labels).",
        );
        for (session, pss) in &state.vmms {
            let _ = writeln!(
                out,
                "agentvm_vmm_session_memory_pss_bytes{{session=\"{}\"}} {pss}",
                escape(session)
            );
        }
    }
    family(
        &mut out,
        "agentvm_disk_free_bytes",
        "gauge",
        "Free space of the directories the node writes (state: journal and snapshots; ram: guest memory).",
    );
    for (dir, free) in &state.disk_free {
        let _ = writeln!(out, "agentvm_disk_free_bytes{{dir=\"{dir}\"}} {free}");
    }
    histogram(
        &mut out,
        "agentvm_journal_append_seconds",
        "Journal append latency, commit (and fsync) included.",
        &m.journal_append,
    );
    histogram(
        &mut out,
        "agentvm_vmm_boot_seconds",
        "VMM spawn to guest ready, for a fresh boot.",
        &m.vmm_boot,
    );
    histogram(
        &mut out,
        "agentvm_vmm_restore_seconds",
        "VMM spawn to guest ready, for a restore from a snapshot (forks included).",
        &m.vmm_restore,
    );
    histogram(
        &mut out,
        "agentvm_vmm_snapshot_seconds",
        "Pause to snapshot written, for a suspend or a fork's checkpoint.",
        &m.vmm_snapshot,
    );
    histogram(
        &mut out,
        "agentvm_fork_seconds",
        "Fork RPCs, checkpoint and every child included.",
        &m.fork,
    );
    family(
        &mut out,
        "agentvm_executions_total",
        "counter",
        "Executions run (live, recovered) by how they ended.",
    );
    for (outcome, n) in m.executions.snapshot() {
        let _ = writeln!(
            out,
            "agentvm_executions_total{{outcome=\"{}\"}} {n}",
            escape(&outcome)
        );
    }
    family(
        &mut out,
        "agentvm_fork_children_total",
        "counter",
        "Sessions created by Fork.",
    );
    let _ = writeln!(
        out,
        "agentvm_fork_children_total {}",
        m.fork_children.load(Ordering::Relaxed)
    );
    family(
        &mut out,
        "agentvm_vmm_lost_total",
        "counter",
        "VMMs that exited without being asked to.",
    );
    let _ = writeln!(
        out,
        "agentvm_vmm_lost_total {}",
        m.vmm_lost.load(Ordering::Relaxed)
    );
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
        assert!(text.contains("agentvm_sessions{compute_state=\"live\"} 2"));
        assert!(text.contains("agentvm_disk_free_bytes{dir=\"state\"} 4096"));
        assert!(text.contains("session=\"we\\\"ird\\\\\"} 1024"), "{text}");
        assert!(text.contains("agentvm_journal_append_seconds_bucket{le=\"+Inf\"} 1"));
        assert!(text.contains("agentvm_executions_total{outcome=\"completed\"} 1"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
            assert!(line.starts_with("agentvm_"), "{line}");
        }
    }
}
