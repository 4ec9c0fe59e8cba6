//! The `[network] allow` entries of image.toml: what a VM may reach. An entry is a target
//! with optional ports, `TARGET[:PORT[-PORT]]`, where the target is an IPv4 address, an IPv4
//! CIDR block, a DNS name, or `*.` and a domain (every name under it). Addresses are
//! enforced by the VMM's network device; names by the host's resolver, which answers only
//! for allowed names and lets the addresses it answered with through.

use std::net::Ipv4Addr;

/// Longest DNS name (RFC 1035, text form without the final dot).
const MAX_NAME: usize = 253;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// An address block: `(network, prefix length)`, the network with host bits clear.
    Block(Ipv4Addr, u8),
    /// One name, lowercase, without a final dot.
    Name(String),
    /// Every name strictly under this domain (`*.example.com` → `example.com`).
    Under(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowEntry {
    pub target: Target,
    /// Inclusive; `None` is every port (and ping).
    pub ports: Option<(u16, u16)>,
    /// The entry as written.
    pub text: String,
}

impl AllowEntry {
    pub fn parse(text: &str) -> Result<Self, String> {
        let (target, ports) = match text.rsplit_once(':') {
            Some((target, ports)) => (target, Some(parse_ports(ports)?)),
            None => (text, None),
        };
        Ok(Self {
            target: parse_target(target)?,
            ports,
            text: text.to_owned(),
        })
    }

    /// Whether `name` (as a resolver gets it) is one this entry allows.
    pub fn allows_name(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        match &self.target {
            Target::Name(n) => *n == name,
            Target::Under(domain) => name
                .strip_suffix(domain.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            Target::Block(..) => false,
        }
    }

    /// The ports as the VMM's rules write them (`N` or `N-M`), `None` for all.
    pub fn ports_text(&self) -> Option<String> {
        self.ports.map(|(lo, hi)| match lo == hi {
            true => lo.to_string(),
            false => format!("{lo}-{hi}"),
        })
    }
}

fn parse_ports(text: &str) -> Result<(u16, u16), String> {
    let port = |p: &str| match p.parse::<u16>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{p:?} is not a port (1-65535)")),
    };
    let (lo, hi) = match text.split_once('-') {
        Some((lo, hi)) => (port(lo)?, port(hi)?),
        None => (port(text)?, port(text)?),
    };
    if lo > hi {
        return Err(format!("port range {text:?} runs backwards"));
    }
    Ok((lo, hi))
}

fn parse_target(text: &str) -> Result<Target, String> {
    if let Some((address, prefix)) = text.split_once('/') {
        let address: Ipv4Addr = address
            .parse()
            .map_err(|_| format!("{address:?} is not an IPv4 address"))?;
        let prefix: u8 = match prefix.parse() {
            Ok(p) if p <= 32 => p,
            _ => return Err(format!("/{prefix} is not a prefix length (0-32)")),
        };
        let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
        if u32::from(address) & !mask != 0 {
            return Err(format!("{text}: host bits are set below the /{prefix}"));
        }
        return Ok(Target::Block(address, prefix));
    }
    if let Ok(address) = text.parse::<Ipv4Addr>() {
        return Ok(Target::Block(address, 32));
    }
    let (wildcard, name) = match text.strip_prefix("*.") {
        Some(domain) => (true, domain),
        None => (false, text),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.is_empty() || name.len() > MAX_NAME || !name.split('.').all(label_ok) {
        return Err(format!(
            "{text:?} is not an IPv4 address, a CIDR block, a DNS name or *.domain"
        ));
    }
    // A bare number-and-dots that did not parse as an address is a typo, not a name.
    if name.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!("{text:?} is not an IPv4 address"));
    }
    Ok(match wildcard {
        true => Target::Under(name),
        false => Target::Name(name),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_into_targets_and_ports() {
        let e = AllowEntry::parse("10.0.0.0/8:443").unwrap();
        assert_eq!(e.target, Target::Block(Ipv4Addr::new(10, 0, 0, 0), 8));
        assert_eq!(e.ports, Some((443, 443)));
        assert_eq!(e.ports_text().as_deref(), Some("443"));
        let e = AllowEntry::parse("192.0.2.7:8000-8080").unwrap();
        assert_eq!(e.target, Target::Block(Ipv4Addr::new(192, 0, 2, 7), 32));
        assert_eq!(e.ports_text().as_deref(), Some("8000-8080"));
        let e = AllowEntry::parse("PyPI.org").unwrap();
        assert_eq!(e.target, Target::Name("pypi.org".into()));
        assert_eq!(e.ports, None);
        let e = AllowEntry::parse("*.example.com:443").unwrap();
        assert_eq!(e.target, Target::Under("example.com".into()));
    }

    #[test]
    fn bad_entries_say_what_is_wrong() {
        for (bad, why) in [
            ("10.0.0.1/8", "host bits"),
            ("10.0.0.0/33", "prefix length"),
            ("10.0.0.300", "not an IPv4 address"),
            ("example.com:0", "not a port"),
            ("example.com:70000", "not a port"),
            ("example.com:90-80", "backwards"),
            ("exa mple.com", "not an IPv4 address, a CIDR block"),
            ("-bad.com", "not an IPv4 address, a CIDR block"),
            ("", "not an IPv4 address, a CIDR block"),
            ("*.", "not an IPv4 address, a CIDR block"),
        ] {
            let err = AllowEntry::parse(bad).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn names_match_exactly_or_strictly_under_a_wildcard() {
        let exact = AllowEntry::parse("api.example.com").unwrap();
        assert!(exact.allows_name("API.example.com."));
        assert!(!exact.allows_name("x.api.example.com"));
        let under = AllowEntry::parse("*.example.com").unwrap();
        assert!(under.allows_name("a.b.example.com"));
        assert!(!under.allows_name("example.com"));
        assert!(!under.allows_name("badexample.com"));
        let block = AllowEntry::parse("10.0.0.0/8").unwrap();
        assert!(!block.allows_name("10.0.0.1"));
    }
}
