//! TLS interception for rules with `"tls": "intercept"` (`docs/network.md`, Interception): the workload's
//! TLS ends here, on a leaf of the sandbox's CA for the host the stream was decided for; each request is
//! read (HTTP/1.1 or HTTP/2), judged by the rule's HTTP rules, has its credential placeholders swapped
//! ([`secrets`]), and goes out over this supervisor's own TLS connection to the destination, verified
//! against the system's roots and `--egress-ca`.
//!
//! ```text
//! guest stream --duplex--> TLS (leaf for the decided host; SNI must match) --> hyper server (h1 / h2)
//!   each request: authority == the decided host? rule still in force? http rules? placeholders?
//!     no: 403 from the proxy, HTTP Activity + finding
//!     yes: hyper client --> TLS (system roots + --egress-ca; untrusted: 502 + finding) --> destination
//! ```

pub mod ca;
mod proxy;
pub mod secrets;

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use vm_protocol::policy::network::{NetRule, TlsMode};

use self::ca::SandboxCa;
pub use self::proxy::serve;

/// Longest request head (HTTP/1.1 line and headers; HTTP/2 header list) the proxy reads.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most HTTP/2 streams open at once on one intercepted connection.
pub const MAX_STREAMS: u32 = 64;

/// What interception needs, for a sandbox whose approved rules intercept some host.
pub struct Interceptor {
    /// The sandbox's CA.
    pub ca: SandboxCa,
    /// TLS to destinations.
    client: Arc<rustls::ClientConfig>,
    /// Off under the `pass-placeholders` control: requests leave as the workload wrote them.
    swap_placeholders: bool,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor").field("swap_placeholders", &self.swap_placeholders).finish_non_exhaustive()
    }
}

/// Why interception could not be set up (fixed text).
#[derive(Debug, thiserror::Error)]
pub enum InterceptError {
    /// The CA could not be made.
    #[error(transparent)]
    Ca(#[from] ca::CaError),
    /// A certificate of `--egress-ca` was refused.
    #[error("a certificate of --egress-ca is not usable")]
    EgressCa,
    /// rustls refused the client configuration.
    #[error("cannot configure TLS to destinations")]
    Client,
}

impl Interceptor {
    /// Interception for `rules` (none when no rule intercepts), trusting the system's roots and `extra`.
    ///
    /// # Errors
    /// [`InterceptError`].
    pub fn new(
        sandbox: &str,
        rules: &[NetRule],
        extra: &[CertificateDer<'static>],
        swap_placeholders: bool,
    ) -> Result<Option<Self>, InterceptError> {
        let hosts = rules.iter().filter(|r| r.tls == TlsMode::Intercept).map(|r| r.host.as_str());
        let domains = ca::domains(hosts);
        if domains.is_empty() {
            return Ok(None);
        }
        let mut roots = rustls::RootCertStore::empty();
        // Unreadable system certificates are skipped: the destination's check then fails, clearly, per request.
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        for cert in extra {
            roots.add(cert.clone()).map_err(|_| InterceptError::EgressCa)?;
        }
        let mut client =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|_| InterceptError::Client)?
                .with_root_certificates(roots)
                .with_no_client_auth();
        client.alpn_protocols = ca::ALPN.iter().map(|p| p.to_vec()).collect();
        let ca = SandboxCa::new(sandbox, &domains)?;
        Ok(Some(Self { ca, client: Arc::new(client), swap_placeholders }))
    }
}
