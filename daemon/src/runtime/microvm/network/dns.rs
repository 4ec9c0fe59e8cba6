//! The resolver a networked guest asks (on its gateway, port 53): it answers A queries for
//! the names the image allows with the addresses the host resolves them to, after telling
//! the VM's network device to let those addresses through on the allowed ports; every other
//! name is REFUSED, so a guest learns nothing through it and cannot tunnel out over it.
//! Queries are served one at a time per VM: a flood costs the host one lookup at a time.
//!
//! An allowed name's answer comes from DNS, which whoever controls that name (or a wildcard
//! under an allowed domain) writes: it must never open what is not the internet. Addresses
//! that are the host's own, the whole guest pool (other VMs, their gateways and resolvers),
//! loopback, link-local (cloud metadata), unspecified, multicast, broadcast and reserved are
//! dropped from every answer and never let through; a query's type is checked before any
//! lookup, and names are looked up fully qualified (the host's search domains add nothing).
//! Private networks (RFC 1918, shared address space, the benchmark block) come through only
//! where the operator named them: in the node's /etc/hosts, or inside an address block the
//! image allows. Otherwise a wildcard zone could point a guest at any service of the
//! operator's own network. And what an answer opened closes again
//! [`LEARNED_LIFETIME`] after the last answer that gave it (connections already open go
//! on): a name that once pointed somewhere does not keep it reachable for good.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use agentvm_guest::egress::AllowEntry;
use agentvm_vmm_api::VmmClient;
use agentvm_vmm_api::config::EgressRule;
use agentvm_vmm_api::types::VmEgressAllow;

use super::DEVICE_ID;

/// A DNS message over UDP without EDNS is at most 512 bytes.
const MAX_MESSAGE: usize = 512;
const HEADER: usize = 12;
const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;
/// How long a guest may cache an answer: short, since the address is let through for good.
const TTL_SECONDS: u32 = 30;
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// The most addresses one VM's resolver lets through (the device holds 4096 rules).
const MAX_LEARNED: usize = 2048;
/// How long an address stays let through after the last answer that gave it: long past the
/// guest's cache of the answer ([`TTL_SECONDS`]), short enough that a name pointed
/// elsewhere soon stops reaching the old address.
const LEARNED_LIFETIME: Duration = Duration::from_secs(300);
/// How often addresses past their lifetime are taken back out of the device's policy.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

mod rcode {
    pub const NOERROR: u8 = 0;
    pub const FORMERR: u8 = 1;
    pub const SERVFAIL: u8 = 2;
    pub const NXDOMAIN: u8 = 3;
    pub const NOTIMP: u8 = 4;
    pub const REFUSED: u8 = 5;
}

pub struct Resolver {
    socket: tokio::net::UdpSocket,
    /// The address it answers: its own VM's (the host routes to every gateway, so anyone
    /// on the host could ask otherwise).
    guest: Ipv4Addr,
    allow: Vec<AllowEntry>,
    vmm: VmmClient,
    /// What an answer may never open.
    never: NeverOpen,
    learned: Learned,
    /// Recent lookups by name, so a guest asking again and again costs the host (and the
    /// name's servers, which see every lookup) one lookup per [`TTL_SECONDS`].
    cache: HashMap<String, (Instant, Lookup)>,
}

/// What a lookup found: the addresses and whether /etc/hosts gave them, or the response
/// code that says why there are none.
type Lookup = Result<(Vec<Ipv4Addr>, bool), u8>;

/// The most names one VM's resolver remembers.
const MAX_CACHED: usize = 256;

/// An (address, ports) pair an answer let through.
type Opened = (Ipv4Addr, Option<String>);

/// What answers let through, and until when.
#[derive(Debug, Default)]
struct Learned {
    until: HashMap<Opened, Instant>,
}

impl Learned {
    /// Notes `pairs` as answered at `now` (each open until [`LEARNED_LIFETIME`] from now);
    /// returns those not let through yet, or why no more can be.
    fn answered(&mut self, pairs: Vec<Opened>, now: Instant) -> Result<Vec<Opened>, String> {
        let new: Vec<Opened> = pairs
            .iter()
            .filter(|p| !self.until.contains_key(*p))
            .cloned()
            .collect();
        if self.until.len() + new.len() > MAX_LEARNED {
            return Err(format!("{MAX_LEARNED} addresses already let through"));
        }
        for pair in pairs {
            self.until.insert(pair, now + LEARNED_LIFETIME);
        }
        Ok(new)
    }

