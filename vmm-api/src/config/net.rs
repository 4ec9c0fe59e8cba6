//! `net[]`: a virtio-net device on a tap, Cloud Hypervisor's rate limiter, and agentvm's
//! egress policy, with the parsed forms the VMM (and the daemon, checking an image's policy
//! before it boots anything) works from.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Most network devices a VM may have: one NIC per VM for now.
pub const MAX_NETS: usize = 1;
/// The guest MAC when the config names none (QEMU's customary locally administered one).
pub const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
/// MTU offered to the guest when the config names none.
pub const DEFAULT_MTU: u16 = 1500;
/// Smallest MTU accepted (the IPv4 minimum datagram every host must take).
pub const MIN_MTU: u16 = 576;
/// Largest MTU accepted: no jumbo frames, the device has no offloads.
pub const MAX_MTU: u16 = 1500;
/// Longest interface name Linux takes (IFNAMSIZ without the NUL).
pub const MAX_TAP_NAME_LEN: usize = 15;
/// Most allow rules one device's policy may hold, `vm.egress-allow` additions included.
pub const MAX_EGRESS_RULES: usize = 4096;
/// Longest token-bucket refill period accepted: a day. Longer ones are surely mistakes, and
/// the bound keeps the bucket's fixed-point arithmetic exact.
pub const MAX_REFILL_TIME_MS: u64 = 24 * 3600 * 1000;

/// A virtio-net device whose backend is a tap interface in the VMM's network namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Tap interface name in the VMM's network namespace (1..=15 bytes, no '/', no NUL).
    /// The VMM opens /dev/net/tun and attaches with TUNSETIFF(IFF_TAP|IFF_NO_PI); the tap
    /// already exists (the daemon created it owned by the VMM's uid).
    pub tap: String,
    /// Guest MAC "xx:xx:xx:xx:xx:xx" (unicast). Default 52:54:00:12:34:56.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Device id; `_net0` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// 576..=1500, default 1500 (offered with VIRTIO_NET_F_MTU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u16>,
    /// Cloud Hypervisor's rate limiter; applied separately to each direction, as policing
    /// (frames over the budget are dropped, counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limiter_config: Option<RateLimiterConfig>,
    /// agentvm extension: when present, only the traffic it allows crosses the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<EgressPolicy>,
}

impl NetConfig {
    /// A device on `tap` with every default.
    pub fn on_tap(tap: impl Into<String>) -> Self {
        Self {
            tap: tap.into(),
            mac: None,
            id: None,
            mtu: None,
            rate_limiter_config: None,
            egress: None,
        }
    }

    /// The device id: its own, else `_netN` for the `index`th device.
    pub fn device_id(&self, index: usize) -> String {
        self.id.clone().unwrap_or_else(|| format!("_net{index}"))
    }

    /// The guest MAC as bytes (the default when none is set).
    pub fn mac_bytes(&self) -> Result<[u8; 6], ConfigError> {
        match &self.mac {
            Some(mac) => parse_mac(mac).map_err(|reason| ConfigError::new("mac", reason)),
            None => Ok(DEFAULT_MAC),
        }
    }

    /// The MTU offered to the guest.
    pub fn mtu(&self) -> u16 {
        self.mtu.unwrap_or(DEFAULT_MTU)
    }

    /// Checks every field; errors name it relative to the device (`tap`, `egress.guest_ip`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_tap_name(&self.tap).map_err(|reason| ConfigError::new("tap", reason))?;
        self.mac_bytes()?;
        if self.id.as_deref() == Some("") {
            return Err(ConfigError::new("id", "must not be empty"));
        }
        if let Some(mtu) = self.mtu
            && !(MIN_MTU..=MAX_MTU).contains(&mtu)
        {
            return Err(ConfigError::new(
                "mtu",
                format!("must be between {MIN_MTU} and {MAX_MTU}, got {mtu}"),
            ));
        }
        if let Some(limiter) = &self.rate_limiter_config {
            limiter
                .validate()
                .map_err(|e| e.within("rate_limiter_config"))?;
        }
        if let Some(egress) = &self.egress {
            egress.validate().map_err(|e| e.within("egress"))?;
        }
        Ok(())
    }
}

