//! Guest networking, for images with `[network] enabled`: each VM gets a tap in its VMM's
//! own network namespace, joined to the host by a veth pair and routed (no bridge, so no
//! VM sees another's frames). The VMM's network device enforces the egress policy on every
//! frame; names resolve through a resolver the node runs on the tap's address, which answers
//! only for allowed names and lets the addresses it answered with through the device.
//!
//! Addresses: the pool is cut into /29 slots, one per running VM. In slot `s` at `B`:
//! `B+1` the tap (the guest's gateway and name server), `B+2` the guest, `B+5` the host's
//! end of the veth (`avnS`), `B+6` the namespace's end. A fork child or a resumed VM takes
//! a new slot, so it never has its parent's address or MAC.

mod dns;
mod netns;

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Mutex;

use agentvm_guest::egress::{AllowEntry, Target};
use agentvm_proto::guest::v1::Network;
use agentvm_vmm_api::config::{
    EgressPolicy, EgressRule, NetConfig, RateLimiterConfig, TokenBucket,
};
use agentvm_vmm_api::types::NetOverride;

/// The address block guest networks come from (a /16: 8192 slots of 8 addresses).
pub const DEFAULT_POOL: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 0);
const SLOTS: u32 = 1 << 13;
/// The tap inside every VMM's namespace (each namespace has its own, so one name serves).
pub const TAP: &str = "tap0";
/// The VMM's network device id.
pub const DEVICE_ID: &str = "net0";
/// How often a rate limit's bucket refills, in milliseconds.
const REFILL_MS: u64 = 100;

/// The session annotation that narrows its image's allow list: comma-separated entries in
/// the image's form, each within an entry of the image (an empty value: nothing beyond the
/// resolver). An image without a network gets none from it.
pub const EGRESS_ANNOTATION: &str = "agentvm.dev/egress-allow";

/// An image's network: what its VMs may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageNetwork {
    pub allow: Vec<AllowEntry>,
    pub rate_limit_mbit: u32,
}

/// What no wide rule of a VM may open, beside what the VMM's filter always keeps closed:
/// the host's own addresses (its services on every interface, not only the tap's) and the
/// whole guest pool (other VMs, their gateways and resolvers).
fn reserved_networks(slot: &Slot) -> Vec<String> {
    let pool_prefix = 32 - (SLOTS * 8).trailing_zeros();
    let mut reserved = vec![format!("{}/{pool_prefix}", slot.pool())];
    reserved.extend(
        dns::host_addresses()
            .into_iter()
            .take(agentvm_vmm_api::config::MAX_RESERVED - 1)
            .map(|a| format!("{a}/32")),
    );
    reserved
}

/// One VM's place in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub index: u32,
    base: u32,
}

impl Slot {
    fn new(pool: Ipv4Addr, index: u32) -> Self {
        Self {
            index,
            base: u32::from(pool) + index * 8,
        }
    }
    /// The first address of the pool the slot is cut from.
    fn pool(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base - self.index * 8)
    }
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base + 1)
    }
    pub fn guest(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base + 2)
    }
    pub fn guest_block(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base)
    }
    pub fn host_end(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base + 5)
    }
    pub fn namespace_end(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base + 6)
    }
    pub fn host_veth(&self) -> String {
        format!("avn{}", self.index)
    }
    /// Locally administered and unicast, unique in the pool (it spells the guest address).
    pub fn mac(&self) -> String {
        let [a, b, c, d] = self.guest().octets();
        format!("06:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
    }

    /// What the guest sets up, on the command line at boot or in a Restored notice.
    pub fn guest_network(&self) -> Network {
        Network {
            address: self.guest().to_string(),
            prefix_len: 30,
            gateway: self.gateway().to_string(),
            mac: self.mac(),
        }
    }

    pub fn cmdline(&self) -> String {
        format!(
            "agentvm.net={}/30,{},{}",
            self.guest(),
            self.gateway(),
            self.mac()
        )
    }
}