    /// Takes out and returns what is past its lifetime at `now`.
    fn expired(&mut self, now: Instant) -> Vec<Opened> {
        let gone: Vec<Opened> = self
            .until
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(pair, _)| pair.clone())
            .collect();
        for pair in &gone {
            self.until.remove(pair);
        }
        gone
    }

    /// Puts back `pairs` a revoke could not take out of the device.
    fn keep(&mut self, pairs: Vec<Opened>, now: Instant) {
        for pair in pairs {
            self.until.insert(pair, now + SWEEP_EVERY);
        }
    }
}

fn rules_of(pairs: &[Opened]) -> Vec<EgressRule> {
    pairs
        .iter()
        .map(|(address, ports)| EgressRule {
            cidr: format!("{address}/32"),
            ports: ports.clone(),
            protocol: None,
        })
        .collect()
}

/// One parsed question.
#[derive(Debug, PartialEq, Eq)]
struct Question {
    id: u16,
    /// The RD bit, echoed back.
    recursion_desired: bool,
    name: String,
    qtype: u16,
    qclass: u16,
    /// The question section's bytes, echoed back.
    section: std::ops::Range<usize>,
}

impl Resolver {
    /// `pool` is the first address of the guest network pool this VM's slot is in, `guest`
    /// the VM's own address.
    pub fn new(
        socket: std::net::UdpSocket,
        allow: Vec<AllowEntry>,
        vmm: VmmClient,
        pool: Ipv4Addr,
        guest: Ipv4Addr,
    ) -> std::io::Result<Self> {
        let named = allow
            .iter()
            .filter_map(|e| match e.target {
                agentvm_guest::egress::Target::Block(net, prefix) => Some((u32::from(net), prefix)),
                _ => None,
            })
            .collect();
        Ok(Self {
            socket: tokio::net::UdpSocket::from_std(socket)?,
            guest,
            allow,
            vmm,
            never: NeverOpen {
                pool,
                host: host_addresses(),
                named,
            },
            learned: Learned::default(),
            cache: HashMap::new(),
        })
    }

