//! The filter on hand-built frames: what it lets through each way, what it refuses, and
//! that no sequence of bytes makes it panic.

use std::net::Ipv4Addr;

use agentvm_vmm_api::config::{EgressPolicy, EgressRule, MAX_EGRESS_RULES};

use super::super::test_frames::*;
use super::{EgressFilter, FLOW_CAPACITY, Verdict};

const GITHUB: Ipv4Addr = Ipv4Addr::new(140, 82, 112, 4);
const PINGABLE: Ipv4Addr = Ipv4Addr::new(1, 1, 1, 1);
const ELSEWHERE: Ipv4Addr = Ipv4Addr::new(93, 184, 216, 34);

fn rule(cidr: &str, ports: Option<&str>, protocol: Option<&str>) -> EgressRule {
    EgressRule {
        cidr: cidr.into(),
        ports: ports.map(Into::into),
        protocol: protocol.map(Into::into),
    }
}

/// HTTPS to 140.82.112.0/20, anything to 1.1.1.1, UDP 5000-5010 anywhere.
fn filter() -> EgressFilter {
    let policy = EgressPolicy {
        guest_ip: GUEST_IP,
        gateway_ip: GATEWAY_IP,
        allow: vec![
            rule("140.82.112.0/20", Some("443"), Some("tcp")),
            rule("1.1.1.1", None, None),
            rule("0.0.0.0/0", Some("5000-5010"), Some("udp")),
        ],
        reserved: Vec::new(),
    };
    EgressFilter::new(GUEST_MAC, &policy.parse().unwrap())
}

fn passes(v: Verdict) -> bool {
    v == Verdict::Pass
}

#[test]
fn allowed_traffic_leaves_and_its_replies_come_back() {
    let mut f = filter();
    assert!(passes(f.outbound(&guest_sends(TCP, 40000, GITHUB, 443))));
    assert!(passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 40000))));
    assert!(passes(
        f.outbound(&guest_sends(UDP, 40001, ELSEWHERE, 5005))
    ));
    assert!(passes(
        f.inbound(&guest_receives(UDP, ELSEWHERE, 5005, 40001))
    ));
    assert!(passes(f.outbound(&guest_sends(TCP, 40002, PINGABLE, 22))));
    assert!(passes(f.outbound(&guest_sends(UDP, 40003, PINGABLE, 9))));
    assert_eq!(f.flow_count(), 4);
}

#[test]
fn dns_to_the_gateway_and_arp_are_always_allowed() {
    let mut f = filter();
    assert!(passes(f.outbound(&guest_sends(UDP, 33000, GATEWAY_IP, 53))));
    assert!(passes(f.outbound(&guest_sends(TCP, 33001, GATEWAY_IP, 53))));
    // A DNS answer from the gateway passes even to a port the guest did not use.
    assert!(passes(
        f.inbound(&guest_receives(UDP, GATEWAY_IP, 53, 33000))
    ));
    assert!(passes(
        f.inbound(&guest_receives(UDP, GATEWAY_IP, 53, 1234))
    ));
    assert!(!passes(
        f.outbound(&guest_sends(UDP, 33000, GATEWAY_IP, 54))
    ));
    assert!(
        !passes(f.outbound(&guest_sends(UDP, 33000, ELSEWHERE, 53))),
        "DNS elsewhere"
    );
    assert!(!passes(
        f.inbound(&guest_receives(UDP, ELSEWHERE, 53, 33000))
    ));

    let who_has = arp(1, (GUEST_MAC, GUEST_IP), ([0; 6], GATEWAY_IP));
    assert!(passes(
        f.outbound(&ethernet(BROADCAST, GUEST_MAC, 0x0806, &who_has))
    ));
    let reply = arp(2, (GATEWAY_MAC, GATEWAY_IP), (GUEST_MAC, GUEST_IP));
    assert!(passes(f.inbound(&ethernet(
        GUEST_MAC,
        GATEWAY_MAC,
        0x0806,
        &reply
    ))));
    let asks_guest = arp(1, (GATEWAY_MAC, GATEWAY_IP), ([0; 6], GUEST_IP));
    assert!(passes(f.inbound(&ethernet(
        BROADCAST,
        GATEWAY_MAC,
        0x0806,
        &asks_guest
    ))));
    let asks_other = arp(1, (GATEWAY_MAC, GATEWAY_IP), ([0; 6], ELSEWHERE));
    assert!(!passes(f.inbound(&ethernet(
        BROADCAST,
        GATEWAY_MAC,
        0x0806,
        &asks_other
    ))));
}

