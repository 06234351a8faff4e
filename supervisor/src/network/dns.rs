//! A minimal DNS stub client: one A or AAAA question over UDP to one server.
//!
//! Written here because no DNS client crate (hickory) is available to this build. It sets RD, advertises
//! EDNS(0) for 1232-byte replies and resends once. A truncated reply is an error: there is no TCP fallback,
//! since 16 addresses fit in 1232 bytes. Replies are untrusted: [`parse_response`] is pure and bounded.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::time::Instant;

/// Room for replies larger than we ask for, so that they parse rather than arrive cut.
const RECV_BUFFER_BYTES: usize = 4096;
/// The UDP payload size we advertise (the 2020 DNS flag day's value).
const EDNS_PAYLOAD_BYTES: u16 = 1232;
/// Datagrams that answer something else, before we give up on the socket.
const MAX_MISMATCHES: usize = 16;
/// Compression pointers followed in one name; a loop ends here.
const MAX_POINTER_HOPS: usize = 16;
/// CNAME records followed from the question name within one answer.
const MAX_CNAME_HOPS: usize = 8;
const MAX_NAME_TEXT_BYTES: usize = 253;
const MAX_NAME_WIRE_BYTES: usize = 255;
const MAX_LABEL_BYTES: usize = 63;

const CLASS_IN: u16 = 1;
const TYPE_CNAME: u16 = 5;
const TYPE_OPT: u16 = 41;
const RCODE_NXDOMAIN: u8 = 3;

/// The record type asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QType {
    /// IPv4 addresses.
    A,
    /// IPv6 addresses.
    Aaaa,
}

impl QType {
    fn code(self) -> u16 {
        match self {
            Self::A => 1,
            Self::Aaaa => 28,
        }
    }
}