    pub async fn serve(mut self) {
        let mut buf = [0u8; MAX_MESSAGE];
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let (n, from) = tokio::select! {
                received = self.socket.recv_from(&mut buf) => match received {
                    Ok(got) => got,
                    Err(e) => {
                        tracing::warn!(error = %e, "guest resolver stopped");
                        return;
                    }
                },
                _ = sweep.tick() => {
                    self.close_expired().await;
                    continue;
                }
            };
            // Its VM, or its own namespace (the gateway: what the VMM's namespace sends
            // from); never a host or another VM routed to it.
            let local = self.socket.local_addr().map(|a| a.ip()).ok();
            if from.ip() != std::net::IpAddr::V4(self.guest) && Some(from.ip()) != local {
                tracing::debug!(%from, "guest resolver ignored a query from another address");
                continue;
            }
            if let Some(reply) = self.answer(&buf[..n]).await {
                let _ = self.socket.send_to(&reply, from).await;
            }
        }
    }

    /// [`lookup`], answered from the cache while its answer is younger than the TTL the
    /// guest was given.
    async fn cached_lookup(&mut self, name: &str) -> Lookup {
        let now = Instant::now();
        let fresh = Duration::from_secs(u64::from(TTL_SECONDS));
        if let Some((at, found)) = self.cache.get(name)
            && now.duration_since(*at) < fresh
        {
            return found.clone();
        }
        let found = lookup(name).await;
        if self.cache.len() >= MAX_CACHED {
            self.cache
                .retain(|_, (at, _)| now.duration_since(*at) < fresh);
        }
        if self.cache.len() < MAX_CACHED {
            self.cache.insert(name.to_owned(), (now, found.clone()));
        }
        found
    }

    /// Takes what is past its lifetime back out of the device's policy.
    async fn close_expired(&mut self) {
        let now = Instant::now();
        let gone = self.learned.expired(now);
        if gone.is_empty() {
            return;
        }
        let body = VmEgressAllow {
            id: Some(DEVICE_ID.into()),
            rules: rules_of(&gone),
        };
        match self
            .vmm
            .put_json(agentvm_vmm_api::endpoint::VM_EGRESS_REVOKE, &body)
            .await
        {
            Ok(()) => tracing::debug!(
                closed = gone.len(),
                "guest resolver closed expired addresses"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "guest resolver could not close expired addresses");
                self.learned.keep(gone, now);
            }
        }
    }

    async fn answer(&mut self, query: &[u8]) -> Option<Vec<u8>> {
        let question = match parse_question(query) {
            Ok(q) => q,
            Err(Some(id)) => return Some(error_reply(id, rcode::FORMERR)),
            Err(None) => return None,
        };
        if question.qclass != CLASS_IN {
            return Some(reply(query, &question, rcode::NOTIMP, &[]));
        }
        let entries: Vec<&AllowEntry> = self
            .allow
            .iter()
            .filter(|e| e.allows_name(&question.name))
            .collect();
        if entries.is_empty() {
            tracing::debug!(name = %question.name, "guest resolver refused a name");
            return Some(reply(query, &question, rcode::REFUSED, &[]));
        }
        if question.qtype != TYPE_A {
            // The guest network is IPv4 only: no records of this type, and no lookup (a TXT
            // or any other query must not reach the name's servers: no tunnel through them).
            return Some(reply(query, &question, rcode::NOERROR, &[]));
        }
        let ports: Vec<Option<String>> = entries.iter().map(|e| e.ports_text()).collect();
        let (mut addresses, from_hosts_file) = match self.cached_lookup(&question.name).await {
            Ok(a) => a,
            Err(code) => return Some(reply(query, &question, code, &[])),
        };
        let before = addresses.len();
        addresses.retain(|a| self.never.allows(*a) && (from_hosts_file || self.never.public(*a)));
        if addresses.len() < before {
            tracing::warn!(name = %question.name, dropped = before - addresses.len(),
                "guest resolver dropped addresses that are not the internet from an answer");
        }
        if let Err(e) = self.let_through(&addresses, &ports).await {
            tracing::warn!(name = %question.name, error = %e, "guest resolver could not open the device");
            return Some(reply(query, &question, rcode::SERVFAIL, &[]));
        }
        Some(reply(query, &question, rcode::NOERROR, &addresses))
    }

    /// Adds rules for the addresses not let through yet, and keeps every one of them open
    /// [`LEARNED_LIFETIME`] from now.
    async fn let_through(
        &mut self,
        addresses: &[Ipv4Addr],
        ports: &[Option<String>],
    ) -> Result<(), String> {
        let pairs: Vec<Opened> = addresses
            .iter()
            .flat_map(|a| ports.iter().map(|p| (*a, p.clone())))
            .collect();
        let new = self.learned.answered(pairs, Instant::now())?;
        if new.is_empty() {
            return Ok(());
        }
        let body = VmEgressAllow {
            id: Some(DEVICE_ID.into()),
            rules: rules_of(&new),
        };
        let added = self
            .vmm
            .put_json(agentvm_vmm_api::endpoint::VM_EGRESS_ALLOW, &body)
            .await
            .map_err(|e| e.to_string());
        if added.is_err() {
            // Not let through: nothing to close later, and the next answer tries again.
            for pair in &new {
                self.learned.until.remove(pair);
            }
        }
        added
    }
}

/// The host's IPv4 addresses for `name`, and whether the operator's /etc/hosts gave them;
/// or the response code that says why there are none. The host's /etc/hosts first, read
/// here: a statically linked agentvmd may have no NSS modules to read it through.
async fn lookup(name: &str) -> Lookup {
    let listed = std::fs::read_to_string(HOSTS_FILE)
        .map(|text| hosts_file_addresses(&text, name))
        .unwrap_or_default();
    if !listed.is_empty() {
        return Ok((listed, true));
    }
    // Fully qualified: the host's search domains must not answer for the guest.
    let absolute = format!("{name}.");
    let found = tokio::time::timeout(
        LOOKUP_TIMEOUT,
        tokio::net::lookup_host((absolute.as_str(), 0)),
    )
    .await
    .map_err(|_| rcode::SERVFAIL)?
    .map_err(|_| rcode::NXDOMAIN)?;
    let mut addresses: Vec<Ipv4Addr> = found
        .filter_map(|a| match a {
            SocketAddr::V4(v4) => Some(*v4.ip()),
            SocketAddr::V6(_) => None,
        })
        .collect();
    addresses.sort();
    addresses.dedup();
    addresses.truncate(16);
    Ok((addresses, false))
}

/// Networks of private use, `(network, prefix)`: RFC 1918, the shared address space of
/// carrier NAT, and the benchmarking block.
const PRIVATE: [(u32, u8); 5] = [
    (0x0a00_0000, 8),
    (0xac10_0000, 12),
    (0xc0a8_0000, 16),
    (0x6440_0000, 10),
    (0xc612_0000, 15),
];