#[test]
fn traffic_no_rule_allows_is_refused() {
    let mut f = filter();
    for frame in [
        guest_sends(TCP, 40000, GITHUB, 80),
        guest_sends(UDP, 40000, GITHUB, 443),
        guest_sends(TCP, 40000, Ipv4Addr::new(140, 82, 128, 1), 443),
        guest_sends(TCP, 40000, ELSEWHERE, 443),
        guest_sends(UDP, 40000, ELSEWHERE, 5011),
        guest_sends(TCP, 40000, ELSEWHERE, 5005),
        // Other IP protocols (GRE) and ethertypes (IPv6, VLAN).
        ethernet(
            GATEWAY_MAC,
            GUEST_MAC,
            0x0800,
            &ipv4(GUEST_IP, PINGABLE, 47, 0, &[0; 8]),
        ),
        ethernet(GATEWAY_MAC, GUEST_MAC, 0x86dd, &[0x60; 60]),
        ethernet(GATEWAY_MAC, GUEST_MAC, 0x8100, &[0; 60]),
    ] {
        assert!(!passes(f.outbound(&frame)), "{frame:02x?}");
    }
    assert_eq!(f.flow_count(), 0, "refused traffic opens no flow");
}

#[test]
fn spoofed_sources_are_refused() {
    let mut f = filter();
    let mut wrong_mac = guest_sends(TCP, 40000, GITHUB, 443);
    wrong_mac[6..12].copy_from_slice(&[0x52, 0x54, 0, 0, 0, 9]);
    assert_eq!(
        f.outbound(&wrong_mac),
        Verdict::Drop("Ethernet source is not the guest's MAC")
    );
    let other_ip = ethernet(
        GATEWAY_MAC,
        GUEST_MAC,
        0x0800,
        &ipv4(
            Ipv4Addr::new(10, 0, 0, 3),
            GITHUB,
            TCP,
            0,
            &transport(1, 443, b""),
        ),
    );
    assert_eq!(
        f.outbound(&other_ip),
        Verdict::Drop("IPv4 source is not the guest's address")
    );
    // ARP claiming another address, or another MAC, or probing from 0.0.0.0.
    for sender in [
        (GUEST_MAC, Ipv4Addr::new(10, 0, 0, 3)),
        (GATEWAY_MAC, GUEST_IP),
        (GUEST_MAC, Ipv4Addr::UNSPECIFIED),
    ] {
        let claim = arp(2, sender, (GATEWAY_MAC, GATEWAY_IP));
        assert!(!passes(f.outbound(&ethernet(
            GATEWAY_MAC,
            GUEST_MAC,
            0x0806,
            &claim
        ))));
    }
    // DHCP from 0.0.0.0.
    let dhcp = ethernet(
        BROADCAST,
        GUEST_MAC,
        0x0800,
        &ipv4(
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::BROADCAST,
            UDP,
            0,
            &transport(68, 67, b""),
        ),
    );
    assert!(!passes(f.outbound(&dhcp)));
    assert_eq!(f.flow_count(), 0);
}

#[test]
fn inbound_needs_a_flow_the_guest_opened_and_the_guest_as_destination() {
    let mut f = filter();
    // Nothing sent yet: an allowed peer still cannot open a connection to the guest.
    assert!(!passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 40000))));
    assert!(passes(f.outbound(&guest_sends(TCP, 40000, GITHUB, 443))));
    assert!(passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 40000))));
    for frame in [
        guest_receives(TCP, GITHUB, 443, 40001),
        guest_receives(TCP, GITHUB, 444, 40000),
        guest_receives(UDP, GITHUB, 443, 40000),
        guest_receives(TCP, Ipv4Addr::new(140, 82, 112, 5), 443, 40000),
    ] {
        assert!(!passes(f.inbound(&frame)), "{frame:02x?}");
    }
    // The right flow, but to another address, another MAC, or broadcast.
    let mut to_other_ip = guest_receives(TCP, GITHUB, 443, 40000);
    to_other_ip[14 + 16..14 + 20].copy_from_slice(&[10, 0, 0, 3]);
    assert!(!passes(f.inbound(&to_other_ip)));
    let mut to_other_mac = guest_receives(TCP, GITHUB, 443, 40000);
    to_other_mac[0..6].copy_from_slice(&[0x52, 0x54, 0, 0, 0, 9]);
    assert!(!passes(f.inbound(&to_other_mac)));
    let mut broadcast = guest_receives(TCP, GITHUB, 443, 40000);
    broadcast[0..6].copy_from_slice(&BROADCAST);
    assert_eq!(
        f.inbound(&broadcast),
        Verdict::Drop("not addressed to the guest's MAC")
    );
}

