//! `vm-driver serve`'s OpenShell options: where a gateway reaches the driver's ComputeDriver service, and
//! where the sandboxes' supervisors reach the gateway (`docs/openshell.md`).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use vm_contract::gateway::GatewayEndpoint;
use vm_driver::service::OpenShellConfig;

#[derive(Debug, Args)]
pub struct OpenShellArgs {
    /// Serve OpenShell's ComputeDriver service (openshell.compute.v1) on this Unix socket, for an OpenShell
    /// gateway to drive this driver (its directory must be private to this user).
    #[arg(long, value_name = "PATH", requires = "openshell_endpoint")]
    pub openshell_socket: Option<PathBuf>,
    /// The gateway's gRPC endpoint, which each sandbox's supervisor dials on the host: http://HOST:PORT
    /// (plaintext HTTP/2) or https://HOST:PORT (with --openshell-ca).
    #[arg(long, value_name = "URL", requires = "openshell_socket")]
    pub openshell_endpoint: Option<String>,
    /// The CA bundle (PEM) the gateway's certificate must chain to; the system's roots are never used.
    #[arg(long, value_name = "FILE")]
    pub openshell_ca: Option<PathBuf>,
    /// A client certificate (PEM) for a gateway that asks for one, with --openshell-client-key.
    #[arg(long, value_name = "FILE", requires = "openshell_client_key")]
    pub openshell_client_cert: Option<PathBuf>,
    /// The client certificate's key (PEM, 0600).
    #[arg(long, value_name = "FILE", requires = "openshell_client_cert")]
    pub openshell_client_key: Option<PathBuf>,
    /// Only this process (the gateway) may use the ComputeDriver socket.
    #[arg(long, value_name = "PID")]
    pub openshell_gateway_pid: Option<i32>,
}

impl OpenShellArgs {
    /// The service's settings, or none; paths made absolute (supervisors run elsewhere).
    pub fn config(self) -> Result<Option<OpenShellConfig>> {
        let (Some(socket), Some(url)) = (self.openshell_socket, self.openshell_endpoint) else {
            return Ok(None);
        };
        let lower = url.to_ascii_lowercase();
        if !(lower.starts_with("http://") || lower.starts_with("https://")) {
            bail!("--openshell-endpoint: an http:// or https:// URL");
        }
        let absolute = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
        let endpoint = GatewayEndpoint {
            url,
            ca: self.openshell_ca.map(absolute),
            client_identity: self
                .openshell_client_cert
                .zip(self.openshell_client_key)
                .map(|(c, k)| (absolute(c), absolute(k))),
        };
        if endpoint.is_tls() && endpoint.ca.is_none() {
            bail!("--openshell-endpoint https:// needs --openshell-ca: the gateway's CA, the only roots trusted");
        }
        for path in endpoint.ca.iter().chain(endpoint.client_identity.iter().flat_map(|(c, k)| [c, k])) {
            if !path.is_file() {
                bail!("{}: not a file", path.display());
            }
        }
        Ok(Some(OpenShellConfig { socket, gateway_pid: self.openshell_gateway_pid, endpoint }))
    }
}
