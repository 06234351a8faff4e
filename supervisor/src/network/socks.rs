//! Reading a SOCKS5 CONNECT (RFC 1928, no authentication) from the first bytes of a guest stream (the guest's
//! loopback port 1080).
//!
//! The caller buffers the stream and calls [`Socks::feed`] with all of it after each read:
//!
//! ```text
//! guest                                      supervisor
//! VER=5 NMETHODS METHODS...             ->   Step::Reply([5, 0]): send it, feed again
//!                                       <-   [5, 0]
//! VER=5 CMD=1 RSV=0 ATYP ADDR PORT      ->   Step::Connect { target, consumed }: decide, dial
//!                                       <-   reply(SUCCEEDED) or reply(code); then relay from `consumed`
//! ```
//!
//! A client may send the request before the method selection arrives, so feed again after a reply even
//! without new bytes. Both messages have a fixed upper size ([`MAX_HANDSHAKE_BYTES`] together): nothing is
//! buffered past it. There is no DNS in the guest, so names arrive as ATYP 3 (`socks5h`) and go through
//! [`normalize_host`], like every address.

use std::net::{Ipv4Addr, Ipv6Addr};

use vm_protocol::policy::network::normalize_host;

pub use super::request::Target;

/// The protocol version byte.
pub const VERSION: u8 = 5;
/// Largest greeting, bytes: VER, NMETHODS and up to 255 methods.
pub const MAX_GREETING_BYTES: usize = 2 + 255;
/// Largest request, bytes: VER, CMD, RSV, ATYP, a length-prefixed name of up to 255 bytes, and the port.
pub const MAX_REQUEST_BYTES: usize = 4 + 1 + 255 + 2;
/// The most a stream's buffer needs before [`Socks::feed`] has an answer.
pub const MAX_HANDSHAKE_BYTES: usize = MAX_GREETING_BYTES + MAX_REQUEST_BYTES;

/// Reply code: the connection is up.
pub const SUCCEEDED: u8 = 0;
/// Reply code: general SOCKS server failure.
pub const GENERAL_FAILURE: u8 = 1;
/// Reply code: connection not allowed by ruleset.
pub const NOT_ALLOWED: u8 = 2;
/// Reply code: host unreachable.
pub const HOST_UNREACHABLE: u8 = 4;
/// Reply code: connection refused.
pub const CONNECTION_REFUSED: u8 = 5;
/// Reply code: command not supported.
pub const COMMAND_NOT_SUPPORTED: u8 = 7;
/// Reply code: address type not supported.
pub const ADDRESS_TYPE_NOT_SUPPORTED: u8 = 8;

/// Method: no authentication required, the only one served.
const NO_AUTH: u8 = 0;
/// Method selection: none of the client's methods is acceptable.
const NO_ACCEPTABLE_METHODS: u8 = 0xFF;
const CMD_CONNECT: u8 = 1;
const ATYP_IPV4: u8 = 1;
const ATYP_DOMAIN: u8 = 3;
const ATYP_IPV6: u8 = 4;

/// A reply to a request: VER 5, the code, RSV 0, and a bound address of 0.0.0.0:0 (the guest has no use
/// for the host's).
pub fn reply(code: u8) -> [u8; 10] {
    [VERSION, code, 0, ATYP_IPV4, 0, 0, 0, 0, 0, 0]
}

/// What [`Socks::feed`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do until more bytes come.
    NeedMore,
    /// Send these bytes, then feed again: the next message may already be buffered.
    Reply(Vec<u8>),
    /// The client asks for `target`. Answer with [`reply`] once dialed (or refused); the buffer's bytes from
    /// `consumed` on are the client's payload, to relay.
    Connect {
        /// Where to dial.
        target: Target,
        /// Bytes of the buffer the greeting and the request used.
        consumed: usize,
    },
}

/// Why a SOCKS handshake was refused. The text is fixed: nothing the client sent is repeated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub enum SocksError {
    /// The greeting's version is not 5 (a SOCKS4 client, or not SOCKS at all).
    Version,
    /// The client offered no "no authentication" method.
    NoAcceptableMethod,
    /// The request's version is not 5.
    RequestVersion,
    /// The request's reserved byte is not 0.
    Reserved,
    /// BIND, UDP ASSOCIATE, or an unknown command: only CONNECT is served.
    CommandNotSupported,
    /// An address type other than IPv4, domain name and IPv6.
    AddressTypeNotSupported,
    /// A domain name that is empty, not UTF-8, or not a valid host name.
    BadHost,
    /// Destination port 0.
    PortZero,
}