#[test]
fn echo_needs_a_portless_rule_and_errors_must_quote_a_flow() {
    let mut f = filter();
    let ping = |dst, id| {
        ethernet(
            GATEWAY_MAC,
            GUEST_MAC,
            0x0800,
            &ipv4(GUEST_IP, dst, ICMP, 0, &icmp(8, id)),
        )
    };
    let pong = |src, kind, id| {
        ethernet(
            GUEST_MAC,
            GATEWAY_MAC,
            0x0800,
            &ipv4(src, GUEST_IP, ICMP, 0, &icmp(kind, id)),
        )
    };
    assert!(passes(f.outbound(&ping(PINGABLE, 7))));
    assert!(passes(f.inbound(&pong(PINGABLE, 0, 7))));
    assert!(!passes(f.inbound(&pong(PINGABLE, 0, 8))), "another echo id");
    // HTTPS-only and UDP-range rules do not allow ping.
    assert!(!passes(f.outbound(&ping(GITHUB, 7))));
    assert!(!passes(f.outbound(&ping(ELSEWHERE, 7))));
    assert!(!passes(f.inbound(&pong(GITHUB, 0, 7))));
    // Only echo requests go out.
    let timestamp = ethernet(
        GATEWAY_MAC,
        GUEST_MAC,
        0x0800,
        &ipv4(GUEST_IP, PINGABLE, ICMP, 0, &icmp(13, 1)),
    );
    assert!(!passes(f.outbound(&timestamp)));
    assert!(
        !passes(f.inbound(&pong(PINGABLE, 8, 0))),
        "echo requests are refused"
    );
    // Unreachable / time exceeded: from any router on the path, about a packet of a flow
    // the guest opened.
    let error = |from, kind, quoted: &[u8]| {
        let mut body = vec![kind, 0, 0, 0, 0, 0, 0, 0];
        body.extend_from_slice(&quoted[..quoted.len().min(28)]);
        ethernet(
            GUEST_MAC,
            GATEWAY_MAC,
            0x0800,
            &ipv4(from, GUEST_IP, ICMP, 0, &body),
        )
    };
    let sent = ipv4(GUEST_IP, GITHUB, TCP, 0, &transport(40000, 443, b"x"));
    assert!(
        !passes(f.inbound(&error(GATEWAY_IP, 3, &sent))),
        "no such flow yet"
    );
    assert!(passes(f.outbound(&guest_sends(TCP, 40000, GITHUB, 443))));
    assert!(passes(f.inbound(&error(GATEWAY_IP, 3, &sent))));
    assert!(
        passes(f.inbound(&error(ELSEWHERE, 11, &sent))),
        "a router on the path"
    );
    let pinged = ipv4(GUEST_IP, PINGABLE, ICMP, 0, &icmp(8, 7));
    assert!(passes(f.inbound(&error(GATEWAY_IP, 3, &pinged))));
    // Quoting another flow, another sender's packet, too little, or a redirect: dropped.
    let other = ipv4(GUEST_IP, GITHUB, TCP, 0, &transport(40001, 443, b"x"));
    let not_guest = ipv4(
        Ipv4Addr::new(10, 0, 0, 3),
        GITHUB,
        TCP,
        0,
        &transport(40000, 443, b"x"),
    );
    for (frame, why) in [
        (error(GATEWAY_IP, 3, &other), "another flow"),
        (error(GATEWAY_IP, 3, &not_guest), "not the guest's packet"),
        (error(GATEWAY_IP, 3, &sent[..24]), "a truncated quote"),
        (error(GATEWAY_IP, 5, &sent), "a redirect"),
        (pong(GITHUB, 3, 0), "no quoted packet"),
    ] {
        assert!(!passes(f.inbound(&frame)), "{why}");
    }
}

