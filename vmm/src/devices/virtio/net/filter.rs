//! The egress policy as a frame filter: pure functions of the frame and the policy (and the
//! flows the guest opened), no I/O.
//!
//! Guest → host, a frame passes when its Ethernet source is the guest's MAC and it is ARP
//! spoken as the guest, or IPv4 from the guest's address that is DNS to the gateway or that
//! some rule allows. Host → guest, a frame passes when it is addressed to the guest and is
//! ARP about the guest's address, or IPv4 that answers something the guest sent: a DNS reply
//! from the gateway, a packet of a flow the guest opened, an echo reply to its ping, an ICMP
//! error about a packet of such a flow (what it quotes must be the guest's own), or a later
//! fragment of a packet let in whole (its first fragment passed). Everything else is dropped.
//!
//! Every header is read defensively (lengths checked against the frame before a byte is
//! read), so any sequence of bytes gets a verdict and none gets a panic.

use std::collections::{BTreeMap, HashMap};

use agentvm_vmm_api::config::{IpProtocol, MAX_EGRESS_RULES, ParsedPolicy, ParsedRule};

/// The network mask of a `/prefix`, host order.
fn mask(prefix: u8) -> u32 {
    u32::MAX
        .checked_shl(32 - u32::from(prefix.min(32)))
        .unwrap_or(0)
}

/// Flows remembered per device; past this the oldest is forgotten (its replies are dropped
/// until the guest sends on it again).
pub const FLOW_CAPACITY: usize = 8192;
/// Fragmented packets for the guest whose later fragments are awaited; past this the oldest
/// is forgotten (its packet never reassembles, and the sender retransmits).
pub const FRAGMENT_CAPACITY: usize = 512;

const ETH_HEADER_LEN: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;
const ARP_LEN: usize = 28;
const IPV4_MIN_HEADER: usize = 20;
const PROTO_ICMP: u8 = 1;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_UNREACHABLE: u8 = 3;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMP_TIME_EXCEEDED: u8 = 11;
const DNS_PORT: u16 = 53;
const BROADCAST_MAC: [u8; 6] = [0xff; 6];

/// Networks no wide rule opens (`0.0.0.0/0:443` is "the internet on 443", not the host's
/// loopback or the cloud's metadata service): "this" network, loopback, link-local (where
/// metadata services answer), multicast, and the reserved block with the limited
/// broadcast. Only a rule whose own network lies inside one reaches it: an operator who
/// writes `169.254.169.254/32` means it. The gateway (the host's side of the link) is one
/// more, for every port but DNS.
const RESERVED: [(u32, u8); 5] = [
    (0x0000_0000, 8),
    (0x7f00_0000, 8),
    (0xa9fe_0000, 16),
    (0xe000_0000, 4),
    (0xf000_0000, 4),
];

/// What the filter decided, with why a frame was dropped (for traces and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop(&'static str),
}

/// More rules than a policy may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the policy would hold {would} rules, at most {MAX_EGRESS_RULES} are allowed")]
pub struct TooManyRules {
    pub would: usize,
}

/// One device's policy and the flows its guest opened.
#[derive(Debug)]
pub struct EgressFilter {
    mac: [u8; 6],
    guest_ip: u32,
    gateway_ip: u32,
    rules: Vec<ParsedRule>,
    /// The host's own reserved networks (the policy's `reserved`), beside [`RESERVED`].
    reserved: Vec<(u32, u8)>,
    flows: RecencyTable<Flow>,
    /// Packets for the guest whose first fragment was let in.
    fragments: RecencyTable<Fragmented>,
}

impl EgressFilter {
    /// A filter for the guest with `mac` under `policy`, remembering no flow yet.
    pub fn new(mac: [u8; 6], policy: &ParsedPolicy) -> Self {
        Self {
            mac,
            guest_ip: u32::from(policy.guest_ip),
            gateway_ip: u32::from(policy.gateway_ip),
            rules: policy.rules.clone(),
            reserved: policy.reserved.clone(),
            flows: RecencyTable::new(FLOW_CAPACITY),
            fragments: RecencyTable::new(FRAGMENT_CAPACITY),
        }
    }