/// Why a DNS query gave no addresses.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// The name has an empty or over-long label, or is over 253 bytes.
    #[error("the name cannot be asked of DNS")]
    InvalidName,
    /// The kernel gave no randomness for the query id.
    #[error("could not draw a random query id")]
    RandomId(#[source] io::Error),
    /// Binding or connecting the UDP socket failed.
    #[error("could not open a UDP socket to the DNS server")]
    Socket(#[source] io::Error),
    /// Sending the query failed.
    #[error("could not send the DNS query")]
    Send(#[source] io::Error),
    /// Receiving failed, for example because the server's port is closed.
    #[error("could not receive the DNS reply")]
    Receive(#[source] io::Error),
    /// No reply within the timeout, after one resend.
    #[error("the DNS server did not answer in time")]
    Timeout,
    /// The datagram is not a reply to this query (id, flags or question differ).
    #[error("the datagram does not answer the query")]
    Mismatch,
    /// Too many datagrams that were not a reply to this query.
    #[error("too many datagrams that do not answer the query")]
    TooManyMismatches,
    /// The reply matches the query but its records do not parse.
    #[error("the DNS reply is malformed")]
    Malformed,
    /// The server set TC; there is no TCP fallback.
    #[error("the DNS reply is truncated")]
    Truncated,
    /// NXDOMAIN.
    #[error("the name does not exist")]
    NoSuchName,
    /// Any other nonzero response code (SERVFAIL, REFUSED, ...).
    #[error("the DNS server failed the query (rcode {rcode})")]
    Failed {
        /// The 4-bit response code.
        rcode: u8,
    },
}

/// Asks `server` for `name`'s `qtype` records, resending once halfway through `timeout`.
pub(crate) async fn query(
    server: SocketAddr,
    name: &str,
    qtype: QType,
    timeout: Duration,
) -> Result<Vec<IpAddr>, DnsError> {
    let start = Instant::now();
    let id = random_id()?;
    let packet = build_query(id, &encode_name(name)?, qtype);
    let local: SocketAddr =
        if server.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let socket = UdpSocket::bind(local).await.map_err(DnsError::Socket)?;
    // Connected, so the kernel drops datagrams from any other source.
    socket.connect(server).await.map_err(DnsError::Socket)?;
    socket.send(&packet).await.map_err(DnsError::Send)?;
    let mut resend_at = Some(start + timeout / 2);
    let mut buf = vec![0u8; RECV_BUFFER_BYTES];
    let mut mismatches = 0;
    loop {
        let wake = resend_at.unwrap_or(start + timeout);
        let Ok(received) = tokio::time::timeout_at(wake, socket.recv(&mut buf)).await else {
            resend_at.take().ok_or(DnsError::Timeout)?;
            socket.send(&packet).await.map_err(DnsError::Send)?;
            continue;
        };
        let len = received.map_err(DnsError::Receive)?;
        match parse_response(id, name, qtype, buf.get(..len).unwrap_or_default()) {
            Err(DnsError::Mismatch) => {
                mismatches += 1;
                if mismatches >= MAX_MISMATCHES {
                    return Err(DnsError::TooManyMismatches);
                }
            }
            other => return other,
        }
    }
}

fn random_id() -> Result<u16, DnsError> {
    let mut id = [0u8; 2];
    let filled = rustix::rand::getrandom(&mut id[..], rustix::rand::GetRandomFlags::empty())
        .map_err(|errno| DnsError::RandomId(errno.into()))?;
    if filled != id.len() {
        return Err(DnsError::RandomId(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(u16::from_ne_bytes(id))
}

/// `name` in wire form, lowercased: each label after its length, then the root's zero.
pub(super) fn encode_name(name: &str) -> Result<Vec<u8>, DnsError> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > MAX_NAME_TEXT_BYTES {
        return Err(DnsError::InvalidName);
    }
    let mut wire = Vec::with_capacity(name.len() + 2);
    for label in name.split('.') {
        let len = u8::try_from(label.len()).map_err(|_| DnsError::InvalidName)?;
        // Printable ASCII only: a hostname with spaces or controls is not worth asking about.
        if label.is_empty() || label.len() > MAX_LABEL_BYTES || !label.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(DnsError::InvalidName);
        }
        wire.push(len);
        wire.extend(label.bytes().map(|b| b.to_ascii_lowercase()));
    }
    wire.push(0);
    Ok(wire)
}

fn build_query(id: u16, qname: &[u8], qtype: QType) -> Vec<u8> {
    let mut packet = Vec::with_capacity(qname.len() + 27);
    packet.extend_from_slice(&id.to_be_bytes());
    // RD set; one question; the additional record is the OPT.
    packet.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1]);
    packet.extend_from_slice(qname);
    packet.extend_from_slice(&qtype.code().to_be_bytes());
    packet.extend_from_slice(&CLASS_IN.to_be_bytes());
    // OPT: root owner, payload size in the class field, no extended flags, no options.
    packet.push(0);
    packet.extend_from_slice(&TYPE_OPT.to_be_bytes());
    packet.extend_from_slice(&EDNS_PAYLOAD_BYTES.to_be_bytes());
    packet.extend_from_slice(&[0; 6]);
    packet
}

/// The addresses in a reply to query `id` for `name`, following CNAMEs within the answer section.
///
/// Records for any other owner are ignored, so an answer cannot smuggle in addresses for other names.
/// A CNAME chain longer than 8 gives no addresses.
pub(crate) fn parse_response(id: u16, name: &str, qtype: QType, msg: &[u8]) -> Result<Vec<IpAddr>, DnsError> {
    let qname = encode_name(name)?;
    let mut reader = Reader { msg, pos: 0 };
    let header = reader.header();
    let question = reader.question();
    // Bytes that do not even hold a question answer nothing of ours.
    let (Ok([reply_id, flags, qdcount, ancount, ..]), Ok((name, asked, qclass))) = (header, question) else {
        return Err(DnsError::Mismatch);
    };
    let [high, low] = flags.to_be_bytes();
    let (is_reply, opcode) = (high & 0x80 != 0, (high >> 3) & 0x0f);
    if reply_id != id || !is_reply || opcode != 0 || qdcount != 1 {
        return Err(DnsError::Mismatch);
    }
    if name != qname || asked != qtype.code() || qclass != CLASS_IN {
        return Err(DnsError::Mismatch);
    }
    if high & 0x02 != 0 {
        return Err(DnsError::Truncated);
    }
    match low & 0x0f {
        0 => {}
        RCODE_NXDOMAIN => return Err(DnsError::NoSuchName),
        rcode => return Err(DnsError::Failed { rcode }),
    }

    let mut cnames: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut addresses: Vec<(Vec<u8>, IpAddr)> = Vec::new();
    for _ in 0..ancount {
        let owner = reader.name()?;
        let rtype = reader.u16()?;
        let class = reader.u16()?;
        reader.bytes(4)?; // TTL: we do not cache.
        let rdlength = usize::from(reader.u16()?);
        let rdata_at = reader.pos;
        let rdata = reader.bytes(rdlength)?;
        if class != CLASS_IN {
            continue;
        }
        if rtype == qtype.code() {
            let ip = match qtype {
                QType::A => <[u8; 4]>::try_from(rdata).map(IpAddr::from),
                QType::Aaaa => <[u8; 16]>::try_from(rdata).map(IpAddr::from),
            };
            addresses.push((owner, ip.map_err(|_| DnsError::Malformed)?));
        } else if rtype == TYPE_CNAME {
            let (target, end) = read_name(msg, rdata_at)?;
            if end != rdata_at + rdlength {
                return Err(DnsError::Malformed);
            }
            cnames.push((owner, target));
        }
    }

    let mut current = qname.as_slice();
    for _ in 0..=MAX_CNAME_HOPS {
        let found: Vec<IpAddr> = addresses.iter().filter(|(owner, _)| owner == current).map(|&(_, ip)| ip).collect();
        if !found.is_empty() {
            return Ok(found);
        }
        match cnames.iter().find(|(owner, _)| owner == current) {
            Some((_, target)) => current = target.as_slice(),
            None => break,
        }
    }
    Ok(Vec::new())
}

/// A cursor over a message; every read checks its bounds.
struct Reader<'a> {
    msg: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], DnsError> {
        let bytes = self.msg.get(self.pos..self.pos + n).ok_or(DnsError::Malformed)?;
        self.pos += n;
        Ok(bytes)
    }

    fn u16(&mut self) -> Result<u16, DnsError> {
        let bytes = self.bytes(2)?;
        Ok(u16::from_be_bytes([bytes[0], bytes[1]]))
    }

    /// ID, flags and the four counts.
    fn header(&mut self) -> Result<[u16; 6], DnsError> {
        let mut words = [0u16; 6];
        for word in &mut words {
            *word = self.u16()?;
        }
        Ok(words)
    }

    /// Name, type and class.
    fn question(&mut self) -> Result<(Vec<u8>, u16, u16), DnsError> {
        Ok((self.name()?, self.u16()?, self.u16()?))
    }

    fn name(&mut self) -> Result<Vec<u8>, DnsError> {
        let (name, end) = read_name(self.msg, self.pos)?;
        self.pos = end;
        Ok(name)
    }
}

