//! Names resolved on the host: by the system resolver, or by asking the DNS server that
//! `--egress-resolver` names.
//!
//! The caller classifies every address returned ([`super::address::classify`]) and dials only those, so one
//! stream's name is resolved once. An IP literal comes back as it is, without a lookup.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

pub use super::dns::DnsError;
use super::dns::{self, QType};

/// How long one resolution may take; the A and AAAA queries run within it side by side.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Addresses kept from one resolution; the rest are dropped.
pub const MAX_ADDRESSES: usize = 16;

/// Where names are resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolver {
    /// getaddrinfo, so the host's hosts file and NSS apply.
    System,
    /// A DNS server asked directly over UDP; the host's hosts file does not apply.
    Dns(SocketAddr),
}

/// Why a name gave no addresses.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The name is empty, over 253 bytes, or has an empty, over-long or unprintable label.
    #[error("the host name is not valid")]
    InvalidName,
    /// getaddrinfo failed, a missing name included.
    #[error("the system resolver failed")]
    System(#[source] io::Error),
    /// The DNS server could not be asked, or its answer was not usable.
    #[error("the DNS query failed")]
    Dns(#[source] DnsError),
    /// The DNS server says the name does not exist.
    #[error("the name does not exist")]
    NoSuchName,
    /// The name exists but has no A or AAAA records.
    #[error("the name has no addresses")]
    NoAddress,
    /// No answer within [`RESOLVE_TIMEOUT`].
    #[error("the name did not resolve in time")]
    Timeout,
}

impl From<DnsError> for ResolveError {
    fn from(error: DnsError) -> Self {
        match error {
            DnsError::InvalidName => Self::InvalidName,
            DnsError::NoSuchName => Self::NoSuchName,
            DnsError::Timeout => Self::Timeout,
            other => Self::Dns(other),
        }
    }
}

impl Resolver {
    /// The addresses of `host` (a name, or an IP literal with or without brackets), IPv4 first for
    /// [`Resolver::Dns`], without duplicates, at most [`MAX_ADDRESSES`].
    ///
    /// `port` only matters to getaddrinfo's interface; it does not change the answer.
    ///
    /// # Errors
    /// [`ResolveError`]: an invalid name, a failed lookup, a timeout, or no address at all. With
    /// [`Resolver::Dns`], one of the two queries may fail if the other gives addresses.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<IpAddr>, ResolveError> {
        if let Some(ip) = literal(host) {
            return Ok(vec![ip]);
        }
        // The DNS encoder's rules, for getaddrinfo too: it never sees a name DNS would refuse.
        dns::encode_name(host)?;
        let found = match self {
            Self::System => system(host, port).await?,
            Self::Dns(server) => ask(*server, host).await?,
        };
        let mut addresses = Vec::new();
        for ip in found {
            if addresses.len() == MAX_ADDRESSES {
                break;
            }
            if !addresses.contains(&ip) {
                addresses.push(ip);
            }
        }
        if addresses.is_empty() {
            return Err(ResolveError::NoAddress);
        }
        Ok(addresses)
    }
}

fn literal(host: &str) -> Option<IpAddr> {
    let inner = host.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')).unwrap_or(host);
    inner.parse().ok()
}

async fn system(host: &str, port: u16) -> Result<Vec<IpAddr>, ResolveError> {
    let lookup = tokio::net::lookup_host((host, port));
    let found = tokio::time::timeout(RESOLVE_TIMEOUT, lookup)
        .await
        .map_err(|_| ResolveError::Timeout)?
        .map_err(ResolveError::System)?;
    Ok(found.map(|address| address.ip()).collect())
}

