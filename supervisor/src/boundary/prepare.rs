//! What a spawn becomes before the gate judges it: the image root's defaults (docs/images.md, "What of the
//! image config is honoured"), then the workload's network variables (docs/network.md).

use vm_contract::root::RunConfig;
use vm_protocol::message::EnvVar;
use vm_protocol::net::{HTTP_PROXY_PORT, SOCKS_PROXY_PORT, TRUST_BUNDLE_FILE, TRUST_CA_FILE};
use vm_protocol::{SignalName, Spawn};

use crate::network::intercept::secrets::Secrets;

/// What every spawn of a sandbox is given, fixed at its start.
#[derive(Debug, Default)]
pub struct Prepare {
    /// How the image root asks processes be run (nothing for the built-in root).
    pub run: RunConfig,
    /// Variables every process gets over its own: credential placeholders and the sandbox CA's trust
    /// ([`egress_env`]).
    pub egress_env: Vec<EnvVar>,
}

impl Prepare {
    /// `spawn` as the sandbox runs it: the image's defaults under it, then, with `proxies` (a policy with a
    /// network section), the proxy settings under its own, then the egress variables over its own.
    pub fn spawn(&self, spawn: &mut Spawn, proxies: bool) {
        defaults(&self.run, spawn);
        if proxies {
            proxy_env(spawn);
        }
        for var in &self.egress_env {
            spawn.env.retain(|e| e.key != var.key);
            spawn.env.push(var.clone());
        }
    }

    /// What asks the workload to stop ([`stop_signal`]).
    pub fn stop_signal(&self) -> SignalName {
        stop_signal(&self.run)
    }
}

/// An image's defaults under a request, as Docker applies them: its command (the entrypoint, then the
/// request's arguments or the image's `Cmd`), its variables under the request's (the guest lets a later
/// value of a key win) and its working directory when the request names none.
fn defaults(run: &RunConfig, spawn: &mut Spawn) {
    if let Some(argv) = run.command(&spawn.argv) {
        spawn.argv = argv;
    }
    if !run.env.is_empty() {
        let own = std::mem::take(&mut spawn.env);
        spawn.env = run.env_pairs().map(|(key, value)| EnvVar { key: key.into(), value: value.into() }).collect();
        spawn.env.extend(own);
    }
    if spawn.cwd.is_none() {
        spawn.cwd.clone_from(&run.working_dir);
    }
}

/// What asks the workload to stop: the image's `StopSignal`, else SIGTERM (also for one outside the set
/// this product sends).
fn stop_signal(run: &RunConfig) -> SignalName {
    run.stop_signal.as_deref().and_then(SignalName::parse_name_or_number).unwrap_or(SignalName::Term)
}

/// What every process of a sandbox gets over its own variables: each credential's placeholder and, when
/// the supervisor intercepts TLS, the files that make its CA trusted (the bundle with the system's roots,
/// or the CA alone where a tool adds it to its own roots).
pub fn egress_env(secrets: &Secrets, intercepting: bool) -> Vec<EnvVar> {
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
