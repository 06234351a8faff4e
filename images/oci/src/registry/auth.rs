//! Registry credentials and the `WWW-Authenticate` challenge.
//!
//! Credentials come from a Docker `config.json` (`auths.<host>.auth`, base64 `user:password`), never from
//! argv. They go to the registry itself, or to the token realm its Bearer challenge names, and there only
//! over https (a plain-http realm gets them only when it is the same `--insecure-registry` host): a
//! registry can name any realm, and must not be able to send the user's password elsewhere in the clear.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Deserialize;

/// Largest credentials file read.
const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// A user and password for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Login {
    /// The user.
    pub user: String,
    /// The password or token.
    pub password: String,
}

impl fmt::Debug for Login {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Login").field("user", &self.user).finish_non_exhaustive()
    }
}

/// Logins by registry host.
#[derive(Debug, Clone, Default)]
pub struct Logins(BTreeMap<String, Login>);

/// Why the credentials file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoginsError {
    /// Unreadable or too large.
    #[error("cannot read the registry credentials file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Not a Docker `config.json`.
    #[error("the registry credentials file {} is not a Docker config.json", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
    },
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    auth: Option<String>,
}

impl Logins {
    /// Reads `path` (a Docker `config.json`).
    ///
    /// # Errors
    /// [`LoginsError`].
    pub fn read(path: &Path) -> Result<Self, LoginsError> {
        let read = |source| LoginsError::Read { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(read)?;
        let text = crate::bounded::read_up_to(file, MAX_CONFIG_BYTES)
            .map_err(read)?
            .ok_or_else(|| read(std::io::ErrorKind::FileTooLarge.into()))?;
        let config: DockerConfig =
            serde_json::from_slice(&text).map_err(|_| LoginsError::Malformed { path: path.to_owned() })?;
        let mut logins = BTreeMap::new();
        for (key, auth) in config.auths {
            let Some(decoded) = auth.auth.and_then(|a| base64::engine::general_purpose::STANDARD.decode(a).ok()) else {
                continue;
            };
            let Some((user, password)) = String::from_utf8(decoded)
                .ok()
                .and_then(|s| s.split_once(':').map(|(u, p)| (u.to_owned(), p.to_owned())))
            else {
                continue;
            };
            logins.insert(host_of(&key), Login { user, password });
        }
        Ok(Self(logins))
    }

    /// The default file: `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`, if it exists.
    pub fn default_path() -> Option<PathBuf> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let path = var("DOCKER_CONFIG").or_else(|| var("HOME").map(|h| h.join(".docker")))?.join("config.json");
        path.is_file().then_some(path)
    }

    /// The login for a registry host (`docker.io` is also found under Docker's own key for it).
    pub fn for_host(&self, host: &str) -> Option<&Login> {
        self.0.get(host).or_else(|| (host == "registry-1.docker.io").then(|| self.0.get("docker.io")).flatten())
    }
}

/// `https://index.docker.io/v1/` and `docker.io` name one registry; a key may be a URL or a bare host.
fn host_of(key: &str) -> String {
    let bare = key.trim_start_matches("https://").trim_start_matches("http://");
    let host = bare.split('/').next().unwrap_or(bare);
    match host {
        "index.docker.io" | "registry-1.docker.io" => "docker.io".to_owned(),
        other => other.to_owned(),
    }
}

/// A `WWW-Authenticate` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    /// `Basic realm=...`.
    Basic,
    /// `Bearer realm=...,service=...,scope=...`.
    Bearer {
        /// Where to ask for a token.
        realm: String,
        /// The service to name.
        service: Option<String>,
        /// The scope the registry asked for.
        scope: Option<String>,
    },
}

/// Parses a challenge header; `None` for a scheme we do not speak.
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let (scheme, params) = header.trim().split_once(' ').unwrap_or((header.trim(), ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut fields = BTreeMap::new();
    let mut rest = params.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let (value, after) = if let Some(quoted) = after.strip_prefix('"') {
            let end = quoted.find('"')?;
            (&quoted[..end], &quoted[end + 1..])
        } else {
            after.split_once(',').map_or((after, ""), |(v, a)| (v, a))
        };
        fields.insert(key.trim().to_ascii_lowercase(), value.to_owned());
        rest = after.trim_start_matches([',', ' ']);
    }
    Some(Challenge::Bearer {
        realm: fields.remove("realm")?,
        service: fields.remove("service"),
        scope: fields.remove("scope"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse() {
        let hub = r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/python:pull""#;
        assert_eq!(
            parse_challenge(hub),
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/python:pull".into()),
            })
        );
        assert_eq!(parse_challenge(r#"Basic realm="Registry""#), Some(Challenge::Basic));
        assert_eq!(parse_challenge("Negotiate abc"), None);
        assert_eq!(parse_challenge(r#"Bearer service="x""#), None, "no realm");
        assert_eq!(parse_challenge(r#"Bearer realm="unterminated"#), None);
    }

    #[test]
    fn logins_come_from_a_docker_config_and_never_show() {
        let path = std::env::temp_dir().join(format!("vm-oci-auth-{}.json", std::process::id()));
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret-pw");
        std::fs::write(&path, format!(r#"{{"auths":{{"https://index.docker.io/v1/":{{"auth":"{auth}"}},"127.0.0.1:5000":{{"auth":"{auth}"}}}}}}"#)).unwrap();
        let logins = Logins::read(&path).unwrap();
        assert_eq!(logins.for_host("registry-1.docker.io").unwrap().user, "alice");
        assert_eq!(logins.for_host("127.0.0.1:5000").unwrap().password, "s3cret-pw");
        assert!(logins.for_host("ghcr.io").is_none());
        assert!(!format!("{logins:?}").contains("s3cret"), "the password never shows");
        std::fs::write(&path, "not json").unwrap();
        assert!(matches!(Logins::read(&path), Err(LoginsError::Malformed { .. })));
        let _ = std::fs::remove_file(&path);
    }
}
