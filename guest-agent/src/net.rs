//! The guest's one network interface: its MAC, address, default route and name server, as
//! the host gives them (at boot on the kernel command line, after a restore or fork in the
//! Restored notice). Set with the classic socket ioctls: the agent needs no netlink and no
//! tools in the image.

use std::net::Ipv4Addr;

use agentvm_proto::guest::v1::Network;
use nix::errno::Errno;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};

use crate::sys;
use crate::system::SystemError;

/// Where the name server goes: the host's resolver at the gateway enforces the policy.
const RESOLV_CONF: &str = "/etc/resolv.conf";

/// A [`Network`] checked and parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interface {
    pub address: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
    pub mac: [u8; 6],
}

impl Interface {
    pub fn parse(network: &Network) -> Result<Self, SystemError> {
        let invalid = |m: String| SystemError::Invalid(format!("network.{m}"));
        let address: Ipv4Addr = network.address.parse().map_err(|_| {
            invalid(format!(
                "address {:?}: not an IPv4 address",
                network.address
            ))
        })?;
        let gateway: Ipv4Addr = network.gateway.parse().map_err(|_| {
            invalid(format!(
                "gateway {:?}: not an IPv4 address",
                network.gateway
            ))
        })?;
        if !(1..=30).contains(&network.prefix_len) {
            return Err(invalid(format!(
                "prefix_len {}: 1 to 30 expected",
                network.prefix_len
            )));
        }
        let mac = parse_mac(&network.mac)
            .ok_or_else(|| invalid(format!("mac {:?}: not a unicast MAC", network.mac)))?;
        Ok(Self {
            address,
            prefix_len: network.prefix_len as u8,
            gateway,
            mac,
        })
    }

    /// From `agentvm.net=ADDRESS/PREFIX,GATEWAY,MAC`.
    pub fn from_cmdline(value: &str) -> Option<Network> {
        let mut parts = value.split(',');
        let (address, prefix) = parts.next()?.split_once('/')?;
        let gateway = parts.next()?;
        let mac = parts.next()?;
        Some(Network {
            address: address.to_owned(),
            prefix_len: prefix.parse().ok()?,
            gateway: gateway.to_owned(),
            mac: mac.to_owned(),
        })
    }

    fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::MAX << (32 - u32::from(self.prefix_len)))
    }
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    // Multicast (and broadcast) addresses are not an interface's own.
    (parts.next().is_none() && mac[0] & 1 == 0).then_some(mac)
}

/// The first interface that is not loopback (the VM has one network device).
fn interface_name() -> Result<String, SystemError> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .map_err(|source| SystemError::Syscall {
            what: "listing /sys/class/net",
            source,
        })?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n != "lo")
        .collect();
    names.sort();
    names
        .into_iter()
        .next()
        .ok_or_else(|| SystemError::Invalid("network: the VM has no network interface".into()))
}

/// Brings the interface down, gives it `iface`'s MAC and address, brings it and loopback up,
/// routes everything through the gateway and names it the name server. Going down first
/// drops every route (and so every connection) of an earlier identity.
pub fn configure(iface: &Interface) -> Result<(), SystemError> {
    let name = interface_name()?;
    let sock = socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| failed("socket(AF_INET)", e))?;
    let up = |name: &str, up: bool| {
        sys::set_interface_up(&sock, name, up).map_err(|e| failed("SIOCSIFFLAGS", e))
    };
    up("lo", true)?;
    up(&name, false)?;
    sys::set_interface_hwaddr(&sock, &name, iface.mac).map_err(|e| failed("SIOCSIFHWADDR", e))?;
    sys::set_interface_ipv4(&sock, &name, libc::SIOCSIFADDR, iface.address)
        .map_err(|e| failed("SIOCSIFADDR", e))?;
    sys::set_interface_ipv4(&sock, &name, libc::SIOCSIFNETMASK, iface.netmask())
        .map_err(|e| failed("SIOCSIFNETMASK", e))?;
    up(&name, true)?;
    match sys::add_default_route(&sock, iface.gateway) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(failed("SIOCADDRT (default route)", e)),
    }
    write_resolv_conf(iface.gateway)
}

fn write_resolv_conf(gateway: Ipv4Addr) -> Result<(), SystemError> {
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all("/etc")?;
        // A symlink (systemd-resolved's stub) would send the write elsewhere.
        let _ = std::fs::remove_file(RESOLV_CONF);
        std::fs::write(RESOLV_CONF, format!("nameserver {gateway}\n"))
    };
    write().map_err(|source| SystemError::Syscall {
        what: "writing /etc/resolv.conf",
        source,
    })
}

fn failed(what: &'static str, errno: Errno) -> SystemError {
    SystemError::Syscall {
        what,
        source: errno.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn network(address: &str, prefix_len: u32, gateway: &str, mac: &str) -> Network {
        Network {
            address: address.into(),
            prefix_len,
            gateway: gateway.into(),
            mac: mac.into(),
        }
    }

    #[test]
    fn a_network_is_parsed_and_checked() {
        let iface =
            Interface::parse(&network("10.77.0.2", 30, "10.77.0.1", "06:00:0a:4d:00:02")).unwrap();
        assert_eq!(iface.address, Ipv4Addr::new(10, 77, 0, 2));
        assert_eq!(iface.netmask(), Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(iface.mac, [6, 0, 0x0a, 0x4d, 0, 2]);
        for (bad, field) in [
            (
                network("10.77.0", 30, "10.77.0.1", "06:00:00:00:00:01"),
                "address",
            ),
            (
                network("10.77.0.2", 0, "10.77.0.1", "06:00:00:00:00:01"),
                "prefix_len",
            ),
            (
                network("10.77.0.2", 31, "10.77.0.1", "06:00:00:00:00:01"),
                "prefix_len",
            ),
            (
                network("10.77.0.2", 30, "x", "06:00:00:00:00:01"),
                "gateway",
            ),
            (
                network("10.77.0.2", 30, "10.77.0.1", "07:00:00:00:00:01"),
                "mac",
            ),
            (
                network("10.77.0.2", 30, "10.77.0.1", "06:00:00:00:00"),
                "mac",
            ),
            (
                network("10.77.0.2", 30, "10.77.0.1", "06:00:00:00:00:01:02"),
                "mac",
            ),
        ] {
            let err = Interface::parse(&bad).unwrap_err().to_string();
            assert!(err.contains(&format!("network.{field}")), "{err}");
        }
    }

    #[test]
    fn the_command_line_form_round_trips() {
        let net = Interface::from_cmdline("10.77.0.2/30,10.77.0.1,06:00:0a:4d:00:02").unwrap();
        assert_eq!(
            net,
            network("10.77.0.2", 30, "10.77.0.1", "06:00:0a:4d:00:02")
        );
        assert!(Interface::from_cmdline("10.77.0.2,10.77.0.1").is_none());
        assert!(Interface::from_cmdline("10.77.0.2/x,10.77.0.1,06:00:0a:4d:00:02").is_none());
    }
}
