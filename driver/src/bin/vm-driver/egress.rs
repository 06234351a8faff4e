//! The operator's egress flags of `launch` and `serve` (docs/network.md): where names resolve, and the
//! upstream proxy every connection must leave through, with its credentials read from a 0600 file.

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use anyhow::{bail, Context as _, Result};
use base64::Engine as _;
use vm_driver::sandbox::Egress;

/// Egress settings for every sandbox this driver runs; none of them reaches the guest.
#[derive(Debug, clap::Args)]
pub struct EgressArgs {
    /// A DNS server (IP:PORT) for the names of egress connections, instead of the host's resolver
    /// (/etc/hosts and NSS). Every answer is still checked against the address rules.
    #[arg(long, value_name = "IP:PORT")]
    pub egress_resolver: Option<SocketAddr>,
    /// An HTTP proxy (http://HOST:PORT) every egress connection leaves through, by CONNECT to the address
    /// the supervisor resolved and checked.
    #[arg(long, value_name = "URL")]
    pub egress_proxy: Option<String>,
    /// USER:PASSWORD for --egress-proxy, in a file only its owner can read (0600); never on the command line.
    #[arg(long, value_name = "FILE", requires = "egress_proxy")]
    pub egress_proxy_credentials: Option<PathBuf>,
    /// Certificates (PEM) trusted, beside the system's roots, for the destinations of connections the
    /// supervisor intercepts (network rules with "tls": "intercept").
    #[arg(long, value_name = "FILE")]
    pub egress_ca: Option<PathBuf>,
}

impl EgressArgs {
    /// The settings, checked.
    ///
    /// # Errors
    /// A proxy URL that is not `http://HOST:PORT`, or a credentials file that is unreadable or readable by
    /// others.
    pub fn egress(&self) -> Result<Egress> {
        let proxy = self.egress_proxy.as_deref().map(proxy_address).transpose()?;
        let proxy_authorization = match &self.egress_proxy_credentials {
            Some(path) => Some(credentials(path)?),
            None => None,
        };
        let ca = match &self.egress_ca {
            Some(path) => Some(std::fs::canonicalize(path).with_context(|| format!("cannot read {}", path.display()))?),
            None => None,
        };
        Ok(Egress { resolver: self.egress_resolver, proxy, proxy_authorization, ca })
    }
}

/// `http://HOST:PORT[/]` to `HOST:PORT`.
fn proxy_address(url: &str) -> Result<String> {
    let rest = url.strip_prefix("http://").context("--egress-proxy must be http://HOST:PORT")?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('@') {
        bail!("--egress-proxy must not hold credentials; give them with --egress-proxy-credentials FILE");
    }
    let ok =
        rest.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if !ok || rest.contains('/') {
        bail!("--egress-proxy must be http://HOST:PORT");
    }
    Ok(rest.to_owned())
}

/// The `Proxy-Authorization` value from a `USER:PASSWORD` file of mode 0600 (or stricter) owned by us.
fn credentials(path: &PathBuf) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if meta.mode() & 0o077 != 0 || meta.uid() != rustix::process::geteuid().as_raw() {
        bail!("{} must be owned by this user and not readable by others (chmod 600)", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let line = text.trim_end_matches(['\r', '\n']);
    if !line.contains(':') || line.contains(['\r', '\n']) {
        bail!("{} must hold one line USER:PASSWORD", path.display());
    }
    Ok(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(line)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_urls_are_host_and_port_only() {
        assert_eq!(proxy_address("http://proxy.corp:3128/").unwrap(), "proxy.corp:3128");
        for bad in ["https://p:1", "http://u:p@p:1", "http://p", "http://p:0", "http://p:1/x", "p:1"] {
            assert!(proxy_address(bad).is_err(), "{bad}");
        }
    }
}
