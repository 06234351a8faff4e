//! The sandbox's certificate authority: made at start, its key only in this process's memory, its
//! certificate name-constrained to the hosts the approved rules intercept. Leaves are minted per
//! destination host (the one the stream was decided for, never a name the workload picks) and cached,
//! bounded.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CidrSubnet, DnType, ExtendedKeyUsagePurpose, GeneralSubtree, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, NameConstraints, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::ServerConfig;

/// Leaves kept: a workload that asks for more hosts (a wildcard rule admits many) mints again.
pub const LEAF_CACHE_ITEMS: usize = 256;
/// How far back certificates start: a guest clock a little behind the host's still accepts them.
const BACKDATE: Duration = Duration::from_secs(24 * 3600);
/// The CA's lifetime; a sandbox that runs longer gets a new CA at its next start.
const CA_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// A leaf's lifetime.
const LEAF_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);
/// What the guest side offers.
pub const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// Why a CA or leaf could not be made (fixed text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CaError {
    /// Key generation or signing failed.
    #[error("cannot make the sandbox's certificates")]
    Sign,
    /// rustls refused the leaf.
    #[error("cannot use the sandbox's leaf certificate")]
    Tls,
}

/// The CA and its cache of leaves.
pub struct SandboxCa {
    issuer: Issuer<'static, KeyPair>,
    /// One key for every leaf: each leaf is bound to it by the CA's signature, and it never leaves memory.
    leaf_key: KeyPair,
    pem: String,
    der: CertificateDer<'static>,
    leaves: Mutex<VecDeque<(String, Arc<ServerConfig>)>>,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCa").finish_non_exhaustive()
    }
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = SystemTime::now();
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + lifetime).into();
}

impl SandboxCa {
    /// A new CA allowed to name only `domains` and their subdomains.
    ///
    /// # Errors
    /// [`CaError::Sign`].
    pub fn new(sandbox: &str, domains: &[String]) -> Result<Self, CaError> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, format!("vm-driver sandbox {sandbox} CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        // Names only: every address is excluded, or an iPAddress SAN would be unconstrained (RFC 5280 4.2.1.10).
        params.name_constraints = Some(NameConstraints {
            permitted_subtrees: domains.iter().map(|d| GeneralSubtree::DnsName(d.clone())).collect(),
            excluded_subtrees: vec![
                GeneralSubtree::IpAddress(CidrSubnet::from_v4_prefix([0; 4], 0)),
                GeneralSubtree::IpAddress(CidrSubnet::from_v6_prefix([0; 16], 0)),
            ],
        });
        validity(&mut params, CA_LIFETIME);
        let key = KeyPair::generate().map_err(|_| CaError::Sign)?;
        let cert = params.self_signed(&key).map_err(|_| CaError::Sign)?;
        let leaf_key = KeyPair::generate().map_err(|_| CaError::Sign)?;
        Ok(Self {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
            leaf_key,
            leaves: Mutex::new(VecDeque::new()),
        })
    }

    /// The CA certificate, for the guest's trust.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The TLS configuration that presents a leaf for `host`, minted on first use.
    ///
    /// # Errors
    /// [`CaError`].
    pub fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, CaError> {
        let mut leaves = self.leaves.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, config)) = leaves.iter().find(|(h, _)| h == host) {
            return Ok(Arc::clone(config));
        }
        let config = Arc::new(self.mint(host)?);
        if leaves.len() == LEAF_CACHE_ITEMS {
            leaves.pop_front();
        }
        leaves.push_back((host.to_owned(), Arc::clone(&config)));
        Ok(config)
    }

    /// Leaves in the cache.
    pub fn cached(&self) -> usize {
        self.leaves.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    fn mint(&self, host: &str) -> Result<ServerConfig, CaError> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, host);
        let name = host.to_owned().try_into().map_err(|_| CaError::Sign)?;
        params.subject_alt_names = vec![SanType::DnsName(name)];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, LEAF_LIFETIME);
        let leaf = params.signed_by(&self.leaf_key, &self.issuer).map_err(|_| CaError::Sign)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|_| CaError::Tls)?
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone(), self.der.clone()], key)
            .map_err(|_| CaError::Tls)?;
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }
}

/// The name-constraint domains for rule hosts: `*.example.com` and `example.com` both give `example.com`.
pub fn domains<'a>(hosts: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut domains: Vec<String> = hosts.map(|h| h.strip_prefix("*.").unwrap_or(h).to_owned()).collect();
    domains.sort_unstable();
    domains.dedup();
    domains
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_are_cached_up_to_the_bound() {
        let ca = SandboxCa::new("t", &domains(["*.example.com", "api.example.org"].into_iter())).unwrap();
        assert!(ca.pem().starts_with("-----BEGIN CERTIFICATE-----\n"));
        let a = ca.server_config("a.example.com").unwrap();
        assert!(Arc::ptr_eq(&a, &ca.server_config("a.example.com").unwrap()), "a second ask is served from the cache");
        for i in 0..LEAF_CACHE_ITEMS + 10 {
            ca.server_config(&format!("h{i}.example.com")).unwrap();
        }
        assert_eq!(ca.cached(), LEAF_CACHE_ITEMS);
        assert!(!Arc::ptr_eq(&a, &ca.server_config("a.example.com").unwrap()), "the oldest was evicted");
    }
}