/// The name at `start`, lowercased wire form, and where the record continues after it.
fn read_name(msg: &[u8], start: usize) -> Result<(Vec<u8>, usize), DnsError> {
    let mut name = Vec::new();
    let mut pos = start;
    let mut after_first_pointer = None;
    let mut hops = 0;
    loop {
        let len = *msg.get(pos).ok_or(DnsError::Malformed)?;
        match len & 0xc0 {
            0x00 if len == 0 => {
                name.push(0);
                return Ok((name, after_first_pointer.unwrap_or(pos + 1)));
            }
            0x00 => {
                let label = msg.get(pos + 1..pos + 1 + usize::from(len)).ok_or(DnsError::Malformed)?;
                name.push(len);
                name.extend(label.iter().map(u8::to_ascii_lowercase));
                if name.len() >= MAX_NAME_WIRE_BYTES {
                    return Err(DnsError::Malformed);
                }
                pos += 1 + usize::from(len);
            }
            0xc0 => {
                let low = *msg.get(pos + 1).ok_or(DnsError::Malformed)?;
                hops += 1;
                if hops > MAX_POINTER_HOPS {
                    return Err(DnsError::Malformed);
                }
                after_first_pointer.get_or_insert(pos + 2);
                pos = usize::from(u16::from_be_bytes([len & 0x3f, low]));
            }
            // 0x40 and 0x80 are extended label types, never valid in a reply.
            _ => return Err(DnsError::Malformed),
        }
    }
}

#[cfg(test)]
mod tests;
