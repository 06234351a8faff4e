//! Network streams on the supervisor's side (`docs/network.md`): egress from the guest's loopback proxies,
//! decided, resolved and dialed here, and port forwards into the guest.
//!
//! - [`address`]: which addresses are never reached unless a rule lists them.
//! - [`resolve`]: names resolved on the host (the system resolver, or `--egress-resolver`'s DNS server).
//! - [`request`] and [`socks`]: reading a proxy request from a stream's first bytes, bounded.
//! - [`streams`]: the link's streams and their rules; [`pipe`]: what an egress stream shares with its task;
//!   [`egress`]: that task (read the request, answer, relay, close); [`dial`]: its decision, address checks
//!   and dial; [`upstream`]: the operator's proxy.

pub mod address;
pub mod dial;
mod dns;
pub mod egress;
pub mod intercept;
pub mod pipe;
pub mod request;
pub mod resolve;
pub mod socks;
pub mod streams;
pub mod upstream;

use vm_protocol::message::EnvVar;
use vm_protocol::net::{HTTP_PROXY_PORT, SOCKS_PROXY_PORT, TRUST_BUNDLE_FILE, TRUST_CA_FILE};
use vm_protocol::Spawn;

/// What every process of a sandbox gets over its own variables: each credential's placeholder and, when
/// the supervisor intercepts TLS, the files that make its CA trusted (the bundle with the system's roots,
/// or the CA alone where a tool adds it to its own roots).
pub fn egress_env(secrets: &intercept::secrets::Secrets, intercepting: bool) -> Vec<EnvVar> {
    let mut env: Vec<EnvVar> = secrets.env().into_iter().map(|(key, value)| EnvVar { key, value }).collect();
    if intercepting {
        let bundles = [
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "GIT_SSL_CAINFO",
            "PIP_CERT",
            "AWS_CA_BUNDLE",
            "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
        ];
        for key in bundles {
            env.push(EnvVar { key: key.to_owned(), value: TRUST_BUNDLE_FILE.to_owned() });
        }
        env.push(EnvVar { key: "NODE_EXTRA_CA_CERTS".to_owned(), value: TRUST_CA_FILE.to_owned() });
    }
    env
}

/// Gives a workload its network variables: the proxy settings under its own (with a network section), then
/// `egress` ([`egress_env`]) over its own.
pub fn workload_env(spawn: &mut Spawn, proxies: bool, egress: &[EnvVar]) {
    if proxies {
        proxy_env(spawn);
    }
    for var in egress {
        spawn.env.retain(|e| e.key != var.key);
        spawn.env.push(var.clone());
    }
}

/// The proxy settings, under any the workload sets itself: both spellings of each variable, since tools
/// disagree on which they read, and `socks5h` so SOCKS clients let the host resolve names (the guest has no
/// DNS).
fn proxy_env(spawn: &mut Spawn) {
    let http = format!("http://127.0.0.1:{HTTP_PROXY_PORT}");
    let socks = format!("socks5h://127.0.0.1:{SOCKS_PROXY_PORT}");
    let none = "localhost,127.0.0.1,::1".to_owned();
    let vars = [
        ("HTTP_PROXY", &http),
        ("HTTPS_PROXY", &http),
        ("ALL_PROXY", &socks),
        ("NO_PROXY", &none),
        ("http_proxy", &http),
        ("https_proxy", &http),
        ("all_proxy", &socks),
        ("no_proxy", &none),
        ("grpc_proxy", &http),
        ("NODE_USE_ENV_PROXY", &"1".to_owned()),
    ];
    for (key, value) in vars {
        if !spawn.env.iter().any(|e| e.key == key) {
            spawn.env.push(EnvVar { key: key.to_owned(), value: value.clone() });
        }
    }
}
