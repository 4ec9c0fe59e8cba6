//! `agentvm node status`: the node's capacity and make-up, as a fleet scheduler sees it.

use agentvm_proto::canon::to_proto_json;
use agentvm_proto::node::v1::GetStatusRequest;
use agentvm_proto::node::v1::node_client::NodeClient;
use agentvmd::config::ListenAddr;
use anyhow::Context;

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

pub async fn status(
    addr: &ListenAddr,
    creds: &agentvmd::client::Credentials,
    json: bool,
) -> anyhow::Result<()> {
    let channel = agentvmd::client::connect_with(addr, creds).await?;
    let s = NodeClient::with_interceptor(channel, agentvmd::client::bearer(creds.token.clone())?)
        .get_status(GetStatusRequest {})
        .await?
        .into_inner();
    if json {
        println!("{}", to_proto_json(&s).context("rendering JSON")?);
        return Ok(());
    }
    println!(
        "node        {} (agentvmd {})",
        s.hostname, s.agentvmd_version
    );
    println!("kvm         {}", s.kvm_flavour);
    if s.microvm_unavailable.is_empty() {
        println!("vmm         {} ({})", s.vmm_flavour, s.vmm_version);
    } else {
        println!("vmm         none: {}", s.microvm_unavailable);
    }
    if s.microvm_unavailable.is_empty() {
        let isolation = match s.vmm_isolation.is_empty() {
            true => "none".to_owned(),
            false => s.vmm_isolation.join(", "),
        };
        println!("isolation   {isolation}");
    }
    println!("cpus        {}", s.cpus);
    println!(
        "memory      {} available of {}",
        mib(s.memory_available_bytes),
        mib(s.memory_total_bytes)
    );
    let ram = match s.microvm_unavailable.is_empty() {
        true => format!(", ram {}", mib(s.ram_dir_free_bytes)),
        false => String::new(),
    };
    println!(
        "disk free   state {}{ram} (reserve {})",
        mib(s.state_dir_free_bytes),
        mib(s.min_free_disk_bytes)
    );
    println!("sessions    {} ({} live)", s.sessions, s.sessions_live);
    println!("vmms        {} holding {}", s.vmms, mib(s.vmm_memory_bytes));
    println!(
        "capacity    ~{} more idle microVM sessions",
        s.capacity_sessions
    );
    println!("harnesses   {}", s.harnesses.join(", "));
    Ok(())
}