fn in_network(a: u32, (net, prefix): (u32, u8)) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
    a & mask == net & mask
}

const HOSTS_FILE: &str = "/etc/hosts";

/// What no answer may open, whatever name it is for.
struct NeverOpen {
    /// The guest pool's first address: every VM's address, gateway and resolver are in it.
    pool: Ipv4Addr,
    /// The host's own addresses.
    host: Vec<Ipv4Addr>,
    /// The address blocks the image allows, `(network, prefix)`.
    named: Vec<(u32, u8)>,
}

impl NeverOpen {
    /// Whether a DNS answer may give `a`: outside every private network, or inside a block
    /// the image names that lies within that private network (a wide `0.0.0.0/0` names no
    /// private network).
    fn public(&self, a: Ipv4Addr) -> bool {
        let a = u32::from(a);
        PRIVATE
            .iter()
            .filter(|private| in_network(a, **private))
            .all(|&(net, prefix)| {
                self.named.iter().any(|&(block, len)| {
                    len >= prefix && in_network(block, (net, prefix)) && in_network(a, (block, len))
                })
            })
    }

    fn allows(&self, a: Ipv4Addr) -> bool {
        let [a0, ..] = a.octets();
        let in_pool = u32::from(a).wrapping_sub(u32::from(self.pool)) < super::SLOTS * 8;
        !(a.is_loopback()
            || a.is_unspecified()
            || a0 == 0
            || a.is_link_local()
            || a.is_multicast()
            || a.is_broadcast()
            // 240.0.0.0/4: reserved.
            || a0 >= 240
            || in_pool
            || self.host.contains(&a))
    }
}

/// The host's own IPv4 addresses (its network namespace's LOCAL routes).
pub(super) fn host_addresses() -> Vec<Ipv4Addr> {
    std::fs::read_to_string("/proc/net/fib_trie")
        .map(|text| local_addresses(&text))
        .unwrap_or_default()
}

/// The addresses `/proc/net/fib_trie` gives a `/32 host LOCAL` route.
fn local_addresses(fib_trie: &str) -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    let mut last: Option<Ipv4Addr> = None;
    for line in fib_trie.lines() {
        let line = line.trim();
        if let Some(address) = line.strip_prefix("|-- ") {
            last = address.parse().ok();
        } else if line.starts_with("/32 host LOCAL")
            && let Some(a) = last
            && !out.contains(&a)
        {
            out.push(a);
        }
    }
    out
}

/// The IPv4 addresses `hosts` (the text of an /etc/hosts) gives `name`.
fn hosts_file_addresses(hosts: &str, name: &str) -> Vec<Ipv4Addr> {
    hosts
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let address: Ipv4Addr = words.next()?.parse().ok()?;
            words
                .any(|w| w.eq_ignore_ascii_case(name))
                .then_some(address)
        })
        .collect()
}

/// The question of a standard query, or the id to answer FORMERR to (`None`: too short to
/// answer at all, or itself a response).
fn parse_question(message: &[u8]) -> Result<Question, Option<u16>> {
    if message.len() < HEADER {
        return Err(None);
    }
    let id = u16::from_be_bytes([message[0], message[1]]);
    let flags = message[2];
    if flags & 0x80 != 0 {
        // A response: never answered (no reflection between resolvers).
        return Err(None);
    }
    let opcode = (flags >> 3) & 0x0f;
    let questions = u16::from_be_bytes([message[4], message[5]]);
    if opcode != 0 || questions != 1 {
        return Err(Some(id));
    }
    let mut at = HEADER;
    let mut labels: Vec<String> = Vec::new();
    loop {
        let len = usize::from(*message.get(at).ok_or(Some(id))?);
        at += 1;
        if len == 0 {
            break;
        }
        // No compression pointers in a question; labels are at most 63 bytes.
        if len > 63 {
            return Err(Some(id));
        }
        let label = message.get(at..at + len).ok_or(Some(id))?;
        if !label
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
        {
            return Err(Some(id));
        }
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        at += len;
    }
    let fixed = message.get(at..at + 4).ok_or(Some(id))?;
    let name = labels.join(".");
    if name.is_empty() || name.len() > 253 {
        return Err(Some(id));
    }
    Ok(Question {
        id,
        recursion_desired: flags & 0x01 != 0,
        name,
        qtype: u16::from_be_bytes([fixed[0], fixed[1]]),
        qclass: u16::from_be_bytes([fixed[2], fixed[3]]),
        section: HEADER..at + 4,
    })
}