/// Parses "xx:xx:xx:xx:xx:xx" (hex, either case) into a unicast, non-zero MAC.
pub fn parse_mac(text: &str) -> Result<[u8; 6], String> {
    let bad = || format!("{text:?} is not a MAC address of the form xx:xx:xx:xx:xx:xx");
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().ok_or_else(bad)?;
        if part.len() != 2 {
            return Err(bad());
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    if mac[0] & 1 != 0 {
        return Err(format!(
            "{text} is a multicast address; the guest needs a unicast one"
        ));
    }
    if mac == [0; 6] {
        return Err("00:00:00:00:00:00 is not a usable address".to_owned());
    }
    Ok(mac)
}

/// The MAC as "xx:xx:xx:xx:xx:xx".
pub fn format_mac(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// An interface name Linux would take: 1..=15 bytes, not `.` or `..`, no '/', ':', NUL or
/// whitespace.
pub fn check_tap_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".to_owned());
    }
    if name.len() > MAX_TAP_NAME_LEN {
        return Err(format!(
            "{name:?} is {} bytes long, an interface name has at most {MAX_TAP_NAME_LEN}",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return Err(format!("{name:?} is not an interface name"));
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c == '\0' || c.is_whitespace())
    {
        return Err(format!(
            "{name:?} contains a character interface names cannot have ('/', ':', NUL or \
             whitespace)"
        ));
    }
    Ok(())
}

/// Cloud Hypervisor's rate limiter: token buckets for bytes and for frames (either or both).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimiterConfig {
    /// Bytes (of Ethernet frames, without the virtio header).
    #[serde(default)]
    pub bandwidth: Option<TokenBucket>,
    /// Frames.
    #[serde(default)]
    pub ops: Option<TokenBucket>,
}

impl RateLimiterConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (name, bucket) in [("bandwidth", &self.bandwidth), ("ops", &self.ops)] {
            if let Some(bucket) = bucket {
                bucket.validate().map_err(|e| e.within(name))?;
            }
        }
        Ok(())
    }
}

/// `size` tokens every `refill_time` ms, plus `one_time_burst` spent first (Firecracker and
/// Cloud Hypervisor semantics). A `size` of 0 means no limit, as there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucket {
    pub size: u64,
    #[serde(default)]
    pub one_time_burst: Option<u64>,
    /// Milliseconds to refill the bucket from empty: 1..=86400000.
    pub refill_time: u64,
}

impl TokenBucket {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_REFILL_TIME_MS).contains(&self.refill_time) {
            return Err(ConfigError::new(
                "refill_time",
                format!(
                    "must be between 1 and {MAX_REFILL_TIME_MS} ms, got {}",
                    self.refill_time
                ),
            ));
        }
        Ok(())
    }
}

/// agentvm's egress policy for one device: what the guest may send, and the replies it may
/// receive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressPolicy {
    /// The only IPv4 source address the guest may use (and the only destination let in).
    pub guest_ip: Ipv4Addr,
    /// The tap's address: ARP with it and DNS (UDP and TCP port 53) to it are always allowed.
    pub gateway_ip: Ipv4Addr,
    #[serde(default)]
    pub allow: Vec<EgressRule>,
    /// Networks (`a.b.c.d/n`) that no rule opens unless the rule's own network lies inside
    /// one: what only the host knows to keep closed (its own addresses, the guest pool),
    /// beside the reserved networks the filter always keeps so.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved: Vec<String>,
}

/// Most networks a policy may hold in `reserved`.
pub const MAX_RESERVED: usize = 256;

/// An [`EgressPolicy`] with its rules parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedPolicy {
    pub guest_ip: Ipv4Addr,
    pub gateway_ip: Ipv4Addr,
    pub rules: Vec<ParsedRule>,
    /// `reserved`, as (network, prefix) in host order.
    pub reserved: Vec<(u32, u8)>,
}

impl EgressPolicy {
    /// Checks the addresses and every rule; errors name the field (`allow[2].ports`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.parse().map(drop)
    }

    /// The policy with its rules parsed, after the checks of [`Self::validate`].
    pub fn parse(&self) -> Result<ParsedPolicy, ConfigError> {
        check_host_address(self.guest_ip).map_err(|r| ConfigError::new("guest_ip", r))?;
        check_host_address(self.gateway_ip).map_err(|r| ConfigError::new("gateway_ip", r))?;
        if self.guest_ip == self.gateway_ip {
            return Err(ConfigError::new(
                "gateway_ip",
                format!("{} is the guest's own address", self.gateway_ip),
            ));
        }
        if self.allow.len() > MAX_EGRESS_RULES {
            return Err(ConfigError::new(
                "allow",
                format!("at most {MAX_EGRESS_RULES} rules, got {}", self.allow.len()),
            ));
        }
        let rules = parse_rules(&self.allow).map_err(|e| e.within("allow"))?;
        if self.reserved.len() > MAX_RESERVED {
            return Err(ConfigError::new(
                "reserved",
                format!(
                    "at most {MAX_RESERVED} networks, got {}",
                    self.reserved.len()
                ),
            ));
        }
        let reserved = self
            .reserved
            .iter()
            .enumerate()
            .map(|(i, cidr)| {
                parse_cidr(cidr)
                    .map_err(|reason| ConfigError::new(&format!("reserved[{i}]"), reason))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ParsedPolicy {
            guest_ip: self.guest_ip,
            gateway_ip: self.gateway_ip,
            rules,
            reserved,
        })
    }
}

/// Parses rules in order; an error names the rule by index (`[2].ports`, to be put under
/// the field that holds them).
pub fn parse_rules(rules: &[EgressRule]) -> Result<Vec<ParsedRule>, ConfigError> {
    rules
        .iter()
        .enumerate()
        .map(|(i, rule)| rule.parse().map_err(|e| e.within_index(i)))
        .collect()
}

