//! Deciding and dialing one egress stream's destination: the rule, the addresses (the host gateway's
//! loopback, a literal, or one resolution, never repeated), the address check, the re-check against a
//! policy update, and the dial (directly or through the operator's proxy).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use tokio::net::TcpStream;
use vm_protocol::policy::network::{NetRule, TlsMode, HOST_GATEWAY};

use super::egress::{Context, Decided, Refusal, CONNECT_TIMEOUT};
use super::pipe::Pipe;
use super::request::{Kind, ProxyRequest};
use super::socks;
use crate::policy::NetView;

/// Decides, resolves, checks and dials.
pub(super) async fn connect(ctx: &Context, req: &ProxyRequest, pipe: &Pipe) -> Result<(TcpStream, Decided), Refusal> {
    let (host, port) = (req.target.host.as_str(), req.target.port);
    let rule = current_rule(ctx, host, port).ok_or(Refusal::new(
        403,
        socks::NOT_ALLOWED,
        "no network rule allows the destination",
    ))?;
    // A plain-HTTP request is judged by the rule's HTTP rules before anything is dialed; a tunnel, whose
    // requests nobody reads unless the rule intercepts, cannot be judged by them at all.
    match &req.kind {
        Kind::Forward { method, path, .. } if !rule.allows_request(method, path) => {
            return Err(Refusal::new(403, socks::NOT_ALLOWED, "no http rule of the network rule allows the request"));
        }
        Kind::Connect if !rule.http.is_empty() && rule.tls == TlsMode::Passthrough => {
            return Err(Refusal::new(
                403,
                socks::NOT_ALLOWED,
                "the rule's http rules cannot judge a tunnel it does not intercept",
            ));
        }
        _ => {}
    }
    // From here a policy update that no longer allows it ends the stream; one that came before is caught below.
    pipe.decide(&rule);
    let ips = addresses(ctx, host, port).await?;
    if ctx.check_addresses {
        for ip in &ips {
            allowed(&rule, host, *ip)
                .map_err(|reason| Refusal { ip: Some(*ip), ..Refusal::new(403, socks::NOT_ALLOWED, reason) })?;
        }
    }
    if current_rule(ctx, host, port).is_none_or(|now| now != rule) || pipe.ended().is_some() {
        return Err(Refusal::new(403, socks::NOT_ALLOWED, "a policy update revoked the rule while connecting"));
    }
    let mut last = Refusal::new(502, socks::CONNECTION_REFUSED, "the destination refused the connection");
    for ip in ips {
        match dial(ctx, SocketAddr::new(ip, port)).await {
            Ok(stream) => {
                let decided =
                    Decided { host: host.to_owned(), port, rule: rule.host.as_str().to_owned(), ip: Some(ip) };
                return Ok((stream, decided));
            }
            Err(DialError::Refused) => {
                last = Refusal {
                    ip: Some(ip),
                    ..Refusal::new(502, socks::CONNECTION_REFUSED, "the destination refused the connection")
                }
            }
            Err(DialError::TimedOut) => {
                last =
                    Refusal { ip: Some(ip), ..Refusal::new(504, socks::HOST_UNREACHABLE, "the connection timed out") }
            }
        }
    }
    Err(last)
}

/// Why a dial failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialError {
    /// The destination (or the operator's proxy) refused.
    Refused,
    /// No answer within [`CONNECT_TIMEOUT`].
    TimedOut,
}

/// Dials `addr`, an address already checked: directly, or by CONNECT through the operator's proxy.
///
/// # Errors
/// [`DialError`].
pub async fn dial(ctx: &Context, addr: SocketAddr) -> Result<TcpStream, DialError> {
    let dial = async {
        match &ctx.upstream {
            None => TcpStream::connect(addr).await.map_err(drop),
            Some(proxy) => proxy.connect(addr).await.map_err(drop),
        }
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, dial).await {
        Ok(Ok(stream)) => {
            let _ = stream.set_nodelay(true);
            Ok(stream)
        }
        Ok(Err(())) => Err(DialError::Refused),
        Err(_) => Err(DialError::TimedOut),
    }
}

fn current_rule(ctx: &Context, host: &str, port: u16) -> Option<NetRule> {
    ctx.view.borrow().rule_for(host, port).cloned()
}

/// The addresses to dial: the host's loopback for the host gateway, the literal, or the answers.
async fn addresses(ctx: &Context, host: &str, port: u16) -> Result<Vec<IpAddr>, Refusal> {
    if host == HOST_GATEWAY {
        return Ok(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    }
    let ips = ctx
        .resolver
        .resolve(host, port)
        .await
        .map_err(|_| Refusal::new(502, socks::HOST_UNREACHABLE, "the name did not resolve"))?;
    Ok(ips.into_iter().map(|ip| ip.to_canonical()).collect())
}

/// Whether the rules of `view` still allow what `pipe` decided (a stream not yet decided is judged later).
pub fn still_allowed(pipe: &Pipe, view: &NetView) -> bool {
    pipe.decided().is_none_or(|rule| view.rules.contains(&rule))
}

/// Whether `rule` lets `host` reach `ip`: a public address, one the rule lists, or the host gateway's loopback.
fn allowed(rule: &NetRule, host: &str, ip: IpAddr) -> Result<(), &'static str> {
    if host == HOST_GATEWAY && ip.is_loopback() {
        return Ok(());
    }
    match super::address::classify(ip) {
        Some(_) if rule.lists(ip) => Ok(()),
        Some(blocked) => Err(blocked.describe()),
        None => Ok(()),
    }
}
