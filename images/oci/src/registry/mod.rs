//! A client of the OCI distribution API v2: manifests and blobs, pulled by digest once the tag is
//! resolved, with anonymous or Bearer-token access (the `WWW-Authenticate` flow) or Basic credentials.
//!
//! - TLS: the system's roots, or only the CA file given (`--registry-ca`); plain http only for a host named
//!   insecure (`--insecure-registry HOST:PORT`).
//! - Bounded: each connect and each read has a timeout, so a registry that stalls fails the pull rather
//!   than hanging it; manifests and tokens are read up to a bound; blobs are read through
//!   [`crate::digest::Verified`], never past their descriptor's size.
//! - No redirect leaves https for http; redirects (registries send blobs to storage) are followed up to 5.
//!
//! Why our own client and not `oci-client`: it reads manifests and configs without a size bound and checks
//! a blob's digest only after it has all been written (docs/images.md).

pub mod auth;

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use reqwest::StatusCode;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use self::auth::{parse_challenge, Challenge, Login, Logins};
use crate::digest::Digest;
use crate::manifest::{ACCEPT as MANIFEST_TYPES, MAX_MANIFEST_BYTES};
use crate::reference::Reference;

/// Connecting to a registry.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Waiting for response headers, and for each read of a body, unless [`Options::read_timeout`] says.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest token response read.
const MAX_TOKEN_BYTES: u64 = 64 * 1024;
/// Largest CA file read.
const MAX_CA_BYTES: u64 = 1024 * 1024;

/// How to reach registries.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Trust only this CA bundle (PEM), not the system's roots.
    pub ca_file: Option<PathBuf>,
    /// `HOST:PORT`s spoken to over plain http.
    pub insecure: Vec<String>,
    /// A Docker `config.json` with logins (default: `~/.docker/config.json` if it exists).
    pub auth_file: Option<PathBuf>,
    /// The longest wait for headers or for one read of a body (default 30 s).
    pub read_timeout: Option<Duration>,
}