impl ImageNetwork {
    /// The network of a session whose annotations are `annotations`: the image's, narrowed
    /// by [`EGRESS_ANNOTATION`] where the session has it. An entry the image does not cover
    /// is an error naming it: a session may narrow its image's policy, never widen it.
    pub fn for_session(
        &self,
        annotations: &std::collections::BTreeMap<String, String>,
    ) -> Result<Self, String> {
        let Some(asked) = annotations.get(EGRESS_ANNOTATION) else {
            return Ok(self.clone());
        };
        let field = format!("annotations[{EGRESS_ANNOTATION:?}]");
        let mut allow = Vec::new();
        for text in asked.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let entry = AllowEntry::parse(text).map_err(|e| format!("{field}: {e}"))?;
            if !self.allow.iter().any(|ceiling| covers(ceiling, &entry)) {
                return Err(format!(
                    "{field}: {text:?} is not within the image's [network] allow list"
                ));
            }
            allow.push(entry);
        }
        Ok(Self {
            allow,
            rate_limit_mbit: self.rate_limit_mbit,
        })
    }

    /// The image's address rules, as the device enforces them; names are the resolver's.
    fn address_rules(&self) -> Vec<EgressRule> {
        self.allow
            .iter()
            .filter_map(|entry| match entry.target {
                Target::Block(net, prefix) => Some(EgressRule {
                    cidr: format!("{net}/{prefix}"),
                    ports: entry.ports_text(),
                    protocol: None,
                }),
                _ => None,
            })
            .collect()
    }

    fn policy(&self, slot: &Slot) -> EgressPolicy {
        EgressPolicy {
            guest_ip: slot.guest(),
            gateway_ip: slot.gateway(),
            allow: self.address_rules(),
            reserved: reserved_networks(slot),
        }
    }

    fn rate_limiter(&self) -> Option<RateLimiterConfig> {
        (self.rate_limit_mbit > 0).then(|| RateLimiterConfig {
            bandwidth: Some(TokenBucket {
                // Bytes per refill period: Mbit/s × 10^6 / 8 × period.
                size: u64::from(self.rate_limit_mbit) * 125 * REFILL_MS,
                one_time_burst: None,
                refill_time: REFILL_MS,
            }),
            ops: None,
        })
    }

    /// The network device of a VM in `slot`.
    pub fn device(&self, slot: &Slot) -> NetConfig {
        NetConfig {
            tap: TAP.into(),
            mac: Some(slot.mac()),
            id: Some(DEVICE_ID.into()),
            mtu: None,
            rate_limiter_config: self.rate_limiter(),
            egress: Some(self.policy(slot)),
        }
    }

    /// What a restored VM's device changes to in `slot`.
    pub fn restore_override(&self, slot: &Slot) -> NetOverride {
        NetOverride {
            id: DEVICE_ID.into(),
            tap: Some(TAP.into()),
            mac: Some(slot.mac()),
            egress: Some(self.policy(slot)),
        }
    }
}

/// What a VM's network was given, kept for a daemon that restarts: in the run directory's
/// `.networks/`, which only root writes. (Beside the VMM, the VMM could rewrite it: widen
/// its own allow list, or point root's write at a file of root's through a symlink.)
#[derive(serde::Serialize, serde::Deserialize)]
struct Attached {
    slot: u32,
    allow: Vec<String>,
}

/// The record of the VMM whose API socket is `api` (`RUN_DIR/SESSION/api.sock`):
/// `RUN_DIR/.networks/SESSION.json`.
fn attached_file(api: &Path) -> Option<std::path::PathBuf> {
    let vmm_dir = api.parent()?;
    record_of(vmm_dir)
}

fn record_of(vmm_dir: &Path) -> Option<std::path::PathBuf> {
    let session = vmm_dir.file_name()?.to_str()?;
    Some(
        vmm_dir
            .parent()?
            .join(RECORDS)
            .join(format!("{session}.json")),
    )
}