    pub fn rules(&self) -> &[ParsedRule] {
        &self.rules
    }

    /// Appends `rules`; none is added when the policy would then hold more than
    /// [`MAX_EGRESS_RULES`].
    pub fn allow(&mut self, rules: &[ParsedRule]) -> Result<(), TooManyRules> {
        let would = self.rules.len() + rules.len();
        if would > MAX_EGRESS_RULES {
            return Err(TooManyRules { would });
        }
        self.rules.extend_from_slice(rules);
        Ok(())
    }

    /// Removes every rule equal to one of `rules`. Flows the guest opened under them stay
    /// open: a connection outlives the rule that let it start.
    pub fn revoke(&mut self, rules: &[ParsedRule]) {
        self.rules.retain(|r| !rules.contains(r));
    }

    /// How many flows are remembered.
    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// A frame the guest sent. Allowed TCP, UDP and echo traffic is remembered as a flow, so
    /// its replies pass [`Self::inbound`].
    pub fn outbound(&mut self, frame: &[u8]) -> Verdict {
        let Some(eth) = Ethernet::parse(frame) else {
            return Verdict::Drop("shorter than an Ethernet header");
        };
        if eth.src != self.mac {
            return Verdict::Drop("Ethernet source is not the guest's MAC");
        }
        match eth.ethertype {
            ETHERTYPE_ARP => match Arp::parse(eth.payload) {
                Some(arp) if arp.sender_mac == self.mac && arp.sender_ip == self.guest_ip => {
                    Verdict::Pass
                }
                Some(_) => Verdict::Drop("ARP sender is not the guest"),
                None => Verdict::Drop("malformed ARP"),
            },
            ETHERTYPE_IPV4 => match Ipv4::parse(eth.payload) {
                Some(ip) if ip.src != self.guest_ip => {
                    Verdict::Drop("IPv4 source is not the guest's address")
                }
                Some(ip) => self.outbound_ipv4(&ip),
                None => Verdict::Drop("malformed IPv4"),
            },
            _ => Verdict::Drop("neither ARP nor IPv4"),
        }
    }

    fn outbound_ipv4(&mut self, ip: &Ipv4<'_>) -> Verdict {
        if !ip.first_fragment {
            // No ports to check: only a rule that allows every port may let it through.
            return match self.any_port_allowed(ip.dst, ip.protocol) {
                true => Verdict::Pass,
                false => Verdict::Drop("fragment to a destination no portless rule covers"),
            };
        }
        match ip.protocol {
            PROTO_TCP | PROTO_UDP => {
                let Some((src_port, dst_port)) = ports(ip.payload) else {
                    return Verdict::Drop("TCP/UDP header truncated");
                };
                let tcp = ip.protocol == PROTO_TCP;
                let dns = ip.dst == self.gateway_ip && dst_port == DNS_PORT;
                let flow = Flow {
                    protocol: ip.protocol,
                    remote: ip.dst,
                    remote_port: dst_port,
                    local_port: src_port,
                };
                // A flow already open goes on even if the rule that let it start was revoked.
                if !dns
                    && !self.flows.contains(&flow)
                    && !self
                        .rules
                        .iter()
                        .any(|r| r.allows(ip.dst, tcp, dst_port) && self.reaches(r, ip.dst))
                {
                    return Verdict::Drop("no rule allows the destination");
                }
                self.flows.record(flow);
                Verdict::Pass
            }
            PROTO_ICMP => {
                let Some(icmp) = Icmp::parse(ip.payload) else {
                    return Verdict::Drop("ICMP header truncated");
                };
                if icmp.kind != ICMP_ECHO_REQUEST {
                    return Verdict::Drop("ICMP other than echo request");
                }
                if !self.any_port_allowed(ip.dst, PROTO_ICMP) {
                    return Verdict::Drop("no portless rule allows echo to the destination");
                }
                self.flows.record(Flow {
                    protocol: PROTO_ICMP,
                    remote: ip.dst,
                    remote_port: icmp.id,
                    local_port: 0,
                });
                Verdict::Pass
            }
            _ => Verdict::Drop("IP protocol other than TCP, UDP or ICMP"),
        }
    }