#[test]
fn fragments_without_ports_need_a_portless_rule() {
    let mut f = filter();
    let fragment = |dst, protocol| {
        // Offset 185 (×8 bytes), no ports in it.
        ethernet(
            GATEWAY_MAC,
            GUEST_MAC,
            0x0800,
            &ipv4(GUEST_IP, dst, protocol, 185, &[0xab; 32]),
        )
    };
    assert!(passes(f.outbound(&fragment(PINGABLE, UDP))));
    assert!(passes(f.outbound(&fragment(PINGABLE, ICMP))));
    assert!(
        !passes(f.outbound(&fragment(GITHUB, TCP))),
        "rule with ports"
    );
    assert!(
        !passes(f.outbound(&fragment(ELSEWHERE, UDP))),
        "rule with ports"
    );
    // A first fragment (more-fragments set, offset 0) is checked like a whole packet.
    let first = ethernet(
        GATEWAY_MAC,
        GUEST_MAC,
        0x0800,
        &ipv4(
            GUEST_IP,
            GITHUB,
            TCP,
            0x2000,
            &transport(40000, 443, &[0; 64]),
        ),
    );
    assert!(passes(f.outbound(&first)));
    // For the guest, a later fragment comes in only after its packet's first one did
    // (same source, identification and protocol): a large DNS answer does.
    let for_guest = |src, fragment, payload: &[u8]| {
        ethernet(
            GUEST_MAC,
            GATEWAY_MAC,
            0x0800,
            &ipv4(src, GUEST_IP, UDP, fragment, payload),
        )
    };
    let later = |src| for_guest(src, 185, &[0xab; 32]);
    assert!(
        !passes(f.inbound(&later(GATEWAY_IP))),
        "no first fragment yet"
    );
    assert!(
        !passes(f.inbound(&later(PINGABLE))),
        "a portless rule is not enough"
    );
    let dns_first = for_guest(GATEWAY_IP, 0x2000, &transport(53, 40000, &[0; 64]));
    assert!(passes(f.inbound(&dns_first)));
    assert!(passes(f.inbound(&later(GATEWAY_IP))));
    assert!(
        !passes(f.inbound(&later(PINGABLE))),
        "another source's packet"
    );
    // A first fragment refused lets none of its later ones in.
    let unsolicited = for_guest(GITHUB, 0x2000, &transport(443, 40000, &[0; 64]));
    assert!(!passes(f.inbound(&unsolicited)));
    assert!(!passes(f.inbound(&later(GITHUB))));
}

#[test]
fn a_revoked_rule_opens_nothing_new_and_its_open_flows_go_on() {
    let mut f = filter();
    assert!(passes(f.outbound(&guest_sends(TCP, 40000, GITHUB, 443))));
    let https = EgressPolicy {
        guest_ip: GUEST_IP,
        gateway_ip: GATEWAY_IP,
        allow: vec![rule("140.82.112.0/20", Some("443"), Some("tcp"))],
        reserved: Vec::new(),
    }
    .parse()
    .unwrap()
    .rules;
    f.revoke(&https);
    assert_eq!(f.rules().len(), 2);
    assert_eq!(
        f.outbound(&guest_sends(TCP, 40001, GITHUB, 443)),
        Verdict::Drop("no rule allows the destination")
    );
    // The connection opened before goes on, both ways.
    assert!(passes(f.outbound(&guest_sends(TCP, 40000, GITHUB, 443))));
    assert!(passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 40000))));
    // Revoking what it does not hold changes nothing.
    f.revoke(&https);
    assert_eq!(f.rules().len(), 2);
}

#[test]
fn the_oldest_flow_is_forgotten_first() {
    let mut f = filter();
    let open = |f: &mut EgressFilter, port: u16| {
        assert!(passes(f.outbound(&guest_sends(TCP, port, GITHUB, 443))));
    };
    open(&mut f, 1000);
    open(&mut f, 1001);
    for i in 0..FLOW_CAPACITY as u16 - 2 {
        open(&mut f, 2000 + i);
    }
    assert_eq!(f.flow_count(), FLOW_CAPACITY);
    // Sending on the oldest makes it the newest, so the next one out is 1001.
    open(&mut f, 1000);
    open(&mut f, 60000);
    assert_eq!(f.flow_count(), FLOW_CAPACITY);
    assert!(passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 1000))));
    assert!(!passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 1001))));
    assert!(passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 60000))));
    assert!(passes(f.inbound(&guest_receives(TCP, GITHUB, 443, 2000))));
    // Many more flows than the table holds: it stays at its capacity.
    for port in 0..20_000u16 {
        open(&mut f, port);
    }
    assert_eq!(f.flow_count(), FLOW_CAPACITY);
}