/// Where the records are, in the run directory.
const RECORDS: &str = ".networks";

/// Drops the network record of the VMM that ran in `vmm_dir` (it is gone).
pub fn forget(vmm_dir: &Path) {
    if let Some(path) = record_of(vmm_dir) {
        let _ = std::fs::remove_file(path);
    }
}

/// Whether `outer` allows everything `inner` does.
fn covers(outer: &AllowEntry, inner: &AllowEntry) -> bool {
    let ports = match (outer.ports, inner.ports) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some((lo, hi)), Some((a, b))) => lo <= a && b <= hi,
    };
    let target = match (&outer.target, &inner.target) {
        (Target::Block(net, prefix), Target::Block(inner_net, inner_prefix)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(*prefix)).unwrap_or(0);
            prefix <= inner_prefix && u32::from(*inner_net) & mask == u32::from(*net)
        }
        (Target::Name(name), Target::Name(inner_name)) => name == inner_name,
        (Target::Under(domain), Target::Name(name)) => is_under(name, domain),
        (Target::Under(domain), Target::Under(sub)) => sub == domain || is_under(sub, domain),
        _ => false,
    };
    ports && target
}

/// Whether `name` lies strictly under `domain`.
fn is_under(name: &str, domain: &str) -> bool {
    name.strip_suffix(domain)
        .is_some_and(|head| head.len() > 1 && head.ends_with('.'))
}

/// The node's guest networks: which slots are taken and each VM's resolver.
pub struct Networks {
    pool: Ipv4Addr,
    /// Slots being set up: their veth does not exist yet.
    claimed: Mutex<HashSet<u32>>,
    /// Each networked session's resolver; dropping it releases the VM's namespace.
    resolvers: Mutex<HashMap<String, tokio::task::AbortHandle>>,
}

impl Default for Networks {
    fn default() -> Self {
        Self::new(DEFAULT_POOL)
    }
}

impl Networks {
    pub fn new(pool: Ipv4Addr) -> Self {
        Self {
            pool,
            claimed: Mutex::default(),
            resolvers: Mutex::default(),
        }
    }

    /// A free slot: not being set up, and no VM's veth holds it (a VM outliving an earlier
    /// daemon keeps its slot that way too).
    fn claim(&self) -> Result<Slot, String> {
        let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
        for index in 0..SLOTS {
            let slot = Slot::new(self.pool, index);
            if claimed.contains(&index)
                || Path::new("/sys/class/net").join(slot.host_veth()).exists()
            {
                continue;
            }
            claimed.insert(index);
            return Ok(slot);
        }
        Err(format!("all {SLOTS} guest network slots are in use"))
    }

