//! `vm-driver port-forward SANDBOX [ADDR:]HOST_PORT:GUEST_PORT`: a host listener whose every connection is
//! one `ForwardPort` stream of `serve` into the guest.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use anyhow::{bail, Context as _, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use vm_contract::ids::SandboxId;
use vm_protocol::driver_api::ForwardPortRequest;

use crate::cli::SocketArgs;

/// Largest chunk read from a host connection at once.
const CHUNK_BYTES: usize = 64 * 1024;

#[derive(Debug, clap::Args)]
pub struct PortForwardArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// The sandbox id.
    pub id: SandboxId,
    /// `[ADDR:]HOST_PORT:GUEST_PORT`: ADDR defaults to 127.0.0.1 (an IPv6 address in brackets); HOST_PORT 0
    /// picks a free port.
    #[arg(value_parser = parse_mapping)]
    pub mapping: Mapping,
}

/// Where to listen, and which guest port to reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub listen: SocketAddr,
    pub guest_port: u16,
}

fn parse_mapping(text: &str) -> Result<Mapping, String> {
    let bad = || format!("{text:?} is not [ADDR:]HOST_PORT:GUEST_PORT");
    let (head, guest) = text.rsplit_once(':').ok_or_else(bad)?;
    let guest_port = guest.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad)?;
    let (addr, host_port) = match head.rsplit_once(':') {
        Some((addr, port)) => {
            let addr = addr.strip_prefix('[').and_then(|a| a.strip_suffix(']')).unwrap_or(addr);
            (addr.parse::<IpAddr>().map_err(|_| bad())?, port)
        }
        None => (IpAddr::V4(Ipv4Addr::LOCALHOST), head),
    };
    let host_port = host_port.parse::<u16>().map_err(|_| bad())?;
    Ok(Mapping { listen: SocketAddr::new(addr, host_port), guest_port })
}

pub async fn run(args: PortForwardArgs) -> Result<()> {
    let socket = args.socket.path();
    // Fails fast when serve is unreachable or the sandbox unknown.
    crate::client::connect(&socket).await?;
    let listener = TcpListener::bind(args.mapping.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.mapping.listen))?;
    let local = listener.local_addr()?;
    println!("Forwarding from {local} -> {}", args.mapping.guest_port);
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let (conn, _) = tokio::select! {
            accepted = listener.accept() => accepted.context("cannot accept a connection")?,
            _ = interrupt.recv() => return Ok(()),
            _ = terminate.recv() => return Ok(()),
        };
        let (socket, id, port) = (socket.clone(), args.id.to_string(), args.mapping.guest_port);
        tokio::spawn(async move {
            if let Err(e) = one(&socket, id, port, conn).await {
                eprintln!("vm-driver: port-forward: {e:#}");
            }
        });
    }
}

/// Relays one host connection through a `ForwardPort` stream.
async fn one(socket: &std::path::Path, sandbox_id: String, guest_port: u16, conn: TcpStream) -> Result<()> {
    let mut client = crate::client::connect(socket).await?;
    let (tx, rx) = mpsc::channel(16);
    tx.send(ForwardPortRequest { sandbox_id, guest_port: u32::from(guest_port), data: Vec::new() }).await?;
    let mut responses = client.forward_port(ReceiverStream::new(rx)).await?.into_inner();
    match responses.message().await? {
        Some(first) if first.connected => {}
        _ => bail!("the forward did not connect"),
    }
    let (mut read, mut write) = conn.into_split();
    let upload = async move {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            // A read error (a reset) returns early, which cancels the call: the guest's side is closed, not
            // half-closed as at EOF.
            let n = read.read(&mut buf).await?;
            if n == 0 {
                // Dropping the sender ends the request stream: the guest side sees EOF.
                return anyhow::Ok(());
            }
            let req = ForwardPortRequest { sandbox_id: String::new(), guest_port: 0, data: buf[..n].to_vec() };
            if tx.send(req).await.is_err() {
                return Ok(());
            }
        }
    };
    let download = async move {
        while let Some(msg) = responses.message().await? {
            write.write_all(&msg.data).await?;
        }
        write.shutdown().await?;
        anyhow::Ok(())
    };
    tokio::try_join!(upload, download).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_follow_kubectl() {
        let m = parse_mapping("8080:80").unwrap();
        assert_eq!((m.listen, m.guest_port), ("127.0.0.1:8080".parse().unwrap(), 80));
        assert_eq!(parse_mapping("0.0.0.0:0:22").unwrap().listen, "0.0.0.0:0".parse().unwrap());
        assert_eq!(parse_mapping("[::1]:9000:9000").unwrap().listen, "[::1]:9000".parse().unwrap());
        for bad in ["80", "8080:0", "x:80", "1.2.3:8080:80", "8080:65536"] {
            assert!(parse_mapping(bad).is_err(), "{bad}");
        }
    }
}
