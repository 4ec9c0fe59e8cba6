//! `agentvm node status`: the node's capacity and make-up, as a fleet scheduler sees it.

use agentvm_proto::canon::to_proto_json;
use agentvm_proto::node::v1::node_client::NodeClient;
use agentvm_proto::node::v1::{DrainRequest, GetStatusRequest, ListNodesRequest, WarmImageRequest};
use agentvmd::config::ListenAddr;
use anyhow::Context;

use crate::connection::Connection;

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

type Client = NodeClient<agentvmd::client::AuthedChannel>;

async fn client(conn: &Connection) -> anyhow::Result<Client> {
    Ok(NodeClient::new(conn.connect().await?))
}

/// `agentvm node list`: the fleet as the node at `addr` sees it in the shared journal.
pub async fn list(conn: &Connection, json: bool) -> anyhow::Result<()> {
    let fleet = client(conn)
        .await?
        .list_nodes(ListNodesRequest {})
        .await?
        .into_inner();
    if json {
        outln!("{}", to_proto_json(&fleet).context("rendering JSON")?);
        return Ok(());
    }
    if fleet.nodes.is_empty() {
        outln!(
            "node {} keeps a journal of its own: it is not part of a fleet",
            fleet.this_node
        );
        return Ok(());
    }
    outln!(
        "{:<20} {:<6} {:>10}  {:<12} address",
        "node",
        "alive",
        "heartbeat",
        "sessions"
    );
    for n in &fleet.nodes {
        let status: serde_json::Value = serde_json::from_str(&n.status_json).unwrap_or_default();
        let count = |key: &str| {
            status
                .get(key)
                .and_then(|v| v.as_str())
                .unwrap_or("0")
                .to_owned()
        };
        let marker = if n.name == fleet.this_node {
            " (this)"
        } else {
            ""
        };
        outln!(
            "{:<20} {:<6} {:>8.1} s  {:<12} {}{marker}",
            n.name,
            if n.alive { "yes" } else { "no" },
            n.heartbeat_age_ms as f64 / 1000.0,
            format!("{} ({} live)", count("sessions"), count("sessionsLive")),
            n.address
        );
    }
    Ok(())
}

/// `agentvm node drain NAME`: asks node NAME (at the address the fleet gives for it, or
/// `addr` itself) to drain.
pub async fn drain(
    conn: &Connection,
    name: &str,
    timeout_secs: u32,
    json: bool,
) -> anyhow::Result<()> {
    let mut here = client(conn).await?;
    let fleet = here.list_nodes(ListNodesRequest {}).await?.into_inner();
    let mut target = if fleet.this_node == name {
        here
    } else {
        let node = fleet
            .nodes
            .iter()
            .find(|n| n.name == name)
            .with_context(|| {
                format!("no node {name:?} in the fleet of node {}", fleet.this_node)
            })?;
        let at: ListenAddr = node
            .address
            .parse()
            .map_err(|e| anyhow::anyhow!("node {name}'s address {:?}: {e}", node.address))?;
        client(&conn.at(at)).await?
    };
    let drained = target
        .drain(DrainRequest {
            name: name.to_owned(),
            timeout_secs,
        })
        .await?
        .into_inner();
    if json {
        outln!("{}", to_proto_json(&drained).context("rendering JSON")?);
    } else {
        outln!(
            "node {name} drained: {} suspended, {} released to the fleet",
            drained.suspended,
            drained.released
        );
        for failed in &drained.failed {
            outln!("not suspended: {failed}");
        }
    }
    anyhow::ensure!(
        drained.failed.is_empty(),
        "{} sessions could not be suspended",
        drained.failed.len()
    );
    Ok(())
}

pub async fn status(conn: &Connection, json: bool) -> anyhow::Result<()> {
    let s = client(conn)
        .await?
        .get_status(GetStatusRequest {})
        .await?
        .into_inner();
    if json {
        outln!("{}", to_proto_json(&s).context("rendering JSON")?);
        return Ok(());
    }
    outln!(
        "node        {} (agentvmd {})",
        s.hostname,
        s.agentvmd_version
    );
    outln!("kvm         {}", s.kvm_flavour);
    if s.microvm_unavailable.is_empty() {
        outln!("vmm         {} ({})", s.vmm_flavour, s.vmm_version);
    } else {
        outln!("vmm         none: {}", s.microvm_unavailable);
    }
    if s.microvm_unavailable.is_empty() {
        let isolation = match s.vmm_isolation.is_empty() {
            true => "none".to_owned(),
            false => s.vmm_isolation.join(", "),
        };
        outln!("isolation   {isolation}");
        outln!("restore     {}", s.vmm_restore);
    }
    outln!("cpus        {}", s.cpus);
    outln!(
        "memory      {} available of {}",
        mib(s.memory_available_bytes),
        mib(s.memory_total_bytes)
    );
    let ram = match s.microvm_unavailable.is_empty() {
        true => format!(", ram {}", mib(s.ram_dir_free_bytes)),
        false => String::new(),
    };
    outln!(
        "disk free   state {}{ram} (reserve {})",
        mib(s.state_dir_free_bytes),
        mib(s.min_free_disk_bytes)
    );
    outln!(
        "sessions    {} in the journal ({} recorded live)",
        s.sessions,
        s.sessions_live
    );
    let mut running: Vec<_> = s.running_sessions.iter().collect();
    running.sort();
    let total: u64 = running.iter().map(|(_, n)| **n).sum();
    let by_runtime: Vec<String> = running.iter().map(|(r, n)| format!("{n} {r}")).collect();
    match by_runtime.is_empty() {
        true => outln!("running     0 here"),
        false => outln!("running     {total} here: {}", by_runtime.join(", ")),
    }
    outln!("vmms        {} holding {}", s.vmms, mib(s.vmm_memory_bytes));
    if s.vmms_without_session > 0 {
        outln!(
            "            {} of them serve no running session (adopted after a restart, or \
             stopping)",
            s.vmms_without_session
        );
    }
    outln!(
        "capacity    ~{} more idle microVM sessions ({})",
        s.capacity_sessions,
        s.capacity_basis
    );
    outln!("harnesses   {}", s.harnesses.join(", "));
    for t in &s.templates {
        outln!(
            "template    {} {} ({}, {} session{}{})",
            t.harness,
            t.id,
            mib(t.bytes),
            t.sessions,
            if t.sessions == 1 { "" } else { "s" },
            if t.current {
                ""
            } else {
                ", old: goes with its last session"
            }
        );
    }
    if !s.vm_starts.is_empty() {
        let mut by_path = std::collections::BTreeMap::<&str, u64>::new();
        for path in s.vm_starts.values() {
            *by_path.entry(path.as_str()).or_default() += 1;
        }
        let paths: Vec<String> = by_path.iter().map(|(p, n)| format!("{n} {p}")).collect();
        outln!("vm starts   {}", paths.join(", "));
    }
    Ok(())
}

/// `agentvm image warm NAME`: the node makes the image's template now.
pub async fn warm(conn: &Connection, harness: &str, json: bool) -> anyhow::Result<()> {
    let warmed = client(conn)
        .await?
        .warm_image(WarmImageRequest {
            harness: harness.to_owned(),
        })
        .await?
        .into_inner();
    if json {
        outln!("{}", to_proto_json(&warmed).context("rendering JSON")?);
        return Ok(());
    }
    match warmed.made {
        true => outln!("{} made in {} ms", warmed.template, warmed.took_ms),
        false => outln!("{} (already there)", warmed.template),
    }
    Ok(())
}