async fn ask(server: SocketAddr, host: &str) -> Result<Vec<IpAddr>, ResolveError> {
    let (v4, v6) = tokio::join!(
        dns::query(server, host, QType::A, RESOLVE_TIMEOUT),
        dns::query(server, host, QType::Aaaa, RESOLVE_TIMEOUT),
    );
    match (v4, v6) {
        (Ok(mut v4), Ok(v6)) => {
            v4.extend(v6);
            Ok(v4)
        }
        // One family's failure is tolerated only when the other gave addresses.
        (Ok(found), Err(error)) | (Err(error), Ok(found)) if found.is_empty() => Err(error.into()),
        (Ok(found), Err(_)) | (Err(_), Ok(found)) => Ok(found),
        (Err(DnsError::NoSuchName), Err(_)) | (Err(_), Err(DnsError::NoSuchName)) => Err(ResolveError::NoSuchName),
        (Err(error), Err(_)) => Err(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::address::{classify, Blocked};
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use tokio::time::Instant;

    const DNSMASQ: &str = "/usr/sbin/dnsmasq";

    /// A dnsmasq answering only the names below; killed and reaped on drop.
    struct Dnsmasq {
        child: Child,
        server: SocketAddr,
    }

    impl Drop for Dnsmasq {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    async fn start_dnsmasq() -> Dnsmasq {
        assert!(Path::new(DNSMASQ).exists(), "{DNSMASQ} is missing: scripts/deps installs dnsmasq-base");
        // A free port, released just before dnsmasq takes it.
        let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut command = Command::new(DNSMASQ);
        command.args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--pid-file=",
            "--log-facility=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--listen-address=127.0.0.1",
            // Names under test/ that are not listed get NXDOMAIN rather than REFUSED.
            "--local=/test/",
            "--host-record=public.test,93.184.215.14",
            "--host-record=six.test,2001:4860:4860::8888",
            "--cname=alias.test,public.test",
            "--cname=alias2.test,alias.test",
            "--address=/loop.test/127.0.0.1",
        ]);
        command.arg(format!("--port={port}"));
        if rustix::process::getuid().is_root() {
            command.arg("--user=root");
        }
        let child = command.stdin(Stdio::null()).stdout(Stdio::null()).spawn().unwrap();
        let mut dnsmasq = Dnsmasq { child, server: (Ipv4Addr::LOCALHOST, port).into() };
        let resolver = Resolver::Dns(dnsmasq.server);
        let deadline = Instant::now() + Duration::from_secs(5);
        while resolver.resolve("public.test", 0).await.is_err() {
            assert!(dnsmasq.child.try_wait().unwrap().is_none(), "dnsmasq exited; its stderr is above");
            assert!(Instant::now() < deadline, "dnsmasq did not answer within 5 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        dnsmasq
    }

    #[tokio::test]
    async fn dns_resolver_against_dnsmasq() {
        let dnsmasq = start_dnsmasq().await;
        let resolver = Resolver::Dns(dnsmasq.server);
        let public = IpAddr::V4(Ipv4Addr::new(93, 184, 215, 14));
        assert_eq!(resolver.resolve("public.test", 443).await.unwrap(), [public]);
        assert_eq!(resolver.resolve("PUBLIC.test.", 443).await.unwrap(), [public]);
        assert_eq!(resolver.resolve("alias.test", 443).await.unwrap(), [public]);
        assert_eq!(resolver.resolve("alias2.test", 443).await.unwrap(), [public]);
        let six: Ipv6Addr = "2001:4860:4860::8888".parse().unwrap();
        assert_eq!(resolver.resolve("six.test", 443).await.unwrap(), [IpAddr::V6(six)]);
        let missing = resolver.resolve("missing.test", 443).await;
        assert!(matches!(missing, Err(ResolveError::NoSuchName)), "{missing:?}");
        // Resolving does not judge: the caller classifies what comes back.
        let looped = resolver.resolve("loop.test", 443).await.unwrap();
        assert_eq!(looped, [IpAddr::V4(Ipv4Addr::LOCALHOST)]);
        assert_eq!(classify(looped[0]), Some(Blocked::Loopback));
    }

    #[tokio::test]
    async fn literals_are_not_resolved() {
        // A server that would see any query: it must see none.
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let resolver = Resolver::Dns(server.local_addr().unwrap());
        for (host, ip) in [("127.0.0.1", "127.0.0.1"), ("[::1]", "::1"), ("::ffff:127.0.0.1", "::ffff:127.0.0.1")] {
            assert_eq!(resolver.resolve(host, 80).await.unwrap(), [ip.parse::<IpAddr>().unwrap()], "{host}");
        }
        let mut buf = [0u8; 512];
        assert_eq!(server.try_recv(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock);
    }

    #[tokio::test]
    async fn invalid_names_are_refused_before_any_lookup() {
        for resolver in [Resolver::System, Resolver::Dns((Ipv4Addr::LOCALHOST, 9).into())] {
            for host in ["", "a..b", "bad host", &"a".repeat(64), &["a"; 128].join(".")] {
                let result = resolver.resolve(host, 80).await;
                assert!(matches!(result, Err(ResolveError::InvalidName)), "{host:?}: {result:?}");
            }
        }
    }

    #[tokio::test]
    async fn system_resolver_reads_the_hosts_file() {
        let found = Resolver::System.resolve("localhost", 80).await.unwrap();
        assert!(found.iter().all(|ip| ip.is_loopback()), "{found:?}");
    }
}
