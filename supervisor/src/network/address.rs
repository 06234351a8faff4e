//! Which addresses egress never reaches unless a rule names them: the host's own, private networks, cloud
//! metadata services, and everything IANA keeps out of the global internet.
//!
//! [`classify`] judges the canonical form, so `::ffff:127.0.0.1` is judged as `127.0.0.1`. Its tables follow
//! IANA's special-purpose registries; std's `is_global` would do, but it is unstable and counts 64:ff9b::/96
//! as global.
//!
//! Addresses that carry an IPv4 address inside:
//! - NAT64 `64:ff9b::/96` (RFC 6052): the embedded IPv4 address is judged, and its reason is the reason.
//! - Local NAT64 `64:ff9b:1::/48` (RFC 8215): blocked, since the operator picks where the IPv4 address sits.
//! - 6to4 `2002::/16`: always blocked (deprecated by RFC 7526; a host relay could unwrap it inward); the
//!   embedded IPv4 address's reason is given where it has one.
//! - Teredo `2001::/32`: blocked, with the rest of `2001::/23`.
//! - IPv4-compatible `::/96`: blocked (deprecated by RFC 4291).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

/// Why an address is blocked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Blocked {
    /// A cloud metadata service (169.254.169.254, fd00:ec2::254, 100.100.100.200).
    Metadata,
    /// 0.0.0.0 or `::`.
    Unspecified,
    /// 0.0.0.0/8 ("this network").
    ThisNetwork,
    /// 127.0.0.0/8 or `::1`.
    Loopback,
    /// RFC 1918 private networks.
    Private,
    /// 100.64.0.0/10, carrier-grade NAT.
    SharedCgnat,
    /// 169.254.0.0/16 or fe80::/10.
    LinkLocal,
    /// 192.0.0.0/24 or 2001::/23, IETF protocol assignments.
    ProtocolAssignment,
    /// 2001::/32, Teredo tunnelling.
    Teredo,
    /// TEST-NET-1/2/3, 2001:db8::/32 or 3fff::/20.
    Documentation,
    /// 192.88.99.0/24, the retired 6to4 relay anycast.
    Relay6to4,
    /// 2002::/16 with a public IPv4 address inside.
    SixToFour,
    /// 198.18.0.0/15, network benchmarking.
    Benchmarking,
    /// 224.0.0.0/4 or ff00::/8.
    Multicast,
    /// 255.255.255.255.
    Broadcast,
    /// 240.0.0.0/4, or IPv6 outside the ranges IANA allocates for use.
    Reserved,
    /// ::/96, the deprecated IPv4-compatible addresses.
    Ipv4Compatible,
    /// 64:ff9b:1::/48, local-use NAT64.
    LocalNat64,
    /// 100::/64, the discard prefix.
    Discard,
    /// 5f00::/16, segment routing (SRv6) identifiers.
    SegmentRouting,
    /// fc00::/7, unique local addresses.
    UniqueLocal,
    /// fec0::/10, the deprecated site-local addresses.
    SiteLocal,
}

impl Blocked {
    /// Fixed text for logs and refusals.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Metadata => "cloud metadata service",
            Self::Unspecified => "unspecified address",
            Self::ThisNetwork => "\"this network\" (0.0.0.0/8)",
            Self::Loopback => "loopback address",
            Self::Private => "private network",
            Self::SharedCgnat => "shared address space (carrier-grade NAT)",
            Self::LinkLocal => "link-local address",
            Self::ProtocolAssignment => "IETF protocol assignment",
            Self::Teredo => "Teredo tunnel address",
            Self::Documentation => "documentation address",
            Self::Relay6to4 => "6to4 relay anycast",
            Self::SixToFour => "6to4 tunnel address",
            Self::Benchmarking => "benchmarking network",
            Self::Multicast => "multicast address",
            Self::Broadcast => "broadcast address",
            Self::Reserved => "reserved address",
            Self::Ipv4Compatible => "IPv4-compatible IPv6 address",
            Self::LocalNat64 => "local-use NAT64 address",
            Self::Discard => "discard-only address",
            Self::SegmentRouting => "segment routing identifier",
            Self::UniqueLocal => "unique local address",
            Self::SiteLocal => "site-local address",
        }
    }
}

impl std::fmt::Display for Blocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

const METADATA: [IpAddr; 3] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
];

const fn v4(a: u8, b: u8, c: u8, d: u8, len: u8) -> Ipv4Net {
    Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), len)
}

const fn v6(segments: [u16; 8], len: u8) -> Ipv6Net {
    let [a, b, c, d, e, f, g, h] = segments;
    Ipv6Net::new_assert(Ipv6Addr::new(a, b, c, d, e, f, g, h), len)
}

