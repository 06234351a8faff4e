//! The supervisor's gRPC client of the gateway: one HTTP/2 connection (TLS with the gateway's CA, and a
//! client certificate where it asks for one), every call carrying the sandbox token as
//! `authorization: Bearer`, marked sensitive so no log or `Debug` shows it.

use std::time::Duration;

use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};
use vm_contract::gateway::GatewayEndpoint;
use vm_protocol::openshell::v1::open_shell_client::OpenShellClient;

/// How long a connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 pings, as upstream's supervisor sends them: the gateway's session ends with the connection.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// A client of the gateway's service, authenticated as this sandbox.
pub type Gateway = OpenShellClient<InterceptedService<Channel, Bearer>>;

/// Why the gateway cannot be reached. Fixed text: nothing here quotes the token or a certificate.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The endpoint is not a URL tonic takes.
    #[error("the gateway endpoint is not a valid URL")]
    Endpoint,
    /// A CA or client certificate file cannot be read.
    #[error("cannot read {0}")]
    Pem(std::path::PathBuf, #[source] std::io::Error),
    /// TLS cannot be set up with them.
    #[error("the gateway's TLS settings are not usable")]
    Tls,
    /// The token cannot be a header value.
    #[error("the sandbox token is not a valid header value")]
    Token,
}

/// Adds the token to every call.
#[derive(Clone)]
pub struct Bearer(AsciiMetadataValue);

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Bearer(<redacted>)")
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request.metadata_mut().insert("authorization", self.0.clone());
        Ok(request)
    }
}

/// The channel to `endpoint`, made lazily (the first call connects, each later one reconnects as needed).
///
/// # Errors
/// [`ClientError`].
pub fn connect(endpoint: &GatewayEndpoint, token: &str) -> Result<Gateway, ClientError> {
    let mut builder = Endpoint::from_shared(endpoint.url.clone())
        .map_err(|_| ClientError::Endpoint)?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    if endpoint.is_tls() {
        let read = |path: &std::path::Path| std::fs::read(path).map_err(|e| ClientError::Pem(path.to_owned(), e));
        // Only the gateway's CA: never the system's roots.
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &endpoint.ca {
            tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let Some((cert, key)) = &endpoint.client_identity {
            tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        builder = builder.tls_config(tls).map_err(|_| ClientError::Tls)?;
    }
    let mut value: AsciiMetadataValue =
        MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| ClientError::Token)?;
    value.set_sensitive(true);
    Ok(OpenShellClient::with_interceptor(builder.connect_lazy(), Bearer(value)))
}