#[test]
fn malformed_and_truncated_frames_are_dropped() {
    let mut f = filter();
    let good = guest_sends(TCP, 40000, GITHUB, 443);
    // Every truncation of a good frame.
    for len in 0..good.len() {
        let cut = &good[..len];
        let verdict = f.outbound(cut);
        // Cut inside the transport payload is still a valid-looking header only if the
        // IPv4 total length still fits, which it never does for a cut frame.
        assert!(!passes(verdict), "cut at {len}: {verdict:?}");
    }
    // Ethernet padding after the IPv4 packet is fine.
    let mut padded = good.clone();
    padded.extend_from_slice(&[0; 20]);
    assert!(passes(f.outbound(&padded)));
    let ip = 14;
    for (what, edit) in [
        ("version 6", (ip, 0x65u8)),
        ("IHL 4", (ip, 0x44)),
        ("IHL 15 beyond the packet", (ip, 0x4f)),
        ("total length 0", (ip + 3, 0)),
    ] {
        let mut bad = good.clone();
        bad[edit.0] = edit.1;
        if what == "total length 0" {
            bad[ip + 2] = 0;
        }
        assert!(!passes(f.outbound(&bad)), "{what}");
    }
    let mut too_long = good.clone();
    too_long[ip + 2..ip + 4].copy_from_slice(&4000u16.to_be_bytes());
    assert_eq!(f.outbound(&too_long), Verdict::Drop("malformed IPv4"));
    // A TCP header cut to 3 bytes inside a valid IPv4 packet.
    let short_tcp = ethernet(
        GATEWAY_MAC,
        GUEST_MAC,
        0x0800,
        &ipv4(GUEST_IP, GITHUB, TCP, 0, &[0, 1, 2]),
    );
    assert_eq!(
        f.outbound(&short_tcp),
        Verdict::Drop("TCP/UDP header truncated")
    );
    let short_icmp = ethernet(
        GATEWAY_MAC,
        GUEST_MAC,
        0x0800,
        &ipv4(GUEST_IP, PINGABLE, ICMP, 0, &[8, 0, 0]),
    );
    assert!(!passes(f.outbound(&short_icmp)));
    // ARP of another hardware type, or cut short.
    let mut arp_bad = arp(1, (GUEST_MAC, GUEST_IP), ([0; 6], GATEWAY_IP));
    arp_bad[1] = 6;
    assert!(!passes(
        f.outbound(&ethernet(BROADCAST, GUEST_MAC, 0x0806, &arp_bad))
    ));
    let arp_short = arp(1, (GUEST_MAC, GUEST_IP), ([0; 6], GATEWAY_IP));
    assert!(!passes(f.outbound(&ethernet(
        BROADCAST,
        GUEST_MAC,
        0x0806,
        &arp_short[..27]
    ))));
    assert_eq!(f.flow_count(), 1, "only the padded frame opened a flow");
}

#[test]
fn random_bytes_never_panic_and_rarely_pass() {
    let mut f = filter();
    let mut noise = Noise(0x2545_f491_4f6c_dd1d);
    let mut passed = 0;
    for round in 0..20_000 {
        let len = (noise.next() % 200) as usize;
        let mut frame = noise.bytes(len);
        // Half the time, a plausible header so the deeper parsers see noise too.
        if round % 2 == 0 && frame.len() >= 34 {
            frame[0..6].copy_from_slice(&GUEST_MAC);
            frame[6..12].copy_from_slice(&GUEST_MAC);
            frame[12..14].copy_from_slice(&[0x08, if round % 4 == 0 { 0x00 } else { 0x06 }]);
            frame[14] = 0x45;
            frame[26..30].copy_from_slice(&GUEST_IP.octets());
            frame[30..34].copy_from_slice(&GUEST_IP.octets());
        }
        if passes(f.outbound(&frame)) {
            passed += 1;
        }
        if passes(f.inbound(&frame)) {
            passed += 1;
        }
    }
    assert!(passed < 200, "{passed} random frames passed");
    assert!(f.flow_count() <= FLOW_CAPACITY);
}