/// An address a host on the link may have: not unspecified, broadcast, multicast or
/// loopback.
fn check_host_address(ip: Ipv4Addr) -> Result<(), String> {
    if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() || ip.is_loopback() {
        return Err(format!("{ip} is not a unicast host address"));
    }
    Ok(())
}

/// One allow rule: a destination network, and optionally ports and a protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressRule {
    /// "a.b.c.d/n" (or a bare address = /32).
    pub cidr: String,
    /// "N" or "N-M"; absent = every port (and ICMP echo).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<String>,
    /// "tcp" | "udp"; absent = both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
}

/// An [`EgressRule`] as the filter uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParsedRule {
    /// Network address, host order, host bits zero.
    pub net: u32,
    /// 0..=32.
    pub prefix: u8,
    /// Inclusive; (0, 65535) when the rule names no ports.
    pub ports: (u16, u16),
    pub tcp: bool,
    pub udp: bool,
}

impl EgressRule {
    /// A rule for one host, every port and both protocols.
    pub fn host(ip: Ipv4Addr) -> Self {
        Self {
            cidr: ip.to_string(),
            ports: None,
            protocol: None,
        }
    }

    /// The rule parsed; errors name the field (`cidr`, `ports`, `protocol`).
    pub fn parse(&self) -> Result<ParsedRule, ConfigError> {
        let (net, prefix) =
            parse_cidr(&self.cidr).map_err(|reason| ConfigError::new("cidr", reason))?;
        let ports = match &self.ports {
            None => (0, u16::MAX),
            Some(text) => parse_ports(text).map_err(|reason| ConfigError::new("ports", reason))?,
        };
        let (tcp, udp) = match self.protocol.as_deref() {
            None => (true, true),
            Some("tcp") => (true, false),
            Some("udp") => (false, true),
            Some(other) => {
                return Err(ConfigError::new(
                    "protocol",
                    format!("{other:?} is not \"tcp\" or \"udp\""),
                ));
            }
        };
        Ok(ParsedRule {
            net,
            prefix,
            ports,
            tcp,
            udp,
        })
    }
}

impl ParsedRule {
    /// Whether `addr` (host order) is inside the rule's network.
    pub fn covers(&self, addr: u32) -> bool {
        addr & prefix_mask(self.prefix) == self.net
    }

    /// The rule names no ports: it allows every port and ICMP echo (when it names no
    /// protocol either).
    pub fn all_ports(&self) -> bool {
        self.ports == (0, u16::MAX)
    }

    /// Whether it allows TCP (`tcp`) or UDP (`!tcp`) to `addr`:`port`.
    pub fn allows(&self, addr: u32, tcp: bool, port: u16) -> bool {
        let protocol = if tcp { self.tcp } else { self.udp };
        protocol && self.covers(addr) && (self.ports.0..=self.ports.1).contains(&port)
    }

    /// Whether it allows every packet of IP protocol `protocol` to `addr`, whatever its ports
    /// (ICMP, and fragments that carry no ports): a rule without ports, and for anything but
    /// TCP or UDP one without a protocol either.
    pub fn allows_any_port(&self, addr: u32, protocol: IpProtocol) -> bool {
        let protocol = match protocol {
            IpProtocol::Tcp => self.tcp,
            IpProtocol::Udp => self.udp,
            IpProtocol::Other => self.tcp && self.udp,
        };
        protocol && self.all_ports() && self.covers(addr)
    }
}

/// What [`ParsedRule::allows_any_port`] distinguishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpProtocol {
    Tcp,
    Udp,
    Other,
}

fn prefix_mask(prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p => u32::MAX << (32 - u32::from(p.min(32))),
    }
}

/// "a.b.c.d/n" or "a.b.c.d" (/32); host bits must be zero.
fn parse_cidr(text: &str) -> Result<(u32, u8), String> {
    let (addr, prefix) = match text.split_once('/') {
        Some((addr, prefix)) => {
            let prefix = prefix
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= 32 && !prefix.starts_with('+'))
                .ok_or_else(|| format!("{text:?}: the prefix length must be 0..=32"))?;
            (addr, prefix)
        }
        None => (text, 32),
    };
    let addr: Ipv4Addr = addr
        .parse()
        .map_err(|_| format!("{text:?} is not an IPv4 address or a.b.c.d/n network"))?;
    let addr = u32::from(addr);
    let net = addr & prefix_mask(prefix);
    if net != addr {
        return Err(format!(
            "{text:?} has host bits set (the network is {}/{prefix})",
            Ipv4Addr::from(net)
        ));
    }
    Ok((net, prefix))
}

/// "N" or "N-M" with N <= M.
fn parse_ports(text: &str) -> Result<(u16, u16), String> {
    let port = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|_| !p.starts_with('+'))
            .ok_or_else(|| format!("{text:?}: ports are \"N\" or \"N-M\" with N, M in 0..=65535"))
    };
    let (low, high) = match text.split_once('-') {
        Some((low, high)) => (port(low)?, port(high)?),
        None => {
            let p = port(text)?;
            (p, p)
        }
    };
    if low > high {
        return Err(format!("{text:?}: the range runs backwards"));
    }
    Ok((low, high))
}

#[cfg(test)]
mod tests;