    /// A frame for the guest.
    pub fn inbound(&mut self, frame: &[u8]) -> Verdict {
        let Some(eth) = Ethernet::parse(frame) else {
            return Verdict::Drop("shorter than an Ethernet header");
        };
        let broadcast = eth.dst == BROADCAST_MAC;
        if eth.dst != self.mac && !(broadcast && eth.ethertype == ETHERTYPE_ARP) {
            return Verdict::Drop("not addressed to the guest's MAC");
        }
        match eth.ethertype {
            ETHERTYPE_ARP => match Arp::parse(eth.payload) {
                Some(arp) if arp.target_ip == self.guest_ip => Verdict::Pass,
                Some(_) => Verdict::Drop("ARP about another address"),
                None => Verdict::Drop("malformed ARP"),
            },
            ETHERTYPE_IPV4 => match Ipv4::parse(eth.payload) {
                Some(ip) if ip.dst != self.guest_ip => {
                    Verdict::Drop("IPv4 destination is not the guest's address")
                }
                Some(ip) => {
                    let packet = Fragmented {
                        src: ip.src,
                        id: ip.id,
                        protocol: ip.protocol,
                    };
                    if !ip.first_fragment {
                        // Its ports are in the first fragment: it comes in with that one.
                        return match self.fragments.contains(&packet) {
                            true => Verdict::Pass,
                            false => Verdict::Drop("a later fragment of no packet let in"),
                        };
                    }
                    let verdict = self.inbound_ipv4(&ip);
                    if verdict == Verdict::Pass && ip.more_fragments {
                        self.fragments.record(packet);
                    }
                    verdict
                }
                None => Verdict::Drop("malformed IPv4"),
            },
            _ => Verdict::Drop("neither ARP nor IPv4"),
        }
    }

    /// A whole packet, or the first fragment of one.
    fn inbound_ipv4(&self, ip: &Ipv4<'_>) -> Verdict {
        match ip.protocol {
            PROTO_TCP | PROTO_UDP => {
                let Some((src_port, dst_port)) = ports(ip.payload) else {
                    return Verdict::Drop("TCP/UDP header truncated");
                };
                if ip.src == self.gateway_ip && src_port == DNS_PORT {
                    return Verdict::Pass;
                }
                let reply_to = Flow {
                    protocol: ip.protocol,
                    remote: ip.src,
                    remote_port: src_port,
                    local_port: dst_port,
                };
                match self.flows.contains(&reply_to) {
                    true => Verdict::Pass,
                    false => Verdict::Drop("not a reply to a flow the guest opened"),
                }
            }
            PROTO_ICMP => {
                let Some(icmp) = Icmp::parse(ip.payload) else {
                    return Verdict::Drop("ICMP header truncated");
                };
                match icmp.kind {
                    ICMP_ECHO_REPLY => {
                        let reply_to = Flow {
                            protocol: PROTO_ICMP,
                            remote: ip.src,
                            remote_port: icmp.id,
                            local_port: 0,
                        };
                        match self.flows.contains(&reply_to) {
                            true => Verdict::Pass,
                            false => Verdict::Drop("echo reply to no echo the guest sent"),
                        }
                    }
                    // Unreachable and time exceeded tell the guest why its own traffic
                    // failed (path MTU discovery needs them), from any router on the path;
                    // what they quote must be a packet of a flow the guest opened.
                    ICMP_UNREACHABLE | ICMP_TIME_EXCEEDED => match self.quoted_flow(ip.payload) {
                        Some(flow) if self.flows.contains(&flow) => Verdict::Pass,
                        Some(_) => Verdict::Drop("ICMP error about no flow the guest opened"),
                        None => Verdict::Drop("ICMP error quoting no packet of the guest's"),
                    },
                    _ => Verdict::Drop("ICMP other than echo reply or an error"),
                }
            }
            _ => Verdict::Drop("IP protocol other than TCP, UDP or ICMP"),
        }
    }