fn header(id: u16, recursion_desired: bool, code: u8, questions: u16, answers: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_MESSAGE);
    out.extend_from_slice(&id.to_be_bytes());
    // QR, RD as asked; RA; the response code.
    out.push(0x80 | u8::from(recursion_desired));
    out.push(0x80 | code);
    out.extend_from_slice(&questions.to_be_bytes());
    out.extend_from_slice(&answers.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out
}

fn error_reply(id: u16, code: u8) -> Vec<u8> {
    header(id, false, code, 0, 0)
}

fn reply(query: &[u8], question: &Question, code: u8, addresses: &[Ipv4Addr]) -> Vec<u8> {
    let mut out = header(
        question.id,
        question.recursion_desired,
        code,
        1,
        addresses.len() as u16,
    );
    out.extend_from_slice(&query[question.section.clone()]);
    for address in addresses {
        // The name is the question's (a pointer to offset 12).
        out.extend_from_slice(&[0xc0, 0x0c]);
        out.extend_from_slice(&TYPE_A.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&TTL_SECONDS.to_be_bytes());
        out.extend_from_slice(&4u16.to_be_bytes());
        out.extend_from_slice(&address.octets());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0u8; HEADER];
        q[0..2].copy_from_slice(&id.to_be_bytes());
        q[2] = 0x01;
        q[5] = 1;
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&CLASS_IN.to_be_bytes());
        q
    }

    #[test]
    fn a_question_is_parsed_and_answered_with_its_addresses() {
        let q = query(0x1234, "Allowed.Test", TYPE_A);
        let question = parse_question(&q).unwrap();
        assert_eq!(question.name, "allowed.test");
        assert_eq!((question.qtype, question.qclass), (TYPE_A, CLASS_IN));
        let addresses = [Ipv4Addr::new(10, 78, 1, 2), Ipv4Addr::new(10, 78, 1, 3)];
        let r = reply(&q, &question, rcode::NOERROR, &addresses);
        assert_eq!(&r[0..2], &[0x12, 0x34]);
        assert_eq!(r[2], 0x81, "a response, recursion desired echoed");
        assert_eq!(r[3] & 0x0f, rcode::NOERROR);
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 2);
        let answers = &r[q.len()..];
        assert_eq!(answers.len(), 2 * 16);
        assert_eq!(&answers[12..16], &[10, 78, 1, 2]);
        assert_eq!(&answers[16 + 12..32], &[10, 78, 1, 3]);
    }

    #[test]
    fn answers_never_open_what_is_not_the_internet() {
        let never = NeverOpen {
            pool: Ipv4Addr::new(10, 77, 0, 0),
            host: vec![Ipv4Addr::new(192, 0, 2, 2)],
            named: vec![(0, 0), (0x0a50_0000, 16)],
        };
        for refused in [
            "127.0.0.1",
            "127.3.4.5",
            "0.0.0.0",
            "0.1.2.3",
            "169.254.169.254",
            "10.77.0.5",
            "10.77.0.10",
            "10.77.255.254",
            "224.0.0.1",
            "239.255.255.250",
            "255.255.255.255",
            "240.0.0.1",
            "192.0.2.2",
        ] {
            assert!(!never.allows(refused.parse().unwrap()), "{refused}");
        }
        for allowed in ["93.184.216.34", "10.78.1.2", "8.8.8.8", "192.0.2.3"] {
            assert!(never.allows(allowed.parse().unwrap()), "{allowed}");
        }
        // A DNS answer in a private network only inside a block the image names there
        // (`0.0.0.0/0` names none of them; 10.80.0.0/16 names itself).
        for private in [
            "10.78.1.2",
            "172.16.0.1",
            "172.31.255.1",
            "192.168.1.1",
            "100.64.0.1",
            "198.18.0.1",
            "10.81.0.1",
        ] {
            assert!(!never.public(private.parse().unwrap()), "{private}");
        }
        for public in ["93.184.216.34", "172.32.0.1", "10.80.3.4", "100.128.0.1"] {
            assert!(never.public(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn learned_addresses_close_a_lifetime_after_the_last_answer_that_gave_them() {
        let mut learned = Learned::default();
        let t0 = Instant::now();
        let a = (Ipv4Addr::new(93, 184, 216, 34), Some("443".to_owned()));
        let b = (Ipv4Addr::new(93, 184, 216, 35), None);
        assert_eq!(
            learned.answered(vec![a.clone(), b.clone()], t0).unwrap(),
            [a.clone(), b.clone()]
        );
        // Answered again later: nothing new to open, and `a` stays open longer.
        let later = t0 + LEARNED_LIFETIME / 2;
        assert!(learned.answered(vec![a.clone()], later).unwrap().is_empty());
        assert!(learned.expired(t0 + LEARNED_LIFETIME / 3).is_empty());
        assert_eq!(
            learned.expired(t0 + LEARNED_LIFETIME),
            std::slice::from_ref(&b)
        );
        assert_eq!(
            learned.expired(later + LEARNED_LIFETIME),
            std::slice::from_ref(&a)
        );
        // Closed, it is new again; one that could not be closed is tried at the next sweep.
        assert_eq!(
            learned.answered(vec![b.clone()], later).unwrap(),
            std::slice::from_ref(&b)
        );
        learned.keep(vec![a.clone()], later);
        assert_eq!(learned.expired(later + SWEEP_EVERY), [a]);
        // Bounded.
        let many: Vec<Opened> = (0..MAX_LEARNED as u32)
            .map(|i| (Ipv4Addr::from(0x5d00_0000 + i), None))
            .collect();
        assert!(learned.answered(many, later).is_err());
    }

    #[tokio::test]
    async fn a_name_asked_again_within_its_ttl_is_answered_from_the_cache() {
        let socket = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        socket.set_nonblocking(true).unwrap();
        let mut resolver = Resolver::new(
            socket,
            Vec::new(),
            VmmClient::new("/nonexistent/api.sock"),
            Ipv4Addr::new(10, 77, 0, 0),
            Ipv4Addr::new(10, 77, 0, 2),
        )
        .unwrap();
        let first = resolver.cached_lookup("localhost").await;
        assert_eq!(resolver.cache.len(), 1);
        // What the cache holds is what the next ask gets, with no lookup, until the TTL.
        resolver.cache.get_mut("localhost").unwrap().1 = Err(rcode::SERVFAIL);
        assert_eq!(
            resolver.cached_lookup("localhost").await,
            Err(rcode::SERVFAIL)
        );
        let aged = Instant::now()
            .checked_sub(Duration::from_secs(u64::from(TTL_SECONDS)))
            .unwrap();
        resolver.cache.get_mut("localhost").unwrap().0 = aged;
        assert_eq!(resolver.cached_lookup("localhost").await, first);
    }

    #[test]
    fn the_host_s_addresses_are_its_local_routes() {
        let trie = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n\
                    |-- 127.0.0.1\n              /32 host LOCAL\n\
                    |-- 192.0.2.0\n              /24 link UNICAST\n\
                    |-- 192.0.2.2\n              /32 host LOCAL\n\
                    |-- 192.0.2.255\n           /32 link BROADCAST\n\
                    Local:\n           |-- 192.0.2.2\n              /32 host LOCAL\n";
        assert_eq!(
            local_addresses(trie),
            [Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(192, 0, 2, 2)]
        );
    }

    #[test]
    fn the_hosts_file_names_addresses() {
        let hosts = "127.0.0.1 localhost\n10.78.1.2 allowed.test a # comment\n\
                     ::1 allowed.test\n# 10.9.9.9 allowed.test\n10.78.1.3 ALLOWED.test\n";
        assert_eq!(
            hosts_file_addresses(hosts, "allowed.test"),
            [Ipv4Addr::new(10, 78, 1, 2), Ipv4Addr::new(10, 78, 1, 3)]
        );
        assert!(hosts_file_addresses(hosts, "comment").is_empty());
    }

    #[test]
    fn malformed_queries_get_formerr_or_nothing_and_never_panic() {
        assert_eq!(parse_question(&[0; 5]), Err(None));
        let mut response = query(7, "a.test", TYPE_A);
        response[2] |= 0x80;
        assert_eq!(parse_question(&response), Err(None));
        let mut two = query(7, "a.test", TYPE_A);
        two[5] = 2;
        assert_eq!(parse_question(&two), Err(Some(7)));
        let truncated = query(7, "a.test", TYPE_A);
        assert_eq!(
            parse_question(&truncated[..truncated.len() - 2]),
            Err(Some(7))
        );
        let mut pointer = query(7, "a.test", TYPE_A);
        pointer[HEADER] = 0xc0;
        assert_eq!(parse_question(&pointer), Err(Some(7)));
        let mut seed = 0x2545_f491_u64;
        for _ in 0..5000 {
            let len = (seed % 64) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let _ = parse_question(&bytes);
        }
    }
}