/// Why a registry request failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The CA file is unreadable or holds no certificate.
    #[error("cannot use the registry CA file {}", .0.display())]
    Ca(PathBuf),
    /// The credentials file.
    #[error(transparent)]
    Logins(#[from] auth::LoginsError),
    /// The HTTP client could not be built.
    #[error("cannot set up the registry client")]
    Client(#[source] reqwest::Error),
    /// No answer: refused, TLS failure, timeout.
    #[error("registry {host} did not answer")]
    Unreachable {
        /// The registry.
        host: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// Access refused (after authenticating, if the registry asked).
    #[error("registry {host} refused access to {repository} (401/403): check the credentials in the auth file")]
    Unauthorized {
        /// The registry.
        host: String,
        /// The repository.
        repository: String,
    },
    /// The manifest or blob is not there.
    #[error("{what} not found in {host}/{repository}")]
    NotFound {
        /// The registry.
        host: String,
        /// The repository.
        repository: String,
        /// `manifest <tag>` or `blob <digest>`.
        what: String,
    },
    /// Any other status.
    #[error("registry {host} answered {status} for {what}")]
    Status {
        /// The registry.
        host: String,
        /// The status.
        status: u16,
        /// What was asked for.
        what: String,
    },
    /// A response larger than its bound.
    #[error("registry {host} sent more than {limit} bytes for {what}")]
    TooLarge {
        /// The registry.
        host: String,
        /// What was asked for.
        what: &'static str,
        /// The bound.
        limit: u64,
    },
    /// The token service's answer.
    #[error("the token service at {realm} gave no usable token")]
    Token {
        /// The realm.
        realm: String,
    },
    /// A challenge naming a realm we will not send credentials to, or a scheme we do not speak.
    #[error("registry {host} asked for authentication we do not send: {why}")]
    Challenge {
        /// The registry.
        host: String,
        /// Why it was refused.
        why: &'static str,
    },
}

/// A manifest as fetched.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// Its bytes (what its digest covers).
    pub bytes: Vec<u8>,
    /// The registry's `Content-Type`.
    pub content_type: Option<String>,
    /// The digest of the bytes.
    pub digest: Digest,
}

/// A registry client: one per pull (or per `serve`), sharing tokens across its requests.
#[derive(Debug, Clone)]
pub struct Registry {
    http: Client,
    insecure: Arc<BTreeSet<String>>,
    logins: Arc<Logins>,
    /// Bearer tokens by registry host and repository.
    tokens: Arc<Mutex<HashMap<(String, String), String>>>,
}

impl Registry {
    /// A client with `options`.
    ///
    /// # Errors
    /// [`RegistryError::Ca`], [`RegistryError::Logins`] or [`RegistryError::Client`].
    pub fn new(options: &Options) -> Result<Self, RegistryError> {
        let mut roots = rustls::RootCertStore::empty();
        match &options.ca_file {
            Some(path) => {
                for cert in read_ca(path)? {
                    roots.add(cert).map_err(|_| RegistryError::Ca(path.clone()))?;
                }
            }
            None => {
                // Certificates the platform offers that rustls cannot parse are skipped, as browsers do.
                let _ = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|_| RegistryError::Ca(options.ca_file.clone().unwrap_or_default()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let http = Client::builder()
            .tls_backend_preconfigured(tls)
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(options.read_timeout.unwrap_or(READ_TIMEOUT))
            .redirect(reqwest::redirect::Policy::custom(|attempt| {
                let downgrade = attempt.previous().last().is_some_and(|u| u.scheme() == "https")
                    && attempt.url().scheme() != "https";
                if downgrade || attempt.previous().len() >= 5 {
                    attempt.stop()
                } else {
                    attempt.follow()
                }
            }))
            .build()
            .map_err(RegistryError::Client)?;
        let logins = match options.auth_file.clone().or_else(Logins::default_path) {
            Some(path) => Logins::read(&path)?,
            None => Logins::default(),
        };
        Ok(Self {
            http,
            insecure: Arc::new(options.insecure.iter().cloned().collect()),
            logins: Arc::new(logins),
            tokens: Arc::default(),
        })
    }

    fn base(&self, r: &Reference) -> String {
        let scheme = if self.insecure.contains(&r.registry) { "http" } else { "https" };
        format!("{scheme}://{}/v2/{}", r.api_host(), r.repository)
    }

    /// The manifest (or index) `tag_or_digest` of `r`'s repository.
    ///
    /// # Errors
    /// [`RegistryError`].
    pub fn manifest(&self, r: &Reference, tag_or_digest: &str) -> Result<Fetched, RegistryError> {
        let url = format!("{}/manifests/{tag_or_digest}", self.base(r));
        let what = format!("manifest {tag_or_digest}");
        let response = self.get(r, &url, &what, |req| req.header(ACCEPT, MANIFEST_TYPES.join(", ")))?;
        let content_type = response.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let bytes = read_bounded(response, MAX_MANIFEST_BYTES).map_err(|()| RegistryError::TooLarge {
            host: r.registry.clone(),
            what: "a manifest",
            limit: MAX_MANIFEST_BYTES,
        })?;
        let digest = Digest::of(&bytes);
        Ok(Fetched { bytes, content_type, digest })
    }

    /// The blob `digest` as a stream (the caller verifies it: [`crate::store::Store::ingest`]).
    ///
    /// # Errors
    /// [`RegistryError`].
    pub fn blob(&self, r: &Reference, digest: &Digest) -> Result<impl Read, RegistryError> {
        let url = format!("{}/blobs/{digest}", self.base(r));
        self.get(r, &url, &format!("blob {digest}"), |req| req)
    }

    /// GET `url`, answering one authentication challenge.
    fn get(
        &self,
        r: &Reference,
        url: &str,
        what: &str,
        build: impl Fn(RequestBuilder) -> RequestBuilder,
    ) -> Result<Response, RegistryError> {
        let host = r.registry.clone();
        let key = (host.clone(), r.repository.clone());
        let send = |auth: Option<String>| {
            let mut req = build(self.http.get(url));
            if let Some(auth) = auth {
                req = req.header(AUTHORIZATION, auth);
            }
            req.send().map_err(|source| RegistryError::Unreachable { host: host.clone(), source })
        };
        let cached = self.tokens.lock().unwrap_or_else(PoisonError::into_inner).get(&key).cloned();
        let mut response = send(cached.map(|t| format!("Bearer {t}")))?;
        if response.status() == StatusCode::UNAUTHORIZED {
            let challenge =
                response.headers().get(WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).and_then(parse_challenge);
            let login = self.logins.for_host(r.api_host()).or_else(|| self.logins.for_host(&r.registry));
            let auth = match challenge {
                Some(Challenge::Basic) => match login {
                    Some(login) if url.starts_with("https://") || self.insecure.contains(&r.registry) => basic(login),
                    Some(_) => return Err(RegistryError::Challenge { host, why: "Basic credentials over plain http" }),
                    None => return Err(RegistryError::Unauthorized { host, repository: r.repository.clone() }),
                },
                Some(Challenge::Bearer { realm, service, scope }) => {
                    let token = self.token(r, &realm, service.as_deref(), scope.as_deref(), login)?;
                    self.tokens.lock().unwrap_or_else(PoisonError::into_inner).insert(key, token.clone());
                    format!("Bearer {token}")
                }
                None => return Err(RegistryError::Challenge { host, why: "no challenge we speak" }),
            };
            response = send(Some(auth))?;
        }
        match response.status() {
            s if s.is_success() => Ok(response),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                Err(RegistryError::Unauthorized { host, repository: r.repository.clone() })
            }
            StatusCode::NOT_FOUND => {
                Err(RegistryError::NotFound { host, repository: r.repository.clone(), what: what.to_owned() })
            }
            s => Err(RegistryError::Status { host, status: s.as_u16(), what: what.to_owned() }),
        }
    }

    /// A token from `realm` for pulling `r`'s repository.
    fn token(
        &self,
        r: &Reference,
        realm: &str,
        service: Option<&str>,
        scope: Option<&str>,
        login: Option<&Login>,
    ) -> Result<String, RegistryError> {
        let host = r.registry.clone();
        let Ok(mut url) = reqwest::Url::parse(realm) else {
            return Err(RegistryError::Challenge { host, why: "a realm that is not a URL" });
        };
        let realm_host = url.host_str().map(|h| url.port().map_or_else(|| h.to_owned(), |p| format!("{h}:{p}")));
        let plain_ok =
            url.scheme() == "http" && realm_host.as_deref() == Some(&r.registry) && self.insecure.contains(&r.registry);
        if url.scheme() != "https" && !plain_ok {
            return Err(RegistryError::Challenge { host, why: "a token realm over plain http" });
        }
        let scope = scope.map_or_else(|| format!("repository:{}:pull", r.repository), str::to_owned);
        url.query_pairs_mut().append_pair("scope", &scope);
        if let Some(service) = service {
            url.query_pairs_mut().append_pair("service", service);
        }
        let mut req = self.http.get(url);
        if let Some(login) = login {
            req = req.basic_auth(&login.user, Some(&login.password));
        }
        let response = req.send().map_err(|source| RegistryError::Unreachable { host: host.clone(), source })?;
        let refused = || RegistryError::Token { realm: realm.to_owned() };
        match response.status() {
            s if s.is_success() => {}
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Err(RegistryError::Unauthorized { host, repository: r.repository.clone() })
            }
            _ => return Err(refused()),
        }
        let body = read_bounded(response, MAX_TOKEN_BYTES).map_err(|()| refused())?;
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            token: Option<String>,
            access_token: Option<String>,
        }
        let parsed: TokenResponse = serde_json::from_slice(&body).map_err(|_| refused())?;
        parsed.token.or(parsed.access_token).filter(|t| !t.is_empty()).ok_or_else(refused)
    }
}

fn basic(login: &Login) -> String {
    use base64::Engine as _;
    let pair = format!("{}:{}", login.user, login.password);
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
}

/// The body, up to `limit` bytes; `Err` past it or on a broken read.
fn read_bounded(response: Response, limit: u64) -> Result<Vec<u8>, ()> {
    crate::bounded::read_up_to(response, limit).ok().flatten().ok_or(())
}

fn read_ca(path: &Path) -> Result<Vec<CertificateDer<'static>>, RegistryError> {
    let bad = || RegistryError::Ca(path.to_owned());
    let file = std::fs::File::open(path).map_err(|_| bad())?;
    let pem = crate::bounded::read_up_to(file, MAX_CA_BYTES).ok().flatten().ok_or_else(bad)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem).collect::<Result<_, _>>().map_err(|_| bad())?;
    if certs.is_empty() {
        return Err(bad());
    }
    Ok(certs)
}