#[test]
fn rules_added_later_apply_at_once_and_are_bounded() {
    let mut f = filter();
    assert!(!passes(
        f.outbound(&guest_sends(TCP, 40000, ELSEWHERE, 443))
    ));
    let added = rule("93.184.216.34", Some("443"), Some("tcp"))
        .parse()
        .unwrap();
    f.allow(&[added]).unwrap();
    assert!(passes(f.outbound(&guest_sends(TCP, 40000, ELSEWHERE, 443))));
    assert_eq!(f.rules().len(), 4);
    let many = vec![added; MAX_EGRESS_RULES - 4];
    f.allow(&many).unwrap();
    let err = f.allow(&[added]).unwrap_err();
    assert_eq!(err.would, MAX_EGRESS_RULES + 1);
    assert_eq!(f.rules().len(), MAX_EGRESS_RULES);
}

/// Issue 33 (item 6): a wide rule opened what no operator meant by it. `0.0.0.0/0` on 443
/// reached the metadata address, loopback and the host's side of the link; now only a rule
/// naming such a network does.
#[test]
fn wide_rules_do_not_open_reserved_networks_or_the_host() {
    let metadata = Ipv4Addr::new(169, 254, 169, 254);
    let wide = EgressPolicy {
        guest_ip: GUEST_IP,
        gateway_ip: GATEWAY_IP,
        allow: vec![
            rule("0.0.0.0/0", Some("443"), Some("tcp")),
            rule("0.0.0.0/0", None, None),
        ],
        reserved: Vec::new(),
    };
    let mut f = EgressFilter::new(GUEST_MAC, &wide.parse().unwrap());
    assert!(passes(f.outbound(&guest_sends(TCP, 40000, GITHUB, 443))));
    for closed in [
        metadata,
        Ipv4Addr::new(127, 0, 0, 1),
        Ipv4Addr::new(0, 0, 0, 1),
        Ipv4Addr::new(224, 0, 0, 251),
        Ipv4Addr::new(255, 255, 255, 255),
        GATEWAY_IP,
    ] {
        assert!(
            !passes(f.outbound(&guest_sends(TCP, 40001, closed, 443))),
            "{closed} opened by a wide rule"
        );
        assert!(
            !passes(f.outbound(&guest_sends(UDP, 40002, closed, 9))),
            "{closed} opened by a portless wide rule"
        );
    }
    // DNS to the gateway stays open.
    assert!(passes(f.outbound(&guest_sends(UDP, 33000, GATEWAY_IP, 53))));

    // Named, they open.
    let named = EgressPolicy {
        guest_ip: GUEST_IP,
        gateway_ip: GATEWAY_IP,
        allow: vec![
            rule("169.254.169.254/32", Some("80"), Some("tcp")),
            rule(&format!("{GATEWAY_IP}/32"), Some("8080"), Some("tcp")),
            rule("10.0.0.0/8", Some("5432"), Some("tcp")),
        ],
        reserved: Vec::new(),
    };
    let mut f = EgressFilter::new(GUEST_MAC, &named.parse().unwrap());
    assert!(passes(f.outbound(&guest_sends(TCP, 40003, metadata, 80))));
    assert!(passes(
        f.outbound(&guest_sends(TCP, 40004, GATEWAY_IP, 8080))
    ));
    assert!(passes(f.outbound(&guest_sends(
        TCP,
        40005,
        Ipv4Addr::new(10, 1, 2, 3),
        5432
    ))));
    assert!(!passes(f.outbound(&guest_sends(TCP, 40006, metadata, 81))));

    // What the host reserves (its own addresses, the guest pool) is kept the same way.
    let host = Ipv4Addr::new(192, 0, 2, 7);
    let mut policy = wide.clone();
    policy.reserved = vec!["192.0.2.0/24".into()];
    let mut f = EgressFilter::new(GUEST_MAC, &policy.parse().unwrap());
    assert!(!passes(f.outbound(&guest_sends(TCP, 40007, host, 443))));
    policy
        .allow
        .push(rule("192.0.2.7", Some("443"), Some("tcp")));
    let mut f = EgressFilter::new(GUEST_MAC, &policy.parse().unwrap());
    assert!(passes(f.outbound(&guest_sends(TCP, 40008, host, 443))));
    policy.reserved = vec!["192.0.2.0/33".into()];
    let refused = policy.parse().unwrap_err().to_string();
    assert!(refused.contains("reserved[0]"), "{refused}");
}