impl SocksError {
    /// The reply code for the request stage (the greeting's errors read as a general failure).
    pub fn code(&self) -> u8 {
        match self {
            Self::Version | Self::NoAcceptableMethod | Self::RequestVersion | Self::Reserved | Self::PortZero => {
                GENERAL_FAILURE
            }
            Self::CommandNotSupported => COMMAND_NOT_SUPPORTED,
            Self::AddressTypeNotSupported => ADDRESS_TYPE_NOT_SUPPORTED,
            Self::BadHost => HOST_UNREACHABLE,
        }
    }

    /// A fixed sentence for the event.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::Version => "not a SOCKS5 greeting",
            Self::NoAcceptableMethod => "no acceptable authentication method: only no-auth is served",
            Self::RequestVersion => "not a SOCKS5 request",
            Self::Reserved => "reserved byte is not zero",
            Self::CommandNotSupported => "only CONNECT is supported (no BIND or UDP ASSOCIATE)",
            Self::AddressTypeNotSupported => "address type not supported",
            Self::BadHost => "bad destination host name",
            Self::PortZero => "destination port 0",
        }
    }

    /// The bytes to send before closing: none to a client that does not speak SOCKS5, a method refusal
    /// during the greeting, a [`reply`] with [`Self::code`] after it.
    pub fn answer(&self) -> Option<Vec<u8>> {
        match self {
            Self::Version => None,
            Self::NoAcceptableMethod => Some(vec![VERSION, NO_ACCEPTABLE_METHODS]),
            _ => Some(reply(self.code()).to_vec()),
        }
    }
}

/// Where a handshake stands.
#[derive(Debug, Clone, Default)]
enum State {
    #[default]
    Greeting,
    /// The method is selected; the request starts at this offset of the buffer.
    Request(usize),
    /// Answered: feeding again gives the same answer.
    Done(Target, usize),
    Failed(SocksError),
}

/// One stream's SOCKS5 handshake, fed incrementally.
#[derive(Debug, Clone, Default)]
pub struct Socks {
    state: State,
}

impl Socks {
    /// A handshake waiting for its greeting.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the greeting is past (a refusal is then a request reply).
    pub fn greeted(&self) -> bool {
        !matches!(self.state, State::Greeting)
    }

    /// Reads on from `buf`, all the stream's bytes so far (not only the new ones).
    ///
    /// # Errors
    /// The handshake is refused; [`SocksError::answer`] says what to send before closing. Feeding again
    /// gives the same error.
    pub fn feed(&mut self, buf: &[u8]) -> Result<Step, SocksError> {
        let step = match &self.state {
            State::Greeting => greeting(buf).map(|len| match len {
                None => Step::NeedMore,
                Some(len) => {
                    self.state = State::Request(len);
                    Step::Reply(vec![VERSION, NO_AUTH])
                }
            }),
            &State::Request(start) => request(buf.get(start..).unwrap_or_default()).map(|found| match found {
                None => Step::NeedMore,
                Some((target, len)) => {
                    self.state = State::Done(target.clone(), start + len);
                    Step::Connect { target, consumed: start + len }
                }
            }),
            State::Done(target, consumed) => Ok(Step::Connect { target: target.clone(), consumed: *consumed }),
            &State::Failed(e) => Err(e),
        };
        if let Err(e) = step {
            self.state = State::Failed(e);
        }
        step
    }
}

/// The greeting's length once it is all there and offers no-auth.
fn greeting(buf: &[u8]) -> Result<Option<usize>, SocksError> {
    let Some(&version) = buf.first() else { return Ok(None) };
    if version != VERSION {
        return Err(SocksError::Version);
    }
    let Some(&count) = buf.get(1) else { return Ok(None) };
    let len = 2 + usize::from(count);
    let Some(methods) = buf.get(2..len) else { return Ok(None) };
    if !methods.contains(&NO_AUTH) {
        return Err(SocksError::NoAcceptableMethod);
    }
    Ok(Some(len))
}

