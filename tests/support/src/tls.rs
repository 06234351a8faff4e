//! Throwaway certificates: a CA made for one test, and a server certificate it signed.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A fresh CA and a server certificate it signed, as PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The CA's certificate: what a client is told to trust.
    pub ca_pem: String,
    /// The server's certificate, signed by the CA.
    pub cert_pem: String,
    /// The server certificate's private key.
    pub key_pem: String,
}

/// A CA named `common_name` and a server certificate it signed for `names` (host names or IP addresses).
pub fn issue(common_name: &str, names: &[&str]) -> Issued {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, common_name);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let cert = CertificateParams::new(names).unwrap().signed_by(&key, &Issuer::new(ca_params, ca_key)).unwrap();
    Issued { ca_pem: ca_cert.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
}