/// First match wins, so exact addresses come before the ranges holding them.
const V4_TABLE: [(Ipv4Net, Blocked); 17] = [
    (v4(0, 0, 0, 0, 32), Blocked::Unspecified),
    (v4(0, 0, 0, 0, 8), Blocked::ThisNetwork),
    (v4(10, 0, 0, 0, 8), Blocked::Private),
    (v4(100, 64, 0, 0, 10), Blocked::SharedCgnat),
    (v4(127, 0, 0, 0, 8), Blocked::Loopback),
    (v4(169, 254, 0, 0, 16), Blocked::LinkLocal),
    (v4(172, 16, 0, 0, 12), Blocked::Private),
    (v4(192, 0, 0, 0, 24), Blocked::ProtocolAssignment),
    (v4(192, 0, 2, 0, 24), Blocked::Documentation),
    (v4(192, 88, 99, 0, 24), Blocked::Relay6to4),
    (v4(192, 168, 0, 0, 16), Blocked::Private),
    (v4(198, 18, 0, 0, 15), Blocked::Benchmarking),
    (v4(198, 51, 100, 0, 24), Blocked::Documentation),
    (v4(203, 0, 113, 0, 24), Blocked::Documentation),
    (v4(224, 0, 0, 0, 4), Blocked::Multicast),
    (v4(255, 255, 255, 255, 32), Blocked::Broadcast),
    (v4(240, 0, 0, 0, 4), Blocked::Reserved),
];

/// NAT64 and 6to4 are handled before this table, since they are judged by the address inside.
const V6_TABLE: [(Ipv6Net, Blocked); 14] = [
    (v6([0, 0, 0, 0, 0, 0, 0, 0], 128), Blocked::Unspecified),
    (v6([0, 0, 0, 0, 0, 0, 0, 1], 128), Blocked::Loopback),
    (v6([0, 0, 0, 0, 0, 0, 0, 0], 96), Blocked::Ipv4Compatible),
    (v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48), Blocked::LocalNat64),
    (v6([0x100, 0, 0, 0, 0, 0, 0, 0], 64), Blocked::Discard),
    (v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 32), Blocked::Teredo),
    (v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 23), Blocked::ProtocolAssignment),
    (v6([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32), Blocked::Documentation),
    (v6([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20), Blocked::Documentation),
    (v6([0x5f00, 0, 0, 0, 0, 0, 0, 0], 16), Blocked::SegmentRouting),
    (v6([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7), Blocked::UniqueLocal),
    (v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10), Blocked::LinkLocal),
    (v6([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10), Blocked::SiteLocal),
    (v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8), Blocked::Multicast),
];

const NAT64: Ipv6Net = v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96);
const SIX_TO_FOUR: Ipv6Net = v6([0x2002, 0, 0, 0, 0, 0, 0, 0], 16);
/// Outside this and the table, the space is unassigned.
const GLOBAL_UNICAST: Ipv6Net = v6([0x2000, 0, 0, 0, 0, 0, 0, 0], 3);