    /// The flow of the packet an ICMP error quotes (its IPv4 header and first 8 bytes after
    /// the error's own 8), if the guest sent it.
    fn quoted_flow(&self, icmp: &[u8]) -> Option<Flow> {
        let quoted = icmp.get(8..)?;
        let header_len = usize::from(*quoted.first()? & 0x0f) * 4;
        if *quoted.first()? >> 4 != 4 || header_len < IPV4_MIN_HEADER {
            return None;
        }
        if be32(quoted, 12)? != self.guest_ip {
            return None;
        }
        let (protocol, remote) = (*quoted.get(9)?, be32(quoted, 16)?);
        let transport = quoted.get(header_len..header_len + 8)?;
        match protocol {
            PROTO_TCP | PROTO_UDP => {
                let (local_port, remote_port) = ports(transport)?;
                Some(Flow {
                    protocol,
                    remote,
                    remote_port,
                    local_port,
                })
            }
            PROTO_ICMP if transport[0] == ICMP_ECHO_REQUEST => Some(Flow {
                protocol,
                remote,
                remote_port: be16(transport, 4)?,
                local_port: 0,
            }),
            _ => None,
        }
    }

    fn any_port_allowed(&self, addr: u32, protocol: u8) -> bool {
        let class = match protocol {
            PROTO_TCP => IpProtocol::Tcp,
            PROTO_UDP => IpProtocol::Udp,
            _ => IpProtocol::Other,
        };
        self.rules
            .iter()
            .any(|r| r.allows_any_port(addr, class) && self.reaches(r, addr))
    }

    /// Whether rule `r`, which covers `addr`, may open it: always, unless `addr` is in a
    /// reserved network (the filter's, the policy's, the gateway) that the rule's own
    /// network does not lie in.
    fn reaches(&self, r: &ParsedRule, addr: u32) -> bool {
        let gateway = (self.gateway_ip, 32);
        RESERVED
            .iter()
            .chain(&self.reserved)
            .chain(std::iter::once(&gateway))
            .filter(|(net, prefix)| addr & mask(*prefix) == *net)
            .all(|(net, prefix)| r.prefix >= *prefix && r.net & mask(*prefix) == *net)
    }
}

/// A conversation the guest started, keyed as the guest sees it: its protocol, the remote
/// address and port (the echo id for ICMP) and its own port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Flow {
    protocol: u8,
    remote: u32,
    remote_port: u16,
    local_port: u16,
}

/// A fragmented packet for the guest, as IPv4 names it: its source, identification and
/// protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Fragmented {
    src: u32,
    id: u16,
    protocol: u8,
}

/// Keys by recency of their last use, at most `capacity`: past it the oldest is forgotten.
#[derive(Debug)]
struct RecencyTable<K> {
    /// Key → the tick of its last use.
    last_seen: HashMap<K, u64>,
    /// Tick → key, oldest first.
    by_age: BTreeMap<u64, K>,
    tick: u64,
    capacity: usize,
}

impl<K: Copy + Eq + std::hash::Hash> RecencyTable<K> {
    fn new(capacity: usize) -> Self {
        Self {
            last_seen: HashMap::new(),
            by_age: BTreeMap::new(),
            tick: 0,
            capacity,
        }
    }