    fn unclaim(&self, slot: &Slot) {
        self.claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&slot.index);
    }

    /// Gives the VMM `pid` (in its own network namespace) its tap, veth and routes, and
    /// starts the session's resolver, which tells the VMM at `api` what it let through.
    pub async fn attach(
        &self,
        session: &str,
        pid: u32,
        api: &Path,
        image: &ImageNetwork,
    ) -> Result<Slot, String> {
        // Another daemon on the host (tests run several) may take a slot between our look
        // and our claim: its veth then exists, and the next slot is tried.
        let mut tries = 0;
        let (slot, socket) = loop {
            let slot = self.claim()?;
            let set_up = tokio::task::spawn_blocking(move || netns::set_up(pid, &slot)).await;
            self.unclaim(&slot);
            match set_up {
                Ok(Ok(socket)) => break (slot, socket),
                Ok(Err(netns::SetUpError::Taken)) if tries < 16 => tries += 1,
                Ok(Err(netns::SetUpError::Taken)) => {
                    return Err("no free guest network slot after 16 tries".into());
                }
                Ok(Err(netns::SetUpError::Failed(e))) => return Err(e),
                Err(e) => return Err(format!("setting up the guest network: {e}")),
            }
        };
        let record = Attached {
            slot: slot.index,
            allow: image.allow.iter().map(|e| e.text.clone()).collect(),
        };
        let path = attached_file(api).ok_or("the VMM's directory has no name")?;
        if let Some(records) = path.parent() {
            use std::os::unix::fs::DirBuilderExt;
            match std::fs::DirBuilder::new().mode(0o700).create(records) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(format!("{}: {e}", records.display())),
            }
        }
        std::fs::write(&path, serde_json::to_vec(&record).unwrap_or_default())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        self.serve_resolver(session, socket, image.allow.clone(), api, slot.guest())?;
        tracing::debug!(session, address = %slot.guest(), "guest network attached");
        Ok(slot)
    }

    /// Serves the resolver of a VMM that outlived the daemon that attached its network (its
    /// record sits beside the VMM's API socket); nothing for a VMM without a network.
    pub async fn reattach(&self, session: &str, pid: u32, api: &Path) -> Result<(), String> {
        // Served already (the common case: every attach of a running session comes here).
        if self
            .resolvers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(session)
        {
            return Ok(());
        }
        let Some(path) = attached_file(api) else {
            return Ok(());
        };
        let Ok(bytes) = std::fs::read(&path) else {
            return Ok(());
        };
        let record: Attached =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let allow = record
            .allow
            .iter()
            .map(|e| AllowEntry::parse(e))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let slot = Slot::new(self.pool, record.slot);
        let socket = tokio::task::spawn_blocking(move || netns::rebind_resolver(pid, &slot))
            .await
            .map_err(|e| format!("the guest's resolver: {e}"))??;
        self.serve_resolver(session, socket, allow, api, slot.guest())
    }

    fn serve_resolver(
        &self,
        session: &str,
        socket: std::net::UdpSocket,
        allow: Vec<AllowEntry>,
        api: &Path,
        guest: Ipv4Addr,
    ) -> Result<(), String> {
        let resolver = dns::Resolver::new(
            socket,
            allow,
            agentvm_vmm_api::VmmClient::new(api),
            self.pool,
            guest,
        )
        .map_err(|e| format!("the guest's resolver: {e}"))?;
        let task = tokio::spawn(tracing::Instrument::in_current_span(resolver.serve()));
        if let Some(old) = self
            .resolvers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(session.to_owned(), task.abort_handle())
        {
            old.abort();
        }
        Ok(())
    }

    /// Stops the session's resolver (its VM is stopping): the namespace, and with it the
    /// veth and the slot, go with the VMM.
    pub fn detach(&self, session: &str) {
        if let Some(task) = self
            .resolvers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session)
        {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33 (item 6): a wide rule reached the host's own addresses and the other VMs'
    /// side of the pool. Each VM's policy reserves them, and the VMM takes the list.
    #[test]
    fn each_policy_reserves_the_pool_and_the_host_s_addresses() {
        let slot = Slot::new(DEFAULT_POOL, 3);
        assert_eq!(slot.pool(), DEFAULT_POOL);
        let reserved = reserved_networks(&slot);
        assert_eq!(reserved[0], "10.77.0.0/16");
        assert!(
            reserved.contains(&"127.0.0.1/32".to_owned()),
            "the host's addresses: {reserved:?}"
        );
        let policy = EgressPolicy {
            guest_ip: slot.guest(),
            gateway_ip: slot.gateway(),
            allow: Vec::new(),
            reserved,
        };
        assert!(policy.parse().is_ok());
    }

    #[test]
    fn slots_lay_out_addresses_and_names_without_overlap() {
        let slot = Slot::new(DEFAULT_POOL, 3);
        assert_eq!(slot.guest_block(), Ipv4Addr::new(10, 77, 0, 24));
        assert_eq!(slot.gateway(), Ipv4Addr::new(10, 77, 0, 25));
        assert_eq!(slot.guest(), Ipv4Addr::new(10, 77, 0, 26));
        assert_eq!(slot.host_end(), Ipv4Addr::new(10, 77, 0, 29));
        assert_eq!(slot.namespace_end(), Ipv4Addr::new(10, 77, 0, 30));
        assert_eq!(slot.host_veth(), "avn3");
        assert_eq!(slot.mac(), "06:00:0a:4d:00:1a");
        assert_eq!(
            slot.cmdline(),
            "agentvm.net=10.77.0.26/30,10.77.0.25,06:00:0a:4d:00:1a"
        );
        let last = Slot::new(DEFAULT_POOL, SLOTS - 1);
        assert_eq!(last.namespace_end(), Ipv4Addr::new(10, 77, 255, 254));
        assert!(
            last.host_veth().len() < 16,
            "interface names are at most 15 bytes"
        );
    }

    #[test]
    fn a_session_may_narrow_its_image_s_list_but_not_widen_it() {
        let image = ImageNetwork {
            allow: ["10.0.0.0/8:443", "*.example.com", "pypi.org:443"]
                .iter()
                .map(|e| AllowEntry::parse(e).unwrap())
                .collect(),
            rate_limit_mbit: 0,
        };
        let session = |value: &str| {
            image.for_session(&std::collections::BTreeMap::from([(
                EGRESS_ANNOTATION.to_owned(),
                value.to_owned(),
            )]))
        };
        let texts = |n: ImageNetwork| n.allow.into_iter().map(|e| e.text).collect::<Vec<_>>();
        assert_eq!(
            texts(image.for_session(&Default::default()).unwrap()),
            ["10.0.0.0/8:443", "*.example.com", "pypi.org:443"],
            "no annotation: the image's list"
        );
        assert_eq!(
            texts(session("10.1.2.0/24:443, api.example.com:8080, *.a.example.com").unwrap()),
            ["10.1.2.0/24:443", "api.example.com:8080", "*.a.example.com"]
        );
        assert!(session("").unwrap().allow.is_empty(), "nothing at all");
        for (wider, why) in [
            ("10.0.0.0/7:443", "not within"),
            ("10.1.0.0/16", "not within"),
            ("10.1.0.0/16:80", "not within"),
            ("example.com", "not within"),
            ("pypi.org", "not within"),
            ("files.pypi.org:443", "not within"),
            ("10.0.0.1/8", "host bits"),
        ] {
            let err = session(wider).unwrap_err();
            assert!(
                err.contains(EGRESS_ANNOTATION) && err.contains(why),
                "{wider}: {err}"
            );
        }
    }

    #[test]
    fn address_entries_become_device_rules_and_names_stay_with_the_resolver() {
        let image = ImageNetwork {
            allow: ["10.0.0.0/8:443", "192.0.2.7", "pypi.org:443"]
                .iter()
                .map(|e| AllowEntry::parse(e).unwrap())
                .collect(),
            rate_limit_mbit: 8,
        };
        let slot = Slot::new(DEFAULT_POOL, 0);
        let device = image.device(&slot);
        let egress = device.egress.unwrap();
        assert_eq!(egress.guest_ip, slot.guest());
        assert_eq!(egress.gateway_ip, slot.gateway());
        let rules: Vec<(String, Option<String>)> = egress
            .allow
            .into_iter()
            .map(|r| (r.cidr, r.ports))
            .collect();
        assert_eq!(
            rules,
            [
                ("10.0.0.0/8".to_owned(), Some("443".to_owned())),
                ("192.0.2.7/32".to_owned(), None)
            ]
        );
        // 8 Mbit/s is 1 MB/s: 100 kB per 100 ms.
        let bucket = device.rate_limiter_config.unwrap().bandwidth.unwrap();
        assert_eq!((bucket.size, bucket.refill_time), (100_000, 100));
    }
}