/// Why `ip` is blocked, or `None` when it is a public address.
///
/// IPv4-mapped IPv6 addresses are judged as the IPv4 address they map.
pub fn classify(ip: IpAddr) -> Option<Blocked> {
    let ip = ip.to_canonical();
    if METADATA.contains(&ip) {
        return Some(Blocked::Metadata);
    }
    match ip {
        IpAddr::V4(ip) => classify_v4(ip),
        IpAddr::V6(ip) => classify_v6(ip),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<Blocked> {
    V4_TABLE.iter().find(|(net, _)| net.contains(&ip)).map(|&(_, reason)| reason)
}

fn classify_v6(ip: Ipv6Addr) -> Option<Blocked> {
    let o = ip.octets();
    if NAT64.contains(&ip) {
        return classify(IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15])));
    }
    if SIX_TO_FOUR.contains(&ip) {
        let inner = Ipv4Addr::new(o[2], o[3], o[4], o[5]);
        return Some(classify(IpAddr::V4(inner)).unwrap_or(Blocked::SixToFour));
    }
    V6_TABLE
        .iter()
        .find(|(net, _)| net.contains(&ip))
        .map(|&(_, reason)| reason)
        .or_else(|| (!GLOBAL_UNICAST.contains(&ip)).then_some(Blocked::Reserved))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// One address per row, and its expected reason.
    const V4_ROWS: &[(&str, Blocked)] = &[
        ("169.254.169.254", Blocked::Metadata),
        ("100.100.100.200", Blocked::Metadata),
        ("0.0.0.0", Blocked::Unspecified),
        ("0.1.2.3", Blocked::ThisNetwork),
        ("10.20.30.40", Blocked::Private),
        ("100.64.0.1", Blocked::SharedCgnat),
        ("100.127.255.255", Blocked::SharedCgnat),
        ("127.0.0.1", Blocked::Loopback),
        ("127.255.0.9", Blocked::Loopback),
        ("169.254.1.1", Blocked::LinkLocal),
        ("172.16.0.1", Blocked::Private),
        ("172.31.255.255", Blocked::Private),
        ("192.0.0.8", Blocked::ProtocolAssignment),
        ("192.0.2.1", Blocked::Documentation),
        ("192.88.99.1", Blocked::Relay6to4),
        ("192.168.1.1", Blocked::Private),
        ("198.18.0.1", Blocked::Benchmarking),
        ("198.19.255.255", Blocked::Benchmarking),
        ("198.51.100.7", Blocked::Documentation),
        ("203.0.113.9", Blocked::Documentation),
        ("224.0.0.1", Blocked::Multicast),
        ("239.255.255.250", Blocked::Multicast),
        ("240.0.0.1", Blocked::Reserved),
        ("255.255.255.254", Blocked::Reserved),
        ("255.255.255.255", Blocked::Broadcast),
    ];

    const V6_ROWS: &[(&str, Blocked)] = &[
        ("fd00:ec2::254", Blocked::Metadata),
        ("::", Blocked::Unspecified),
        ("::1", Blocked::Loopback),
        ("::8.8.8.8", Blocked::Ipv4Compatible),
        ("::2", Blocked::Ipv4Compatible),
        ("64:ff9b::7f00:1", Blocked::Loopback),
        ("64:ff9b::10.0.0.1", Blocked::Private),
        ("64:ff9b::169.254.169.254", Blocked::Metadata),
        ("64:ff9b:1::808:808", Blocked::LocalNat64),
        ("100::1", Blocked::Discard),
        ("2001::1", Blocked::Teredo),
        ("2001:0:4136:e378::1", Blocked::Teredo),
        ("2001:2::1", Blocked::ProtocolAssignment),
        ("2001:1ff:ffff::1", Blocked::ProtocolAssignment),
        ("2001:db8::1", Blocked::Documentation),
        ("3fff::1", Blocked::Documentation),
        ("3fff:fff::1", Blocked::Documentation),
        ("2002:808:808::1", Blocked::SixToFour),
        ("2002:7f00:1::1", Blocked::Loopback),
        ("2002:c0a8:101::1", Blocked::Private),
        ("5f00::1", Blocked::SegmentRouting),
        ("fc00::1", Blocked::UniqueLocal),
        ("fd12:3456::1", Blocked::UniqueLocal),
        ("fe80::1", Blocked::LinkLocal),
        ("febf::1", Blocked::LinkLocal),
        ("fec0::1", Blocked::SiteLocal),
        ("ff02::1", Blocked::Multicast),
        ("4000::1", Blocked::Reserved),
        ("::ffff:0:808:808", Blocked::Reserved),
    ];

    #[test]
    fn every_v4_row_is_blocked_native_and_mapped() {
        for &(text, reason) in V4_ROWS {
            let addr: Ipv4Addr = text.parse().unwrap();
            assert_eq!(classify(IpAddr::V4(addr)), Some(reason), "{text}");
            let mapped = IpAddr::V6(addr.to_ipv6_mapped());
            assert_eq!(classify(mapped), Some(reason), "{mapped}");
        }
    }

    #[test]
    fn every_v6_row_is_blocked() {
        for &(text, reason) in V6_ROWS {
            assert_eq!(classify(ip(text)), Some(reason), "{text}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for text in ["8.8.8.8", "1.1.1.1", "93.184.215.14", "2606:4700::1111", "2001:4860:4860::8888", "2400::1"] {
            assert_eq!(classify(ip(text)), None, "{text}");
        }
        // The controls for the mapped and embedded rows: a public address inside passes.
        assert_eq!(classify(ip("::ffff:8.8.8.8")), None);
        assert_eq!(classify(ip("64:ff9b::8.8.8.8")), None);
    }

    #[test]
    fn range_edges_are_exact() {
        assert_eq!(classify(ip("100.63.255.255")), None);
        assert_eq!(classify(ip("100.128.0.0")), None);
        assert_eq!(classify(ip("172.15.255.255")), None);
        assert_eq!(classify(ip("172.32.0.0")), None);
        assert_eq!(classify(ip("198.17.255.255")), None);
        assert_eq!(classify(ip("198.20.0.0")), None);
        assert_eq!(classify(ip("223.255.255.255")), None);
        assert_eq!(classify(ip("2001:200::1")), None);
        assert_eq!(classify(ip("3fff:1000::1")), None);
        assert_eq!(classify(ip("2003::1")), None);
    }

    #[test]
    fn every_reason_has_text() {
        let all = V4_ROWS.iter().chain(V6_ROWS).map(|&(_, reason)| reason);
        for reason in all {
            assert!(!reason.describe().is_empty());
            assert_eq!(reason.to_string(), reason.describe());
        }
    }

    proptest! {
        #[test]
        fn mapped_is_judged_as_v4(bits in any::<u32>()) {
            let addr = Ipv4Addr::from_bits(bits);
            prop_assert_eq!(classify(IpAddr::V4(addr)), classify(IpAddr::V6(addr.to_ipv6_mapped())));
        }

        #[test]
        fn nat64_is_judged_as_v4(bits in any::<u32>()) {
            let addr = Ipv4Addr::from_bits(bits);
            let nat64 = Ipv6Addr::from_bits(NAT64.addr().to_bits() | u128::from(bits));
            prop_assert_eq!(classify(IpAddr::V4(addr)), classify(IpAddr::V6(nat64)));
        }
    }
}