/// The request's target and length once it is all there. Fields are checked in wire order, so a prefix
/// fails the way the whole would.
fn request(buf: &[u8]) -> Result<Option<(Target, usize)>, SocksError> {
    let Some(&[version, command, reserved, atyp]) = buf.get(..4) else { return Ok(None) };
    if version != VERSION {
        return Err(SocksError::RequestVersion);
    }
    // BIND (2) would open a listener and UDP ASSOCIATE (3) a relay: neither is served.
    if command != CMD_CONNECT {
        return Err(SocksError::CommandNotSupported);
    }
    if reserved != 0 {
        return Err(SocksError::Reserved);
    }
    let addr_len = match atyp {
        ATYP_IPV4 => 4,
        ATYP_IPV6 => 16,
        ATYP_DOMAIN => match buf.get(4) {
            None => return Ok(None),
            Some(0) => return Err(SocksError::BadHost),
            Some(&n) => 1 + usize::from(n),
        },
        _ => return Err(SocksError::AddressTypeNotSupported),
    };
    let len = 4 + addr_len + 2;
    let (Some(addr), Some(&[hi, lo])) = (buf.get(4..4 + addr_len), buf.get(4 + addr_len..len)) else {
        return Ok(None);
    };
    let host = match atyp {
        ATYP_IPV4 => <[u8; 4]>::try_from(addr).ok().map(|a| Ipv4Addr::from(a).to_string()),
        ATYP_IPV6 => <[u8; 16]>::try_from(addr).ok().map(|a| Ipv6Addr::from(a).to_string()),
        _ => addr.get(1..).and_then(|name| std::str::from_utf8(name).ok()).map(str::to_owned),
    };
    let host = host.as_deref().and_then(normalize_host).ok_or(SocksError::BadHost)?;
    let port = u16::from_be_bytes([hi, lo]);
    if port == 0 {
        return Err(SocksError::PortZero);
    }
    Ok(Some((Target { host, port }, len)))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const GREETING: &[u8] = &[5, 2, 2, 0];

    /// Plays the caller: the buffer grows to each cut in turn, and every step until `NeedMore` is kept.
    fn drive(input: &[u8], cuts: &[usize]) -> (Vec<Step>, Option<SocksError>) {
        let mut socks = Socks::new();
        let mut steps = Vec::new();
        for &end in cuts.iter().chain([&input.len()]) {
            loop {
                match socks.feed(&input[..end]) {
                    Ok(Step::NeedMore) => break,
                    Ok(step @ Step::Connect { .. }) => {
                        steps.push(step);
                        return (steps, None);
                    }
                    Ok(step) => steps.push(step),
                    Err(e) => return (steps, Some(e)),
                }
            }
        }
        (steps, None)
    }

    fn with_greeting(request: &[u8]) -> Vec<u8> {
        [GREETING, request].concat()
    }

    fn connect(request: &[u8]) -> Result<(Target, usize), SocksError> {
        match drive(&with_greeting(request), &[]) {
            (steps, None) => match steps.as_slice() {
                [Step::Reply(sel), Step::Connect { target, consumed }] if sel == &[5, 0] => {
                    Ok((target.clone(), *consumed))
                }
                other => panic!("unexpected steps {other:?}"),
            },
            (_, Some(e)) => Err(e),
        }
    }

    fn target(host: &str, port: u16) -> Target {
        Target { host: host.to_owned(), port }
    }

    #[test]
    fn socks5h_name_then_payload() {
        let mut request = vec![5, 1, 0, 3, 8];
        request.extend_from_slice(b"PyPI.org\x01\xbbGET / HTTP/1.1");
        assert_eq!(connect(&request), Ok((target("pypi.org", 443), GREETING.len() + 15)));
    }

    #[test]
    fn addresses() {
        assert_eq!(connect(&[5, 1, 0, 1, 93, 184, 216, 34, 0, 80]), Ok((target("93.184.216.34", 80), 14)));
        let mut v6 = vec![5, 1, 0, 4];
        v6.extend_from_slice(&"2606:4700::1111".parse::<Ipv6Addr>().unwrap().octets());
        v6.extend_from_slice(&[0x1f, 0x90]);
        assert_eq!(connect(&v6), Ok((target("2606:4700::1111", 8080), 26)));
        let mut mapped = vec![5, 1, 0, 4];
        mapped.extend_from_slice(&Ipv4Addr::LOCALHOST.to_ipv6_mapped().octets());
        mapped.extend_from_slice(&[0, 22]);
        assert_eq!(connect(&mapped).unwrap().0, target("127.0.0.1", 22));
    }

    #[test]
    fn refusals() {
        assert_eq!(connect(&[5, 2, 0, 1, 1, 2, 3, 4, 0, 80]), Err(SocksError::CommandNotSupported));
        assert_eq!(connect(&[5, 3, 0, 1, 0, 0, 0, 0, 0, 0]), Err(SocksError::CommandNotSupported));
        assert_eq!(SocksError::CommandNotSupported.answer(), Some(reply(7).to_vec()));
        assert_eq!(connect(&[5, 1, 0, 2, 1, 2, 3, 4, 0, 80]), Err(SocksError::AddressTypeNotSupported));
        assert_eq!(connect(&[5, 1, 0, 1, 1, 2, 3, 4, 0, 0]), Err(SocksError::PortZero));
        assert_eq!(connect(&[5, 1, 1, 1, 1, 2, 3, 4, 0, 80]), Err(SocksError::Reserved));
        assert_eq!(connect(&[4, 1, 0, 1, 1, 2, 3, 4, 0, 80]), Err(SocksError::RequestVersion));
        assert_eq!(connect(&[5, 1, 0, 3, 0, 0, 80]), Err(SocksError::BadHost));
        for bad in [&b"a..b"[..], b"2130706433", b"a b", b"\xff\xfe", b"[a.com]"] {
            let request = [&[5, 1, 0, 3, u8::try_from(bad.len()).unwrap()][..], bad, &[0, 80]].concat();
            assert_eq!(connect(&request), Err(SocksError::BadHost), "{bad:?}");
        }
        assert_eq!(SocksError::BadHost.code(), HOST_UNREACHABLE);
    }

    #[test]
    fn greeting_refusals() {
        assert_eq!(drive(&[5, 1, 2], &[]), (vec![], Some(SocksError::NoAcceptableMethod)));
        assert_eq!(drive(&[5, 0], &[]), (vec![], Some(SocksError::NoAcceptableMethod)));
        assert_eq!(SocksError::NoAcceptableMethod.answer(), Some(vec![5, 0xFF]));
        // A SOCKS4 CONNECT: refused on its first byte, with nothing sent back.
        assert_eq!(drive(&[4, 1, 0, 80, 1, 2, 3, 4, 0], &[]), (vec![], Some(SocksError::Version)));
        assert_eq!(SocksError::Version.answer(), None);
        let mut socks = Socks::new();
        assert_eq!(socks.feed(&[4]), Err(SocksError::Version));
        assert_eq!(socks.feed(&[5, 1, 0]), Err(SocksError::Version), "a failed handshake stays failed");
    }

    #[test]
    fn every_split_gives_the_same_result() {
        let mut input = with_greeting(&[5, 1, 0, 3, 7]);
        input.extend_from_slice(b"a.b.com\x01\xbbpayload");
        let whole = drive(&input, &[]);
        assert!(matches!(whole.0.last(), Some(Step::Connect { consumed: 18, .. })), "{whole:?}");
        for cut in 0..=input.len() {
            assert_eq!(drive(&input, &[cut]), whole, "cut {cut}");
        }
        assert_eq!(drive(&input, &(0..input.len()).collect::<Vec<_>>()), whole, "byte by byte");
    }

    #[test]
    fn reply_layout() {
        assert_eq!(reply(SUCCEEDED), [5, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(reply(NOT_ALLOWED)[1], 2);
    }

    /// Requests likely to get past the first checks: a plausible header, then a name or random bytes.
    fn requests() -> impl Strategy<Value = Vec<u8>> {
        let head = (prop_oneof![Just(5u8), any::<u8>()], 0u8..5, prop_oneof![Just(0u8), any::<u8>()], 0u8..6);
        let name = "[a-z0-9.-]{0,12}".prop_map(|n| [&[u8::try_from(n.len()).unwrap()][..], n.as_bytes()].concat());
        let rest = prop_oneof![prop::collection::vec(any::<u8>(), 0..40), name];
        (head, rest, any::<[u8; 2]>()).prop_map(|((v, c, r, a), rest, port)| [&[v, c, r, a][..], &rest, &port].concat())
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_split_alike(
            input in prop_oneof![
                prop::collection::vec(any::<u8>(), 0..MAX_HANDSHAKE_BYTES),
                requests().prop_map(|r| with_greeting(&r)),
            ],
            cut in any::<prop::sample::Index>(),
        ) {
            let whole = drive(&input, &[]);
            prop_assert_eq!(drive(&input, &[cut.index(input.len() + 1)]), whole);
        }
    }
}