    fn record(&mut self, key: K) {
        self.tick += 1;
        if let Some(previous) = self.last_seen.insert(key, self.tick) {
            self.by_age.remove(&previous);
        }
        self.by_age.insert(self.tick, key);
        if self.last_seen.len() > self.capacity
            && let Some((_, oldest)) = self.by_age.pop_first()
        {
            self.last_seen.remove(&oldest);
        }
    }

    fn contains(&self, key: &K) -> bool {
        self.last_seen.contains_key(key)
    }

    fn len(&self) -> usize {
        self.last_seen.len()
    }
}

fn be16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn be32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn mac_at(bytes: &[u8], at: usize) -> Option<[u8; 6]> {
    bytes.get(at..at + 6)?.try_into().ok()
}

struct Ethernet<'a> {
    dst: [u8; 6],
    src: [u8; 6],
    ethertype: u16,
    payload: &'a [u8],
}

impl<'a> Ethernet<'a> {
    fn parse(frame: &'a [u8]) -> Option<Self> {
        Some(Self {
            dst: mac_at(frame, 0)?,
            src: mac_at(frame, 6)?,
            ethertype: be16(frame, 12)?,
            payload: frame.get(ETH_HEADER_LEN..)?,
        })
    }
}

/// An Ethernet/IPv4 ARP request or reply.
struct Arp {
    sender_mac: [u8; 6],
    sender_ip: u32,
    target_ip: u32,
}

impl Arp {
    fn parse(payload: &[u8]) -> Option<Self> {
        if payload.len() < ARP_LEN {
            return None;
        }
        let ethernet_ipv4 = be16(payload, 0)? == 1
            && be16(payload, 2)? == ETHERTYPE_IPV4
            && payload[4] == 6
            && payload[5] == 4;
        let operation = be16(payload, 6)?;
        if !ethernet_ipv4 || !(operation == 1 || operation == 2) {
            return None;
        }
        Some(Self {
            sender_mac: mac_at(payload, 8)?,
            sender_ip: be32(payload, 14)?,
            target_ip: be32(payload, 24)?,
        })
    }
}

struct Ipv4<'a> {
    src: u32,
    dst: u32,
    protocol: u8,
    /// The identification its fragments share.
    id: u16,
    /// Fragment offset 0: the packet starts with its transport header.
    first_fragment: bool,
    /// More fragments follow this one.
    more_fragments: bool,
    /// The transport bytes, within the header's total length.
    payload: &'a [u8],
}

impl<'a> Ipv4<'a> {
    fn parse(packet: &'a [u8]) -> Option<Self> {
        let first = *packet.first()?;
        let header_len = usize::from(first & 0x0f) * 4;
        if first >> 4 != 4 || header_len < IPV4_MIN_HEADER || packet.len() < header_len {
            return None;
        }
        let total_len = usize::from(be16(packet, 2)?);
        // Shorter than its header, or longer than the frame: malformed. Shorter than the
        // frame is fine (Ethernet pads small frames).
        if total_len < header_len || total_len > packet.len() {
            return None;
        }
        let fragment = be16(packet, 6)?;
        Some(Self {
            src: be32(packet, 12)?,
            dst: be32(packet, 16)?,
            protocol: packet[9],
            id: be16(packet, 4)?,
            first_fragment: fragment & 0x1fff == 0,
            more_fragments: fragment & 0x2000 != 0,
            payload: packet.get(header_len..total_len)?,
        })
    }
}

/// (source port, destination port) of a TCP or UDP header.
fn ports(transport: &[u8]) -> Option<(u16, u16)> {
    Some((be16(transport, 0)?, be16(transport, 2)?))
}

struct Icmp {
    kind: u8,
    /// The identifier of an echo request or reply.
    id: u16,
}

impl Icmp {
    fn parse(transport: &[u8]) -> Option<Self> {
        if transport.len() < 8 {
            return None;
        }
        Some(Self {
            kind: transport[0],
            id: be16(transport, 4)?,
        })
    }
}

#[cfg(test)]
mod tests;
